"""One adapter per transformers family: what its decoder layer, attention, MLP, norms and loss do differently from
Llama's, stated as data (`Family`). A module is patched only when its class comes from the modeling module of a
family listed here and its structure and source say what the adapter states; anything else is refused with the
reason. `apply`'s self-check then compares the patched model's logits, loss and gradients with transformers'."""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .. import functional as OF
from . import _fused as F
from . import _layers as L
from . import _peft as P


@dataclass(frozen=True)
class Family:
    """What a family does differently from Llama (every field's default is Llama's).

    Attributes:
        name: transformers' model directory (`transformers.models.<name>`).
        layout: the decoder layer's norms: "pre" (input / post-attention norm), "sandwich" (Gemma 2/3: input,
            post-attention, pre- and post-feed-forward norms), "post" (OLMo 2: post-attention and post-feed-forward
            norms only).
        offset: the norms scale by 1 + weight (Gemma; state_dict keeps the stored weight).
        scale_first: the norms multiply by the weight in float32 before rounding to the input dtype (Gemma, OLMo 2;
            opforge's rms_norm does so for every family).
        packed: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3).
        residual_multiplier: both residual branches are scaled by the layer's `residual_multiplier` (Granite).
        resid_dropout: both residual branches go through `resid_attn_dropout` / `resid_mlp_dropout` (Phi-3).
        logits_divisor: config attribute the logits are divided by (Granite's `logits_scaling`).
        final_softcap: config attribute of the final logit soft-cap, c · tanh(logits / c) (Gemma 2/3).
        moe: mixture-of-experts blocks (router kept, experts on indexed_linear, the router's auxiliary loss).
    """

    name: str
    layout: str = "pre"
    offset: bool = False
    scale_first: bool = False
    packed: bool = False
    residual_multiplier: bool = False
    resid_dropout: bool = False
    logits_divisor: Optional[str] = None
    final_softcap: Optional[str] = None
    moe: bool = False


FAMILIES: Dict[str, Family] = {f.name: f for f in (
    Family("llama"),
    Family("mistral"),
    Family("qwen2"),
    Family("qwen3"),
    Family("gemma", offset=True, scale_first=True),
    Family("gemma2", layout="sandwich", offset=True, scale_first=True, final_softcap="final_logit_softcapping"),
    Family("gemma3", layout="sandwich", offset=True, scale_first=True, final_softcap="final_logit_softcapping"),
    Family("phi3", packed=True, resid_dropout=True),
    Family("granite", residual_multiplier=True, logits_divisor="logits_scaling"),
    Family("olmo2", layout="post", scale_first=True),
    Family("mixtral", moe=True),
    Family("qwen2_moe", moe=True),
    Family("qwen3_moe", moe=True),
)}

# Source tokens of a forward that change the math; each must be one the family's adapter states.
_LAYER_TOKENS = {"residual_multiplier": lambda f: f.residual_multiplier,
                 "resid_attn_dropout": lambda f: f.resid_dropout,
                 "pre_feedforward_layernorm": lambda f: f.layout == "sandwich",
                 "post_feedforward_layernorm": lambda f: f.layout in ("sandwich", "post"),
                 "input_layernorm": lambda f: f.layout != "post"}
_LM_TOKENS = {"logits_scaling": lambda f: f.logits_divisor == "logits_scaling",
              "final_logit_softcapping": lambda f: f.final_softcap == "final_logit_softcapping",
              "logit_scale": lambda f: False,
              "load_balancing_loss_func": lambda f: f.moe}


def family_of(m: torch.nn.Module) -> Optional[Family]:
    """The family of `m`'s class: the transformers modeling module it is defined in, when listed."""
    parts = type(m).__module__.split(".")
    if len(parts) >= 4 and parts[:2] == ["transformers", "models"] and parts[3].startswith("modeling_"):
        return FAMILIES.get(parts[2])
    return None


def family_name(m: torch.nn.Module) -> Optional[str]:
    parts = type(m).__module__.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["transformers", "models"] else None


def _source(fn) -> str:
    try:
        return inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return ""


