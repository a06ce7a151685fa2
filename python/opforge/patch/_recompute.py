"""Selective activation recomputation (apply(recompute=True)). A GEMM saves its input for the weight gradient; where
that input is a norm's or an activation's output, computable again from tensors saved anyway (the norm's input and
rstd, the gated activation's gate and up), the GEMM runs under saved-tensor hooks that store a recipe instead of the
tensor, so the tensor is freed after the forward and computed again, bitwise, when the backward needs it. An FP8
GEMM (apply(fp8=...)) would save its FP8 q(inputᵀ) instead of the input: under the hooks it saves the input
(`_fp8_cache.saving_input`), so that the recipe stands for it and the backward quantizes inputᵀ again (the same
bits).

The same hooks keep the gated activation's input in FP8 (apply(fp8_activations=True), `Fp8Saved`): the activation runs
under them with a recipe that dequantizes a rowwise float8_e4m3fn copy of its input (the gate/up output), made in
the forward, so the full-precision gate/up output is freed after the forward; down_proj's recipe then computes the
activation from that copy too. That recipe is not bitwise the forward's tensor (see `Fp8Saved`)."""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from .. import _fp8_cache


def recompute_on(owner: torch.nn.Module) -> bool:
    """True when `owner` (patched with recompute=True) may drop a saved activation now (`hooks_usable`)."""
    return owner.__dict__.get("_opforge_recompute", False) and hooks_usable()


def fp8_activations_on(owner: torch.nn.Module) -> bool:
    """True when `owner` (a patched MLP, apply(fp8_activations=True)) may keep its gate/up output in FP8 for the
    activation's backward now: the conditions of `recompute_on` (`hooks_usable`)."""
    return owner.__dict__.get("_opforge_fp8_activations", False) and hooks_usable()


def hooks_usable() -> bool:
    """True when opforge's saved-tensor hooks may replace saved tensors now: eager autograd records (grad mode on,
    so not under no_grad or inference_mode), no other saved-tensor hooks are active (activation checkpointing,
    save_on_cpu, user hooks), and neither torch.compile/export traces (Inductor's partitioner decides recompute
    there) nor a torch.func transform runs (those refuse saved-tensor hooks). The patched forwards enter their hooks
    one after the other (the gate/up GEMM's, the activation's, down_proj's), never one inside another, so one never
    sees another as "other hooks"."""
    if torch.compiler.is_compiling():
        return False
    return (torch.is_grad_enabled() and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and not _other_saved_tensors_hooks() and torch._C._functorch.maybe_current_level() is None)


def _other_saved_tensors_hooks() -> bool:
    """True when some saved-tensor hooks are active (also while a tracer hides them); True where torch cannot say."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(True) is not None  # ignore_is_tracing=True
    except TypeError:  # a torch whose binding takes no argument
        return top() is not None


def _recordable(t: torch.Tensor) -> bool:
    """A plain tensor with storage (not a subclass, fake or functorch-wrapped tensor): one a recipe can stand for."""
    return type(t) is torch.Tensor and t.numel() > 0 and not torch._C._functorch.is_functorch_wrapped_tensor(t) \
        and t.layout == torch.strided and t.device.type != "meta"


class _Recipe:
    """What a dropped saved tensor leaves in the autograd graph: `fn(*args)` gives the full tensor again (bitwise
    the forward's), whose (size, stride, offset) view is the tensor that was saved. `versions`: the version
    counters of the tensor arguments when the forward ran (an in-place change since then is an error, as for
    any saved tensor)."""

    __slots__ = ("fn", "args", "versions", "view", "what", "stale")

    def __init__(self, fn, args, view, what):
        self.fn, self.args, self.view, self.what, self.stale = fn, args, view, what, False
        self.versions = tuple(a._version if isinstance(a, torch.Tensor) else None for a in args)


class _Kept:
    """A tensor a GEMM saved under the recipe hooks and that was kept as it is, with its version counter then:
    saved-tensor hooks bypass autograd's own check that a saved tensor was not changed in place before backward,
    so _unpack_recipe makes it (the same error autograd raises)."""

    __slots__ = ("t", "version")

    def __init__(self, t):
        self.t, self.version = t, t._version


def _modified_in_place(detail: str) -> RuntimeError:
    """autograd's error for a saved tensor changed in place before backward, with what opforge.patch knows of it."""
    return RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                        f"operation: {detail}")


