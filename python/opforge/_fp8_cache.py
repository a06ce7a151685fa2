"""The FP8 weight-operand cache of opforge's FP8 layers (`opforge.nn.Linear(fp8=...)`, `opforge.patch.apply(model,
fp8=...)`).

fp8_linear quantizes its weight twice a step: q(W) in the forward, q(Wᵀ) in the backward (and the forward again
under activation recomputation), although the weight only changes at optimizer steps. The layers keep
(q(W), s_W, q(Wᵀ), s_Wᵀ) per weight Parameter and granularity, computed by the private op `_quantize_fp8_weight`
(the bits of `quantize_fp8` of W and of Wᵀ, which fp8_linear computes inside; tensorwise, one amax pass and one cast
pass write both), and pass them to the private op `_fp8_linear_quantized`, which is bit-identical to fp8_linear.

An entry is reused only while all of these are unchanged since it was made:
  * the Parameter itself (entries are weakly keyed by the object: a dead Parameter's entry goes with it);
  * its `_version` counter: bumped by every in-place write through it or a view of it (`torch.optim`'s for-each and
    single-tensor steps, `load_state_dict`'s copy, `torch.nn.init`, `with torch.no_grad(): w.add_(1)`);
  * the optimizer generation: bumped after every step of any `torch.optim.Optimizer` (a global step post-hook), as
    fused steps (`torch.optim.AdamW(fused=True)`) write the parameters without bumping their version counters;
  * its storage (the same storage object, alive), data_ptr, dtype, device, shape and strides (`.to()`, `.data = ...`);
  * the caller's `extra` key (the patch passes the state of the Parameters standing for a fused projection's rows,
    whose in-place writes reach the fused weight without bumping its counter).
Writes that none of these see (through `.data`, or from outside torch) need `opforge.functional.fp8_cache_clear()`.

Where the cache cannot be verified, or would hold what the training setup frees, the layers call fp8_linear, which
quantizes in the op each call:
  * while Dynamo traces (torch.compile) and inside torch.func transforms;
  * for a weight that is not a plain Parameter: a DTensor (tensor parallel, and FSDP2's sharded parameters), FSDP1's
    FlatParameter or the plain tensors FSDP1 puts in the module for its forward, another tensor subclass, a tensor
    put in the parameter's place by functional_call, an inference tensor;
  * for a Parameter FSDP1 flattened (`use_orig_params=True`: its data is a view into the FlatParameter, re-gathered
    between uses; marked by FSDP's own `_fsdp_flattened` attribute);
  * for the Parameter of a module that FSDP manages (FSDP2's `fully_shard` or FSDP1; FSDP sets the module attribute
    `_is_fsdp_managed_module` that Dynamo reads): FSDP2's unsharded Parameter is one object for the whole run whose
    storage is freed after use and all-gathered again, with its version counter preserved, so a write to the sharded
    parameter outside `torch.optim` would reach it unseen; and the cache would keep a full FP8 copy of every
    sharded weight.
Plain DDP (DistributedDataParallel over ordinary Parameters) keeps the cache: each rank holds the whole weight in its
own storage and the optimizer writes it in place, as in a single process (its broadcast at construction copies into
the parameters, which bumps their version counters). A torch.distributed collective that writes into a Parameter
(`dist.broadcast(w)`, `dist.all_reduce(w)`) bumps no version counter: inside an optimizer step (the broadcasts of
ZeroRedundancyOptimizer) the optimizer generation covers it; called by hand, it needs `fp8_cache_clear()` after.

Memory: each cached weight holds two FP8 copies (its own size in bfloat16) for as long as the Parameter lives.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: weight Parameter -> {granularity: _Entry}
_CACHE = WeakIdKeyDictionary()
#: bumped after every torch.optim step and by clear(): every entry made before is stale
_GENERATION = [0]
_HOOK: list = []
#: how many times operands were quantized for the cache (tests read it to see that reuse happened)
QUANTIZED = [0]
#: the library's private ops the cache calls; a library without them (built before they were added) gets fp8_linear
_PRIVATE_OPS = ("_quantize_fp8_weight", "_fp8_linear_quantized")


class _Entry:
    __slots__ = ("key", "storage", "operands", "keep")

    def __init__(self, key, storage, operands, keep):
        self.key, self.storage, self.operands, self.keep = key, storage, operands, keep


def _step_post_hook(opt, args, kwargs) -> None:
    _GENERATION[0] += 1


def _install_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_step_post_hook))


def clear() -> None:
    """Drop every cached operand (the next FP8 forward of each layer quantizes its weight again)."""
    _GENERATION[0] += 1
    _CACHE.clear()


def _fsdp_managed(weight: torch.Tensor, modules: Tuple) -> bool:
    """True when FSDP (FSDP1 or FSDP2) owns `weight`: FSDP1 marks the parameters it flattened, FSDP1 and FSDP2 mark
    every module they manage (the attributes `torch.distributed.fsdp` sets for Dynamo)."""
    if getattr(weight, "_fsdp_flattened", False):
        return True
    return any(getattr(m, "_is_fsdp_managed_module", False) for m in modules)


def usable(weight: torch.Tensor, modules: Tuple = ()) -> bool:
    """True when a cached operand of `weight` can be verified (see the module's docstring). `modules`: the modules
    that hold `weight` (the FP8 layer; for a fused projection of the patch, its owner too)."""
    if torch.compiler.is_compiling() or type(weight) is not torch.nn.Parameter:
        return False
    if torch._C._functorch.maybe_current_level() is not None or torch._C._functorch.is_functorch_wrapped_tensor(weight):
        return False
    if weight.is_inference() or weight.device.type == "meta" or weight.layout != torch.strided:
        return False
    return not _fsdp_managed(weight, modules)


def _storage_ref(weight: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(weight.untyped_storage())


def operands(weight: torch.nn.Parameter, granularity: str, extra: Tuple = (),
             keep: Tuple = ()) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q(W), s_W, q(Wᵀ), s_Wᵀ) of `weight` for `granularity`: quantize_fp8(W) and quantize_fp8(Wᵀ) in
    float8_e4m3fn (one `_quantize_fp8_weight` call; the scales flat), from the cache when it still holds them for the weight as it is now, else computed and stored.
    `extra`: more of the key (ints); `keep`: objects the entry holds (those whose ids are in `extra`)."""
    _install_hook()
    key = (_GENERATION[0], weight._version, weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape),
           weight.stride(), extra)
    entries = _CACHE.get(weight)
    entry = entries.get(granularity) if entries is not None else None
    if entry is not None and entry.key == key and not entry.storage.expired() \
            and entry.storage.cdata == weight.untyped_storage()._cdata:
        return entry.operands
    with torch.no_grad(), torch.inference_mode(False):  # (normal tensors even when first made under inference
        w = weight.detach()                             # mode: a later training forward saves them for backward)
        d, s, dt, st = torch.ops.opforge._quantize_fp8_weight(w, granularity)
    QUANTIZED[0] += 1
    if entries is None:
        entries = {}
        _CACHE[weight] = entries
    entries[granularity] = _Entry(key, _storage_ref(weight), (d, s, dt, st), keep)
    return d, s, dt, st


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], granularity: str,
           grad_dtype: Optional[torch.dtype] = None, modules: Tuple = (),
           alias_key: Optional[Callable[[], Tuple[Tuple, Tuple]]] = None) -> torch.Tensor:
    """fp8_linear(input, weight, bias) with the weight's operands from the cache where it is usable (`modules`: those
    holding `weight`, see `usable`), else fp8_linear itself: the same bits either way. `alias_key`: () -> (extra,
    keep) of `operands`, called only when the cache is used."""
    from . import functional as OF

    if not usable(weight, modules) or not all(hasattr(torch.ops.opforge, op) for op in _PRIVATE_OPS):
        return OF.fp8_linear(input, weight, bias, granularity=granularity, grad_dtype=grad_dtype)
    ops = operands(weight, granularity, *(alias_key() if alias_key is not None else ()))
    return torch.ops.opforge._fp8_linear_quantized(input, weight, *ops, bias, granularity=granularity,
                                                   grad_dtype=grad_dtype)
