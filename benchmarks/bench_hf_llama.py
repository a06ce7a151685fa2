"""Train-step benchmark of a Hugging Face LlamaForCausalLM: plain, with Liger-Kernel, with opforge.patch.apply,
each eager and under torch.compile.

Each variant runs in its own process (same seed, same initial weights, same random tokens), trains
``--warmup`` untimed steps and ``--steps`` timed ones (forward with ``labels``, backward, AdamW step; fused
AdamW on CUDA) and reports tokens/s, ms/step (median of the timed steps), peak memory (CUDA: max allocated
over the training steps, weights, FP8 weight cache, gradients and optimizer state included; the peak of building
and patching the model, opforge.patch.apply's self-check, is printed apart; CPU: peak RSS of the worker) and the loss
at the first and last step. The table also gives each variant's largest per-step relative loss difference
from HF eager, to be read against the bf16 bound (``--loss-bound``; with the variant ``hf-seed1``, HF eager from
other initial weights, the bound is that run's mean relative distance from HF eager: ``seed_spread_bound``). The
training forward passes
``use_cache=False`` (no KV cache is needed to train; with transformers' default ``use_cache=True`` every decoder
layer gets the cache object, whose per-layer state makes a per-layer compile recompile once per layer and
fall back to eager past Dynamo's recompile limit of 8). The "+compile" variants compile each decoder layer
(``--compile-scope layers``, fullgraph=True; identical layers share one compiled graph) and report Dynamo's
graph breaks, recompiles and graphs; a "+compile-model" or "+compile-layers" variant names its scope, so one
run can hold both. The "torchao-fp8" variants convert every decoder-layer Linear with torchao's float8 training
(``convert_to_float8_training``, tensorwise or rowwise recipe; lm_head stays bf16) before compiling; Inductor's cache is ``build/inductor-cache/<digest of csrc/library.cpp>`` unless TORCHINDUCTOR_CACHE_DIR
is set. Weights are initialised on the run's device (``--init-device``, same seed in every variant's process).
The opforge variants patch with ``patch.apply``'s defaults: in eager, ``recompute=True`` (the norm and SwiGLU
outputs are computed again in backward instead of kept); under compile Inductor decides what to recompute.
The "+compile-ro" variants compile with ``mode="reduce-overhead"`` (CUDA graphs through cudagraph trees: no
per-kernel launch cost on the host; ``torch.compiler.cudagraph_mark_step_begin()`` before each step).
"opforge-inductor+compile" patches with ``inductor_math=True``: the norms, SwiGLU and projections run as torch math
Inductor fuses with its neighbours instead of opforge's ops (opaque in the graph, the default: they measured 2.9 %
less GPU time a step, docs/patching.md). In hf_llama.csv, rows with variant "opforge-opaque+compile" are
"opforge+compile" under its earlier name, and rows of those commits named "opforge+compile" are
"opforge-inductor+compile". The "opforge-fp8" variants patch with ``fp8="tensorwise"`` ("-fp8-rowwise":
``"rowwise"``): every decoder-layer projection on opforge.fp8_linear, lm_head and the loss in bf16. The "-fp8act"
variants add ``fp8_activations=True`` (the gate/up output kept for SwiGLU's backward in rowwise e4m3).

    # the default configuration on one GPU (about 10 minutes on an H200, compile included):
    python benchmarks/bench_hf_llama.py
    # smaller / other shapes:
    python benchmarks/bench_hf_llama.py --layers 4 --vocab 32000 --seq 1024 --batch 2 --steps 10
    # the lm_head's dW accumulated in bf16 (knob OPFORGE_LCE_DW_ACCUM=1 in the variant's process), against opforge:
    python benchmarks/bench_hf_llama.py --variants hf,opforge,opforge-dwbf16,opforge-dwbf16-c2048
    # one run with the whole-model and per-layer compiled rows and torchao's float8 training (carried wheel):
    python benchmarks/bench_hf_llama.py --variants hf,liger,opforge,hf+compile-model,opforge+compile-model,\
        hf+compile-layers,opforge+compile-layers,torchao-fp8+compile-model,torchao-fp8-rowwise+compile-model
    # FP8 training, opforge's and torchao's, eager and compiled:
    python benchmarks/bench_hf_llama.py --variants hf,opforge,opforge-fp8,opforge-fp8-rowwise,\
        opforge-fp8+compile-layers,opforge-fp8+compile-model,torchao-fp8+compile-model,torchao-fp8-rowwise+compile-model
    # every logged loss of 100 FP8 steps against the bf16 seed spread (HF eager from seed 0 and from seed 1):
    python benchmarks/bench_hf_llama.py --variants hf,hf-seed1,opforge,opforge-fp8 --steps 100 --warmup 2
    # the gate/up output kept in FP8 for SwiGLU's backward (fp8_activations=True), bf16 and FP8 projections:
    python benchmarks/bench_hf_llama.py --variants hf,opforge,opforge-fp8act,opforge-fp8,opforge-fp8-fp8act
    # a profile (torch.profiler table of one step) of some variants:
    python benchmarks/bench_hf_llama.py --variants opforge,liger --profile
    # CPU smoke run (tiny config, 3 steps, no compile variants; used by tests/python/test_hf_llama.py):
    python benchmarks/bench_hf_llama.py --smoke
    # graph breaks and recompiles of the compiled variants (CPU: a tiny config, about a minute):
    python benchmarks/bench_hf_llama.py --smoke --variants hf+compile,opforge+compile

Other families (``--family``, default llama): the same shape arguments build a random-weight model of that
family (with the defaults 1.3-1.7B parameters; head_dim = hidden / heads; Gemma 2/3 with their soft-caps and a
sliding window of half the sequence, Gemma 2 on transformers' eager attention (its soft-capped scores have no SDPA
path); Granite with Granite 3's multipliers; the mixtures of experts with 8 experts of intermediate / 8, top-2,
Qwen2-MoE with a shared expert of intermediate / 4), and the "liger" variants apply
Liger-Kernel's own patch for that family (``apply_liger_kernel_to_<family>``; "n/a" where Liger has none):

    python benchmarks/bench_hf_llama.py --family gemma2 --variants hf,liger,hf+compile,opforge
    python benchmarks/bench_hf_llama.py --family mixtral --smoke      # CPU, tiny config

Results: <out>/hf_llama.csv (appended; context columns date, device, device_name, torch, commit,
transformers, liger; another family: <out>/hf_<family>.csv) and <out>/hf_llama_<cpu|cuda>.png; profiles in
<out>/hf_llama_profile_<variant>.txt.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = {
    "hf": "HF eager (SDPA)",
    "hf-seed1": "HF eager, initial weights of seed 1 (the bf16 seed spread: the loss bound)",
    "liger": "HF + Liger (apply_liger_kernel_to_llama)",
    "opforge": "HF + opforge.patch.apply",
    "opforge-norecompute": "HF + opforge.patch.apply(recompute=False)",
    "opforge-nolean": "HF + opforge.patch.apply, OPFORGE_LCE_LEAN=0 (float32 loss chunks)",
    "opforge-dwbf16": "HF + opforge.patch.apply, OPFORGE_LCE_DW_ACCUM=1",
    "opforge-dwbf16-c2048": "HF + opforge.patch.apply, OPFORGE_LCE_DW_ACCUM=1, OPFORGE_LCE_CHUNK_SIZE=2048",
    "hf+compile": "HF + torch.compile",
    "opforge+compile": "HF + opforge.patch.apply + torch.compile",
    "opforge-inductor+compile": "HF + opforge.patch.apply(inductor_math=True) + torch.compile",
    "hf+compile-ro": "HF + torch.compile(mode=\"reduce-overhead\")",
    "opforge+compile-ro": "HF + opforge.patch.apply + torch.compile(mode=\"reduce-overhead\")",
    "liger+compile": "HF + Liger + torch.compile",
    "hf+compile-model": "HF + torch.compile(model)",
    "opforge+compile-model": "HF + opforge.patch.apply + torch.compile(model)",
    "hf+compile-layers": "HF + torch.compile per layer",
    "opforge+compile-layers": "HF + opforge.patch.apply + torch.compile per layer",
    "opforge-fp8": "HF + opforge.patch.apply(fp8=\"tensorwise\")",
    "opforge-fp8-rowwise": "HF + opforge.patch.apply(fp8=\"rowwise\")",
    "opforge-fp8-fast": "HF + opforge.patch.apply(fp8=\"tensorwise\"), OPFORGE_FP8_FAST_ACCUM=1 (the forward GEMM's "
                        "fast accumulation, torchao's default)",
    "opforge-fp8-rowwise-fast": "HF + opforge.patch.apply(fp8=\"rowwise\"), OPFORGE_FP8_FAST_ACCUM=2 (every GEMM's fast "
                                "accumulation, torchao's rowwise recipe)",
    "opforge-fp8-norecompute": "HF + opforge.patch.apply(fp8=\"tensorwise\", recompute=False) (the GEMMs keep "
                               "q(inputᵀ) of the norm and SwiGLU outputs)",
    "opforge-fp8-lt": "HF + opforge.patch.apply(fp8=\"tensorwise\"), the GEMMs through opforge's cuBLASLt engine (test "
                      "hook fp8_gemm = 1) instead of torch._scaled_mm",
    "opforge-fp8-amax": "HF + opforge.patch.apply(fp8=\"tensorwise\"), the q/k/v, gate/up and down GEMMs taking their "
                        "input's amax from the norm's or SwiGLU's kernel (test hook "
                        "opforge.patch._fp8.PRODUCER_AMAX_DEVICES with \"cuda\") instead of their own amax pass",
    "opforge-fp8act": "HF + opforge.patch.apply(fp8_activations=True)",
    "opforge-fp8-fp8act": "HF + opforge.patch.apply(fp8=\"tensorwise\", fp8_activations=True)",
    "opforge-fp8+compile-layers": "HF + opforge.patch.apply(fp8=\"tensorwise\") + torch.compile per layer",
    "opforge-fp8+compile-model": "HF + opforge.patch.apply(fp8=\"tensorwise\") + torch.compile(model)",
    "opforge-fp8-rowwise+compile-model": "HF + opforge.patch.apply(fp8=\"rowwise\") + torch.compile(model)",
    "torchao-fp8+compile-model": "HF + torchao float8 (tensorwise) + torch.compile(model)",
    "torchao-fp8-rowwise+compile-model": "HF + torchao float8 (rowwise) + torch.compile(model)",
}
#: the variants of a run without --variants: the model-level table of docs/patching.md (the -inductor, "-ro" and
#: "-dwbf16" ones are measured by name)
DEFAULT_VARIANTS = ["hf", "liger", "opforge", "opforge-norecompute", "hf+compile", "opforge+compile", "liger+compile"]
# Environment variables of a variant's own process (read once there by opforge's knobs and chunk-size resolution):
# the loss with float32 logits chunks (lean mode off); the lm_head's dW accumulated in bf16 (no fp32 V x H accumulator),
# and that with 2048-token loss chunks.
VARIANT_ENV = {
    "opforge-nolean": {"OPFORGE_LCE_LEAN": "0"},
    "opforge-fp8-fast": {"OPFORGE_FP8_FAST_ACCUM": "1"},
    "opforge-fp8-rowwise-fast": {"OPFORGE_FP8_FAST_ACCUM": "2"},
    "opforge-dwbf16": {"OPFORGE_LCE_DW_ACCUM": "1"},
    "opforge-dwbf16-c2048": {"OPFORGE_LCE_DW_ACCUM": "1", "OPFORGE_LCE_CHUNK_SIZE": "2048"},
}
#: test hooks (csrc/core/knobs.h) a variant's process sets through torch.ops.opforge._set_knob before it builds the
#: model: the FP8 GEMMs through opforge's cuBLASLt engine.
VARIANT_KNOBS = {
    "opforge-fp8-lt": {"fp8_gemm": 1},
}
#: --family -> (config class, model class, liger patch function, extra config of that family). The MoE sizes: 8
#: experts of intermediate / 8, top-2 (Qwen2-MoE: a shared expert of intermediate / 4).
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "apply_liger_kernel_to_llama", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "apply_liger_kernel_to_mistral", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "apply_liger_kernel_to_qwen2", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "apply_liger_kernel_to_qwen3", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "apply_liger_kernel_to_gemma", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "apply_liger_kernel_to_gemma2", {"sliding_window": 4096}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "apply_liger_kernel_to_gemma3_text", {"sliding_window": 4096}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "apply_liger_kernel_to_phi3", {"pad_token_id": 0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", "apply_liger_kernel_to_granite",
                {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "apply_liger_kernel_to_olmo2", {"pad_token_id": 0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "apply_liger_kernel_to_mixtral", {"num_local_experts": 8}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "apply_liger_kernel_to_qwen2_moe", {"num_experts": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "apply_liger_kernel_to_qwen3_moe", {"num_experts": 8}),
}


def family_config(a: argparse.Namespace):
    """(model class, config) of ``a.family`` with ``a``'s shape (Llama's rules: the given sizes, head_dim =
    hidden / heads)."""
    import transformers

    cfg_name, model_name, _, extra = FAMILIES[a.family]
    kw = dict(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
              num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
              max_position_embeddings=max(a.seq, 128), **extra)
    hd = a.hidden // a.heads
    if a.family in ("gemma", "gemma2", "gemma3", "qwen3", "qwen3_moe"):
        kw["head_dim"] = hd
    if a.family in ("gemma2", "gemma3"):
        kw["query_pre_attn_scalar"] = hd
        kw["sliding_window"] = min(kw["sliding_window"], max(a.seq // 2, 2))  # a window smaller than the sequence
    if a.family == "granite":
        kw["attention_multiplier"] = 1.0 / hd
    if a.family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        kw["num_experts_per_tok"] = 2
        if a.family != "mixtral":
            kw["moe_intermediate_size"] = max(a.intermediate // 8, 8)
        else:
            kw["intermediate_size"] = max(a.intermediate // 8, 8)
        if a.family == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = max(a.intermediate // 4, 8)
    if a.family not in ("gemma2",):  # Gemma 2's soft-capped attention has no SDPA path: transformers' default
        kw["attn_implementation"] = "sdpa"
    return getattr(transformers, model_name), getattr(transformers, cfg_name)(**kw)


CSV_COLUMNS = ["date", "device", "device_name", "torch", "commit", "transformers", "liger", "variant", "layers",
               "hidden", "intermediate", "heads", "kv_heads", "vocab", "seq", "batch", "dtype", "steps", "tokens_per_s",
               "ms_per_step", "peak_mem_gib", "first_loss", "last_loss", "max_rel_loss_diff_vs_hf", "status"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens there)")
    p.add_argument("--dtype", default="bfloat16", help="parameter and activation dtype (bfloat16, float32)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--compile-scope", choices=["model", "layers"], default="layers",
                   help="what +compile variants compile: 'layers' (default) compiles each decoder layer with "
                        "fullgraph=True (identical layers share one graph), 'model' the whole model")
    p.add_argument("--init-device", default=None,
                   help="where the weights are initialised before the cast to --dtype (default: --device; cpu "
                        "takes ~20 s per variant at the default size). Same seed, so every variant starts alike")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--family", default="llama",
                   help=f"transformers family of the model, or several comma-separated (one table each, then a "
                        f"summary), or 'all': {','.join(FAMILIES)} (default: llama); the shape arguments apply to each")
    p.add_argument("--loss-bound", type=float, default=None,
                   help="largest allowed per-step relative loss difference from HF eager (default: 2e-2 for "
                        "16-bit dtypes, 1e-3 for float32; with the hf-seed1 variant in the run, the bound B of "
                        "seed_spread_bound); a variant over it is marked in the table")
    p.add_argument("--profile", action="store_true", help="also write a torch.profiler table of one step per variant")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny config, float32, 3 steps, eager variants only")
    p.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="results directory")
    p.add_argument("--no-save", action="store_true", help="print only: no CSV and no PNG")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per variant process")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.family_list = list(FAMILIES) if a.family == "all" else [f.strip() for f in a.family.split(",") if f.strip()]
    bad = [f for f in a.family_list if f not in FAMILIES]
    if bad or not a.family_list:
        p.error(f"--family: unknown {', '.join(bad) or '(none given)'}; known: {', '.join(FAMILIES)} or all")
    a.family = a.family_list[0]
    if a.smoke:
        a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab, a.seq, a.batch = 2, 64, 128, 4, 2, 256, 32, 2
        a.steps, a.warmup, a.dtype, a.device = 3, 1, "float32", a.device or "cpu"
        a.lr = 1e-3
        if a.variants is None:
            a.variants = "hf,opforge"
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.init_device is None:
        a.init_device = a.device
    if a.variants is None:
        a.variants = ",".join(DEFAULT_VARIANTS)
    a.variant_list = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variant_list if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    if a.loss_bound is None:
        a.loss_bound = 1e-3 if a.dtype in ("float32", "float64") else 2e-2
    return a


# ---- one variant, in its own process -------------------------------------------------------------------

def _peak_memory_gib(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)


def build_variant(a: argparse.Namespace, variant: str):
    """One variant's model, ready to train (also used by benchmarks/profile_step.py).

    Returns (model, step_model, optimizer, patch report or None, step(i) -> detached loss, sync()): the Llama of
    ``a``'s configuration (seed 0, initialised on ``a.init_device``, then moved to ``a.device`` and ``a.dtype``),
    Liger's or opforge's patch applied as the variant says, AdamW (fused on CUDA), the compile of "+compile"
    variants; ``step(i)`` trains on the i-th of the fixed random token batches (seed 1234; ``a.warmup + a.steps``
    of them). CUDA's peak-memory counter is reset once the model is built (the fp32 initialisation is not
    counted; weights are) and again once the patch is applied (``a.setup_peak_gib``: the peak of applying it,
    e.g. opforge.patch.apply's self-check; the training steps' peak counts what stays allocated: weights, the FP8
    weight cache, and from the first step the gradients and the optimizer state). Raises ImportError when the variant needs Liger-Kernel and it is not installed.
    """
    import torch
    import transformers

    device, dtype = a.device, getattr(torch, a.dtype)
    use_liger, use_opforge, use_compile = "liger" in variant, "opforge" in variant, "+compile" in variant
    mode = "reduce-overhead" if variant.endswith("+compile-ro") else None  # CUDA graphs (cudagraph trees)
    scope = compile_scope(a, variant)
    if use_liger:
        import liger_kernel.transformers as liger  # ImportError: variant n/a

        fn = getattr(liger, FAMILIES[getattr(a, "family", "llama")][2], None)
        if fn is None:
            raise ImportError(f"liger_kernel has no {FAMILIES[a.family][2]}")
        fn()  # before the model is built: patches transformers' classes of the family
    if use_opforge:
        try:
            import opforge  # noqa: F401
        except ImportError:
            sys.path.insert(0, str(common.REPO_ROOT / "python"))
        from opforge import patch
    torch.manual_seed(1 if variant == "hf-seed1" else 0)
    model_cls, cfg = family_config(a)
    with torch.device(a.init_device):
        model = model_cls(cfg)  # same initial weights for every variant (same seed and device)
    model = model.to(device=device, dtype=dtype).train()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    report = None
    if use_opforge:
        fp8act = variant.endswith("-fp8act")  # fp8_activations=True; the rest of the name as without it
        base = variant[:-len("-fp8act")] if fp8act else variant
        fp8 = ("rowwise" if "-fp8-rowwise" in base else "tensorwise") if "-fp8" in base else None
        for name, value in VARIANT_KNOBS.get(variant, {}).items():
            torch.ops.opforge._set_knob(name, value)
        if variant == "opforge-fp8-amax":
            from opforge.patch import _fp8 as patch_fp8

            patch_fp8.PRODUCER_AMAX_DEVICES.add("cuda")
        report = str(patch.apply(model, recompute="-norecompute" not in variant,
                                 inductor_math="-inductor" in variant, fp8=fp8, fp8_activations=fp8act))
    if variant.startswith("torchao-fp8"):
        # torchao's float8 training (its recipe, dynamic scaling): every decoder-layer Linear, lm_head left in bf16
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # ImportError: variant n/a

        recipe = "rowwise" if "-rowwise" in variant else "tensorwise"
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn != "lm_head")
    if device.startswith("cuda"):
        # what setting up the variant took at its peak (opforge.patch.apply's self-check runs the model unpatched
        # and patched with labels, and a float32 copy where a 16-bit gradient fails its bound: a one-time cost of
        # apply, not of training); the training steps' peak is counted from here (the weights and the FP8 weight
        # cache stay allocated)
        a.setup_peak_gib = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=device.startswith("cuda"))
    step_model = model
    if use_compile:
        if scope == "model":
            step_model = torch.compile(model, mode=mode)
        else:
            for layer in model.model.layers:
                layer.compile(fullgraph=True, mode=mode)
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, a.vocab, (a.warmup + a.steps, a.batch, a.seq), generator=g)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(i):
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: the graphs' earlier outputs may be reused
        ids = tokens[i].to(device, non_blocking=True)
        loss = step_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step_model, opt, report, step, sync


def compile_scope(a: argparse.Namespace, variant: str) -> str:
    """What a "+compile" variant compiles: "model" or "layers" as its name says ("+compile-model",
    "+compile-layers"), else ``--compile-scope``."""
    for scope in ("model", "layers"):
        if variant.endswith(f"+compile-{scope}"):
            return scope
    return a.compile_scope


def dynamo_stats() -> dict:
    """Dynamo's counters of this process: frames compiled, graphs, graph breaks (reason -> count) and recompiles
    (guard failures: (function, first reason) per recompile)."""
    from torch._dynamo.utils import counters, guard_failures

    recompiles = []
    for code, reasons in guard_failures.items():
        for r in reasons:
            recompiles.append(f"{getattr(code, 'co_name', code)}: {str(r).splitlines()[0][:160]}")
    breaks = dict(counters.get("graph_break", {}))
    return {"frames_ok": counters["frames"].get("ok", 0), "frames_total": counters["frames"].get("total", 0),
            "unique_graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(breaks.values()),
            "graph_break_reasons": {str(k)[:200]: v for k, v in breaks.items()}, "recompiles": len(recompiles),
            "recompile_reasons": recompiles[:10]}


def run_variant(a: argparse.Namespace) -> dict:
    import torch

    variant = a.worker
    device = a.device
    _, _, _, report, step, sync = build_variant(a, variant)
    n_steps = a.warmup + a.steps
    losses, times = [], []
    t_compile, t_start = math.nan, time.perf_counter()
    for i in range(n_steps):
        sync()
        t0 = time.perf_counter()
        losses.append(step(i))
        sync()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
        if i == a.warmup - 1:
            t_compile = time.perf_counter() - t_start
    losses = [float(x) for x in torch.stack(losses).float().cpu()]
    ms = statistics.median(times) * 1e3
    out = {"variant": variant, "ms_per_step": ms, "tokens_per_s": a.batch * a.seq / (ms / 1e3),
           "peak_mem_gib": _peak_memory_gib(device), "setup_peak_gib": getattr(a, "setup_peak_gib", math.nan),
           "losses": losses, "warmup_s": t_compile, "report": report,
           "status": "ok", "env": {k: os.environ.get(k) for k in VARIANT_ENV.get(variant, {})},
           "knobs": VARIANT_KNOBS.get(variant, {})}
    if "+compile" in variant:
        out["dynamo"] = dynamo_stats()
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            step(n_steps - 1)
            sync()
        key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
        out["profile"] = prof.key_averages().table(sort_by=key, row_limit=30)
    return out


# ---- the driver --------------------------------------------------------------------------------------------

def spawn_worker(script: Path, worker: str, argv: list, timeout: float) -> dict:
    """Runs ``python script --worker <worker> --json <tmp> *argv`` (python/ on PYTHONPATH, Inductor's cache per
    checkout, the variant's VARIANT_ENV added to the environment) and returns the JSON it wrote, or {"variant": worker,
    "status": why not} (timeout, a failure's last line, "n/a (liger_kernel not installed)"). Shared with
    benchmarks/profile_step.py."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        cmd = [sys.executable, str(script), "--worker", worker, "--json", str(path), *argv]
        env = dict(os.environ, **VARIANT_ENV.get(worker, {}))
        env["PYTHONPATH"] = os.pathsep.join([str(common.REPO_ROOT / "python"), env.get("PYTHONPATH", "")])
        # Inductor's cache per checkout and version of the schemas (as tests/python/conftest.py): a second run
        # skips most compilation, a changed op schema gets a fresh cache
        library_cpp = common.REPO_ROOT / "csrc" / "library.cpp"
        schemas = hashlib.sha1(library_cpp.read_bytes()).hexdigest()[:12] if library_cpp.exists() else "schemas"
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(common.REPO_ROOT / "build" / "inductor-cache" / schemas))
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": worker, "status": f"timeout after {timeout:.0f} s"}
        if p.returncode != 0 or not path.exists():
            err = (p.stderr or p.stdout).strip().splitlines()
            tail = err[-1] if err else f"exit {p.returncode}"
            if "No module named 'liger_kernel'" in (p.stderr or ""):
                tail = "n/a (liger_kernel not installed)"
            elif "liger_kernel has no" in (p.stderr or ""):
                tail = "n/a (Liger-Kernel has no patch for this family)"
            elif "No module named 'torchao'" in (p.stderr or ""):
                tail = "n/a (torchao not installed)"
            else:
                sys.stderr.write(f"--- {worker} failed ---\n{p.stderr[-4000:]}\n")
            return {"variant": worker, "status": tail[:200]}
        return json.loads(path.read_text())


