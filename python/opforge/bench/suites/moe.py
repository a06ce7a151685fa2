"""A Mixtral-style mixture-of-experts block (router, top-2 of E experts, gated MLP experts), forward+backward:
transformers' own block against the same block after `opforge.patch.apply` (its experts on `opforge.indexed_linear`).

Rows per (tokens T, hidden D, intermediate I, experts E), op `mixtral_moe_block`, pass fwd+bwd:
    HF expert loop   transformers' MixtralSparseMoeBlock with `experts_implementation="eager"`: a Python loop over
                     the experts that are hit (one host sync and two GEMMs each);
    HF grouped_mm    the same block with transformers' `grouped_mm` experts, when this transformers has them;
    opforge          the block of a copy of the model patched by `opforge.patch.apply` (same weights).
Forward+backward is a training step's: the gradients of the input and of every parameter of the block (router and
expert banks). The metric is TFLOP/s of the experts' GEMMs (6 · T · top_k · 3 · D · I for forward+backward), the
router's small GEMM left out. Before timing, the patched block's output is checked against the unpatched block in float64
(a float64 copy run through transformers' expert loop, on the first 256 tokens) by the tests' tolerance rule.

    python -m opforge bench --ops moe [--quick]
    python benchmarks/bench_moe.py --device cpu --quick
"""
from __future__ import annotations

import copy

import torch

from .. import harness

NAME = "moe"
# (T tokens, D hidden, I intermediate, E experts): a Mixtral-style layer at the benchmark model's width, and
# Mixtral 8x7B's own layer width.
CUDA_SHAPES = [(8192, 2048, 8192, 8), (8192, 4096, 14336, 8)]
CPU_SHAPES = [(512, 256, 512, 8)]
TOP_K = 2
CHECK_TOKENS = 256  # the reference check runs on the first tokens (the float64 block is slow)


def _model(D: int, I: int, E: int, experts_implementation: str):
    """A one-layer MixtralForCausalLM (tiny vocabulary) with the given experts implementation, float32 on the CPU."""
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=D, intermediate_size=I, num_hidden_layers=1,
                                     num_attention_heads=max(1, D // 128), num_key_value_heads=max(1, D // 512),
                                     num_local_experts=E, num_experts_per_tok=TOP_K, pad_token_id=0)
    cfg._experts_implementation = experts_implementation
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


def _block_fn(block):
    """fn(x) -> the block's output hidden states (transformers' blocks return the states alone or with logits)."""
    def run(x):
        out = block(x)
        return out[0] if isinstance(out, tuple) else out
    return run


def _grouped_mm_supported() -> bool:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return "grouped_mm" in ALL_EXPERTS_FUNCTIONS.valid_keys()


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    from opforge import patch

    run = harness.start(NAME, __doc__, argv, dtypes=lambda cuda, quick: [torch.bfloat16] if cuda else [torch.float32],
                        warmup=(5, 2), reps=((10, 20), (3, 5)))
    for T, D, I, E in run.shapes(CUDA_SHAPES, CPU_SHAPES):
        hf = _model(D, I, E, "eager")
        ours = copy.deepcopy(hf)
        patch.apply(ours, strict=True)
        ref = copy.deepcopy(hf).to(run.device, torch.float64).model.layers[0].mlp
        for dtype in run.dtypes:
            blocks = {"HF expert loop": copy.deepcopy(hf).to(run.device, dtype).model.layers[0].mlp,
                      "opforge": copy.deepcopy(ours).to(run.device, dtype).model.layers[0].mlp}
            if _grouped_mm_supported():
                g = copy.deepcopy(hf).to(run.device, dtype)
                g.config._experts_implementation = "grouped_mm"
                blocks["HF grouped_mm"] = g.model.layers[0].mlp
            x = torch.randn(1, T, D, device=run.device, dtype=dtype)
            xs = x[:, :CHECK_TOKENS]
            with torch.no_grad():
                harness.check_reference(f"mixtral_moe_block {harness.dtype_str(dtype)} {T}x{D}x{I}x{E}",
                                        _block_fn(blocks["opforge"])(xs), _block_fn(ref)(xs.double()),
                                        _block_fn(blocks["HF expert loop"])(xs))
            flops = 6 * T * TOP_K * 3 * D * I
            dy = torch.randn_like(x)
            group = []
            for impl, block in blocks.items():
                xi = x.detach().clone().requires_grad_()
                # the gradients of a training step: the input's and every parameter's (router, expert banks)
                step = harness.fwd_bwd(_block_fn(block), [xi], dy, params=list(block.parameters()))
                if impl == "HF grouped_mm":  # a peer that this GPU or torch may not run: its row says n/a
                    try:
                        t = run.time(step)
                    except (RuntimeError, NotImplementedError) as e:
                        print(f"{impl}: {type(e).__name__}: {str(e).splitlines()[0]}")
                        t = float("nan")
                else:  # opforge's and the loop's failures are errors, never a NaN row
                    t = run.time(step)
                row = run.add("mixtral_moe_block", (T, D, I, E), dtype, impl, "fwd+bwd", t,
                              harness.tflops(flops, t), "TFLOP/s")
                group.append(f"{impl} {harness._fmt(t)} us ({harness._fmt(row.metric)} TFLOP/s)")
            run.say_case("mixtral_moe_block", "fwd+bwd", dtype, (T, D, I, E), group, "; ")
            del blocks, x, dy
            run.release()
    return run.finish()
