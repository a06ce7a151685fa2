"""The shared patched forwards: the attention (one q/k/v GEMM, optional q/k norms, RoPE), the gated MLP (one gate/up
GEMM, SwiGLU or GeGLU of its packed output), the decoder layer (its norms and residual adds in the layouts the
families use), the causal-LM loss (logits never materialised), the experts of a mixture-of-experts block and a
stand-alone RMSNorm. Each is the forward of a subclass of the transformers class (built once per class and kind),
so isinstance checks, class attributes and decorators of __init__ stay transformers'. What differs between
families is read from a few `_opforge_*` attributes the family adapters (`_families`) set on the modules."""
from __future__ import annotations

import inspect
import types
import sys
import warnings
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as TF

from .. import functional as OF
from . import _fp8 as FP8
from . import _fused as F
from . import _peft as P
from . import _recompute as R

# ---------------------------------------------------------------------------------------------------------
# Ops. Where an op is not in this build, the patched forward uses transformers' math instead, and the report says so.


def _op(name: str):
    return getattr(OF, name, None) if hasattr(torch.ops.opforge, name) else None


ROPE = _op("rope")
LCE = _op("linear_cross_entropy")
GEGLU_PACKED = _op("geglu_packed")
INDEXED_LINEAR = _op("indexed_linear")


def torch_math(m: torch.nn.Module) -> bool:
    """True while Dynamo traces a module patched with inductor_math=True: use torch math Inductor can fuse."""
    return m.__dict__.get("_opforge_inductor_math", False) and torch.compiler.is_compiling()


def eps(norm: torch.nn.Module) -> float:
    e = getattr(norm, "variance_epsilon", None)
    return float(norm.eps if e is None else e)


def norm_weight(owner: torch.nn.Module, norm: torch.nn.Module) -> torch.Tensor:
    """The scale a norm multiplies by: its weight, or 1 + weight for the families that store the offset (Gemma).
    state_dict keeps the stored weight."""
    w = norm.weight
    return w + 1.0 if owner.__dict__.get("_opforge_offset", False) else w


def _torch_rms_norm(owner: torch.nn.Module, x: torch.Tensor, w: torch.Tensor, e: float) -> torch.Tensor:
    """transformers' RMSNorm math: Llama rounds the normalised input to its dtype, then scales; Gemma and OLMo 2
    scale in float32, then round."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + e)
    if owner.__dict__.get("_opforge_scale_first", False):
        return (h * w.float()).to(x.dtype)
    return w * h.to(x.dtype)


def norm(owner: torch.nn.Module, n: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = norm_weight(owner, n)
    if torch_math(owner):
        return _torch_rms_norm(owner, x, w, eps(n))
    return OF.rms_norm(x, (x.shape[-1],), w, eps(n))


def add_norm(owner: torch.nn.Module, n: torch.nn.Module, x: torch.Tensor,
             residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x)."""
    w = norm_weight(owner, n)
    if torch_math(owner):
        r = residual + x
        return _torch_rms_norm(owner, r, w, eps(n)), r
    return OF.fused_add_rms_norm(x, residual, (x.shape[-1],), w, eps(n))


