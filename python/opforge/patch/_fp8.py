"""FP8 projections of the patched decoder layers (`apply(model, fp8=...)`).

The fused q/k/v and gate/up GEMMs of a patched attention / MLP read the granularity from the module
(`_opforge_fp8`, see `_layers.proj`, which calls `linear` here); o_proj and down_proj, which the patched forwards call
as modules, are swapped for `opforge.nn.Linear(..., fp8=...)` holding the same Parameter objects (so state_dict, the
optimizer and `revert` see the module's own parameters). Everything else (embedding, norms, lm_head, the loss, the
experts of a mixture-of-experts block) keeps the model's precision.

Every FP8 projection reuses its weight's quantized operands while the weight is unchanged (`opforge._fp8_cache`).
A fused projection's rows are also reachable through the Parameters standing for q_proj, k_proj, ... (which share
its storage but not its version counter): their identities and version counters are part of the cache key. The
merges of PEFT tuner layers over these projections (in either order of PEFT and apply) drop the merged weight's
cached operands (`_peft.MergeLog`): the patched modules name their projection slots in `_opforge_fp8_slots`.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .. import _fp8_cache
from .. import functional as OF
from .. import nn as onn
from . import _peft as P
from ._report import PatchReport

#: module kinds of the patched classes (`_layers.subclass`) whose projections go FP8, with the projection each
#: calls as a module
_CALLED = {"attention": "o_proj", "mlp": "down_proj"}
_FUSED = {"attention": "qkv", "mlp": "gate/up"}
_FUSED_NAME = {"attention": "qkv_proj", "mlp": "gate_up_proj"}


def check_fp8(fp8: Optional[str]) -> None:
    """Raises ValueError unless fp8 is None or one of `opforge.functional.FP8_GRANULARITIES`."""
    if fp8 is not None and fp8 not in OF.FP8_GRANULARITIES:
        raise ValueError(f"opforge.patch.apply: expected fp8 to be None, "
                         f"{' or '.join(repr(g) for g in OF.FP8_GRANULARITIES)}, but got {fp8!r}")


#: the private ops of opforge's producers that also return their output's amax (max |y|, the tensorwise recipe's
#: reduction), which the FP8 GEMM reading that output takes instead of its own amax pass
_PRODUCERS = ("_rms_norm_forward_amax", "_fused_add_rms_norm_forward_amax", "_swiglu_packed_amax")
#: test hook: False makes every FP8 GEMM compute its input's amax itself (the same bits either way)
PRODUCER_AMAX = True
#: test hook: the device types on which the producers hand their amax on. CUDA's amax kernels have not yet run on a
#: GPU: they join this set once the CUDA tests of tests/python/test_amax_producers.py, test_fp8_amax.py and
#: test_fp8_patch.py (which add "cuda" here) have passed on the H100/H200; until then CUDA models compute every amax
#: in the FP8 GEMMs (bench variant opforge-fp8-amax measures the hand-off).
PRODUCER_AMAX_DEVICES = {"cpu"}


def amax_on(owner: torch.nn.Module, x: Optional[torch.Tensor] = None) -> bool:
    """True when `owner`'s FP8 GEMMs take their input's amax from the opforge kernel that produced the input (the
    decoder layer's norms, the MLP's SwiGLU) from `x` (the producer's input; None: any device): tensorwise scales
    (one amax per tensor), eager (torch.compile traces the plain ops and Inductor fuses there, inductor_math's torch
    math included; torch.func transforms see the plain ops too), x on a device of PRODUCER_AMAX_DEVICES, and a build
    with the producers' private ops; not under `torch.inference_mode()` (inference tensors have no version counter,
    so `_fp8_cache.input_amax` could not see an in-place write to the producer's output)."""
    if not PRODUCER_AMAX or owner.__dict__.get("_opforge_fp8") != "tensorwise" or torch.compiler.is_compiling() \
            or torch._C._functorch.maybe_current_level() is not None or torch.is_inference_mode_enabled() \
            or (x is not None and x.device.type not in PRODUCER_AMAX_DEVICES):
        return False
    return _fp8_cache.ops_built(_PRODUCERS)


def input_amax(x: torch.Tensor, amax: Optional[torch.Tensor]):
    """A context in which the FP8 GEMMs reading `x` take `amax` (max |x|, from x's producer) instead of computing
    it (`_fp8_cache.input_amax`); nothing when amax is None."""
    return contextlib.nullcontext() if amax is None else _fp8_cache.input_amax(x, amax)


def linear(owner: torch.nn.Module, x: torch.Tensor, lin: torch.nn.Module, fp8: str) -> torch.Tensor:
    """fp8_linear(x, lin.weight, lin.bias) of a patched layer's projection (fused q/k/v or gate/up: `lin` the fused
    Linear, or the operand object of `_fused.gemm_operand`), with the weight's quantized operands cached."""
    w = lin.weight
    modules = (owner, lin) if isinstance(lin, torch.nn.Module) else (owner,)
    return _fp8_cache.linear(x, w, lin.bias, fp8, modules=modules, aliases=lambda: _aliases(owner, w))


def _aliases(owner: torch.nn.Module, weight: torch.Tensor):
    """The Parameters standing for rows of `weight` when it is a fused projection's weight of `owner`: writes through
    them change the fused rows without bumping its counter (and replacing their `.data` makes new ones)."""
    fused = owner.__dict__.get("_opforge_fused")
    if not fused:
        return ()
    keep = []
    for base, parts in fused.values():
        if base.__dict__.get("_parameters", {}).get("weight") is not weight:
            continue
        for *_, sl in parts:
            cached = sl.__dict__.get("_opforge_alias_weight")
            if cached is not None:
                keep.append(cached[0])
    return tuple(keep)


def _fp8_linear(old: torch.nn.Linear, fp8: str) -> onn.Linear:
    from . import _modules as M

    new = M._linear(old)
    new.fp8 = fp8
    return new


def enable(model: torch.nn.Module, report: PatchReport, fp8: str) -> int:
    """Switch every patched attention and MLP of `model` to FP8 projections; returns how many modules were."""
    n = 0
    for name, m in list(model.named_modules()):
        kind = type(m).__dict__.get("_opforge_kind")
        if kind not in _CALLED:
            continue
        called = _CALLED[kind]
        sub = m._modules.get(called)
        base, lora = P.split(sub) if sub is not None else (None, None)
        if type(base) not in (torch.nn.Linear, onn.Linear) or getattr(base, "activation", "none") != "none":
            report.skipped.append((f"{name}.{called}", type(sub).__name__,
                                   f"not a plain Linear: left in the model's precision (fp8={fp8!r})"))
        else:  # a LoRA layer (PEFT wrapped the model first): its base layer goes FP8, PEFT's forward stays
            from . import _modules as M

            M._set(model, f"{name}.{called}" if lora is None else f"{name}.{called}.base_layer",
                   _fp8_linear(base, fp8))
        m._opforge_fp8 = fp8
        m._opforge_fp8_slots = tuple(m.__dict__.get("_opforge_parts", ())) + (_FUSED_NAME[kind], called)
        P.watch_slots(m, m._opforge_fp8_slots)  # the tuner layers already there (see _peft's docstring)
        report.patched.append((name, type(m).__dict__["_opforge_base"].__name__,
                               f"FP8 {fp8} projections (fp8_linear: fused {_FUSED[kind]}, {called})"))
        n += 1
    return n
