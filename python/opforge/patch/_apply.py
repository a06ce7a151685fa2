"""apply, revert, is_patched, gradients_by_name: the public entry points of opforge.patch."""
from __future__ import annotations

import copy
import warnings
from typing import Dict, Optional

import torch

from . import _families as FAM
from . import _fp8 as FP8
from . import _fused as F
from . import _layers as L
from . import _modules as M
from . import _peft as P
from ._report import PatchReport

#: transformers versions whose layer signatures and forwards the adapters follow (checked by `apply`).
TRANSFORMERS_RANGE = ("5.17", "6")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _check_transformers(model: torch.nn.Module) -> None:
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return
    from packaging.version import Version

    v = _transformers_version()
    lo, hi = TRANSFORMERS_RANGE
    if not Version(lo) <= Version(v) < Version(hi):
        raise RuntimeError(f"opforge.patch.apply: expected transformers {lo} <= version < {hi}, but got transformers "
                           f"{v}: the patched forwards follow the layer signatures of that range (pip install "
                           f"'transformers>={lo},<{hi}', or leave the model unpatched); the model was not changed")


def gradients_by_name(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The gradients of `model`'s parameters under transformers' names, patched or not.

    A patched model's fused q/k/v and gate/up gradients are split into their projections' rows, so the dict of a
    patched model and the dict of the unpatched one have the same keys (those of `state_dict`).

    Args:
        model: torch.nn.Module. Any model; parameters without a gradient are left out.

    Returns:
        dict from parameter name to gradient tensor (views of the fused gradients where fused).
    """
    return F.split_gradients(model)


# ---------------------------------------------------------------------------------------------------------
# The self-check: the patched model must give the unpatched model's logits, loss and gradients on a probe batch.

def _routers(model: torch.nn.Module) -> list:
    """[(path, router)] of the mixture-of-experts blocks (a `gate` beside an `experts` bank) of the families with an
    adapter (their routers return (logits, top-k weights, top-k indices), the weights a softmax of the logits
    gathered at the indices, optionally divided by their sum)."""
    out = []
    for n, m in model.named_modules():
        fam = FAM.family_of(m)
        if "gate" in m._modules and "experts" in m._modules and fam is not None and fam.moe:
            out.append((f"{n}.gate" if n else "gate", m.gate))
    return out


def _route_hook(record: list, replay: Optional[list]):
    """Forward hook on a router: records its top-k indices (`replay` None), or replaces them by the recorded ones,
    the weights recomputed from this run's router logits as the router computes them (softmax, gathered at the
    indices, divided by their sum when the router normalises)."""
    calls = iter(replay) if replay is not None else None

    def hook(module, args, out):
        if not (isinstance(out, tuple) and len(out) == 3 and torch.is_tensor(out[2])):
            return None
        logits, scores, index = out
        if calls is None:
            record.append(index.detach().clone())
            return None
        forced = next(calls, None)
        if forced is None or forced.shape != index.shape:
            return None
        probs = torch.softmax(logits.float(), dim=-1)
        mine = probs.gather(-1, index)
        normalises = not torch.allclose(mine, scores.float(), rtol=1e-2, atol=1e-4)
        w = probs.gather(-1, forced.to(index.device))
        if normalises:
            w = w / w.sum(dim=-1, keepdim=True)
        return logits, w.to(scores.dtype), forced.to(index.dtype)

    return hook


def _probe(model: torch.nn.Module, routes: Optional[dict] = None) -> Optional[dict]:
    """The probe batch's logits (no grad), loss with labels and gradients. `routes`: {router path: [top-k indices
    per call]} recorded by the unpatched run (`res["routes"]`) and replayed in the patched run, so that both runs
    send every token to the same experts (a near-tie of two router logits may pick either expert in 16-bit,
    in transformers' model alone as much as between it and the patched one; see `_mismatch`)."""
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    p = next(model.parameters(), None)
    if not isinstance(vocab, int) or p is None or p.device.type == "meta" or not p.is_floating_point() \
            or not (type(model).__name__.endswith("ForCausalLM") or type(model).__module__.startswith("peft.")):
        return None  # (PEFT's PeftModel of a causal LM is probed too)
    g = torch.Generator(device="cpu").manual_seed(4321)
    ids = torch.randint(0, vocab, (2, 7), generator=g).to(p.device)
    modes = [(m, m.training) for m in model.modules()]
    params = list(model.parameters())
    saved = [(q, q.grad) for q in params]
    recorded: Dict[str, list] = {}
    handles = []
    for path, gate in _routers(model):
        recorded[path] = []
        handles.append(gate.register_forward_hook(_route_hook(recorded[path], None if routes is None
                                                                else routes.get(path))))
    model.eval()
    try:
        for q in params:
            q.grad = None
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        logits = (out.logits if hasattr(out, "logits") else out[0]).float()
        res = {"logits": logits, "loss": None, "grads": None, "routes": recorded}
        if any(q.requires_grad for q in params):
            with torch.enable_grad():
                out = model(input_ids=ids, labels=ids, use_cache=False)
                loss = out.loss if hasattr(out, "loss") else out[0]
                loss.backward()
            res["loss"] = loss.detach().float()
            # the gradients themselves, in their own dtype (the model's .grad is restored below, so nothing else
            # holds them): no float32 copy, 2 bytes a parameter for a 16-bit model where a copy would add 4;
            # _grad_errors widens one parameter at a time
            res["grads"] = {n: t.detach() for n, t in F.split_gradients(model).items()}
        return res
    finally:
        for h in handles:
            h.remove()
        for m, t in modes:
            m.training = t
        for q, gr in saved:
            q.grad = gr


#: The self-check's bounds (docs/patching.md, "The check"): the logits' largest difference over their largest
#: magnitude, the loss's relative difference, and each parameter's largest gradient difference over its largest
#: gradient, for float32/float64 models and for 16-bit ones.
_BOUNDS = {"exact": {"logits": 1e-4, "loss": 1e-4, "grad": 1e-3}, "16-bit": {"logits": 5e-2, "loss": 2e-2, "grad": 1e-1}}


def _grad_errors(grads: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Each parameter's largest gradient difference from `ref` over the largest magnitude of its `ref` gradient (at
    least 1e-3 of the largest gradient of the whole model, so a gradient that is all but zero is not judged
    relative to itself)."""
    floor = 1e-3 * max((t.abs().max().item() for t in ref.values()), default=0.0)
    return {n: _widened(grads[n]).sub_(_widened(t)).abs_().max().item() / max(t.abs().max().item(), floor, 1e-30)
            for n, t in ref.items()}


def _widened(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in float32, or float64 for a float64 `t` (differences of 16-bit gradients taken exactly)."""
    return t.to(torch.promote_types(t.dtype, torch.float32), copy=True)


def _mismatch(before: dict, after: dict, dtype: torch.dtype) -> Optional[str]:
    b = _BOUNDS["exact" if dtype in (torch.float32, torch.float64) else "16-bit"]
    x, y = after["logits"], before["logits"]
    err = (x - y).abs().max().item() / max(y.abs().max().item(), 1e-6)
    if not err <= b["logits"]:
        return f"gives different logits (max difference {err:.2e} of the largest logit > {b['logits']:g})"
    if before["loss"] is None:
        return None
    if after["loss"] is None:
        return "gives no loss with labels"
    err = (after["loss"] - before["loss"]).abs().item() / max(before["loss"].abs().item(), 1e-6)
    if not err <= b["loss"]:
        return f"gives a different loss with labels (relative difference {err:.2e} > {b['loss']:g})"
    ga, gb = after["grads"], before["grads"]
    if ga.keys() != gb.keys():
        missing = sorted(set(gb) ^ set(ga))
        return f"gives gradients for other parameters ({', '.join(missing[:4])} ...)"
    errors = _grad_errors(ga, gb)
    where = max(errors, key=errors.get, default=None)
    if where is not None and not errors[where] <= b["grad"]:
        return (f"gives different gradients with labels (max difference {errors[where]:.2e} of the largest value in "
                f"{where} > {b['grad']:g})")
    return None


def _room_for_float32_copy(model: torch.nn.Module) -> bool:
    """Whether each device holding `model`'s parameters has the free memory a float32 copy and its probe need: about
    10 bytes a parameter (4 for the copy, 4 for its gradients, the 16-bit copy before the cast and the activations of
    the 2×7-token probe). CUDA devices report their free memory; the host its available physical memory (Linux
    sysconf); any other device (meta among them) counts as no room, so the copy is never attempted blind."""
    import os

    need: Dict[torch.device, int] = {}
    for q in model.parameters():
        need[q.device] = need.get(q.device, 0) + 10 * q.numel()
    for dev, n in need.items():
        if dev.type == "cuda":
            free = torch.cuda.mem_get_info(dev)[0]
        elif dev.type == "cpu":
            try:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                return False
        else:
            return False
        if free < n:
            return False
    return True


def _float32_probe(model: torch.nn.Module, routes: dict) -> Optional[dict]:
    """`_probe` of a float32 copy of `model` (unpatched) with the expert choices `routes`, or None when no copy can
    be made (not enough free memory on a device, `_room_for_float32_copy`; a module that does not deep-copy)."""
    if not _room_for_float32_copy(model):
        return None
    try:
        ref = copy.deepcopy(model)
        for q in ref.parameters():
            q.grad = None
        ref.float()
    except Exception:  # noqa: BLE001 - out of memory or an uncopyable module: the 16-bit verdict stands
        return None
    try:
        return _probe(ref, routes)
    finally:
        del ref


def _rounding_verdict(before: dict, after: dict, ref: dict) -> Optional[str]:
    """For a 16-bit model whose patched gradients failed the bound against transformers' 16-bit run (`before`):
    None when against a float32 run of the unpatched model (`ref`) every patched gradient (`after`) is within the
    16-bit bound or at most twice as far as transformers' own 16-bit gradient, i.e. the difference is rounding;
    else the reason."""
    mine, theirs = _grad_errors(after["grads"], ref["grads"]), _grad_errors(before["grads"], ref["grads"])
    bound = _BOUNDS["16-bit"]["grad"]
    excess = {n: e / max(bound, 2 * theirs[n]) for n, e in mine.items()}
    where = max(excess, key=excess.get, default=None)
    if where is None or excess[where] <= 1:
        return None
    return (f"gives different gradients with labels, farther from a float32 run of the model than transformers' "
            f"own 16-bit run ({mine[where]:.2e} against {theirs[where]:.2e} of the largest value in {where})")


def _fp8_activations(model: torch.nn.Module, on: bool) -> int:
    """Records `on` (apply's fp8_activations) on every patched MLP of `model` (`_opforge_fp8_activations`, read by
    `_recompute.fp8_activations_on`); returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__dict__.get("_opforge_kind") == "mlp":
            m._opforge_fp8_activations = on
            n += 1
    return n


# ---------------------------------------------------------------------------------------------------------

def is_patched(model: torch.nn.Module) -> bool:
    """True when `apply` changed `model` (or one of its submodules) and `revert` has not undone it.

    Args:
        model: torch.nn.Module. The model to look at.

    Returns:
        bool.
    """
    return any(L.is_patched_class(m) or "_opforge_swapped" in m.__dict__ or "_opforge_original" in m.__dict__
               for m in model.modules())


def _patch(model, report: PatchReport, *, decoder, loss, inductor_math, recompute, linear, rms_norm, mlp) -> None:
    done: set = set()
    counts: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for name, m in list(model.named_modules()):
        if any(name.startswith(d + ".") for d in done):
            continue
        if L.is_patched_class(m):
            done.add(name)
            continue
        cls = type(m).__name__
        if decoder and "self_attn" in m._modules and "mlp" in m._modules:
            fam = FAM.family_of(m)
            if fam is None:
                known = ", ".join(sorted(FAM.FAMILIES))
                fname = FAM.family_name(m)
                reason = (f"transformers' {fname} family has no opforge.patch adapter (known: {known})" if fname
                          else f"{type(m).__module__}.{cls} is not a transformers class (known families: {known})")
            else:
                reason = FAM.decoder_layer_reason(fam, counts, m)
            if reason:
                report.skipped.append((name, cls, f"decoder layer left as transformers wrote it: {reason}"))
                continue
            for rel, old, what in FAM.patch_decoder_layer(fam, m, inductor_math, recompute):
                report.patched.append((f"{name}.{rel}" if rel else name, old, what))
            done.add(name)
    if loss:
        for name, m in list(model.named_modules()):
            # transformers' classes only (a wrapper such as PEFT's PeftModelForCausalLM holds one)
            if type(m).__name__.endswith("ForCausalLM") and FAM.family_name(m) and not L.is_patched_class(m):
                fam = FAM.family_of(m)
                reason = FAM.causal_lm_reason(fam, m)
                if reason:
                    report.skipped.append((name, type(m).__name__, f"loss left as transformers computes it: {reason}"))
                    continue
                old = type(m).__name__
                FAM.patch_causal_lm(fam, m, inductor_math)
                what = "opforge loss (linear_cross_entropy; logits None when labels are given)"
                report.patched.append((name, old, what))
    if decoder and inductor_math and rms_norm and done:
        # Norms outside the layers (the final norm): under compile Inductor must fuse the last residual add into
        # it, so the HF module keeps its place and gets a forward that is opforge.rms_norm in eager, torch under compile.
        for name, m in list(model.named_modules()):
            if any(name == d or name.startswith(d + ".") for d in done) or L.is_patched_class(m) or not name:
                continue
            fam = FAM.family_of(m)
            w = getattr(m, "weight", None)
            if M._looks_rms_norm(m) and not isinstance(m, torch.nn.RMSNorm) and fam is not None \
                    and not list(m.children()) and isinstance(w, torch.nn.Parameter) and w.dim() == 1 \
                    and not FAM.norm_reason(m, w.shape[0], fam):
                old = type(m).__name__
                M.swap_norm(m, fam, inductor_math)
                report.patched.append((name, old, "opforge RMSNorm (rms_norm; torch math under compile)"))
                done.add(name)
    kinds = [k for _, _, k in report.patched]
    if any(k.startswith("opforge attention") for k in kinds) and L.ROPE is None:
        report.notes.append("opforge.rope is not in this build: RoPE runs transformers' rotate-half math")
    if any(k.startswith("opforge loss") for k in kinds) and L.LCE is None:
        report.notes.append("opforge.linear_cross_entropy is not in this build: the loss materialises fp32 logits")
    if any("geglu" in k for k in kinds) and L.GEGLU_PACKED is None:
        report.notes.append("opforge.geglu_packed is not in this build: GeGLU runs torch math (gelu(gate) · up)")
    M.apply_modules(model, report, done, linear=linear, rms_norm=rms_norm, mlp=mlp)


def apply(model: torch.nn.Module, *, decoder: bool = True, loss: bool = True, inductor_math: bool = False,
          recompute: bool = True, linear: bool = True, rms_norm: bool = True, mlp: bool = True, check: bool = True,
          strict: bool = False, verbose: bool = False, fp8: Optional[str] = None,
          fp8_activations: bool = False) -> PatchReport:
    """Patch `model` in place to run on opforge ops (see the package docstring); `revert` undoes it.

    Args:
        model: torch.nn.Module. Typically a transformers `*ForCausalLM` of a family with an adapter (Llama,
            Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text, Phi-3, Granite, OLMo 2, Mixtral, Qwen2-MoE,
            Qwen3-MoE), with its weights loaded (patch after `from_pretrained`, before building the optimizer
            and before wrapping in DDP/FSDP or compiling). transformers 5.17 <= version < 6.
        decoder: bool. Patch the decoder layers (fused add+norm, fused q/k/v and gate/up GEMMs, RoPE, the gated
            activation, experts on indexed_linear). Default: True.
        loss: bool. With `labels`, compute a `*ForCausalLM`'s loss by opforge.linear_cross_entropy (logits not
            materialised; `outputs.logits` is None). Default: True.
        inductor_math: bool. While torch.compile traces, run the norms, the gated activation and projections of the
            patched layers as torch math, so Inductor fuses them with their neighbours. Default: False (opforge's
            ops stay opaque in the graph: 2.9 % less GPU time a step on the H200, see the package docstring).
        recompute: bool. Selective activation recomputation in the patched decoder layers (eager training only): the
            GEMMs' inputs that are cheap to compute again are not kept for backward but computed again, bitwise,
            when backward needs them: the input norm's output (kept by the q/k/v GEMM; again rms_norm of the
            layer input, which rms_norm keeps anyway), the norm before the MLP (kept by the gate/up GEMM;
            again residual · rstd · weight from what fused_add_rms_norm keeps) and the gated activation's output
            (kept by down_proj; again the activation of the gate/up output it keeps); and v is copied out of the
            fused q/k/v output, which the attention would otherwise keep whole for the view v. Saved per layer, with
            T tokens, hidden size D, intermediate size I, q/k/v widths Dq/Dkv and e bytes per element:
            T·(2·D + I + Dq + Dkv)·e (8192 tokens of a 2048/8192 Llama with 8 KV heads, bf16: 240 MiB a layer).
            Cost: one rms_norm, one normalisation pass and one activation forward per layer in backward, one
            copy of v in forward (H200, the benchmark's Llama: 62,520 against 64,816 tokens/s, 16.95 against 20.70
            GiB). Off (the graph of recompute=False) while torch.compile traces (Inductor's partitioner decides
            recompute there), under other saved-tensor hooks (non-reentrant activation checkpointing, save_on_cpu,
            yours; reentrant checkpointing runs the layer again with grad on, recipes included) and inside
            torch.func transforms; with no grad (inference, generate) nothing changes. Under torch.autocast the
            GEMM keeps its own low-precision copy of a norm's output, so the norms' share is not saved there.
            Without opforge.rope, or with per-head q/k norms (Qwen3, Gemma 3), v is not copied (q/k keep the fused
            output anyway). With `fp8`, the three GEMMs would keep the FP8 transposed copy of their input (tensorwise:
            T·(2·D + I) bytes a layer) instead: they keep the input, which the recipes drop, and quantize it again in
            backward (one more amax pass over it). Default: True.
        linear: bool. Swap the remaining plain torch.nn.Linear modules for opforge.nn.Linear. Default: True.
        rms_norm: bool. Swap the remaining RMSNorm modules for opforge.nn.RMSNorm (Gemma's (1 + weight) norms keep
            their module and get opforge's forward). Default: True.
        mlp: bool. Swap the remaining SiLU-gated MLPs for opforge.nn.GatedMLP. Default: True.
        check: bool. For a `*ForCausalLM` with real weights, run the model on 2×7 random tokens before and after
            patching (eval mode): the logits without labels (no grad), then the loss with labels and its gradients
            (the gradients the parameters had are put back afterwards; one gradient copy of the model is held
            meanwhile). If the logits differ by more than 1e-4 (float32/64) or 5e-2 (16-bit) of their largest
            magnitude, the loss by more than 1e-4 or 2e-2 relative, or a parameter's gradient by more than 1e-3 or
            1e-1 of its largest value, undo everything and report why. In a mixture of experts the patched run
            replays the unpatched run's expert choices (a 16-bit near-tie of two router logits may flip between
            two correct computations; docs/patching.md, "The check"). A 16-bit model that fails only the gradient
            bound is judged again against a float32 copy of the unpatched model: kept when no patched gradient is
            farther from it than the bound or twice transformers' own 16-bit gradient. Default: True.
        strict: bool. Raise instead of warning when some module could not be patched; the model is then left as
            it was (nothing patched). Default: False.
        verbose: bool. Print the report. Default: False.
        fp8: str or None. `"tensorwise"` or `"rowwise"`: every projection of every patched decoder layer (the fused
            q/k/v and gate/up GEMMs, o_proj and down_proj) computed by `opforge.fp8_linear` (e4m3 forward, FP8
            gradients, current scaling; docs/ops/fp8.md); the embedding, norms, lm_head, the loss and the experts of
            a mixture-of-experts block keep the model's precision. o_proj and down_proj become
            `opforge.nn.Linear(..., fp8=...)` holding the same Parameters. The self-check (`check`) runs before
            FP8 is switched on: it judges the patch's structure with its usual tolerances (FP8's rounding is the
            op's, tested against its own bound). Needs `decoder=True`. Default: None (the model's precision).
        fp8_activations: bool. Keep the gate/up output gu = [gate | up] `(T, 2I)` that the gated activation of
            every patched MLP keeps for its backward as float8_e4m3fn with one float32 scale per token
            (`opforge.quantize_fp8(gu, float8_e4m3fn, "rowwise")`: data `(T, 2I)`, scale `(T, 1)`, gu ≈ data / scale;
            COAT, Xi et al. 2024, "COAT: Compressing Optimizer states and Activation for memory-efficient FP8
            Training"), dequantized when backward needs it (`data.to(dtype).div_(scale)`: float32 opmath, one
            rounding to the model dtype). Saved per layer: T·2I·(e − 1) − 4·T bytes with e bytes per element (bf16:
            half of gu: 128 MiB a layer at 8192 tokens and I = 8192, 2 GiB over 16 layers). With `recompute=True` down_proj's input is
            computed again from the FP8 copy (the activation of the dequantized gu), so no full-precision gu
            survives the forward (the activation's backward reuses that dequantized gu: one dequantization a layer).
            Numerics: the forward (outputs, loss) is bitwise that of fp8_activations=False; backward sees each
            element of gate and up with a relative error of at most 2^-4 (e4m3's rounding; absolute 2^-10 / scale,
            i.e. max(amax_token, 1e-12) / 458752, for the elements below e4m3's normal range: a token whose gu is
            all below 1e-12 / 448 in magnitude reads zeros) and one rounding to the model dtype, so gradients are
            no longer bitwise those of fp8_activations=False, and with `recompute=True` down_proj's
            weight gradient reads the activation of that rounded gu (the recipes' bitwise promise does not hold
            for this option). Cost: one rowwise quantize pass over gu in forward and one dequantize pass in backward
            per layer. Off (exactly fp8_activations=False) where the recipes of `recompute` are off: no grad
            (inference, `generate`, inference_mode), other saved-tensor hooks (activation checkpointing that is not
            reentrant, save_on_cpu, yours), torch.compile/export tracing, torch.func transforms. Independent of `fp8`
            (works with None, "tensorwise", "rowwise"; tensorwise SwiGLU still hands down_proj its amax). The
            experts of a mixture-of-experts block keep their gate/up output in the model dtype (a shared expert,
            a patched MLP, has the option); LoRA adapters on gate/up are included (the activation's input is the
            sum). Like `fp8`, it is switched on after the self-check (`check` judges the patch's structure, which
            the option does not change; the FP8 rounding of the saved tensor is the op's, tested against its own
            bound). Needs `decoder=True`. Default: False.

    The fused projections (read docs/patching.md, "Fused projections", before training):
        * **Build the optimizer after `apply`.** `model.parameters()` then holds one fused `qkv_proj.weight`
          (`gate_up_proj.weight`) per layer in place of the q/k/v (gate/up) Parameters, whose storage is freed
          until `revert`. A `torch.optim` optimizer built before still holds those: it raises `RuntimeError` at
          its first `step()` (a global torch.optim step hook), as does one holding fused Parameters after
          `revert`; an optimizer outside `torch.optim` is not checked and would train nothing there.
        * `q_proj` etc. are parameter-less slices: their `weight` shares the fused rows' storage, `.grad` is the
          fused gradient's rows, and freezing them (`q_proj.requires_grad_(False)`, or `.weight.requires_grad =
          False`, seen at the next forward) freezes those rows (detached in the GEMM, kept by torch.optim steps; a
          warning says the fused Parameter is partly frozen). Selecting parameters by name finds the fused names.
        * `state_dict()` has transformers' keys with copies of the fused rows (writing into them changes nothing);
          `state_dict(keep_vars=True)` gives the slices' Parameters. `torch.func.functional_call` accepts either
          set of keys; the patched model pickles.

    Returns:
        `PatchReport`: the patched modules and those left unchanged, with the reason.

    Raises:
        TypeError: model is not a torch.nn.Module; fp8_activations is not a bool (a string such as "false" or
            "rowwise" would otherwise read as True).
        RuntimeError: a transformers model and transformers outside 5.17 <= version < 6; strict=True and the check
            found different logits, loss or gradients.
        ValueError: strict=True and some module could not be patched, or nothing at all was patchable; fp8 not
            None, "tensorwise" or "rowwise".
        In every case the model is left as it was.

    Warns:
        UserWarning: (strict=False) naming the modules that could not be patched.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.patch.apply: expected a torch.nn.Module, but got {type(model).__name__}")
    FP8.check_fp8(fp8)
    if not isinstance(fp8_activations, bool):  # bool("false"), bool("rowwise") are True: no silent truthiness
        raise TypeError(f"opforge.patch.apply: expected fp8_activations to be a bool (True or False), but got "
                        f"{type(fp8_activations).__name__} {fp8_activations!r}; the model was not changed")
    _check_transformers(model)
    if is_patched(model):
        msg = f"opforge.patch.apply: found nothing to patch in {type(model).__name__}: it is patched already"
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
        return PatchReport()
    report = PatchReport()
    name = type(model).__name__
    before = _probe(model) if check else None
    try:
        _patch(model, report, decoder=decoder, loss=loss, inductor_math=inductor_math, recompute=recompute,
               linear=linear, rms_norm=rms_norm, mlp=mlp)
        if before is not None and report.patched:
            dtype = next(model.parameters()).dtype
            after = _probe(model, before["routes"])
            reason = _mismatch(before, after, dtype)
            if reason and reason.startswith("gives different gradients") and dtype in (torch.float16, torch.bfloat16):
                # 16-bit rounding or an error? Judged against a float32 run of the unpatched model
                revert(model)
                ref = _float32_probe(model, before["routes"])
                if ref is not None:
                    reason = _rounding_verdict(before, after, ref)
                    del ref
                if not reason:
                    report = PatchReport()
                    _patch(model, report, decoder=decoder, loss=loss, inductor_math=inductor_math,
                           recompute=recompute, linear=linear, rms_norm=rms_norm, mlp=mlp)
            if reason:
                revert(model)
                msg = f"opforge.patch.apply: the patched {name} {reason}; the model was left unpatched"
                if strict:
                    raise RuntimeError(msg)
                warnings.warn(msg, stacklevel=2)
                return PatchReport(skipped=[("", name, msg)])
        n_mlp = _fp8_activations(model, fp8_activations) if report.patched else 0
        if fp8_activations and n_mlp:
            report.notes.append(f"fp8_activations: {n_mlp} patched MLP(s) keep their gate/up output for backward in "
                                f"rowwise e4m3 (eager training)")
        elif fp8_activations and report.patched:
            report.skipped.append(("", name, "fp8_activations=True: no patched MLP, so no gate/up output kept in FP8 "
                                             "(needs decoder=True and a family with an adapter; the experts of a "
                                             "mixture-of-experts block keep theirs in the model's dtype)"))
        if fp8 is not None and report.patched and not FP8.enable(model, report, fp8):
            report.skipped.append(("", name, f"fp8={fp8!r}: no patched decoder layer, so no FP8 projection "
                                             "(fp8 needs decoder=True and a family with an adapter)"))
        if not report.patched:
            msg = f"opforge.patch.apply: found nothing to patch in {name}\n{report}"
            if strict:
                raise ValueError(msg)
            warnings.warn(msg, stacklevel=2)
        elif report.skipped:
            if strict:
                raise ValueError(f"opforge.patch.apply: could not patch every module of {name}; "
                                 f"the model was left unpatched\n{report}")
            warnings.warn(f"opforge.patch.apply: could not patch {len(report.skipped)} module(s) of "
                          f"{name}:\n"
                          + "\n".join(f"  {n or '<root>'} ({c}): {r}" for n, c, r in report.skipped), stacklevel=2)
    except BaseException:
        revert(model)
        raise
    if verbose:
        print(report)
    return report


def revert(model: torch.nn.Module) -> int:
    """Undo `apply` on `model`, in place: transformers' classes and forwards come back.

    The fused projections are split back into the original `torch.nn.Linear` modules (their original
    `Parameter` objects, holding the current values and gradients), swapped modules are put back holding the
    current parameters. Build a new optimizer afterwards (the fused parameters are gone).

    Args:
        model: torch.nn.Module. A model `apply` patched (anything else is left as it is).

    Returns:
        int: the number of modules restored (0 when `model` was not patched).

    Raises:
        TypeError: model is not a torch.nn.Module.
        RuntimeError: model was sharded by `opforge.parallel.parallelize` (its fused weights are DTensor shards in
            the plan's row order: un-fusing them would not give transformers' Linears; revert a model before
            parallelizing it, or load its `state_dict` into an unpatched one).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.patch.revert: expected a torch.nn.Module, but got {type(model).__name__}")
    if any("_opforge_tp_ranks" in m.__dict__ for m in model.modules()):
        raise RuntimeError("opforge.patch.revert: expected a model not sharded by opforge.parallel.parallelize, but "
                           "this one is (its fused weights are tensor-parallel shards); load its state_dict "
                           "(transformers' keys and values) into an unpatched model instead")
    n = 0
    for m in list(model.modules()):
        swapped = m.__dict__.pop("_opforge_swapped", None)
        for child, old in (swapped or {}).items():
            M.restore(m, child, old)
            n += 1
    for m in list(model.modules()):  # swapped modules whose parent left the model (PEFT's merge_and_unload)
        for child, sub in list(m._modules.items()):
            old = sub.__dict__.get("_opforge_original") if sub is not None else None
            if old is not None:
                M.restore(m, child, old)
                n += 1
    for m in list(model.modules()):
        P.unwatch(m)  # PEFT's plain merged_adapters lists back
        if "_opforge_fused" in m.__dict__:
            F.unfuse(m)
        if L.is_patched_class(m) or any(a.startswith("_opforge_") for a in m.__dict__):
            L.restore_class(m)
            n += 1
    if n:  # the weights of the former FP8 projections: no step refreshes their cached operands any more
        from .. import _fp8_cache

        _fp8_cache.forget(model.parameters())
    return n


__all__ = ["apply", "revert", "is_patched", "gradients_by_name", "TRANSFORMERS_RANGE"]