def _unpack_recipe(packed):
    tracing = torch.compiler.is_compiling()  # compiled autograd: versions are not guardable there; eager checks them
    if isinstance(packed, _Kept):
        if not tracing and packed.t._version != packed.version:
            raise _modified_in_place(
                f"[{packed.t.dtype}, {list(packed.t.shape)}] is at version {packed.t._version}; expected version "
                f"{packed.version} instead (saved for backward by a GEMM of an opforge-patched layer)")
        return packed.t
    if not isinstance(packed, _Recipe):
        return packed
    if packed.stale:
        raise _modified_in_place(f"{packed.what}, saved for backward by the GEMM that read it, was changed in place "
                                 f"after it was saved")
    for a, v in zip(packed.args, packed.versions):
        if not tracing and v is not None and a._version != v:
            raise _modified_in_place(
                f"opforge.patch recomputes {packed.what} in backward from a {list(a.shape)} tensor that is at version "
                f"{a._version}; expected version {v} instead")
    with torch.no_grad():
        full = packed.fn(*packed.args)
    return full.as_strided(*packed.view)


def droppable(target: torch.Tensor) -> bool:
    """True when `call_dropping` can stand a recipe for `target`: a `_recordable` tensor that is its whole storage,
    contiguous."""
    return _recordable(target) and target.storage_offset() == 0 and target.is_contiguous() \
        and target.untyped_storage().nbytes() == target.numel() * target.element_size()


