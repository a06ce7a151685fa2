"""PEFT LoRA layers on the fused projections. A LoRA `Linear` of PEFT wrapping q_proj (k_proj, v_proj, gate_proj,
up_proj) keeps its adapters; its base layer is (or becomes, when PEFT wraps a patched model) the
FusedProjectionSlice of the fused GEMM, and the patched forward adds each active adapter's
lora_B(lora_A(dropout(x))) · scaling to the slice's columns of the fused output, as PEFT adds it to the base
layer's output. merge/unmerge write into the fused weight through the slice. DoRA and other LoRA variants,
`lora_bias`, `fan_in_fan_out`, mixed-adapter batches and quantized (QLoRA) base layers are not reproduced: such a
layer is refused at apply, and met at a forward it makes the module run transformers' forward (PEFT's own)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def lora_linear_class():
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:  # PEFT not installed
        return None
    return Linear


def lora_reason(m: torch.nn.Module) -> Optional[str]:
    """None for a PEFT LoRA Linear opforge reproduces, else why not (also for what is no LoRA layer at all)."""
    cls = lora_linear_class()
    if cls is None or type(m) is not cls:
        where = type(m).__module__.split(".")[0]
        extra = " (a quantized base: QLoRA is not fused)" if "bnb" in type(m).__module__ or "4bit" in type(m).__name__ \
            else ""
        return f"{where}'s {type(m).__name__} is neither a plain torch.nn.Linear nor a PEFT LoRA Linear{extra}"
    if any(getattr(m, "use_dora", {}).values()):
        return "a DoRA layer (PEFT's use_dora)"
    if getattr(m, "lora_variant", None):
        return f"a LoRA variant ({', '.join(type(v).__name__ for v in m.lora_variant.values())})"
    if any(getattr(m, "lora_bias", {}).values()):
        return "a LoRA layer with lora_bias"
    if getattr(m, "fan_in_fan_out", False):
        return "a LoRA layer with fan_in_fan_out"
    if not getattr(m, "cast_input_dtype_enabled", True):
        return "a LoRA layer with input dtype casting disabled"
    return None


def split(m: torch.nn.Module) -> Tuple[Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """(base linear, LoRA layer or None) for a plain Linear or a LoRA layer opforge reproduces; (None, None)
    for anything else."""
    if isinstance(m, torch.nn.Linear) and type(m).__module__.split(".")[0] in ("torch", "opforge"):
        return m, None
    if lora_reason(m) is None:
        return m.base_layer, m
    return None, None


def delta(m: torch.nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """Σ over the active adapters of lora_B(lora_A(dropout(x))) · scaling (None when there is nothing to add),
    as PEFT's LoRA Linear computes it beside its base layer."""
    if m.disable_adapters:
        if m.merged:
            m.unmerge()
        return None
    if m.merged:
        return None
    out = None
    for name in m.active_adapters:
        if name not in m.lora_A.keys():
            continue
        a = m.lora_A[name]
        xi = x if x.dtype == a.weight.dtype else x.to(a.weight.dtype)
        d = m.lora_B[name](a(m.lora_dropout[name](xi))) * m.scaling[name]
        out = d if out is None else out + d
    return out
