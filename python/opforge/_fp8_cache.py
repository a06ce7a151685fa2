"""The FP8 weight-operand cache of opforge's FP8 layers (`opforge.nn.Linear(fp8=...)`, `opforge.patch.apply(model,
fp8=...)`).

fp8_linear quantizes its weight twice a step: q(W) in the forward, q(Wᵀ) in the backward (and the forward again
under activation recomputation), although the weight only changes at optimizer steps. The layers keep the operands
per weight Parameter and granularity and pass them as (q(W), 1 / s_W, q(Wᵀ), 1 / s_Wᵀ) to the private op
`_fp8_linear_quantized`, which is bit-identical to fp8_linear (the dequantization scales that the GEMMs read, taken
once per entry instead of once per GEMM):
  * tensorwise: q(W) and its scale alone, from `quantize_fp8(W)`; the scale of Wᵀ is the same number, so q(Wᵀ) is
    q(W)'s bytes transposed and goes to the op as the view q(W).t(), which the backward's dX GEMM makes row-major
    with a transpose kernel (one FP8 copy of the weight in memory between steps, the transposed one only while its
    layer's backward runs);
  * rowwise: q(W) per row of W and q(Wᵀ) per column, from the private op `_quantize_fp8_weight` (the bits of
    `quantize_fp8` of W and of Wᵀ).

An entry is reused only while all of these are unchanged since it was made:
  * the Parameter itself (entries are weakly keyed by the object: a dead Parameter's entry goes with it);
  * its `_version` counter: bumped by every in-place write through it or a view of it (`torch.optim`'s for-each and
    single-tensor steps, `load_state_dict`'s copy, `torch.nn.init`, `with torch.no_grad(): w.add_(1)`);
  * the optimizer generation: bumped after every step of any `torch.optim.Optimizer` (a global step post-hook), as
    fused steps (`torch.optim.AdamW(fused=True)`) write the parameters without bumping their version counters. The
    entries of weights that another optimizer (one that has stepped) holds and that were current before the step
    move to the new generation: a step writes only the parameters of its own param_groups (ZeroRedundancyOptimizer's
    broadcasts run inside its outer step, whose param_groups hold every parameter; its inner optimizer's step holds
    the local shard alone). The weights no optimizer holds (frozen base weights under LoRA, the model copies of
    mixed-precision master weights) are quantized again at their first use after a step: they are often written
    right after one unseen by their version counters (PEFT's merge_adapter / unmerge_adapter add to `weight.data`,
    apex and DeepSpeed copy the master weights back through `.data` or a collective);
  * its storage (the same storage object, alive), data_ptr, dtype, device, shape and strides (`.to()`, `.data = ...`);
  * the caller's aliases of the weight, each its identity, version counter and data_ptr (the patch passes the
    Parameters standing for a fused projection's rows, whose in-place writes reach the fused weight without bumping
    its counter; the entry holds them, so that their ids are not reused).
PEFT merges (`merge_adapter`, `unmerge_adapter`, `merge_and_unload`: writes through `.data`) into the projections of
`opforge.patch.apply(model, fp8=...)` drop the merged weight's entries (`forget`, called by `patch._peft.MergeLog`).
Other writes that none of these see (through `.data`, or from outside torch) need `opforge.functional.fp8_cache_clear()`.

After each optimizer step the same hook quantizes again the cached operands of the weights that optimizer holds,
keyed on the weights as the step left them: the host issues those small quantizations while the device still runs
the step, instead of between the next forward's GEMMs, where the device would wait for each (not while Dynamo
traces or a CUDA graph is captured; a weight written again before its next use is quantized at that use).

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

Memory: each cached weight holds one FP8 copy tensorwise (half its size in bfloat16), two rowwise, for as long as
the Parameter lives.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

#: weight Parameter -> {granularity: _Entry}
_CACHE = WeakIdKeyDictionary()
#: bumped after every torch.optim step and by clear(): every entry made before is stale
_GENERATION = [0]
_HOOK: list = []
#: the optimizers that have stepped (weakly held): a weight one of them holds is written by that one's steps
_OPTIMIZERS = weakref.WeakSet()
#: how many times operands were quantized for the cache (tests read it to see that reuse happened)
QUANTIZED = [0]
#: per thread: `saving_input()` is active (the FP8 GEMMs save their input, which saved-tensor hooks may drop)
_LOCAL = threading.local()
#: the library's private ops the cache calls; a library without them (built before they were added) gets fp8_linear
_PRIVATE_OPS = ("_quantize_fp8_weight", "_fp8_linear_quantized")
#: per tuple of op names, the torch.ops.opforge namespace object on which all of them were found
_FOUND: dict = {}


def ops_built(names: Tuple[str, ...]) -> bool:
    """True when the loaded library has every op of `names` (a library built before them has not). Remembered once
    found, per namespace object; checked again, per call, while some are missing."""
    ns = torch.ops.opforge
    if _FOUND.get(names) is ns:
        return True
    if all(hasattr(ns, op) for op in names):
        _FOUND[names] = ns
        return True
    return False


class _Entry:
    __slots__ = ("key", "storage", "operands", "aliases")

    def __init__(self, key, storage, operands, aliases):
        self.key, self.storage, self.operands, self.aliases = key, storage, operands, aliases


def _step_post_hook(opt, args, kwargs) -> None:
    _GENERATION[0] += 1
    _after_step(opt, _GENERATION[0] - 1)


def _capturing() -> bool:
    """True while the current CUDA stream captures a graph (nothing may be allocated or launched for the cache)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _after_step(opt, before: int) -> None:
    """Right after a step of `opt` (the generation was `before` during the step):
      * the entries of the weights another optimizer holds (and `opt` does not), current before the step, move to
        the new generation (the step did not write those weights; their other key parts still judge any other
        change); those of the weights no optimizer holds go stale (see the module's docstring);
      * the cached operands of the weights `opt` holds are quantized again, so that the host issues the weight
        quantizations while the device still runs the step's kernels, not one by one in the next forward (where each
        small quantization waits on the host between the layers' GEMMs). The new entries are keyed on the parameters
        as the step left them, so a weight that changes again before its next use is quantized at that use, as
        without the refresh. Nothing is quantized while Dynamo traces or a CUDA graph is captured (those entries are
        quantized at their next use)."""
    if not _CACHE:
        return
    refresh = not (torch.compiler.is_compiling() or _capturing())
    _OPTIMIZERS.add(opt)
    stepped = _held(opt)
    # Only the weights another optimizer holds keep their entries: a weight that no optimizer holds may be written
    # right after this step without bumping its version counter (mixed-precision master weights copied back through
    # `.data` or a collective, as apex and DeepSpeed do; a PEFT merge into a frozen base weight outside the patch),
    # which the generation bump of this step catches at the weight's next use.
    others = set()
    for o in list(_OPTIMIZERS):
        if o is not opt:
            others |= _held(o)
    # The cached weights (a few per layer), not every parameter. One C-level copy of the underlying dict (atomic
    # under the GIL): iterating `_CACHE` itself runs Python code between its items, where another thread's FP8
    # forward may insert an entry and the iteration would raise "dictionary changed size during iteration".
    for ref, entries in list(_CACHE.data.items()):
        p = ref()
        if p is None:
            continue
        if id(p) not in stepped:
            if id(p) not in others:
                continue
            for entry in list(entries.values()):
                if entry.key[0] == before:
                    entry.key = (_GENERATION[0],) + entry.key[1:]
            continue
        if not refresh or not usable(p):
            continue
        for granularity, entry in list(entries.items()):
            try:
                _quantize(p, granularity, _key(p, entry.aliases), entries, entry.aliases)
            except Exception:  # (e.g. out of memory) the refresh must not fail the step: the weight's next use
                entries.pop(granularity, None)  # quantizes it, and raises there if it still cannot