def call_dropping(call, target: torch.Tensor, fn, args: tuple, what: str, gemm: bool = True):
    """`call()`, with every tensor it saves for backward that is a view of `target` (same storage and dtype)
    replaced by a `_Recipe` `fn(*args)` (args: tensors saved anyway, detached, and constants). `gemm`: call is a
    GEMM whose FP8 form must save its input (see below)."""
    if not droppable(target):
        return call()
    ptr, dtype, device, version = target.untyped_storage().data_ptr(), target.dtype, target.device, target._version
    state = [fn, args]
    made: List[_Recipe] = []

    def pack(t):
        # t._version == version: not changed in place since the forward computed it (views share the counter)
        if state and type(t) is torch.Tensor and t.dtype == dtype and t.device == device \
                and t.layout == torch.strided and t.untyped_storage().data_ptr() == ptr and t._version == version:
            made.append(_Recipe(state[0], state[1], (t.size(), t.stride(), t.storage_offset()), what))
            return made[-1]
        return _Kept(t) if isinstance(t, torch.Tensor) else t

    # an FP8 GEMM saves the input (for the recipe) rather than its FP8 q(inputᵀ); not under autocast, where the GEMM
    # gets a cast copy of the input that no recipe stands for (its q(inputᵀ), half that copy's size, is smaller)
    fp8_input = contextlib.nullcontext() if not gemm or torch.is_autocast_enabled(target.device.type) \
        else _fp8_cache.saving_input()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_recipe), fp8_input:
            return call()
    finally:
        if made and target._version != version:  # changed in place after it was saved: backward must raise
            for r in made:
                r.stale = True
        state.clear()  # pack may outlive the call (held by the graph): it must not hold the recipe
        made.clear()


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data / scale in `dtype`: `data.to(dtype).div_(scale)`, exact up to the division, computed in float32 opmath
    (float64 for float64) and rounded once to `dtype` (an e4m3 value is exact in every floating dtype); no float32
    buffer."""
    return data.to(dtype).div_(scale)


class Fp8Saved:
    """The gate/up output gu `(*, 2I)` of a patched MLP kept for backward as `quantize_fp8(gu, float8_e4m3fn,
    "rowwise")`: data `(*, 2I)` e4m3 and one float32 scale per token `(*, 1)`, 2I + 4 bytes a token in place of
    2I·e (apply(fp8_activations=True); the approach of COAT, Xi et al. 2024, "COAT: Compressing Optimizer states
    and Activation for memory-efficient FP8 Training": FP8 storage of the inputs of non-linear layers, with
    fine-grained scales).

    `saved()` is the recipe the activation's backward reads in place of gu: `dequantize_fp8(data, scale)`, which
    differs from gu by the e4m3 rounding (relative 2^-4 per element in e4m3's normal range, absolute 2^-10 / scale
    below it) and then one rounding to gu's dtype. `activation(act)` is down_proj's recipe (apply(recompute=True)):
    act of that dequantized gu, so no full-precision gu outlives the forward; it is not bitwise the forward's
    act(gu). down_proj's backward runs right before the activation's (which needs its gradient), so the tensor
    that recipe dequantized is handed to the activation's recipe (once) instead of being dequantized again (a
    backward that stops at down_proj, e.g. torch.autograd.grad of its weight alone, leaves that tensor here until
    the graph is freed; it is always dequantize_fp8 of the same data, so a later backward reads the same values)."""

    __slots__ = ("args", "dtype", "_full")

    def __init__(self, gu: torch.Tensor):
        with torch.no_grad():
            self.args = tuple(torch.ops.opforge.quantize_fp8(gu.detach(), torch.float8_e4m3fn, "rowwise"))
        self.dtype, self._full = gu.dtype, None

    def saved(self):
        """fn of the activation's recipe: gu dequantized, the one down_proj's recipe made if it is waiting."""
        def fn(data, scale):
            full, self._full = self._full, None
            return full if full is not None else dequantize_fp8(data, scale, self.dtype)
        return fn

    def activation(self, act, hand_off: bool = True):
        """fn of down_proj's recipe: act(gu dequantized), keeping the dequantized gu for the activation's recipe
        (`hand_off`; False where the activation kept no recipe, gu needing no gradient: nothing would take it, and it
        would stay alive until the graph is freed)."""
        def fn(data, scale):
            full = dequantize_fp8(data, scale, self.dtype)
            if hand_off:
                self._full = full
            return act(full)
        return fn


def saved_by_producer(x: torch.Tensor, depth: int = 4) -> bool:
    """True when the autograd node that computed `x` (reached through at most `depth` nodes of single-input views)
    has saved its output in x's storage for its own backward, as the attention kernels do (flash, memory-efficient,
    cuDNN and the CPU flash kernel keep O; transformers' transpose / reshape of it are views where the kernel wrote
    O in (batch, seq, heads, dim) order): a GEMM reading x may then save x itself at no cost instead of a copy."""
    node, storage = x.grad_fn, x.untyped_storage().data_ptr()
    for _ in range(depth):
        if node is None:
            return False
        out = getattr(node, "_saved_output", None)
        if isinstance(out, torch.Tensor):
            return out.untyped_storage().data_ptr() == storage and out.dtype == x.dtype
        nxt = node.next_functions
        if len(nxt) != 1:
            return False
        node = nxt[0][0]
    return False


def saving_input_of_attention(owner: torch.nn.Module, x: torch.Tensor):
    """A context for o_proj(x) of a patched attention: o_proj's tensorwise FP8 GEMM saves x (the attention
    output, held anyway by the attention's backward: `saved_by_producer`) instead of its FP8 q(xᵀ), under
    recompute=True (eager autograd, no other saved-tensor hooks) and not under autocast (where the GEMM would save
    a cast copy); otherwise nothing."""
    if owner.__dict__.get("_opforge_fp8") != "tensorwise" or not recompute_on(owner) \
            or torch.is_autocast_enabled(x.device.type) or not _recordable(x) or not saved_by_producer(x):
        return contextlib.nullcontext()
    return _fp8_cache.saving_input()


def norm_from_rstd(z: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rms_norm's output from its input z and the rstd its forward computed: the private op
    `_rms_norm_apply` (z · rstd · weight in float32, float64 for float64, rounded once: the forward kernels' last
    step, one pass), so bitwise the forward's output."""
    return torch.ops.opforge._rms_norm_apply.default(z, rstd, weight)


def pending(m: torch.nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """The recipe the decoder layer left on `m` for its input `x` (taken: used once), or None; None too when x
    was changed in place since the recipe was made (a forward pre-hook, say: the recipe would give the old value)."""
    p = m.__dict__.pop("_opforge_pending", None)
    return p[1:4] if p is not None and p[0] is x and x._version == p[4] else None