def _code(src: str) -> str:
    """`src` without its docstrings and comments (their words are not the code)."""
    out = []
    for line in src.splitlines():
        s = line.split("#", 1)[0]
        out.append(s)
    text = "\n".join(out)
    while '"""' in text:
        a = text.find('"""')
        b = text.find('"""', a + 3)
        if b < 0:
            break
        text = text[:a] + text[b + 3:]
    return text


def _token_reason(src: str, family: Family, tokens: dict, what: str) -> Optional[str]:
    code = _code(src)
    for tok, expected in tokens.items():
        if (tok in code) != bool(expected(family)):
            return (f"{what} {'uses' if tok in code else 'does not use'} `{tok}`, which the {family.name} adapter "
                    f"{'does not state' if tok in code else 'expects'} (a transformers version it does not know?)")
    return None


# ---------------------------------------------------------------------------------------------------------
# Recognition.

def has_module_hooks(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_backward_hooks", None)
                or getattr(m, "_backward_pre_hooks", None))


def act_kind(act) -> Optional[str]:
    """"silu" or "gelu_tanh" for the activations opforge's gated ops compute, else None."""
    name = type(act).__name__
    if isinstance(act, torch.nn.SiLU) or name in ("SiLU", "SiLUActivation") or act is torch.nn.functional.silu:
        return "silu"
    if name in ("GELUTanh", "PytorchGELUTanh") or (isinstance(act, torch.nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    return None


def _agree(norm: torch.nn.Module, family: Family, size: int) -> Optional[str]:
    """None if the module computes what the patched forward computes for it on a random input, else why not."""
    p = norm.weight
    if p.device.type == "meta":
        return None
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(3, size, generator=g).to(device=p.device, dtype=p.dtype)
    w = p + 1.0 if family.offset else p
    with torch.no_grad():
        try:
            a = norm(x)
            b = OF.rms_norm(x, (size,), w, L.eps(norm))
        except Exception as e:  # noqa: BLE001
            return f"probe failed: {type(e).__name__}: {e}"
    a, b = a.float(), b.float()
    tol = 1e-4 if p.dtype in (torch.float32, torch.float64) else 3e-2
    err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-6)
    if not err <= tol:
        kind = "1 + weight" if family.offset else "weight"
        return f"its output differs from rms_norm(x) · ({kind}) (max relative difference {err:.2e}): different math"
    return None


def norm_reason(norm, size: int, family: Family) -> Optional[str]:
    if norm is None:
        return "missing"
    if has_module_hooks(norm):
        return f"{type(norm).__name__} has hooks (the patched layer computes the norm without calling the module)"
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.nn.Parameter) or tuple(w.shape) != (size,) or list(norm.children()) \
            or len(list(norm.parameters(recurse=False))) != 1:
        return f"{type(norm).__name__} is not an RMSNorm over ({size},) with one weight"
    e = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(e, (float, int)):
        return f"{type(norm).__name__} has no float epsilon"
    return _agree(norm, family, size)


def _fusable(m: torch.nn.Module, names) -> Tuple[Optional[str], list]:
    """(None, [the base Linear of each]) when m.<names> are plain torch.nn.Linear or PEFT LoRA layers over one,
    without hooks; else (why not, [])."""
    bases = []
    for n in names:
        lin = m._modules.get(n)
        if lin is None:
            return f"{n} is missing", []
        if has_module_hooks(lin):
            return f"{n} has hooks (the patched forward computes it inside a fused GEMM)", []
        if type(lin) is torch.nn.Linear:
            bases.append(lin)
            continue
        reason = P.lora_reason(lin)
        if reason:
            return f"{n}: {reason}", []
        base = lin.base_layer
        if type(base) is not torch.nn.Linear:
            return f"{n}: the LoRA layer's base is {type(base).__name__}, not a plain torch.nn.Linear (QLoRA and " \
                   f"quantized bases are not fused)", []
        if has_module_hooks(base):
            return f"{n}.base_layer has hooks", []
        bases.append(base)
    return None, bases


def _paths(m: torch.nn.Module, names) -> list:
    return [n if type(m._modules[n]) is torch.nn.Linear else f"{n}.base_layer" for n in names]