def _held(opt) -> set:
    """The ids of the parameters of `opt`'s param_groups."""
    return {id(p) for group in opt.param_groups for p in group["params"]}


def _install_hook() -> None:
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_step_post_hook))


def clear() -> None:
    """Drop every cached operand (the next FP8 forward of each layer quantizes its weight again)."""
    _GENERATION[0] += 1
    _CACHE.clear()


def forget(tensors) -> None:
    """Drop the cached operands of `tensors` (weights no FP8 layer uses any more: an optimizer step would otherwise
    keep quantizing them again, and the cache keep their FP8 copies)."""
    for t in tensors:
        _CACHE.pop(t, None)


def _fsdp_managed(weight: torch.Tensor, modules: Tuple) -> bool:
    """True when FSDP (FSDP1 or FSDP2) owns `weight`: FSDP1 marks the parameters it flattened, FSDP1 and FSDP2 mark
    every module they manage (the attributes `torch.distributed.fsdp` sets for Dynamo)."""
    if getattr(weight, "_fsdp_flattened", False):
        return True
    # the instance attribute FSDP sets, read from __dict__ (a missing attribute through Module.__getattr__ costs
    # microseconds on every FP8 call)
    return any(getattr(m, "__dict__", {}).get("_is_fsdp_managed_module", False) for m in modules)


