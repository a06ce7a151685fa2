"""Patch an existing model (a Hugging Face transformers Llama, Mistral, Qwen2 or Qwen3) to run on opforge ops.

`opforge.patch.apply(model)` changes `model` in place and returns a `PatchReport`;
`opforge.patch.revert(model)` undoes it. Two levels:

**Decoder layers of the Llama family** (a layer with `self_attn` (q/k/v/o_proj, optional per-head
q_norm/k_norm), a SiLU-gated `mlp` and Llama-style `input_layernorm`/`post_attention_layernorm`):
the layer, its attention and its MLP get an opforge `forward` (their class is swapped for a subclass,
so `isinstance` checks still hold; signature, keyword arguments, return type and KV-cache handling are
transformers'):

* input norm: `opforge.rms_norm`; the residual add after attention and the post-attention norm:
  one `opforge.fused_add_rms_norm`;
* q/k/v projections as **one GEMM** and gate/up as **one GEMM**: the three (two) weights are concatenated
  once, at patch time, into one `Parameter` (`self_attn.qkv_proj.weight`, `mlp.gate_up_proj.weight`);
  q/k/v (gate/up) are then column views of the GEMM's output, never copied;
* RoPE: `opforge.rope` on the q/k views of the fused projection (transformers' rotate-half math
  as a fallback while the op is not built);
* SwiGLU: `opforge.swiglu_packed` on the fused gate/up output (its gradient is one tensor: no cat);
* saved activations (`recompute=True`, eager training): the GEMMs do not keep the two norm outputs and SwiGLU's
  output for backward, which computes them again, bitwise, from what the norms and SwiGLU keep anyway; v is
  copied out of the fused q/k/v output so the attention does not keep that whole output (see `apply`).

**The loss** of a `*ForCausalLM` whose `loss_function` is transformers' `ForCausalLMLoss`: with
`labels`, the loss is `opforge.linear_cross_entropy` of the final hidden states and
`lm_head.weight` (labels shifted by one, `ignore_index` −100, `shift_labels` and
`num_items_in_batch` as transformers), so the (tokens × vocab) logits are never materialised, and
**`outputs.logits` is None**. Without `labels` (inference, `generate()`) the forward is transformers'
own and `outputs.logits` are the usual logits.

**The final norm** (with the decoder layers patched and `inductor_math=True`): a Llama-style RMSNorm outside
the layers keeps its module and gets a forward that is `opforge.rms_norm` in eager and torch math
under compile (so Inductor fuses the last residual add into it). With the default `inductor_math=False` it
is swapped like the norms below.

**Everything else** (any model): Llama-style RMSNorms, SiLU-gated MLPs and plain `torch.nn.Linear`
modules outside the patched layers are swapped for `opforge.nn.RMSNorm`,
`opforge.nn.GatedMLP` and `opforge.nn.Linear` holding the same `Parameter` objects; a
module whose math differs (Gemma's x·(1 + weight) norm, a GELU MLP, GPT-2's Conv1D) is left alone and
reported.

Parameters, state_dict, optimizer (the trade-off of the fused projections): `model.state_dict()` has
exactly transformers' keys (`...self_attn.q_proj.weight` etc.; a state-dict hook splits the fused
weights, as contiguous copies so that safetensors/`save_pretrained` see no shared storage) and
`load_state_dict`/`from`-checkpoint loading accept transformers' keys (a load pre-hook concatenates
them). `model.parameters()`/`named_parameters()` show the fused `qkv_proj.weight` and
`gate_up_proj.weight` instead of the separate ones, so **build the optimizer after patching**; its
state is per fused parameter (Adam's moments of q, k and v are rows of one tensor). `q_proj` etc. stay
reachable as parameter-less modules whose `weight` is a view of the fused one (reads and in-place
writes go to it). Tied weights (`lm_head` and `embed_tokens`) are untouched. `revert` puts back the
original `torch.nn.Linear` modules, with their original `Parameter` objects holding the current values.

torch.compile: by default (`inductor_math=False`) every opforge op stays in the compiled graph as one
custom op (no graph break); Inductor compiles what is around them. `inductor_math=True` runs the norms,
SwiGLU and the projections as torch math while Dynamo traces, so Inductor fuses them with their neighbours;
the fused projections, RoPE and the fused loss stay. Measured on the H200 (benchmarks/bench_hf_llama.py's
Llama, docs/patching.md): the opaque ops give 2.9 % less GPU time a step (120.1 against 123.7 ms) and 0.7–1.4 %
more tokens/s in three runs: Inductor's SwiGLU backward of the packed projection writes the two halves'
gradients and then a `cat` (5.2 ms a step), where opforge's kernel writes both halves in place. Nothing in the patched forwards
breaks a graph (`torch.compile(layer, fullgraph=True)` works per decoder layer).

Numerics: in float32 the patched model matches the original to rounding. In bfloat16/float16, opforge's
RMSNorm multiplies by the weight before rounding to the input dtype (transformers rounds first), the
fused residual add+norm rounds the sum to the input dtype and normalises that (as transformers does), and the
loss accumulates in fp32 without rounding the logits to bf16 first: outputs differ by about one ulp of that
dtype per layer.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as TF

from . import functional as OF
from . import nn as onn

__all__ = ["PatchReport", "apply", "revert", "is_patched"]


@dataclass
class PatchReport:
    """What `apply` did.

    Attributes:
        patched: (qualified name, old class name, new class name / what) for each module patched.
        skipped: (qualified name, class name, reason) for each module that looked patchable, or that opforge
            has no op for (LayerNorm, GPT-2's Conv1D, non-SiLU MLPs, unrecognised norms), left unchanged.
        notes: free-text remarks (e.g. an op not built in this library, so a fallback is used).
    """

    patched: List[Tuple[str, str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str, str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when something was patched and nothing was skipped."""
        return bool(self.patched) and not self.skipped

    def counts(self) -> dict:
        """{"OldClass -> NewClass": count} over the patched modules."""
        out: dict = {}
        for _, old, new in self.patched:
            key = f"{old} -> {new}"
            out[key] = out.get(key, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"opforge.patch: patched {len(self.patched)} module(s), could not patch {len(self.skipped)}"]
        for key, n in sorted(self.counts().items()):
            lines.append(f"  patched {n:4d} x {key}")
        for name, cls, reason in self.skipped:
            lines.append(f"  not patched: {name or '<root>'} ({cls}): {reason}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation") or act is torch.nn.functional.silu


def _probe_device_dtype(module: torch.nn.Module) -> Optional[Tuple[torch.device, torch.dtype]]:
    p = next(module.parameters(), None)
    if p is None or p.device.type == "meta" or not p.is_floating_point():
        return None
    return p.device, p.dtype


def _agree(old: torch.nn.Module, new: torch.nn.Module, feature_shape) -> Optional[str]:
    """None if old and new compute the same on a small random input of shape (3, *feature_shape), else the
    reason they do not."""
    dd = _probe_device_dtype(old)
    if dd is None:
        return None  # meta / parameterless: trust the structural match
    device, dtype = dd
    if isinstance(feature_shape, int):
        feature_shape = (feature_shape,)
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(3, *feature_shape, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            a = old(x)
            b = new(x)
        except Exception as e:  # noqa: BLE001
            return f"probe failed: {type(e).__name__}: {e}"
    a, b = a.float(), b.float()
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-6)
    if not err <= tol:
        return f"its output differs from opforge's (max relative difference {err:.2e} > {tol:g}): different math"
    return None


def _copy_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    new.train(old.training)


def _linear(old: torch.nn.Linear) -> onn.Linear:
    new = onn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    new.weight = old.weight
    new.bias = old.bias
    _copy_hooks(old, new)
    return new


def _rms_norm(old: torch.nn.Module) -> onn.RMSNorm:
    w = old.weight
    new = onn.RMSNorm(tuple(w.shape), eps=float(old.variance_epsilon), device="meta")
    new.weight = w
    _copy_hooks(old, new)
    return new


def _gated_mlp(old: torch.nn.Module) -> onn.GatedMLP:
    g = old.gate_proj
    new = onn.GatedMLP(g.in_features, g.out_features, bias=g.bias is not None, device="meta")
    new.gate_proj = _linear(old.gate_proj)
    new.up_proj = _linear(old.up_proj)
    new.down_proj = _linear(old.down_proj)
    for attr in ("config", "hidden_size", "intermediate_size"):
        if attr in old.__dict__:
            setattr(new, attr, old.__dict__[attr])
    _copy_hooks(old, new)
    return new


def _looks_gated_mlp(m: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _looks_rms_norm(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") or isinstance(m, torch.nn.RMSNorm)


    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)




# ---------------------------------------------------------------------------------------------------------
# Ops used by the patched forwards. Where an op is not in this build (rope, linear_cross_entropy arrive from
# their own branches), the patched forward uses transformers' math instead, and the report says so.

def _op(name: str):
    return getattr(OF, name, None) if hasattr(torch.ops.opforge, name) else None


_ROPE = _op("rope")
_LCE = _op("linear_cross_entropy")


def _torch_math(m: torch.nn.Module) -> bool:
    """True while Dynamo traces a module patched with inductor_math=True: use torch math Inductor can fuse."""
    return m.__dict__.get("_opforge_inductor_math", False) and torch.compiler.is_compiling()


def _eps(norm: torch.nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if eps is None else eps)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: weight · (x_fp32 · rsqrt(mean(x²) + eps)).to(x.dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _norm(owner: torch.nn.Module, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _torch_math(owner):
        return _hf_rms_norm(x, norm.weight, _eps(norm))
    return OF.rms_norm(x, (x.shape[-1],), norm.weight, _eps(norm))


def _add_norm(owner: torch.nn.Module, norm: torch.nn.Module, x: torch.Tensor,
              residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x)."""
    if _torch_math(owner):
        r = residual + x
        return _hf_rms_norm(r, norm.weight, _eps(norm)), r
    return OF.fused_add_rms_norm(x, residual, (x.shape[-1],), norm.weight, _eps(norm))


def _proj(owner: torch.nn.Module, x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    if _torch_math(owner):
        return TF.linear(x, lin.weight, lin.bias)
    return OF.linear(x, lin.weight, lin.bias)


def _swiglu_packed(owner: torch.nn.Module, gu: torch.Tensor) -> torch.Tensor:
    """swiglu of the fused gate/up output gu `(*, 2I)`: `opforge.swiglu_packed` (one gradient `(*, 2I)` in
    backward, no cat of two halves), or torch math while torch.compile traces (inductor_math)."""
    if _torch_math(owner):
        gate, up = gu.chunk(2, dim=-1)
        return TF.silu(gate) * up
    return OF.swiglu_packed(gu)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) of q `(B, Hq, S, D)` and k `(B, Hk, S, D)` with transformers' cos/sin `(B, S, R)`."""
    rotary_dim = cos.shape[-1]
    if _ROPE is not None:
        return _ROPE(q, k, cos, sin, rotary_dim=None if rotary_dim == q.shape[-1] else rotary_dim)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                          reduction: str, ignore_index: int) -> torch.Tensor:
    if _LCE is not None:
        return _LCE(h, weight, target, linear_bias=bias, reduction=reduction, ignore_index=ignore_index).float()
    logits = TF.linear(h, weight, bias).float()  # fallback (op not built): transformers' materialised fp32 logits
    return TF.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


# ---------------------------------------------------------------------------------------------------------
# Selective activation recomputation (apply(recompute=True)). A GEMM saves its input for the weight gradient; where
# that input is a norm's or SwiGLU's output, computable again from tensors saved anyway (the norm's input and
# rstd, SwiGLU's gate and up), the GEMM runs under saved-tensor hooks that store a recipe instead of the tensor,
# so the tensor is freed after the forward and computed again, bitwise, when the backward needs it.

def _recompute_on(owner: torch.nn.Module) -> bool:
    """True when `owner` (patched with recompute=True) may drop a saved activation now: eager autograd records
    (grad mode on), no other saved-tensor hooks are active (activation checkpointing, save_on_cpu, user hooks),
    and neither torch.compile/export traces (Inductor's partitioner decides recompute there) nor a torch.func
    transform runs (those refuse saved-tensor hooks)."""
    if torch.compiler.is_compiling() or not owner.__dict__.get("_opforge_recompute", False):
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


def _call_dropping(call, target: torch.Tensor, fn, args: tuple, what: str):
    """`call()`, with every tensor it saves for backward that is a view of `target` (same storage and dtype)
    replaced by a `_Recipe` `fn(*args)` (args: tensors saved anyway, detached, and constants)."""
    if not _recordable(target) or target.storage_offset() != 0 or not target.is_contiguous() \
            or target.untyped_storage().nbytes() != target.numel() * target.element_size():
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

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_recipe):
            return call()
    finally:
        if made and target._version != version:  # changed in place after it was saved: backward must raise
            for r in made:
                r.stale = True
        state.clear()  # pack may outlive the call (held by the graph): it must not hold the recipe
        made.clear()


def _norm_from_rstd(z: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rms_norm's output from its input z and the rstd its forward computed: the private op
    `_rms_norm_apply` (z · rstd · weight in float32, float64 for float64, rounded once: the forward kernels' last
    step, one pass), so bitwise the forward's output."""
    return torch.ops.opforge._rms_norm_apply.default(z, rstd, weight)


def _pending(m: torch.nn.Module, x: torch.Tensor) -> Optional[tuple]:
    """The recipe the decoder layer left on `m` for its input `x` (taken: used once), or None; None too when x
    was changed in place since the recipe was made (a forward pre-hook, say: the recipe would give the old value)."""
    p = m.__dict__.pop("_opforge_pending", None)
    return p[1:4] if p is not None and p[0] is x and x._version == p[4] else None


def _gemm(owner: torch.nn.Module, x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """_proj(owner, x, lin), dropping x from the saved tensors when the decoder layer left a recipe for it."""
    p = _pending(owner, x) if _recompute_on(owner) else None
    if p is None:
        return _proj(owner, x, lin)
    return _call_dropping(lambda: _proj(owner, x, lin), x, *p)


# ---------------------------------------------------------------------------------------------------------
# Fused projections.

class FusedProjectionSlice(torch.nn.Module):
    """Rows [start, stop) of a fused projection, standing where `q_proj` (`k_proj`, ...) was.

    Holds no parameter: `weight`/`bias` are views of the fused `torch.nn.Linear`'s (reads and
    in-place writes reach it); calling it computes y = x · weightᵀ + bias for this slice alone. The patched
    forwards never call it: they run the fused GEMM once and take column views of its output.

    Shape: `(*, in_features)` -> `(*, out_features)`.
    """

    def __init__(self, fused: torch.nn.Linear, start: int, stop: int):
        super().__init__()
        object.__setattr__(self, "_fused", fused)  # not a submodule: its parameters belong to the fused module
        self.start, self.stop = int(start), int(stop)
        self.in_features, self.out_features = fused.in_features, self.stop - self.start

    @property
    def weight(self) -> torch.Tensor:
        return self._fused.weight[self.start:self.stop]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        b = self._fused.bias
        return None if b is None else b[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{self.start}, {self.stop}) of the fused projection"


def _split_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the fused weights come out under transformers' keys, in transformers' order."""
    mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for fused_name, parts in module._opforge_fused.items():
        for p in ("weight", "bias"):
            t = mine.pop(f"{prefix}{fused_name}.{p}", None)
            if t is None:
                continue
            for name, a, b in parts:  # contiguous copies: save_pretrained/safetensors refuse shared storage
                mine[f"{prefix}{name}.{p}"] = t[a:b].clone()
    for k in module._opforge_key_order:
        if prefix + k in mine:
            state_dict[prefix + k] = mine.pop(prefix + k)
    state_dict.update(mine)


def _join_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    """load_state_dict pre-hook: transformers' q/k/v (gate/up) keys are concatenated into the fused key."""
    for fused_name, parts in module._opforge_fused.items():
        fused = module._modules[fused_name]
        for p in ("weight", "bias"):
            names = [f"{prefix}{n}.{p}" for n, _, _ in parts]
            cur = getattr(fused, p)
            if cur is None or not any(n in state_dict for n in names):
                continue
            pieces = []
            for n, (_, a, b) in zip(names, parts):
                if n in state_dict:
                    pieces.append(state_dict.pop(n).to(cur.device))
                else:
                    missing_keys.append(n)
                    pieces.append(cur.detach()[a:b])
            state_dict[f"{prefix}{fused_name}.{p}"] = torch.cat(pieces, 0)


def _register_sd_hooks(module: torch.nn.Module) -> list:
    post = getattr(module, "register_state_dict_post_hook", None)
    h1 = post(_split_state_dict_hook) if post is not None else module._register_state_dict_hook(_split_state_dict_hook)
    pre = getattr(module, "register_load_state_dict_pre_hook", None)
    h2 = pre(_join_load_pre_hook) if pre is not None else \
        module._register_load_state_dict_pre_hook(_join_load_pre_hook, with_module=True)
    return [h1, h2]


def _fuse(module: torch.nn.Module, names: List[str], fused_name: str) -> List[int]:
    """Concatenate module.<names> (plain torch.nn.Linear, same input) into one Linear module.<fused_name>;
    the originals are kept aside (storage freed) for revert, FusedProjectionSlice views stand in their place."""
    lins = [module._modules[n] for n in names]
    w0 = lins[0].weight
    with torch.no_grad():
        w = torch.cat([l.weight.detach() for l in lins], 0)
        b = torch.cat([l.bias.detach() for l in lins], 0) if lins[0].bias is not None else None
    fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    fused.weight = torch.nn.Parameter(w, requires_grad=w0.requires_grad)
    if b is not None:
        fused.bias = torch.nn.Parameter(b, requires_grad=lins[0].bias.requires_grad)
    if "_opforge_key_order" not in module.__dict__:
        module._opforge_key_order = [k for k in module.state_dict(keep_vars=True)]
        module._opforge_fused = {}
        module._opforge_stash = {}
    parts, sizes, off = [], [], 0
    for n, l in zip(names, lins):
        parts.append((n, off, off + l.out_features))
        module._modules[n] = FusedProjectionSlice(fused, off, off + l.out_features)  # same position
        module._opforge_stash[n] = l
        for p in l.parameters(recurse=False):  # free the original storage; revert refills it
            p.data = p.data.new_empty(0)
        sizes.append(l.out_features)
        off += l.out_features
    module.add_module(fused_name, fused)
    module._opforge_fused[fused_name] = parts
    return sizes


def _unfuse(module: torch.nn.Module) -> None:
    for fused_name, parts in module.__dict__.get("_opforge_fused", {}).items():
        fused = module._modules.pop(fused_name)
        for n, a, b in parts:
            lin = module._opforge_stash[n]
            with torch.no_grad():
                lin.weight.data = fused.weight.detach()[a:b].clone()
                if lin.bias is not None:
                    lin.bias.data = fused.bias.detach()[a:b].clone()
            lin.weight.requires_grad_(fused.weight.requires_grad)
            module._modules[n] = lin
    for h in module.__dict__.get("_opforge_hooks", []):
        h.remove()
    for attr in ("_opforge_fused", "_opforge_stash", "_opforge_key_order", "_opforge_hooks"):
        module.__dict__.pop(attr, None)


# ---------------------------------------------------------------------------------------------------------
# Patched forwards. Each is the forward of a subclass of the transformers class (built once per class), so
# isinstance checks, class attributes and decorators of __init__ stay transformers'.

def _bind(m: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Positional arguments after the first mapped to the original forward's parameter names."""
    if args:
        kwargs.update(zip(m._opforge_arg_names, args))
    return kwargs


def _decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """transformers' pre-norm decoder layer with the post-attention residual add and norm fused:
    h = rms_norm(x); a = attn(h); (h, r) = fused_add_rms_norm(a, x); return r + mlp(h)."""
    kwargs = _bind(self, args, kwargs)
    recompute = _recompute_on(self)
    h = _norm(self, self.input_layernorm, hidden_states)
    if recompute:  # the q/k/v GEMM keeps a recipe for h, not h (read by _gemm)
        n = self.input_layernorm
        self.self_attn._opforge_pending = (h, OF.rms_norm, (hidden_states.detach(), (h.shape[-1],), n.weight.detach(),
                                                            _eps(n)), "input_layernorm's output", h._version)
        try:
            attn_out = self.self_attn(hidden_states=h, **kwargs)[0]
        finally:
            self.self_attn.__dict__.pop("_opforge_pending", None)
    else:  # (also what torch.compile traces: no __dict__ bookkeeping, which Dynamo of torch 2.11 cannot trace)
        attn_out = self.self_attn(hidden_states=h, **kwargs)[0]
    n = self.post_attention_layernorm
    if recompute:  # the fused op's rstd: the gate/up GEMM keeps a recipe (residual, rstd) for h
        h, residual, rstd = torch.ops.opforge._fused_add_rms_norm_forward.default(
            attn_out, hidden_states, [attn_out.shape[-1]], n.weight, _eps(n))
        self.mlp._opforge_pending = (h, _norm_from_rstd, (residual.detach(), rstd, n.weight.detach()),
                                     "post_attention_layernorm's output", h._version)
        try:
            return residual + self.mlp(h)
        finally:
            self.mlp.__dict__.pop("_opforge_pending", None)
    h, residual = _add_norm(self, n, attn_out, hidden_states)
    return residual + self.mlp(h)


def _attention_forward(self, hidden_states, *args, **kwargs):
    """transformers' Llama-family attention with q/k/v as column views of one fused GEMM, RoPE by opforge."""
    kwargs = _bind(self, args, kwargs)
    position_embeddings = kwargs.pop("position_embeddings", None)
    attention_mask = kwargs.pop("attention_mask", None)
    cache = kwargs.pop("cache", None)
    past = kwargs.pop("past_key_values", None)
    if cache is None:
        cache = past
    input_shape = hidden_states.shape[:-1]
    hd = self.head_dim
    qkv = _gemm(self, hidden_states, self.qkv_proj)
    q, k, v = qkv.split(self._opforge_sizes, dim=-1)
    q = q.view(*input_shape, -1, hd)
    k = k.view(*input_shape, -1, hd)
    v = v.view(*input_shape, -1, hd)
    if not self._opforge_qk_norm and _ROPE is not None and _recompute_on(self):
        # q and k leave the fused output through rope's new tensors; v would stay a view, and the attention saving
        # it would keep the whole (tokens x (q+k+v)) output alive for backward: a copy of v frees it
        v = v.contiguous()
    if self._opforge_qk_norm:
        q = _norm(self, self.q_norm, q)
        k = _norm(self, self.k_norm, k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = _rope(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attention_interface = self._opforge_attention_functions.get_interface(
        self.config._attn_implementation, self._opforge_eager_attention)
    if self._opforge_sliding == "attr":
        kwargs["sliding_window"] = self.sliding_window
    elif self._opforge_sliding == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    attn_output, attn_weights = attention_interface(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _mlp_forward(self, x):
    """down_proj(swiglu_packed(gu)) with gu = [gate | up], the output of one fused GEMM."""
    gu = _gemm(self, x, self.gate_up_proj)
    h = _swiglu_packed(self, gu)
    if _recompute_on(self):  # down_proj keeps a recipe (swiglu_packed of the gate/up output it saves), not h
        return _call_dropping(lambda: self.down_proj(h), h, OF.swiglu_packed, (gu.detach(),), "swiglu's output")
    return self.down_proj(h)


def _causal_lm_forward(self, *args, **kwargs):
    """transformers' *ForCausalLM forward; with labels, the loss by opforge.linear_cross_entropy and logits None."""
    kwargs = _bind(self, args, kwargs)
    labels = kwargs.get("labels")
    keep = kwargs.get("logits_to_keep", 0)
    if labels is None or not (isinstance(keep, int) and keep == 0):
        return self._opforge_base.forward(self, **kwargs)
    kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    outputs = getattr(self, self.base_model_prefix)(**kwargs)
    hidden = outputs[0]
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = TF.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    n_items = kwargs.get("num_items_in_batch")
    head = self.get_output_embeddings()
    loss = _linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                 shift_labels.reshape(-1).to(hidden.device), head.bias,
                                 "mean" if n_items is None else "sum", ignore_index)
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    fields = {"loss": loss, "logits": None}
    for f in self._opforge_output_fields:
        if f not in fields and f in outputs:
            fields[f] = outputs[f]
    out = self._opforge_output_cls(**fields)
    return out if return_dict else out.to_tuple()


def _rms_norm_forward(self, hidden_states):
    """transformers' Llama-style RMSNorm by opforge.rms_norm (torch math while Dynamo traces, inductor_math)."""
    return _norm(self, self, hidden_states)


_SUBCLASSES: Dict[Tuple[type, str], type] = {}
_FORWARDS = {"decoder": _decoder_layer_forward, "attention": _attention_forward, "mlp": _mlp_forward,
             "causal_lm": _causal_lm_forward, "norm": _rms_norm_forward}


def _subclass(cls: type, kind: str) -> type:
    key = (cls, kind)
    if key not in _SUBCLASSES:
        base_forward = inspect.unwrap(cls.forward)
        names = [p.name for p in list(inspect.signature(base_forward).parameters.values())[1 + (kind != "causal_lm"):]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        ns = {"forward": _FORWARDS[kind], "_opforge_base": cls, "_opforge_kind": kind,
              "_opforge_arg_names": tuple(names), "__module__": __name__, "__doc__": cls.__doc__}
        _SUBCLASSES[key] = type(f"Opforge{cls.__name__}", (cls,), ns)
    return _SUBCLASSES[key]


def _swap_class(m: torch.nn.Module, kind: str, inductor_math: bool) -> None:
    m.__class__ = _subclass(type(m), kind)
    m._opforge_inductor_math = bool(inductor_math)


def _restore_class(m: torch.nn.Module) -> None:
    base = type(m).__dict__.get("_opforge_base")
    if base is not None:
        m.__class__ = base
    for attr in [a for a in m.__dict__ if a.startswith("_opforge_")]:
        del m.__dict__[attr]


def _is_patched_class(m: torch.nn.Module) -> bool:
    return "_opforge_base" in type(m).__dict__


# ---------------------------------------------------------------------------------------------------------
# Recognising a Llama-family decoder layer.

_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}


def _has_module_hooks(m: torch.nn.Module) -> bool:
    """Forward (pre-)hooks on m: the patched layer calls its norms' and act_fn's math directly, so they would not run."""
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None)
                or getattr(m, "_backward_pre_hooks", None))


def _norm_reason(norm, size: int) -> Optional[str]:
    if _has_module_hooks(norm):
        return f"{type(norm).__name__} has hooks (the patched layer computes the norm without calling the module)"
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.nn.Parameter) or tuple(w.shape) != (size,) or list(norm.children()) \
            or len(list(norm.parameters(recurse=False))) != 1:
        return f"{type(norm).__name__} is not a Llama-style RMSNorm over ({size},)"
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(eps, (float, int)):
        return f"{type(norm).__name__} has no float variance_epsilon"
    return _agree(norm, _rms_norm_like(norm, w, eps), size)


def _rms_norm_like(norm, w, eps) -> onn.RMSNorm:
    new = onn.RMSNorm(tuple(w.shape), eps=float(eps), device="meta")
    new.weight = w
    return new


def _plain_linears(m: torch.nn.Module, names) -> Optional[str]:
    for n in names:
        lin = m._modules.get(n)
        if type(lin) is not torch.nn.Linear:
            return f"{n} is {type(lin).__name__}, not a plain torch.nn.Linear (LoRA/quantized layers are left alone)"
        if lin._forward_hooks or lin._forward_pre_hooks:
            return f"{n} has forward hooks"
    return None


def _decoder_layer_reason(model_counts: Dict[int, int], layer: torch.nn.Module) -> Optional[str]:
    """None if `layer` is a Llama-family decoder layer this patch reproduces exactly, else why not."""
    if set(layer._modules) != _LAYER_CHILDREN:
        return f"submodules {sorted(layer._modules)} are not the Llama family's {sorted(_LAYER_CHILDREN)}"
    ann = inspect.signature(type(layer).forward).return_annotation
    if ann not in (torch.Tensor, "torch.Tensor"):
        return f"forward returns {ann!r}, not a tensor (a transformers version this patch does not know)"
    attn, mlp = layer.self_attn, layer.mlp
    if not set(attn._modules) <= _ATTN_CHILDREN or not {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(attn._modules):
        return f"attention submodules {sorted(attn._modules)} are not q/k/v/o_proj (+ q_norm/k_norm)"
    for a in ("head_dim", "layer_idx", "scaling", "config", "attention_dropout"):
        if not hasattr(attn, a):
            return f"attention has no {a}"
    mod = sys.modules.get(type(attn).__module__)
    if not hasattr(mod, "ALL_ATTENTION_FUNCTIONS") or not hasattr(mod, "eager_attention_forward") \
            or not hasattr(mod, "apply_rotary_pos_emb"):
        return "its module has no ALL_ATTENTION_FUNCTIONS/eager_attention_forward/apply_rotary_pos_emb"
    reason = _plain_linears(attn, ("q_proj", "k_proj", "v_proj", "o_proj"))
    if reason:
        return reason
    if set(mlp._modules) != {"gate_proj", "up_proj", "down_proj", "act_fn"} or not _is_silu(mlp.act_fn):
        return "MLP is not gate_proj/up_proj/down_proj with a SiLU act_fn"
    if isinstance(mlp.act_fn, torch.nn.Module) and _has_module_hooks(mlp.act_fn):
        return "mlp.act_fn has hooks (the patched MLP computes SwiGLU without calling it)"
    reason = _plain_linears(mlp, ("gate_proj", "up_proj", "down_proj"))
    if reason:
        return reason
    D = attn.q_proj.in_features
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        ps = [p for lin in group for p in lin.parameters()]
        if any(model_counts.get(id(p), 0) != 1 for p in ps):
            return "a projection weight is shared with another module (tied): left unfused"
        if len({(p.dtype, p.device, p.requires_grad) for p in ps}) != 1 or len({lin.bias is None for lin in group}) != 1:
            return "projections to fuse differ in dtype, device, requires_grad or bias"
        if any(p.device.type == "meta" for p in ps):
            return "parameters on the meta device (patch after loading the weights)"
        if any(lin.in_features != D for lin in group):
            return "projections to fuse have different input sizes"
    hd = attn.head_dim
    if attn.q_proj.out_features % hd or attn.k_proj.out_features % hd or attn.k_proj.out_features != attn.v_proj.out_features:
        return "q/k/v sizes are not multiples of head_dim"
    for nm in ("input_layernorm", "post_attention_layernorm"):
        reason = _norm_reason(getattr(layer, nm), D)
        if reason:
            return f"{nm}: {reason}"
    if ("q_norm" in attn._modules) != ("k_norm" in attn._modules):
        return "q_norm without k_norm"
    if "q_norm" in attn._modules:
        for nm in ("q_norm", "k_norm"):
            reason = _norm_reason(getattr(attn, nm), hd)
            if reason:
                return f"self_attn.{nm}: {reason}"
    return None


def _patch_decoder_layer(layer: torch.nn.Module, inductor_math: bool, recompute: bool = False) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    mod = sys.modules[type(attn).__module__]
    src = inspect.getsource(type(attn).forward) if hasattr(type(attn), "forward") else ""
    sliding = "attr" if hasattr(attn, "sliding_window") else ("config" if "sliding_window" in src else None)
    attn_sizes = _fuse(attn, ["q_proj", "k_proj", "v_proj"], "qkv_proj")
    _fuse(mlp, ["gate_proj", "up_proj"], "gate_up_proj")  # equal halves: swiglu_packed splits them
    attn._opforge_hooks = _register_sd_hooks(attn)
    mlp._opforge_hooks = _register_sd_hooks(mlp)
    _swap_class(layer, "decoder", inductor_math)
    _swap_class(attn, "attention", inductor_math)
    _swap_class(mlp, "mlp", inductor_math)
    attn._opforge_sizes = attn_sizes
    attn._opforge_qk_norm = "q_norm" in attn._modules
    attn._opforge_sliding = sliding
    attn._opforge_attention_functions = mod.ALL_ATTENTION_FUNCTIONS
    attn._opforge_eager_attention = mod.eager_attention_forward
    for m in (layer, attn, mlp):
        m._opforge_recompute = bool(recompute)


def _causal_lm_reason(m: torch.nn.Module) -> Optional[str]:
    if not type(m).__name__.endswith("ForCausalLM"):
        return "not a *ForCausalLM"
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers.loss.loss_utils.ForCausalLMLoss not found"
    fn = getattr(m, "loss_function", None)
    if fn is None or inspect.unwrap(fn) is not ForCausalLMLoss:
        return "its loss_function is not transformers' ForCausalLMLoss"
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "its output embedding is not a Linear"
    cfg = getattr(m, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return "its logits are soft-capped or scaled"
    src = inspect.getsource(inspect.unwrap(type(m).forward))
    if "self.lm_head(hidden_states" not in src or "loss_function(" not in src:
        return "its forward is not logits = lm_head(hidden_states); loss_function(logits, labels, ...)"
    mod = sys.modules.get(type(m).__module__)
    if not hasattr(mod, "CausalLMOutputWithPast"):
        return "its module has no CausalLMOutputWithPast"
    return None


def _patch_causal_lm(m: torch.nn.Module, inductor_math: bool) -> None:
    import dataclasses

    out_cls = sys.modules[type(m).__module__].CausalLMOutputWithPast
    _swap_class(m, "causal_lm", inductor_math)
    m._opforge_output_cls = out_cls
    m._opforge_output_fields = tuple(f.name for f in dataclasses.fields(out_cls))


# ---------------------------------------------------------------------------------------------------------
# The probe: the patched model must give the unpatched model's logits on a few random tokens.

def _probe_logits(model: torch.nn.Module) -> Optional[torch.Tensor]:
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    p = next(model.parameters(), None)
    if not isinstance(vocab, int) or p is None or p.device.type == "meta" or not type(model).__name__.endswith("ForCausalLM"):
        return None
    g = torch.Generator(device="cpu").manual_seed(4321)
    ids = torch.randint(0, vocab, (2, 7), generator=g).to(p.device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits.float()
    finally:
        for m, t in modes:
            m.training = t


def _set(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    """Replace submodule `name` by `new`, remembering the old module on its parent for revert."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    swapped = parent.__dict__.setdefault("_opforge_swapped", {})
    swapped.setdefault(child, parent._modules[child])
    parent._modules[child] = new


def _apply_modules(model: torch.nn.Module, report: PatchReport, done: set, *, linear: bool, rms_norm: bool,
                   mlp: bool) -> None:
    """Module-by-module swaps (RMSNorm, gated MLP, Linear) for everything outside the patched decoder layers."""
    for name, m in list(model.named_modules()):
        if name in done or any(name.startswith(d + ".") for d in done) or _is_patched_class(m):
            continue
        cls = type(m).__name__
        if isinstance(m, (onn.Linear, onn.RMSNorm, onn.GatedMLP, onn.FusedAddRMSNorm)):
            continue
        if _looks_gated_mlp(m):
            if not mlp:
                continue
            act = getattr(m, "act_fn", None)
            if not _is_silu(act):
                report.skipped.append((name, cls, f"activation {type(act).__name__} is not SiLU: opforge's gated MLP is swiglu; "
                                                  "its Linear layers are patched one by one"))
                continue
            projs = [getattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")]
            odd = [n for n, p in zip(("gate_proj", "up_proj", "down_proj"), projs) if type(p) is not torch.nn.Linear]
            if odd:  # e.g. LoRA or quantized Linear subclasses: GatedMLP would drop their extra parameters and math
                report.skipped.append((name, cls, f"{', '.join(odd)} not a plain torch.nn.Linear (a subclass's forward and "
                                                  "parameters would be lost); its Linear layers are patched one by one"))
                continue
            proj_params = {id(p) for q in projs for p in q.parameters()}
            extra = [n for n, p in m.named_parameters() if id(p) not in proj_params]
            if extra:  # parameters outside the three projections would be dropped by GatedMLP
                report.skipped.append((name, cls, f"has parameters outside gate_proj/up_proj/down_proj ({', '.join(extra)}); "
                                                  "its Linear layers are patched one by one"))
                continue
            if not name:
                report.skipped.append((name, cls, "the root module cannot be replaced in place"))
                continue
            new = _gated_mlp(m)
            reason = _agree(m, new, m.gate_proj.in_features)
            if reason:
                report.skipped.append((name, cls, reason + "; its Linear layers are patched one by one"))
                continue
            _set(model, name, new)
            report.patched.append((name, cls, "opforge.nn.GatedMLP"))
            done.add(name)
            continue
        if _looks_rms_norm(m):
            if not rms_norm:
                continue
            w = getattr(m, "weight", None)
            eps = getattr(m, "variance_epsilon", None)
            if isinstance(m, torch.nn.RMSNorm):
                eps = m.eps
            eps_ok = isinstance(eps, (float, int)) or (isinstance(m, torch.nn.RMSNorm) and eps is None)
            if not isinstance(w, torch.nn.Parameter) or not eps_ok or list(m.children()) \
                    or len(list(m.parameters(recurse=False))) != 1:
                report.skipped.append((name, cls, "not a Llama-style RMSNorm (expected exactly a `weight` parameter and a "
                                                  "float `variance_epsilon`)"))
                continue
            if not name:
                report.skipped.append((name, cls, "the root module cannot be replaced in place"))
                continue
            if isinstance(m, torch.nn.RMSNorm):
                new = onn.RMSNorm(m.normalized_shape, eps=m.eps, elementwise_affine=True, device="meta")
                new.weight = w
                _copy_hooks(m, new)
            else:
                new = _rms_norm(m)
            # Probed for every weight shape: a norm with a multi-dim weight that normalizes over its last dim only
            # (or computes x·(1 + weight)) must not be swapped unchecked.
            reason = _agree(m, new, tuple(w.shape))
            if reason:
                report.skipped.append((name, cls, reason))
                continue
            _set(model, name, new)
            report.patched.append((name, cls, "opforge.nn.RMSNorm"))
            continue
        if type(m) is torch.nn.Linear:
            if linear:
                if not name:
                    report.skipped.append((name, cls, "the root module cannot be replaced in place"))
                    continue
                _set(model, name, _linear(m))
                report.patched.append((name, cls, "opforge.nn.Linear"))
            continue
        if isinstance(m, torch.nn.Linear):
            report.skipped.append((name, cls, "a subclass of torch.nn.Linear (its forward may differ); left unchanged"))
            continue
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
            report.skipped.append((name, cls, "opforge has no LayerNorm/GroupNorm op"))
            continue
        if cls == "Conv1D" and hasattr(m, "nf"):
            report.skipped.append((name, cls, "GPT-2-style Conv1D (weight stored transposed) is not patched"))
            continue
        if cls.endswith("MLP") and any(isinstance(c, torch.nn.Module) for c in m.children()) and not _looks_gated_mlp(m):
            report.skipped.append((name, cls, "not a gated MLP (expected gate_proj, up_proj, down_proj and a SiLU act_fn)"))
            continue


def is_patched(model: torch.nn.Module) -> bool:
    """True when `apply` changed `model` (or one of its submodules) and `revert` has not undone it.

    Args:
        model: torch.nn.Module. The model to look at.

    Returns:
        bool.
    """
    return any(_is_patched_class(m) or "_opforge_swapped" in m.__dict__ for m in model.modules())


def apply(model: torch.nn.Module, *, decoder: bool = True, loss: bool = True, inductor_math: bool = False,
          recompute: bool = True, linear: bool = True, rms_norm: bool = True, mlp: bool = True, check: bool = True,
          strict: bool = False, verbose: bool = False) -> PatchReport:
    """Patch `model` in place to run on opforge ops (see the module docstring); `revert` undoes it.

    Args:
        model: torch.nn.Module. Typically a transformers `LlamaForCausalLM` (Mistral, Qwen2, Qwen3 ...),
            with its weights loaded (patch after `from_pretrained`, before building the optimizer and
            before wrapping in DDP/FSDP or compiling).
        decoder: bool. Patch Llama-family decoder layers (fused add+norm, fused q/k/v and gate/up GEMMs, RoPE,
            SwiGLU). Default: True.
        loss: bool. With `labels`, compute a `*ForCausalLM`'s loss by opforge.linear_cross_entropy (logits not
            materialised; `outputs.logits` is None). Default: True.
        inductor_math: bool. While torch.compile traces, run the norms, SwiGLU and projections of the patched
            layers as torch math, so Inductor fuses them with their neighbours. Default: False (opforge's ops
            stay opaque in the graph: 2.9 % less GPU time a step on the H200, see the module docstring).
        recompute: bool. Selective activation recomputation in the patched decoder layers (eager training only): the
            GEMMs' inputs that are cheap to compute again are not kept for backward but computed again, bitwise,
            when backward needs them: input_layernorm's output (kept by the q/k/v GEMM; again rms_norm of the
            layer input, which rms_norm keeps anyway), post_attention_layernorm's output (kept by the gate/up GEMM;
            again residual · rstd · weight from what fused_add_rms_norm keeps) and SwiGLU's output (kept by
            down_proj; again swiglu_packed of the gate/up output it keeps); and v is copied out of the fused q/k/v
            output, which the attention would otherwise keep whole for the view v. Saved per layer, with T tokens,
            hidden size D, intermediate size I, q/k/v widths Dq/Dkv and e bytes per element:
            T·(2·D + I + Dq + Dkv)·e (8192 tokens of a 2048/8192 Llama with 8 KV heads, bf16: 240 MiB a layer).
            Cost: one rms_norm, one normalisation pass and one swiglu_packed forward per layer in backward, one
            copy of v in forward (H200, the benchmark's Llama: 62,520 against 64,816 tokens/s, 16.95 against 20.70
            GiB). Off (the graph of recompute=False) while torch.compile traces (Inductor's partitioner decides
            recompute there), under other saved-tensor hooks (non-reentrant activation checkpointing, save_on_cpu,
            yours; reentrant checkpointing runs the layer again with grad on, recipes included) and inside
            torch.func transforms; with no grad (inference, generate) nothing changes. Under torch.autocast the
            GEMM keeps its own low-precision copy of a norm's output, so the norms' share is not saved there.
            Without opforge.rope, or with q/k norms (Qwen3), v is not copied (q/k keep the fused output anyway).
            Default: True.
        linear: bool. Swap the remaining plain torch.nn.Linear modules for opforge.nn.Linear. Default: True.
        rms_norm: bool. Swap the remaining Llama-style RMSNorm modules for opforge.nn.RMSNorm. Default: True.
        mlp: bool. Swap the remaining SiLU-gated MLPs for opforge.nn.GatedMLP. Default: True.
        check: bool. For a `*ForCausalLM` with real weights, run a forward on 2×7 random tokens before and after
            patching (eval mode, no grad); if the logits differ by more than 1e-4 (float32/64) or 5e-2
            (16-bit) of their largest magnitude, undo everything and report why. Default: True.
        strict: bool. Raise instead of warning when some module could not be patched. Default: False.
        verbose: bool. Print the report. Default: False.

    Returns:
        `PatchReport`: the patched modules and those left unchanged, with the reason.

    Raises:
        TypeError: model is not a torch.nn.Module.
        ValueError: strict=True and some module could not be patched, or nothing at all was patchable.
        RuntimeError: strict=True and the check found different logits (the model is reverted first).

    Warns:
        UserWarning: (strict=False) naming the modules that could not be patched.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.patch.apply: expected a torch.nn.Module, but got {type(model).__name__}")
    report = PatchReport()
    done: set = set()
    before = _probe_logits(model) if check and not is_patched(model) else None
    counts: Dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for name, m in list(model.named_modules()):
        if any(name.startswith(d + ".") for d in done):
            continue
        if _is_patched_class(m):
            done.add(name)
            continue
        cls = type(m).__name__
        if decoder and "self_attn" in m._modules and "mlp" in m._modules:
            reason = _decoder_layer_reason(counts, m)
            if reason:
                report.skipped.append((name, cls, f"decoder layer left as transformers wrote it: {reason}"))
                continue
            _patch_decoder_layer(m, inductor_math, recompute)
            report.patched.append((name, cls, "opforge decoder layer (rms_norm, fused_add_rms_norm)"))
            report.patched.append((f"{name}.self_attn", type(m.self_attn).__mro__[1].__name__,
                                   "opforge attention (fused q/k/v GEMM, rope)"))
            report.patched.append((f"{name}.mlp", type(m.mlp).__mro__[1].__name__, "opforge MLP (fused gate/up GEMM, swiglu_packed)"))
            done.add(name)
    if loss:
        for name, m in list(model.named_modules()):
            if type(m).__name__.endswith("ForCausalLM") and not _is_patched_class(m):
                reason = _causal_lm_reason(m)
                if reason:
                    report.skipped.append((name, type(m).__name__, f"loss left as transformers computes it: {reason}"))
                    continue
                _patch_causal_lm(m, inductor_math)
                report.patched.append((name, type(m).__mro__[1].__name__,
                                       "opforge loss (linear_cross_entropy; logits None when labels are given)"))
    if decoder and inductor_math and rms_norm and done:
        # Norms outside the layers (the final norm): under compile Inductor must fuse the last residual add into
        # it, so the HF module keeps its place and gets a forward that is opforge.rms_norm in eager, torch under compile.
        for name, m in list(model.named_modules()):
            if any(name == d or name.startswith(d + ".") for d in done) or _is_patched_class(m) or not name:
                continue
            if _looks_rms_norm(m) and not isinstance(m, torch.nn.RMSNorm) and hasattr(m, "variance_epsilon") \
                    and not list(m.children()) and isinstance(getattr(m, "weight", None), torch.nn.Parameter) \
                    and m.weight.dim() == 1 and not _norm_reason(m, m.weight.shape[0]):
                _swap_class(m, "norm", inductor_math)
                report.patched.append((name, type(m).__mro__[1].__name__, "opforge RMSNorm (rms_norm; torch math under compile)"))
                done.add(name)
    if any(k == "opforge decoder layer (rms_norm, fused_add_rms_norm)" for _, _, k in report.patched) and _ROPE is None:
        report.notes.append("opforge.rope is not in this build: RoPE runs transformers' rotate-half math")
    if any(k.startswith("opforge loss") for _, _, k in report.patched) and _LCE is None:
        report.notes.append("opforge.linear_cross_entropy is not in this build: the loss materialises fp32 logits")
    _apply_modules(model, report, done, linear=linear, rms_norm=rms_norm, mlp=mlp)
    if before is not None and report.patched:
        after = _probe_logits(model)
        scale = max(before.abs().max().item(), 1e-6)
        err = (after - before).abs().max().item() / scale
        dtype = next(model.parameters()).dtype
        tol = 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2
        if not err <= tol:
            revert(model)
            msg = (f"opforge.patch.apply: the patched {type(model).__name__} gives different logits (max difference "
                   f"{err:.2e} of the largest logit > {tol:g}); the model was left unpatched")
            if strict:
                raise RuntimeError(msg)
            warnings.warn(msg, stacklevel=2)
            return PatchReport(skipped=[("", type(model).__name__, msg)])
    if verbose:
        print(report)
    if not report.patched:
        msg = f"opforge.patch.apply: found nothing to patch in {type(model).__name__}\n{report}"
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    elif report.skipped:
        if strict:
            raise ValueError(f"opforge.patch.apply: could not patch every module of {type(model).__name__}\n{report}")
        warnings.warn(f"opforge.patch.apply: could not patch {len(report.skipped)} module(s) of {type(model).__name__}:\n"
                      + "\n".join(f"  {n or '<root>'} ({c}): {r}" for n, c, r in report.skipped), stacklevel=2)
    return report


def revert(model: torch.nn.Module) -> int:
    """Undo `apply` on `model`, in place: transformers' classes and forwards come back.

    The fused projections are split back into the original `torch.nn.Linear` modules (their original
    `Parameter` objects, holding the current values), swapped modules are put back holding the current
    parameters. Build a new optimizer afterwards (the fused parameters are gone).

    Args:
        model: torch.nn.Module. A model `apply` patched (anything else is left as it is).

    Returns:
        int: the number of modules restored (0 when `model` was not patched).

    Raises:
        TypeError: model is not a torch.nn.Module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.patch.revert: expected a torch.nn.Module, but got {type(model).__name__}")
    n = 0
    for m in list(model.modules()):
        swapped = m.__dict__.pop("_opforge_swapped", None)
        for child, old in (swapped or {}).items():
            new = m._modules[child]
            for pname, p in new.named_parameters():  # the current Parameters (e.g. after .to()) go back
                owner, _, leaf = pname.rpartition(".")
                setattr(old.get_submodule(owner) if owner else old, leaf, p)
            m._modules[child] = old
            n += 1
    for m in list(model.modules()):
        if "_opforge_fused" in m.__dict__:
            _unfuse(m)
        if _is_patched_class(m) or any(a.startswith("_opforge_") for a in m.__dict__):
            _restore_class(m)
            n += 1
    return n