def _group_reason(counts: Dict[int, int], group) -> Optional[str]:
    ps = [p for lin in group for p in lin.parameters()]
    if any(counts.get(id(p), 0) != 1 for p in ps):
        return "a projection weight is shared with another module (tied): left unfused"
    if len({(p.dtype, p.device) for p in ps}) != 1 or len({lin.bias is None for lin in group}) != 1:
        return "projections to fuse differ in dtype, device or bias"
    if any(p.device.type == "meta" for p in ps):
        return "parameters on the meta device (patch after loading the weights)"
    if len({lin.in_features for lin in group}) != 1:
        return "projections to fuse have different input sizes"
    return None


_LAYER_CHILDREN = {"pre": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"},
                   "sandwich": {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm",
                                "pre_feedforward_layernorm", "post_feedforward_layernorm"},
                   "post": {"self_attn", "mlp", "post_attention_layernorm", "post_feedforward_layernorm"}}


def mlp_kind(mlp: torch.nn.Module) -> Optional[str]:
    """"dense" (gate_proj/up_proj/down_proj + act_fn), "packed" (gate_up_proj/down_proj + activation_fn, Phi-3),
    "moe" (a block with an `experts` bank), else None."""
    ch = set(mlp._modules)
    if ch == {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return "dense"
    if ch == {"gate_up_proj", "down_proj", "activation_fn"}:
        return "packed"
    if "experts" in ch and "gate" in ch:
        return "moe"
    return None


def dense_mlp_reason(counts, mlp: torch.nn.Module) -> Optional[str]:
    kind = mlp_kind(mlp)
    if kind not in ("dense", "packed"):
        return (f"MLP submodules {sorted(mlp._modules)} are not gate_proj/up_proj/down_proj/act_fn "
                f"(or gate_up_proj/down_proj/activation_fn)")
    act = mlp.act_fn if kind == "dense" else mlp.activation_fn
    if act_kind(act) is None:
        return f"MLP activation {type(act).__name__} is neither SiLU nor GELU (tanh approximation)"
    if isinstance(act, torch.nn.Module) and has_module_hooks(act):
        return "the MLP activation has hooks (the patched MLP computes it without calling it)"
    names = ("gate_proj", "up_proj") if kind == "dense" else ("gate_up_proj",)
    reason, bases = _fusable(mlp, names)
    if reason:
        return reason
    if kind == "dense":
        reason = _group_reason(counts, bases)
        if reason:
            return reason
        if bases[0].out_features != bases[1].out_features:
            return "gate_proj and up_proj differ in size"
    elif bases[0].out_features % 2:
        return "gate_up_proj has an odd number of rows"
    if set(mlp._parameters):
        return "the MLP has parameters of its own"
    src = _code(_source(type(mlp).forward))
    if kind == "dense" and "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))" not in src:
        return "its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if kind == "packed" and ".chunk(2, dim=-1)" not in src:
        return "its forward does not split gate_up_proj's output in two halves [gate | up]"
    return None


def experts_reason(block: torch.nn.Module) -> Optional[str]:
    if L.INDEXED_LINEAR is None:
        return "opforge.indexed_linear is not in this build"
    if getattr(block, "jitter_noise", 0):
        return "router jitter noise (it scales the norm's output in place in training)"
    ex = block.experts
    gu, down = getattr(ex, "gate_up_proj", None), getattr(ex, "down_proj", None)
    if not isinstance(gu, torch.nn.Parameter) or not isinstance(down, torch.nn.Parameter) or gu.dim() != 3 \
            or down.dim() != 3:
        return "experts are not (E, 2I, D) gate_up_proj and (E, D, I) down_proj banks"
    E, I2, D = gu.shape
    if tuple(down.shape) != (E, D, I2 // 2) or I2 % 2:
        return f"experts' banks {tuple(gu.shape)} / {tuple(down.shape)} are not (E, 2I, D) / (E, D, I)"
    for attr, ok in (("has_gate", True), ("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                     ("has_post_expert_norm", False), ("_is_expert_parallel", False)):
        if getattr(ex, attr, ok) != ok:
            return f"experts with {attr}={getattr(ex, attr)} (opforge reproduces {attr}={ok})"
    if set(ex._parameters) != {"gate_up_proj", "down_proj"}:
        return f"experts' parameters {sorted(ex._parameters)} are not gate_up_proj/down_proj"
    act = getattr(ex, "act_fn", None)
    if act_kind(act) is None:
        return f"experts' activation {type(act).__name__} is neither SiLU nor GELU (tanh)"
    if has_module_hooks(ex) or (isinstance(act, torch.nn.Module) and has_module_hooks(act)):
        return "the experts have hooks"
    if gu.device.type == "meta":
        return "parameters on the meta device (patch after loading the weights)"
    return None


def decoder_layer_reason(family: Family, counts: Dict[int, int], layer: torch.nn.Module) -> Optional[str]:
    """None if `layer` is a decoder layer of `family` the shared forwards reproduce exactly, else why not."""
    expected = set(_LAYER_CHILDREN[family.layout])
    if family.resid_dropout:
        expected |= {"resid_attn_dropout", "resid_mlp_dropout"}
    if set(layer._modules) != expected:
        return f"submodules {sorted(layer._modules)} are not the {family.name} adapter's {sorted(expected)}"
    src = _source(type(layer).forward)
    reason = _token_reason(src, family, _LAYER_TOKENS, "its forward")
    if reason:
        return reason
    if not _code(src).rstrip().endswith("return hidden_states"):
        return "its forward does not return the hidden states alone (a transformers version this patch does not know)"
    attn, mlp = layer.self_attn, layer.mlp
    q_names = ("qkv_proj",) if family.packed else ("q_proj", "k_proj", "v_proj")
    base = set(q_names) | {"o_proj"}
    if not base <= set(attn._modules) or not set(attn._modules) <= base | {"q_norm", "k_norm"}:
        return f"attention submodules {sorted(attn._modules)} are not {sorted(base)} (+ q_norm/k_norm)"
    for a in ("head_dim", "layer_idx", "scaling", "config", "attention_dropout"):
        if not hasattr(attn, a):
            return f"attention has no {a}"
    mod = sys.modules.get(type(attn).__module__)
    if not hasattr(mod, "ALL_ATTENTION_FUNCTIONS") or not hasattr(mod, "eager_attention_forward"):
        return "its module has no ALL_ATTENTION_FUNCTIONS/eager_attention_forward"
    asrc = _code(_source(type(attn).forward))
    if "apply_rotary_pos_emb(" not in asrc or "attention_interface(" not in asrc:
        return "its attention does not apply_rotary_pos_emb then call the attention interface"
    reason, bases = _fusable(attn, q_names)
    if reason:
        return reason
    hd = attn.head_dim
    cfg = attn.config
    if family.packed:
        nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        if bases[0].out_features != nq + 2 * nkv:
            return "qkv_proj's size is not (heads + 2 · kv heads) · head_dim"
    else:
        reason = _group_reason(counts, bases)
        if reason:
            return reason
        qp, kp, vp = bases
        if qp.out_features % hd or kp.out_features % hd or kp.out_features != vp.out_features:
            return "q/k/v sizes are not multiples of head_dim"
    D = bases[0].in_features
    for nm in _LAYER_CHILDREN[family.layout] - {"self_attn", "mlp"}:
        reason = norm_reason(getattr(layer, nm), D, family)
        if reason:
            return f"{nm}: {reason}"
    if ("q_norm" in attn._modules) != ("k_norm" in attn._modules):
        return "q_norm without k_norm"
    if "q_norm" in attn._modules:
        qn = attn.q_norm.weight.shape[-1] if isinstance(getattr(attn.q_norm, "weight", None), torch.Tensor) else None
        nq = None if family.packed else bases[0].out_features
        nkv = None if family.packed else bases[1].out_features
        if qn == hd:
            sizes = (hd, hd)
        elif qn == nq and nkv is not None:
            sizes = (nq, nkv)
        else:
            return "q_norm is neither per head nor over the whole q projection"
        for nm, size in zip(("q_norm", "k_norm"), sizes):
            reason = norm_reason(getattr(attn, nm), size, family)
            if reason:
                return f"self_attn.{nm}: {reason}"
    kind = mlp_kind(mlp)
    if kind == "moe":
        if not family.moe:
            return f"a mixture-of-experts block, which the {family.name} adapter does not state"
        reason = experts_reason(mlp)
        if reason:
            return f"mlp: {reason}"
        for nm, sub in mlp._modules.items():
            if nm not in ("gate", "experts", "shared_expert", "shared_expert_gate"):
                return f"mlp.{nm}: a submodule of the expert block opforge.patch does not know"
        if "shared_expert" in mlp._modules:
            reason = dense_mlp_reason(counts, mlp.shared_expert)
            if reason:
                return f"mlp.shared_expert: {reason}"
        return None
    reason = dense_mlp_reason(counts, mlp)
    return f"mlp: {reason}" if reason else None


def _sliding(attn) -> Optional[str]:
    src = _code(_source(type(attn).forward))
    if "sliding_window=self.sliding_window" in src:
        return "attr"
    if 'sliding_window=getattr(self.config, "sliding_window"' in src:
        return "config"
    return None


def _bypassed(m: torch.nn.Module, names) -> tuple:
    return tuple(n for n in names if n in m._modules)


def patch_dense_mlp(mlp: torch.nn.Module, inductor_math: bool, recompute: bool) -> None:
    kind = mlp_kind(mlp)
    act = mlp.act_fn if kind == "dense" else mlp.activation_fn
    if kind == "dense":
        F.fuse(mlp, _paths(mlp, ("gate_proj", "up_proj")), "gate_up_proj")  # equal halves: the packed op splits them
        mlp._opforge_hooks = F.register_sd_hooks(mlp)
    L.swap_class(mlp, "mlp", inductor_math, _bypassed(mlp, ("gate_proj", "up_proj", "gate_up_proj", "act_fn",
                                                            "activation_fn")))
    mlp._opforge_act = act_kind(act)
    mlp._opforge_recompute = bool(recompute)
    mlp._opforge_parts = ("gate_proj", "up_proj") if kind == "dense" else ()


def patch_decoder_layer(family: Family, layer: torch.nn.Module, inductor_math: bool, recompute: bool) -> list:
    """Patch `layer` (decoder_layer_reason said yes); returns [(relative name, old class, what)]."""
    attn, mlp = layer.self_attn, layer.mlp
    mod = sys.modules[type(attn).__module__]
    done = []
    sliding = _sliding(attn)
    softcap = "softcap=self.attn_logit_softcapping" in _code(_source(type(attn).forward))
    hd, cfg = attn.head_dim, attn.config
    if family.packed:
        nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        sizes = [nq, nkv, nkv]
    else:
        sizes = F.fuse(attn, _paths(attn, ("q_proj", "k_proj", "v_proj")), "qkv_proj")
        attn._opforge_hooks = F.register_sd_hooks(attn)
    qk_norm = None
    if "q_norm" in attn._modules:
        qk_norm = "head" if attn.q_norm.weight.shape[-1] == hd else "full"
    names = [type(layer).__name__, type(attn).__name__, type(mlp).__name__]
    L.swap_class(layer, "decoder", inductor_math, _bypassed(layer, ("input_layernorm", "post_attention_layernorm",
                                                                    "pre_feedforward_layernorm",
                                                                    "post_feedforward_layernorm")))
    L.swap_class(attn, "attention", inductor_math, _bypassed(attn, ("q_proj", "k_proj", "v_proj", "qkv_proj",
                                                                    "q_norm", "k_norm")))
    for m in (layer, attn):
        m._opforge_offset = family.offset
        m._opforge_scale_first = family.scale_first
        m._opforge_recompute = bool(recompute)
    layer._opforge_layout = family.layout
    layer._opforge_dropout = family.resid_dropout
    layer._opforge_residual_multiplier = bool(family.residual_multiplier)  # the value is read at every forward
    attn._opforge_sizes = sizes
    attn._opforge_parts = () if family.packed else ("q_proj", "k_proj", "v_proj")
    attn._opforge_qk_norm = qk_norm
    attn._opforge_sliding = sliding
    attn._opforge_softcap = softcap
    attn._opforge_attention_functions = mod.ALL_ATTENTION_FUNCTIONS
    attn._opforge_eager_attention = mod.eager_attention_forward
    done.append(("", names[0], f"opforge decoder layer ({family.name}: rms_norm, fused_add_rms_norm)"))
    done.append(("self_attn", names[1], "opforge attention (fused q/k/v GEMM, rope" + (", q/k norms)" if qk_norm else ")")))
    if mlp_kind(mlp) == "moe":
        ex = mlp.experts
        ename = type(ex).__name__
        L.swap_class(ex, "experts", inductor_math, _bypassed(ex, ("act_fn",)))
        ex._opforge_act = act_kind(ex.act_fn)
        done.append(("mlp.experts", ename, "opforge experts (indexed_linear; router as transformers)"))
        if "shared_expert" in mlp._modules:
            sname = type(mlp.shared_expert).__name__
            what = _mlp_what(mlp.shared_expert)
            patch_dense_mlp(mlp.shared_expert, inductor_math, False)
            done.append(("mlp.shared_expert", sname, what))
    else:
        what = _mlp_what(mlp)
        patch_dense_mlp(mlp, inductor_math, recompute)
        done.append(("mlp", names[2], what))
    return done


def _mlp_what(mlp) -> str:
    act = act_kind(mlp.act_fn if "act_fn" in mlp._modules else mlp.activation_fn)
    return f"opforge MLP (fused gate/up GEMM, {'swiglu' if act == 'silu' else 'geglu'}_packed)"


def causal_lm_reason(family: Optional[Family], m: torch.nn.Module) -> Optional[str]:
    if family is None:
        fam = family_name(m)
        known = ", ".join(sorted(FAMILIES))
        return (f"transformers' {fam} family has no opforge.patch adapter (known: {known})" if fam
                else "not a transformers model class")
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers.loss.loss_utils.ForCausalLMLoss not found"
    fn = getattr(m, "loss_function", None)
    if fn is None or inspect.unwrap(fn) is not ForCausalLMLoss:
        return "its loss_function is not transformers' ForCausalLMLoss"
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return "its output embedding is not a plain torch.nn.Linear"
    if has_module_hooks(head):
        return "its output embedding has hooks (the fused loss does not call it)"
    src = _source(type(m).forward)
    reason = _token_reason(src, family, _LM_TOKENS, "its forward")
    if reason:
        return reason
    code = _code(src)
    if "self.lm_head(hidden_states" not in code or "loss_function(" not in code:
        return "its forward is not logits = lm_head(hidden_states); loss_function(logits, labels, ...)"
    mod = sys.modules.get(type(m).__module__)
    cls_name = "MoeCausalLMOutputWithPast" if family.moe else "CausalLMOutputWithPast"
    if not hasattr(mod, cls_name):
        return f"its module has no {cls_name}"
    if family.moe and not hasattr(mod, "load_balancing_loss_func"):
        return "its module has no load_balancing_loss_func"
    for a in (("router_aux_loss_coef", "num_experts", "num_experts_per_tok") if family.moe else ()):
        if not hasattr(m, a):
            return f"it has no {a}"
    return None


def patch_causal_lm(family: Family, m: torch.nn.Module, inductor_math: bool) -> None:
    import dataclasses

    mod = sys.modules[type(m).__module__]
    out_cls = mod.MoeCausalLMOutputWithPast if family.moe else mod.CausalLMOutputWithPast
    head_name = next((n for n, c in m.named_children() if c is m.get_output_embeddings()), "lm_head")
    L.swap_class(m, "causal_lm", inductor_math, (head_name,))
    m._opforge_output_cls = out_cls
    m._opforge_output_fields = tuple(f.name for f in dataclasses.fields(out_cls))
    m._opforge_logits_divisor = family.logits_divisor
    m._opforge_final_softcap = family.final_softcap
    m._opforge_aux_loss = L.moe_aux_loss if family.moe else None
    m._opforge_moe = family.moe