def usable(weight: torch.Tensor, modules: Tuple = ()) -> bool:
    """True when a cached operand of `weight` can be verified (see the module's docstring). `modules`: the modules
    that hold `weight` (the FP8 layer; for a fused projection of the patch, its owner too)."""
    if type(weight) is not torch.nn.Parameter or torch.compiler.is_compiling():
        return False
    if torch._C._functorch.maybe_current_level() is not None or torch._C._functorch.is_functorch_wrapped_tensor(weight):
        return False
    if weight.is_inference() or weight.is_meta or weight.layout != torch.strided:
        return False
    return not _fsdp_managed(weight, modules)


def _storage_ref(weight: torch.Tensor):
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(weight.untyped_storage())


def _key(weight: torch.Tensor, aliases: Tuple) -> Tuple:
    """What an entry of `weight` depends on (see the module's docstring), its aliases' state included."""
    return (_GENERATION[0], weight._version, weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape),
            weight.stride(), tuple((id(a), a._version, a.data_ptr()) for a in aliases))


def quantize(weight: torch.Tensor, granularity: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operands of a 2-D floating `weight` (N, K) as the cache holds them, computed now (no history, normal tensors
    even under inference mode): (q(W) [N, K], 1 / s_W, q(Wᵀ) [K, N], 1 / s_Wᵀ) in float8_e4m3fn with flat float32
    dequantization scales. Tensorwise, q(Wᵀ) = q(W)ᵀ (one scale): the transposed view of q(W), no second copy;
    rowwise, `_quantize_fp8_weight`'s outputs. Raises the quantizers' errors."""
    with torch.no_grad(), torch.inference_mode(False):  # (normal tensors even when first made under inference
        w = weight.detach()                             # mode: a later training forward saves them for backward)
        if granularity == "tensorwise":
            data, scale = torch.ops.opforge.quantize_fp8(w, torch.float8_e4m3fn, "tensorwise")
            inv_scale = scale.reshape(1).reciprocal()
            return data, inv_scale, data.t(), inv_scale
        return tuple(torch.ops.opforge._quantize_fp8_weight(w, granularity))


def _quantize(weight: torch.Tensor, granularity: str, key: Tuple, entries: Optional[dict],
              aliases: Tuple) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantizes `weight` for the cache and stores the entry (holding `aliases`) under `key`; returns its operands."""
    ops = quantize(weight, granularity)
    QUANTIZED[0] += 1
    if entries is None:
        entries = {}
        _CACHE[weight] = entries
    entries[granularity] = _Entry(key, _storage_ref(weight), ops, aliases)
    return ops


def operands(weight: torch.nn.Parameter, granularity: str,
             aliases: Tuple = ()) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q(W), 1 / s_W, q(Wᵀ), 1 / s_Wᵀ) of `weight` for `granularity`: the data of quantize_fp8(W) and
    quantize_fp8(Wᵀ) in float8_e4m3fn with the reciprocals of their scales, flat (`_quantize_fp8_weight`'s outputs;
    tensorwise, q(Wᵀ) is the transposed view of q(W), see the module's docstring),
    from the cache when it still holds them for the weight as it is now, else computed and stored. `aliases`:
    tensors whose in-place writes reach the weight unseen by its version counter (their identities, version
    counters and data_ptrs join the key; the entry holds them)."""
    _install_hook()
    key = _key(weight, aliases)
    entries = _CACHE.get(weight)
    entry = entries.get(granularity) if entries is not None else None
    if entry is not None and entry.key == key and not entry.storage.expired() \
            and entry.storage.cdata == weight.untyped_storage()._cdata:
        return entry.operands
    return _quantize(weight, granularity, key, entries, aliases)


@contextmanager
def saving_input():
    """While active (in this thread), the cached FP8 GEMMs have autograd save their input instead of their FP8
    q(inputᵀ) (`_fp8_linear_quantized(save_input=True)`; the backward quantizes inputᵀ from it, the same bits):
    opforge.patch's selective recomputation drops a recomputable input from the saved tensors and computes it again
    in backward, which frees it only when the GEMM saves the input itself."""
    before = getattr(_LOCAL, "save_input", False)
    _LOCAL.save_input = True
    try:
        yield
    finally:
        _LOCAL.save_input = before


@contextmanager
def input_amax(input: torch.Tensor, amax: torch.Tensor):
    """While active (in this thread), `linear` called on `input` itself (the same tensor object, not written in place
    since: its `_version` unchanged) takes `amax` as its input_amax: for a caller that computed h and its amax in one
    kernel (rms_norm, fused_add_rms_norm, swiglu_packed) and calls a module that reaches `linear` with h, possibly
    through wrappers (PEFT's LoRA layers pass their input to the base layer as it is), as in
    `with _fp8_cache.input_amax(h, amax): self.down_proj(h)`. Nests (the innermost entry for a tensor wins); nothing
    stays after the block. An inference tensor (made under `torch.inference_mode()`) has no version counter, so an
    in-place write to it could not be seen: the block hands nothing down for it (the GEMMs compute their amax).
    Writes that bump no version counter (through `.data`, or from outside torch, e.g. a forward pre-hook doing
    `h.data.mul_(2)`) are not seen either: such a hook must write through the tensor itself or return a new one.

    Args:
        input: the tensor whose amax is handed down.
        amax: max|input| over the whole tensor, [1], float32 (float64 for a float64 input), on input's device (the
            interface of `_fp8_linear_quantized`'s input_amax, whose checks apply where it is used).
    """
    if input.is_inference():
        yield
        return
    stack = getattr(_LOCAL, "amax", None)
    if stack is None:
        stack = _LOCAL.amax = []
    stack.append((input, input._version, amax))
    try:
        yield
    finally:
        stack.pop()


def _amax_of(input: torch.Tensor) -> Optional[torch.Tensor]:
    """The amax that an active `input_amax` block gives for `input` as it is now, or None."""
    for t, version, amax in reversed(getattr(_LOCAL, "amax", None) or ()):
        if t is input:
            return amax if t._version == version else None
    return None


def linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], granularity: str,
           grad_dtype: Optional[torch.dtype] = None, modules: Tuple = (),
           aliases: Optional[Callable[[], Tuple]] = None) -> torch.Tensor:
    """fp8_linear(input, weight, bias) with the weight's operands from the cache where it is usable (`modules`: those
    holding `weight`, see `usable`), else fp8_linear itself: the same bits either way. `aliases`: () -> the weight's
    aliases (see `operands`), called only when the cache is used. Tensorwise, the amax an active `input_amax` block
    gives for this very input (max|input| from the kernel that wrote it) goes to `_fp8_linear_quantized`, which
    quantizes input (and, under `saving_input`, inputᵀ in backward) from it instead of its own amax pass: the same
    bits; rowwise and fp8_linear compute their own."""
    if not usable(weight, modules) or not ops_built(_PRIVATE_OPS):
        from . import functional as OF

        return OF.fp8_linear(input, weight, bias, granularity=granularity, grad_dtype=grad_dtype)
    ops = operands(weight, granularity, aliases() if aliases is not None else ())
    kwargs = {}
    amax = _amax_of(input) if granularity == "tensorwise" else None
    if amax is not None:
        kwargs["input_amax"] = amax
    return torch.ops.opforge._fp8_linear_quantized(input, weight, *ops, bias, granularity=granularity,
                                                   grad_dtype=grad_dtype,
                                                   save_input=getattr(_LOCAL, "save_input", False), **kwargs)