def norm_amax(owner: torch.nn.Module, n: torch.nn.Module, x: torch.Tensor,
              consumer: torch.nn.Module) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(norm(owner, n, x), max |output| for `consumer`'s FP8 GEMMs, or None where they compute it themselves, see
    `_fp8.amax_on`): the private op `_rms_norm_forward_amax` writes both in one pass (its output bit-identical)."""
    if not FP8.amax_on(consumer, x):
        return norm(owner, n, x), None
    h, _, amax = torch.ops.opforge._rms_norm_forward_amax.default(x, [x.shape[-1]], norm_weight(owner, n), eps(n))
    return h, amax


def proj(owner: torch.nn.Module, x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    fp8 = owner.__dict__.get("_opforge_fp8")  # apply(model, fp8=...): the FP8 GEMM, also under compile
    if fp8 is not None:
        return FP8.linear(owner, x, lin, fp8)  # the weight's FP8 operands cached while it is unchanged
    if torch_math(owner):
        return TF.linear(x, lin.weight, lin.bias)
    return OF.linear(x, lin.weight, lin.bias)


def gated_act(owner: torch.nn.Module, gu: torch.Tensor) -> torch.Tensor:
    """act(gate) · up of the fused gate/up output gu = [gate | up] `(*, 2I)`: `opforge.swiglu_packed` (SiLU) or
    `opforge.geglu_packed` (GELU, tanh approximation) — one gradient `(*, 2I)` in backward, no cat of two halves —
    or torch math while torch.compile traces (inductor_math) and for GELU while the op is not built."""
    if owner.__dict__.get("_opforge_act", "silu") == "gelu_tanh":
        if GEGLU_PACKED is None or torch_math(owner):
            gate, up = gu.chunk(2, dim=-1)
            return TF.gelu(gate, approximate="tanh") * up
        return GEGLU_PACKED(gu, approximate="tanh")
    if torch_math(owner):
        gate, up = gu.chunk(2, dim=-1)
        return TF.silu(gate) * up
    return OF.swiglu_packed(gu)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE (rotate-half) of q `(B, Hq, S, D)` and k `(B, Hk, S, D)` with transformers' cos/sin `(B, S, R)` on the
    first R dims (R < D: partial rotary, Phi-3)."""
    rotary_dim = cos.shape[-1]
    if ROPE is not None:
        return ROPE(q, k, cos, sin, rotary_dim=None if rotary_dim == q.shape[-1] else rotary_dim)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def one(x):
        if rotary_dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat([xr * cos + _rotate_half(xr) * sin, xp], dim=-1)

    return one(q), one(k)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
                         reduction: str, ignore_index: int, softcap: Optional[float] = None) -> torch.Tensor:
    if LCE is not None:
        return LCE(h, weight, target, linear_bias=bias, reduction=reduction, ignore_index=ignore_index,
                   softcap=softcap).float()
    logits = TF.linear(h, weight, bias).float()  # fallback (op not built): transformers' materialised fp32 logits
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return TF.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)


def gemm(owner: torch.nn.Module, x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """proj(owner, x, lin), dropping x from the saved tensors when the decoder layer left a recipe for it."""
    p = R.pending(owner, x) if R.recompute_on(owner) else None
    if p is None:
        return proj(owner, x, lin)
    return R.call_dropping(lambda: proj(owner, x, lin), x, *p)


# ---------------------------------------------------------------------------------------------------------
# Hooks. A patched forward computes some submodules' math without calling them (the norms, the q/k/v and gate/up
# projections, the activation, lm_head): a hook on one of those (registered after apply; apply refuses a layer that
# has them) would not run. Each patched forward checks, before anything else, the hook dicts of the submodules it
# bypasses and torch's global module hooks; with any present it runs transformers' forward (which calls them) and
# warns once.

_MOD = torch.nn.modules.module


def _hooked(m: Optional[torch.nn.Module]) -> bool:
    """True when m has module hooks other than those opforge.parallel's plan installed (`_opforge_plan_hooks`: the
    layout conversions that the patched forwards do themselves on DTensors)."""
    if m is None:
        return False
    own = m.__dict__.get("_opforge_plan_hooks", ())
    return any(k not in own for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks,
                                      getattr(m, "_backward_pre_hooks", {})) for k in d)


def _global_hooks() -> bool:
    return bool(_MOD._global_forward_hooks or _MOD._global_forward_pre_hooks or _MOD._global_backward_hooks
                or getattr(_MOD, "_global_backward_pre_hooks", None))


def bypassed_hooks(m: torch.nn.Module) -> bool:
    """True when a module `m`'s patched forward would bypass carries hooks (or global module hooks exist).

    Under opforge.parallel (`m._opforge_tp_ranks` set) transformers' forward cannot run on the sharded fused
    weights: the patched forward runs, with a warning the first time, and those hooks do not see the submodules it
    computes directly."""
    hooked = _global_hooks() or any(_hooked(_submodule(m, path)) for path in m._opforge_bypassed)
    if hooked and m.__dict__.get("_opforge_tp_ranks"):
        if not m.__dict__.get("_opforge_warned", False):
            m.__dict__["_opforge_warned"] = True
            warnings.warn(f"opforge.patch: {type(m).__mro__[1].__name__} is tensor-parallel (opforge.parallel): "
                          f"module hooks do not run on {', '.join(m._opforge_bypassed)}, which its patched forward "
                          f"computes without calling them", stacklevel=3)
        return False
    return hooked