def _spawn(a: argparse.Namespace, variant: str) -> dict:
    argv = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--intermediate", str(a.intermediate),
            "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--vocab", str(a.vocab), "--seq", str(a.seq),
            "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup), "--dtype", a.dtype,
            "--device", a.device, "--compile-scope", a.compile_scope, "--lr", str(a.lr), "--init-device", a.init_device,
            "--family", a.family]
    if a.profile:
        argv.append("--profile")
    return spawn_worker(Path(__file__).resolve(), variant, argv, a.timeout)


def seed_spread_bound(losses_a: list, losses_b: list) -> float:
    """B = mean over steps of |loss_b − loss_a| / |loss_a|: how far apart two bf16 trainings of the same model on the
    same batches are when only their initial weights differ (``hf`` from seed 0, ``hf-seed1`` from seed 1). Nobody
    would call those two runs different, so a variant whose every logged loss stays within B of HF eager's trains
    as bf16 does (the argument of docs/performance/fp8_convergence.md, "The bound"). The mean, not the largest
    difference: single steps where one batch happens to suit one model are several times the mean."""
    pairs = list(zip(losses_a, losses_b))
    if not pairs:
        raise ValueError("seed_spread_bound: expected logged losses of both runs, got none")
    return sum(abs(b - x) / abs(x) for x, b in pairs) / len(pairs)


