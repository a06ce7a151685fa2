"""PEFT LoRA layers on the fused projections. A LoRA `Linear` of PEFT wrapping q_proj (k_proj, v_proj, gate_proj,
up_proj) keeps its adapters; its base layer is (or becomes, when PEFT wraps a patched model) the
FusedProjectionSlice of the fused GEMM, and the patched forward adds each active adapter's
lora_B(lora_A(dropout(x))) · scaling to the slice's columns of the fused output, as PEFT adds it to the base
layer's output. merge/unmerge write into the fused weight through the slice. DoRA and other LoRA variants,
`lora_bias`, `fan_in_fan_out`, mixed-adapter batches and quantized (QLoRA) base layers are not reproduced: such a
layer is refused at apply, and met at a forward it makes the module run transformers' forward (PEFT's own).

Merges into FP8 projections. A PEFT tuner layer's merge and unmerge write its base weight through `.data` (no
version bump), so the FP8 weight cache (`opforge._fp8_cache`) cannot see them by the weight alone. Under
`apply(model, fp8=...)` each tuner layer over a patched layer's projection (q_proj ... v_proj, gate_proj, up_proj, the
fused qkv_proj / gate_up_proj, o_proj, down_proj) has its `merged_adapters` list replaced by a `MergeLog` holding the
same names: every change of the list (a merge appends, an unmerge pops) drops the cached operands of the weight the
layer merges into, which are quantized again at their next use. The list is replaced when `apply` finds the layer,
when PEFT puts the layer in a patched module (`setattr`, as `get_peft_model` and `PeftModel.from_pretrained` do) and
at every eager forward of the patched module (a layer not seen yet, or a list PEFT replaced); each replacement drops
the weight's operands too (the layer may have merged before). `revert` puts plain lists back."""
from __future__ import annotations

import weakref
from typing import Iterable, Optional, Tuple

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


def _merged_weights(layer: torch.nn.Module) -> list:
    """The Parameters `layer`'s merges write: its base layer's weight, or for a fused projection's slice the fused
    weight holding its rows."""
    from ._fused import FusedProjectionSlice

    get = getattr(layer, "get_base_layer", None)
    base = get() if callable(get) else None
    if isinstance(base, FusedProjectionSlice):
        base = base._fused
    w = base._parameters.get("weight") if isinstance(base, torch.nn.Module) else None
    return [w] if w is not None else []


def _forget(layer: torch.nn.Module) -> None:
    from .. import _fp8_cache

    _fp8_cache.forget(_merged_weights(layer))


class MergeLog(list):
    """A tuner layer's `merged_adapters` (the names of its merged adapters, a list as PEFT keeps it) that drops the
    FP8 cache's operands of the weight the layer merges into whenever it changes (see the module's docstring).
    Copies and pickles of it are plain lists."""

    __slots__ = ("_layer",)

    def __init__(self, names: Iterable[str], layer: torch.nn.Module):
        super().__init__(names)
        self._layer = weakref.ref(layer)

    def _changed(self) -> None:
        layer = self._layer()
        if layer is not None:
            _forget(layer)

    def __reduce_ex__(self, protocol):
        return list, (list(self),)

    def append(self, name):
        super().append(name)
        self._changed()

    def extend(self, names):
        super().extend(names)
        self._changed()

    def insert(self, index, name):
        super().insert(index, name)
        self._changed()

    def pop(self, *index):
        out = super().pop(*index)
        self._changed()
        return out

    def remove(self, name):
        super().remove(name)
        self._changed()

    def clear(self):
        super().clear()
        self._changed()

    def sort(self, *args, **kwargs):
        super().sort(*args, **kwargs)
        self._changed()

    def reverse(self):
        super().reverse()
        self._changed()

    def __setitem__(self, index, value):
        super().__setitem__(index, value)
        self._changed()

    def __delitem__(self, index):
        super().__delitem__(index)
        self._changed()

    def __iadd__(self, names):
        out = super().__iadd__(names)
        self._changed()
        return out

    def __imul__(self, n):
        out = super().__imul__(n)
        self._changed()
        return out


def watch(layer: Optional[torch.nn.Module]) -> None:
    """Give a PEFT tuner layer (a module with a `merged_adapters` list and `get_base_layer`) a MergeLog, dropping
    the cached operands of its base weight; anything else, or a layer that has one, is left alone."""
    if layer is None:
        return
    names = layer.__dict__.get("merged_adapters")
    if type(names) is MergeLog or not isinstance(names, list) or not hasattr(layer, "get_base_layer"):
        return
    layer.__dict__["merged_adapters"] = MergeLog(names, layer)
    _forget(layer)


def watch_slots(owner: torch.nn.Module, slots: Tuple[str, ...]) -> None:
    """watch() the tuner layers among `owner`'s children `slots` (the projections of a patched FP8 layer): one dict
    lookup and a type check per slot when there is nothing to do."""
    mods = owner._modules
    for n in slots:
        m = mods.get(n)
        if m is not None and type(m.__dict__.get("merged_adapters")) is list:
            watch(m)


def unwatch(layer: torch.nn.Module) -> None:
    """Put a plain list back in place of a MergeLog (revert)."""
    names = layer.__dict__.get("merged_adapters")
    if type(names) is MergeLog:
        layer.__dict__["merged_adapters"] = list(names)