def _submodule(m: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    sub = m
    for part in path.split("."):
        sub = sub._modules.get(part) if sub is not None else None
    return sub


_HOOKS = "hooks"
_FOREIGN = "foreign"


def _fall_back(m: torch.nn.Module, why: str, *args, **kwargs):
    """transformers' forward of `m` (which calls every submodule), with a warning the first time."""
    if not m.__dict__.get("_opforge_warned", False):
        m.__dict__["_opforge_warned"] = True
        name = type(m).__mro__[1].__name__
        if why == _HOOKS:
            msg = (f"{name} has hooks on a submodule its patched forward computes without calling it "
                   f"({', '.join(m._opforge_bypassed)}, or global module hooks): running transformers' forward there "
                   f"so that they run")
        else:
            msg = (f"{name} has a projection that is neither opforge's fused slice, a plain Linear nor a PEFT LoRA "
                   f"layer opforge reproduces (or a wrapped lm_head): running transformers' forward there")
        warnings.warn(f"opforge.patch: {msg}", stacklevel=3)
    return m._opforge_base.forward(m, *args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# Patched forwards.

def bind(m: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Positional arguments after the first mapped to the original forward's parameter names."""
    if args:
        kwargs.update(zip(m._opforge_arg_names, args))
    return kwargs


def decoder_layer_forward(self, hidden_states, *args, **kwargs):
    """transformers' decoder layer with a residual add and the norm after it fused (fused_add_rms_norm). Layouts:
    "pre" (Llama): h = norm1(x); r = x + attn(h); return r + mlp(norm2(r));
    "sandwich" (Gemma 2/3): r = x + norm2(attn(norm1(x))); return r + norm4(mlp(norm3(r)));
    "post" (OLMo 2): r = x + norm2(attn(x)); return r + norm4(mlp(r)).
    A residual multiplier (Granite) scales both branches, residual dropouts (Phi-3) run on them."""
    kwargs = bind(self, args, kwargs)
    if bypassed_hooks(self):
        return _fall_back(self, _HOOKS, hidden_states, **kwargs)
    layout = self._opforge_layout
    x = hidden_states
    recompute = R.recompute_on(self)
    attn = self.self_attn
    if layout == "post":
        a = attn(hidden_states=x, **kwargs)[0]
    else:
        n = self.input_layernorm
        h, amax = norm_amax(self, n, x, attn)
        if recompute:  # the q/k/v GEMM keeps a recipe for h, not h (read by gemm)
            attn._opforge_pending = (h, OF.rms_norm, (x.detach(), (h.shape[-1],), norm_weight(self, n).detach(),
                                                      eps(n)), "input_layernorm's output", h._version)
            try:
                with FP8.input_amax(h, amax):
                    a = attn(hidden_states=h, **kwargs)[0]
            finally:
                attn.__dict__.pop("_opforge_pending", None)
        else:  # (also what torch.compile traces: no __dict__ bookkeeping)
            with FP8.input_amax(h, amax):
                a = attn(hidden_states=h, **kwargs)[0]
    if layout != "pre":
        a = norm(self, self.post_attention_layernorm, a)
    if self._opforge_dropout:
        a = self.resid_attn_dropout(a)
    mult = self.residual_multiplier if self._opforge_residual_multiplier else None  # live, as transformers reads it
    if mult is not None:
        a = a * mult
    if layout == "post":
        r = x + a
        m = norm(self, self.post_feedforward_layernorm, self.mlp(r))
        return r + (m if mult is None else m * mult)
    n = self.pre_feedforward_layernorm if layout == "sandwich" else self.post_attention_layernorm
    amax = None
    if recompute or FP8.amax_on(self.mlp, a):  # the fused op's rstd; the gate/up GEMM's input amax (FP8 tensorwise)
        w = norm_weight(self, n)
        if FP8.amax_on(self.mlp, a):
            h, r, rstd, amax = torch.ops.opforge._fused_add_rms_norm_forward_amax.default(a, x, [a.shape[-1]], w,
                                                                                         eps(n))
        else:
            h, r, rstd = torch.ops.opforge._fused_add_rms_norm_forward.default(a, x, [a.shape[-1]], w, eps(n))
    else:
        h, r = add_norm(self, n, a, x)
    if recompute:  # the gate/up GEMM keeps a recipe (residual, rstd) for h
        what = "pre_feedforward_layernorm's output" if layout == "sandwich" else "post_attention_layernorm's output"
        self.mlp._opforge_pending = (h, R.norm_from_rstd, (r.detach(), rstd, w.detach()), what, h._version)
        try:
            with FP8.input_amax(h, amax):
                m = self.mlp(h)
        finally:
            self.mlp.__dict__.pop("_opforge_pending", None)
    else:
        with FP8.input_amax(h, amax):
            m = self.mlp(h)
    if layout == "sandwich":
        m = norm(self, self.post_feedforward_layernorm, m)
    if self._opforge_dropout:
        m = self.resid_mlp_dropout(m)
    if mult is not None:
        m = m * mult
    return r + m


def attention_forward(self, hidden_states, *args, **kwargs):
    """transformers' attention with q/k/v as column views of one fused GEMM, optional q/k norms per head (Qwen3,
    Gemma 3) or over the whole projection (OLMo 2), RoPE by opforge; the KV cache, the attention function (sdpa,
    flash, eager, with sliding windows and Gemma 2's score soft-capping) and o_proj as transformers."""
    kwargs = bind(self, args, kwargs)
    if not torch.compiler.is_compiling() and "_opforge_fp8_slots" in self.__dict__:
        P.watch_slots(self, self._opforge_fp8_slots)  # PEFT merges into the FP8 projections drop cached operands
    hooked = bypassed_hooks(self)
    plan = None if hooked else _lora_plan(self, "qkv_proj", self._opforge_parts)
    if plan is None:
        return _fall_back(self, _HOOKS if hooked else _FOREIGN, hidden_states, **kwargs)
    base, wrap, loras = plan
    position_embeddings = kwargs.pop("position_embeddings", None)
    attention_mask = kwargs.pop("attention_mask", None)
    cache = kwargs.pop("cache", None)
    past = kwargs.pop("past_key_values", None)
    if cache is None:
        cache = past
    input_shape = hidden_states.shape[:-1]
    hd = self.head_dim
    qkv = gemm(self, hidden_states, base)
    if wrap is not None:  # a LoRA layer on the fused projection itself (Phi-3's qkv_proj)
        qkv = _add(qkv, P.delta(wrap, hidden_states))
    q, k, v = qkv.split(self._opforge_sizes, dim=-1)
    if loras:  # LoRA layers on q_proj / k_proj / v_proj: their adapters beside the fused GEMM
        qkv_parts = [q, k, v]
        for i, w in loras:
            qkv_parts[i] = _add(qkv_parts[i], P.delta(w, hidden_states))
        q, k, v = qkv_parts
    qk_norm = self._opforge_qk_norm
    if qk_norm == "full":
        q = norm(self, self.q_norm, q)
        k = norm(self, self.k_norm, k)
    q = q.view(*input_shape, -1, hd)
    k = k.view(*input_shape, -1, hd)
    v = v.view(*input_shape, -1, hd)
    if qk_norm != "head" and ROPE is not None and R.recompute_on(self):
        # q and k leave the fused output through new tensors; v would stay a view, and the attention saving it
        # would keep the whole (tokens x (q+k+v)) output alive for backward: a copy of v frees it
        v = v.contiguous()
    if qk_norm == "head":
        q = norm(self, self.q_norm, q)
        k = norm(self, self.k_norm, k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = rope(q, k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    attention_interface = self._opforge_attention_functions.get_interface(
        self.config._attn_implementation, self._opforge_eager_attention)
    if self._opforge_sliding == "attr":
        kwargs["sliding_window"] = getattr(self, "sliding_window", None)
    elif self._opforge_sliding == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    if self._opforge_softcap:
        kwargs["softcap"] = self.attn_logit_softcapping
    attn_output, attn_weights = attention_interface(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    with R.saving_input_of_attention(self, attn_output):  # FP8: saves the attention's output, held anyway
        return self.o_proj(attn_output), attn_weights


def _lora_plan(m: torch.nn.Module, fused_name: str, parts: tuple):
    """(fused base Linear, its LoRA layer or None, [(part index, LoRA layer)]) for the patched forward, or None when
    some projection is neither opforge's slice, a plain Linear, nor a PEFT LoRA layer over one (then transformers'
    forward runs). Also writes into the fused weight rows whose `.data` was replaced (PEFT's safe merge)."""
    base, wrap = P.split(m._modules[fused_name])
    if base is None:
        return None
    if wrap is None:
        # read through the attribute: under opforge.parallel it is a view of this rank's local weight shard
        base = getattr(m, fused_name)
    loras = []
    for i, n in enumerate(parts):
        sub = m._modules.get(n)
        if isinstance(sub, F.FusedProjectionSlice):
            continue
        b, w = P.split(sub)
        if w is None or not isinstance(b, F.FusedProjectionSlice):
            return None
        loras.append((i, w))
    for w in ([wrap] if wrap is not None else []) + [w for _, w in loras]:
        # PEFT's LoRA forward with the adapters disabled unmerges before its base layer's GEMM: so must the fused
        # GEMM, which reads the base rows before `_peft.delta` sees the layer (else merged deltas are served once)
        if w.disable_adapters and w.merged:
            w.unmerge()
    if not torch.compiler.is_compiling():
        F.sync_slices(m)
    base = F.gemm_operand(m, fused_name, base)  # frozen slices' rows detached; tensors assigned to slices in theirs
    return base, wrap, loras


def _add(t: torch.Tensor, d: Optional[torch.Tensor]) -> torch.Tensor:
    return t if d is None else (t + d).to(t.dtype)


def _act_again(owner):
    return lambda gu: gated_act(owner, gu)


def mlp_forward(self, x):
    """down_proj(act(gate) · up) with [gate | up] the output of one fused GEMM. With apply(fp8_activations=True)
    the activation's backward reads gu from its rowwise e4m3 copy (`_recompute.Fp8Saved`), LoRA adapters on
    gate/up included (gu is then the sum the activation reads)."""
    if not torch.compiler.is_compiling() and "_opforge_fp8_slots" in self.__dict__:
        P.watch_slots(self, self._opforge_fp8_slots)  # PEFT merges into the FP8 projections drop cached operands
    hooked = bypassed_hooks(self)
    plan = None if hooked else _lora_plan(self, "gate_up_proj", self._opforge_parts)
    if plan is None:
        return _fall_back(self, _HOOKS if hooked else _FOREIGN, x)
    base, wrap, loras = plan
    gu = gemm(self, x, base)
    if wrap is not None:
        gu = _add(gu, P.delta(wrap, x))
    if loras:  # LoRA layers on gate_proj / up_proj: [gate + Δgate | up + Δup]
        halves = list(gu.chunk(2, dim=-1))
        for i, w in loras:
            halves[i] = _add(halves[i], P.delta(w, x))
        gu = torch.cat(halves, dim=-1)
    # down_proj's input amax from the SwiGLU kernel where down_proj is FP8 (tensorwise, eager)
    if FP8.amax_on(self, gu) and self.__dict__.get("_opforge_act", "silu") == "silu":
        def act():
            return torch.ops.opforge._swiglu_packed_amax.default(gu)
    else:
        def act():
            return gated_act(self, gu), None
    # fp8_activations: the activation keeps a recipe (gu dequantized from its rowwise e4m3 copy), not gu; down_proj's
    # recipe (recompute) computes its input from that copy too, also where gu needs no gradient but down_proj saves
    # its input (gate/up frozen and an input without grad, e.g. adapters on down_proj alone: else its recipe keeps gu)
    recompute = R.recompute_on(self)
    saved = None  # (the option's checks first: the default path pays no parameter walk)
    if R.fp8_activations_on(self) and R.droppable(gu) and (
            gu.requires_grad or (recompute and any(p.requires_grad for p in self.down_proj.parameters()))):
        saved = R.Fp8Saved(gu)
    if saved is not None and gu.requires_grad:
        h, amax = R.call_dropping(act, gu, saved.saved(), saved.args, "the gate/up output", gemm=False)
    else:
        h, amax = act()

    def down():
        with FP8.input_amax(h, amax):
            return self.down_proj(h)

    if recompute:  # down_proj keeps a recipe (the activation of the gate/up output it saves), not h
        what = "swiglu's output" if self.__dict__.get("_opforge_act", "silu") == "silu" else "geglu's output"
        if saved is not None:  # from the FP8 copy: no full-precision gu is kept
            # the dequantized gu is handed to the activation's recipe only where there is one (gu needs a gradient)
            return R.call_dropping(down, h, saved.activation(_act_again(self), gu.requires_grad), saved.args, what)
        return R.call_dropping(down, h, _act_again(self), (gu.detach(),), what)
    return down()


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts of a mixture-of-experts block (weights stored as (E, 2I, D) gate/up and (E, D, I) down
    banks) on `opforge.indexed_linear`: each (token, chosen expert) pair is one row; the pairs are sorted by expert
    once, so both GEMMs run on rows already grouped (`index_sorted=True`: no sort, gather or scatter inside either);
    the rows are put back in pair order, scaled by the router's weights and summed per token. Every step is a
    gather through a permutation or a sum over the k choices, so the result and its gradients are deterministic.
    The router (top-k, its weights, the auxiliary loss) stays transformers'. apply(fp8_activations=True) does not
    reach the experts: their gate/up output stays in the model's dtype (a shared expert is a patched MLP and has
    it)."""
    if bypassed_hooks(self):
        return _fall_back(self, _HOOKS, hidden_states, top_k_index, top_k_weights)
    T, D = hidden_states.shape
    k = top_k_index.shape[-1]
    E = self.gate_up_proj.shape[0]
    index = top_k_index.reshape(-1).long()
    # transformers skips index E (no expert): such pairs are keyed E, sort last and get index -1
    key = torch.where(index.ge(0) & index.lt(E), index, E)
    key, order = torch.sort(key, stable=True)
    index = torch.where(key.lt(E), key, -1)
    x = hidden_states.unsqueeze(1).expand(T, k, D).reshape(T * k, D) if k > 1 else hidden_states
    x = x.index_select(0, order)
    gu = INDEXED_LINEAR(x, self.gate_up_proj, index, index_sorted=True)
    h = gated_act(self, gu)
    y = INDEXED_LINEAR(h, self.down_proj, index, index_sorted=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = y.index_select(0, inverse) * top_k_weights.reshape(-1, 1).to(y.dtype)
    return y.view(T, k, D).sum(1).to(hidden_states.dtype)


def causal_lm_forward(self, *args, **kwargs):
    """transformers' *ForCausalLM forward; with labels, the loss by opforge.linear_cross_entropy and logits None.
    The family's logit transforms are the op's: a divisor (Granite's logits_scaling) scales the hidden states, a
    final soft-cap (Gemma 2/3) is the op's `softcap`."""
    kwargs = bind(self, args, kwargs)
    labels = kwargs.get("labels")
    keep = kwargs.get("logits_to_keep", 0)
    if labels is None or not (isinstance(keep, int) and keep == 0):
        return self._opforge_base.forward(self, **kwargs)
    head = self.get_output_embeddings()
    hooked = bypassed_hooks(self)
    if hooked or type(head) not in (torch.nn.Linear, _onn_linear()):
        return _fall_back(self, _HOOKS if hooked else _FOREIGN, **kwargs)  # hooks, or lm_head wrapped (a LoRA layer): transformers' forward
    kwargs.pop("labels")
    kwargs.pop("logits_to_keep", None)
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    if self._opforge_moe:  # resolved before the model runs, as transformers does
        orl = kwargs.get("output_router_logits")
        kwargs["output_router_logits"] = getattr(self.config, "output_router_logits", False) if orl is None else orl
    outputs = getattr(self, self.base_model_prefix)(**kwargs)
    hidden = outputs[0]
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = TF.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    n_items = kwargs.get("num_items_in_batch")
    divisor = self._opforge_logits_divisor
    if divisor is not None:
        hidden = hidden / getattr(self.config, divisor)
    softcap = self._opforge_final_softcap
    softcap = getattr(self.config, softcap, None) if softcap is not None else None
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                                shift_labels.reshape(-1).to(hidden.device), head.bias,
                                "mean" if n_items is None else "sum", ignore_index, softcap=softcap)
    if n_items is not None:
        loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
    fields = {"loss": loss, "logits": None}
    for f in self._opforge_output_fields:
        if f not in fields and f in outputs:
            fields[f] = outputs[f]
    aux = self._opforge_aux_loss
    if aux is not None:  # mixture of experts: transformers' router loss, added to the loss as it adds it
        fields.update(aux(self, outputs, kwargs, loss))
    if return_dict:
        return self._opforge_output_cls(**fields)
    # transformers' tuple: the non-None fields in order; the logits' place is kept (None) so that positions match
    return tuple(fields.get(f) for f in self._opforge_output_fields if f == "logits" or fields.get(f) is not None)


def moe_aux_loss(self, outputs, kwargs, loss) -> dict:
    """transformers' router loss of a mixture-of-experts *ForCausalLM: its modeling module's
    load_balancing_loss_func of the router logits, added to the loss with router_aux_loss_coef."""
    if not kwargs.get("output_router_logits"):
        return {"aux_loss": None}
    lb_loss = sys.modules[self._opforge_base.__module__].load_balancing_loss_func
    a = lb_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok, kwargs.get("attention_mask"))
    return {"aux_loss": a, "loss": loss + self.router_aux_loss_coef * a.to(loss.device)}


def _onn_linear():
    from .. import nn as onn

    return onn.Linear


def rms_norm_forward(self, hidden_states):
    """transformers' RMSNorm by opforge.rms_norm (torch math while Dynamo traces, inductor_math)."""
    return norm(self, self, hidden_states)


# ---------------------------------------------------------------------------------------------------------
# Subclasses.

_SUBCLASSES: Dict[Tuple[type, str], type] = {}
# Attributes read from the transformers modeling module at patch time: not pickled, read again on unpickling.
_FROM_MODULE = {"_opforge_attention_functions": "ALL_ATTENTION_FUNCTIONS",
                "_opforge_eager_attention": "eager_attention_forward"}


def _rebuild(base: type, kind: str) -> torch.nn.Module:
    """Unpickling a patched module: an empty instance of its opforge subclass (made again in this process)."""
    cls = subclass(base, kind)
    return cls.__new__(cls)


def _reduce_ex(self, protocol):
    """Pickles as (the transformers class, the kind of patch, the state): the opforge subclass is made at run time
    and has no importable name."""
    state = {k: v for k, v in self.__dict__.items() if k not in _FROM_MODULE and k != "_opforge_pending"}
    return _rebuild, (self._opforge_base, self._opforge_kind), state


def _setattr(self, name, value) -> None:
    """Module.__setattr__; a PEFT tuner layer put in an FP8 projection's slot (get_peft_model and
    PeftModel.from_pretrained `setattr` it) has its merges seen by the FP8 weight cache from now on (`_peft.watch`)."""
    self._opforge_base.__setattr__(self, name, value)
    if isinstance(value, torch.nn.Module) and name in self.__dict__.get("_opforge_fp8_slots", ()):
        P.watch(value)


def _setstate(self, state) -> None:
    self._opforge_base.__setstate__(self, state)
    mod = sys.modules.get(self._opforge_base.__module__)
    if self._opforge_kind == "attention" and mod is not None:
        for attr, name in _FROM_MODULE.items():
            self.__dict__[attr] = getattr(mod, name)
FORWARDS = {"decoder": decoder_layer_forward, "attention": attention_forward, "mlp": mlp_forward,
            "causal_lm": causal_lm_forward, "norm": rms_norm_forward, "experts": experts_forward}


def _with_signature(fn, original):
    """A copy of the patched forward `fn` whose inspect.signature is the original forward's: code that reads the
    parameter names (the HF Trainer drops dataset columns the forward does not name; generate checks its model
    kwargs) sees what it sees on the unpatched module."""
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__, out.__qualname__, out.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    try:
        out.__signature__ = inspect.signature(original)
    except (TypeError, ValueError):  # no signature to give: the patched one's stays
        pass
    return out


def subclass(cls: type, kind: str) -> type:
    key = (cls, kind)
    if key not in _SUBCLASSES:
        base_forward = inspect.unwrap(cls.forward)
        names = [p.name for p in list(inspect.signature(base_forward).parameters.values())[1 + (kind != "causal_lm"):]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        ns = {"forward": _with_signature(FORWARDS[kind], cls.forward), "_opforge_base": cls, "_opforge_kind": kind,
              "_opforge_arg_names": tuple(names), "__module__": "opforge.patch", "__doc__": cls.__doc__,
              "__reduce_ex__": _reduce_ex, "__setstate__": _setstate}
        if kind in ("attention", "mlp"):
            ns["__setattr__"] = _setattr
        _SUBCLASSES[key] = type(f"Opforge{cls.__name__}", (cls,), ns)
    return _SUBCLASSES[key]


def swap_class(m: torch.nn.Module, kind: str, inductor_math: bool, bypassed=()) -> None:
    m.__class__ = subclass(type(m), kind)
    m._opforge_inductor_math = bool(inductor_math)
    m._opforge_bypassed = tuple(bypassed)


def restore_class(m: torch.nn.Module) -> None:
    base = type(m).__dict__.get("_opforge_base")
    if base is not None:
        m.__class__ = base
    for attr in [a for a in m.__dict__ if a.startswith("_opforge_")]:
        del m.__dict__[attr]


def is_patched_class(m: torch.nn.Module) -> bool:
    return "_opforge_base" in type(m).__dict__