def _versions() -> dict:
    try:
        import transformers

        tv = transformers.__version__
    except ImportError:
        tv = "n/a"
    return {"transformers": tv, "liger": common.liger_version()}


def _plot(rows: list, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["variant"] for r in ok]
    axes[0].barh(names, [r["tokens_per_s"] for r in ok], color="tab:blue")
    axes[0].set_xlabel("tokens/s (higher is better)")
    axes[1].barh(names, [r["peak_mem_gib"] for r in ok], color="tab:orange")
    axes[1].set_xlabel("peak memory, GiB (lower is better)")
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> list:
    """Run every variant of every family given (each variant in its own process); the rows of all families."""
    a = parse_args(argv)
    if a.worker:
        out = run_variant(a)
        Path(a.json).write_text(json.dumps(out))
        return [out]
    rows = []
    for family in a.family_list:
        a.family = family
        rows += [{"family": family, **r} for r in run_family(a)]
    if len(a.family_list) > 1:
        print_family_summary(rows)
    return rows


def print_family_summary(rows: list) -> None:
    """One line per family: each variant's tokens/s and peak memory, and opforge against HF eager and Liger."""
    print("\n| family | " + " | ".join(f"{v} tokens/s (peak GiB)" for v in ("hf", "liger", "opforge"))
          + " | opforge vs HF | opforge vs Liger |")
    print("| --- |" + " ---: |" * 5)
    for family in dict.fromkeys(r["family"] for r in rows):
        by = {r["variant"]: r for r in rows if r["family"] == family and r["status"] == "ok"}
        cells = [f"{by[v]['tokens_per_s']:,.0f} ({by[v]['peak_mem_gib']:.2f})" if v in by else "n/a"
                 for v in ("hf", "liger", "opforge")]
        ratio = lambda v: f"{by['opforge']['tokens_per_s'] / by[v]['tokens_per_s']:.2f}x" \
            if "opforge" in by and v in by else "n/a"
        print(f"| {family} | " + " | ".join(cells) + f" | {ratio('hf')} | {ratio('liger')} |")


def run_family(a: argparse.Namespace) -> list:
    """Every variant of ``a.family``: prints its table, appends its CSV (unless --no-save); its rows."""
    import torch

    shape = (f"layers={a.layers} hidden={a.hidden} intermediate={a.intermediate} heads={a.heads}/{a.kv_heads} "
             f"vocab={a.vocab} seq={a.seq} batch={a.batch} {a.dtype}")
    if a.family != "llama":
        shape = f"{a.family} {shape}"
    print(f"bench_hf_llama: {common.device_name(a.device)}, torch {torch.__version__}, {shape}, "
          f"{a.warmup}+{a.steps} steps, compile scope {a.compile_scope}", flush=True)
    results = []
    for v in a.variant_list:
        t0 = time.perf_counter()
        r = _spawn(a, v)
        print(f"  {v:16s} {r['status']:8s} ({time.perf_counter() - t0:.0f} s)", flush=True)
        results.append(r)
    base = next((r for r in results if r["variant"] == "hf" and r["status"] == "ok"), None)
    spread = next((r for r in results if r["variant"] == "hf-seed1" and r["status"] == "ok"), None)
    if base is not None and spread is not None:
        a.loss_bound = seed_spread_bound(base["losses"], spread["losses"])
        print(f"loss bound B = {a.loss_bound:.2e}: the mean relative |loss difference| of HF eager from seed 0 and "
              f"from seed 1 (the same batches) over the {len(base['losses'])} logged steps")
    ctx = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "device": a.device,
           "device_name": common.device_name(a.device), "torch": torch.__version__, "commit": common.git_commit(),
           **_versions()}
    rows = []
    for r in results:
        row = {**ctx, "variant": r["variant"], "layers": a.layers, "hidden": a.hidden, "intermediate": a.intermediate,
               "heads": a.heads, "kv_heads": a.kv_heads, "vocab": a.vocab, "seq": a.seq, "batch": a.batch,
               "dtype": a.dtype, "steps": a.steps, "status": r["status"]}
        if r["status"] == "ok":
            diff = math.nan
            if base is not None:
                diff = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base["losses"]))
            row.update(tokens_per_s=r["tokens_per_s"], ms_per_step=r["ms_per_step"], peak_mem_gib=r["peak_mem_gib"],
                       first_loss=r["losses"][0], last_loss=r["losses"][-1], max_rel_loss_diff_vs_hf=diff)
        rows.append(row)
    print()
    print(f"| variant | tokens/s | vs HF eager | ms/step | peak memory | first loss | last loss | max loss diff vs HF |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    liger_fn = FAMILIES[getattr(a, "family", "llama")][2]

    def label(variant: str) -> str:  # the Liger rows name the family's own patch function
        return VARIANTS[variant].replace("apply_liger_kernel_to_llama", liger_fn)

    for row in rows:
        if row["status"] != "ok":
            print(f"| {label(row['variant'])} | {row['status']} | | | | | | |")
            continue
        ratio = row["tokens_per_s"] / base["tokens_per_s"] if base else math.nan
        over = row["max_rel_loss_diff_vs_hf"] > a.loss_bound and row["variant"] != "hf-seed1"  # the spread itself
        flag = f" (> {a.loss_bound:.2g}!)" if over else ""
        print(f"| {label(row['variant'])} | {row['tokens_per_s']:,.0f} | {ratio:.2f}x | {row['ms_per_step']:.1f} | "
              f"{row['peak_mem_gib']:.2f} GiB | {row['first_loss']:.4f} | {row['last_loss']:.4f} | "
              f"{row['max_rel_loss_diff_vs_hf']:.1e}{flag} |")
    setup = [r for r in results if r["status"] == "ok" and not math.isnan(r.get("setup_peak_gib", math.nan))]
    if setup:  # the peak column counts the training steps; setting up (apply's self-check) peaked apart
        print("\nsetup peak (building and patching, before the first step): " + ", ".join(
            f"{r['variant']} {r['setup_peak_gib']:.2f} GiB" for r in setup))
    for r in results:
        if r.get("env"):  # what the variant's own process saw of VARIANT_ENV
            print(f"\n{r['variant']}: env " + " ".join(f"{k}={v}" for k, v in r["env"].items()))
        if r.get("knobs"):  # the test hooks the variant's process set
            print(f"\n{r['variant']}: knobs " + " ".join(f"{k}={v}" for k, v in r["knobs"].items()))
    for r in results:
        if r.get("report"):
            print(f"\n{r['variant']}: {r['report']}")
    for r in results:
        d = r.get("dynamo")
        if d:
            print(f"\n{r['variant']}: torch.compile ({compile_scope(a, r['variant'])}, warm-up {r.get('warmup_s', math.nan):.1f} s): "
                  f"{d['graph_breaks']} graph break(s), {d['recompiles']} recompile(s), {d['unique_graphs']} graph(s)")
            for reason, n in d["graph_break_reasons"].items():
                print(f"  graph break x{n}: {reason}")
            for reason in d["recompile_reasons"]:
                print(f"  recompile: {reason}")
    if not a.no_save:
        a.out.mkdir(parents=True, exist_ok=True)
        path = a.out / ("hf_llama.csv" if a.family == "llama" else f"hf_{a.family}.csv")
        new = not path.exists()
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
            if new:
                w.writeheader()
            for row in rows:
                w.writerow(row)
        print(f"\nappended {len(rows)} rows to {path}")
        png = a.out / f"hf_{a.family}_{'cuda' if a.device.startswith('cuda') else 'cpu'}.png"
        title = FAMILIES[a.family][1]
        if _plot(rows, png, f"HF {title} train step: {shape}, {common.device_name(a.device)}"):
            print(f"plot: {png}")
        for r in results:
            if r.get("profile"):
                stem = "hf_llama" if a.family == "llama" else f"hf_{a.family}"
                prof = a.out / f"{stem}_profile_{r['variant'].replace('+', '_')}.txt"
                prof.write_text(f"{shape}\n{r['profile']}\n")
                print(f"profile: {prof}")
    return rows


if __name__ == "__main__":
    main()
