"""Drop-in `torch.nn` modules built on opforge operators.

Each module mirrors its `torch.nn` counterpart: same constructor arguments, same parameters and
`state_dict` keys, same initialisation, so a `torch.nn` state_dict loads unchanged.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from . import _fp8_cache
from . import functional as F

__all__ = ["FusedAddRMSNorm", "GatedMLP", "Linear", "RMSNorm", "Sigmoid"]
__all__ += ["IndexedLinear"]  # linear variants


class Linear(torch.nn.Linear):
    """y = act(x · weightᵀ + bias) through `opforge.functional.linear`.

    Drop-in for `torch.nn.Linear` (it subclasses it, so constructor, `weight` `(out_features, in_features)`,
    `bias` `(out_features,)`, initialisation, `state_dict` keys and `isinstance` checks are torch's). The
    optional keyword-only `activation` fuses an activation into the layer; it is not part of the state_dict.

    Args:
        in_features: int. K, the size of each input sample.
        out_features: int. N, the size of each output sample.
        bias: bool. Learn an additive bias. Default: True.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.
        activation: str, keyword-only. One of `opforge.functional.LINEAR_ACTIVATIONS` (`"none"`, `"relu"`,
            `"gelu"`, `"gelu_tanh"`, `"silu"`). Default: `"none"` (torch.nn.Linear's math).
        fp8: str or None, keyword-only. `"tensorwise"` or `"rowwise"`: compute the layer with
            `opforge.functional.fp8_linear` (FP8 GEMMs, current scaling; activation must be `"none"`). Default: None
            (off). The layer keeps its weight's quantized operands and reuses them while the weight is unchanged
            (until an optimizer step or an in-place write; bit-identical to quantizing each call; kept under DDP,
            off under FSDP, DTensor, torch.compile and torch.func): set the attribute `fp8_cache = False` to
            quantize in every call; `opforge.functional.fp8_cache_clear` after writes through `weight.data`
            (docs/ops/fp8.md: The weight cache).

    Shape: input `(*, K)` -> output `(*, N)`.

    Raises:
        ValueError: at construction, an unknown activation; in forward, as `opforge.functional.linear`.

    Source: `torch.nn.Linear`.
    """

    activation: str = "none"  # (a class default too: modules pickled before the attribute existed load)
    fp8: Optional[str] = None
    fp8_cache: bool = True  # reuse the weight's FP8 operands while it is unchanged (see fp8)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 activation: str = "none", fp8: Optional[str] = None) -> None:
        if activation not in F.LINEAR_ACTIVATIONS:
            raise ValueError(f"opforge.nn.Linear: expected activation to be one of "
                             f"{', '.join(repr(a) for a in F.LINEAR_ACTIVATIONS)}, but got {activation!r}")
        if fp8 is not None and (fp8 not in F.FP8_GRANULARITIES or activation != "none"):
            raise ValueError(f"opforge.nn.Linear: expected fp8 to be None, 'tensorwise' or 'rowwise' with activation "
                             f"'none', but got fp8={fp8!r}, activation={activation!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation
        self.fp8 = fp8

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            if self.fp8_cache:
                return _fp8_cache.linear(input, self.weight, self.bias, self.fp8, modules=(self,))
            return F.fp8_linear(input, self.weight, self.bias, granularity=self.fp8)
        return F.linear(input, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.activation != "none":
            extra = f"{extra}, activation={self.activation!r}"
        return extra if self.fp8 is None else f"{extra}, fp8={self.fp8!r}"


class Sigmoid(torch.nn.Module):
    """y = 1 / (1 + exp(−x)), elementwise; drop-in for `torch.nn.Sigmoid`.

    Computed by `opforge.functional.sigmoid`.

    Shape: input `(*)` -> output `(*)`, same dtype.

    Raises:
        TypeError: non-floating input.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(input)


class GatedMLP(torch.nn.Module):
    """y = down(act(gate(x)) · up(x)): the gated feed-forward block of transformers (SwiGLU, GeGLU).

    Built from opforge ops: three `Linear` projections and `opforge.functional.swiglu` (activation `"silu"`:
    Llama, Mistral, Qwen) or `opforge.functional.geglu` (activation `"gelu"`, with `approximate="tanh"` for
    Gemma, Gemma 2 and Gemma 3's `gelu_pytorch_tanh`). Parameter names (`gate_proj`, `up_proj`, `down_proj`, no bias
    by default) follow Hugging Face's LlamaMLP and GemmaMLP, so their state_dicts load unchanged.

    Args:
        hidden_size: int. D, the size of the model's hidden state.
        intermediate_size: int. F, the size of the gated hidden layer.
        bias: bool. Add biases to the three projections. Default: False.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.
        activation: str, keyword-only. The gate's activation, by its torch.nn.functional name: `"silu"` or
            `"gelu"`. Default: `"silu"`.
        approximate: str, keyword-only. For `"gelu"`, as `torch.nn.GELU`'s: `"none"` (the erf form) or `"tanh"`.
            Default: `"none"`. Not part of the state_dict (neither is activation).

    Shape: input `(*, D)` -> output `(*, D)`.

    Raises:
        ValueError: at construction, an activation other than `"silu"` or `"gelu"`, an approximate other than
            `"none"` or `"tanh"`, or `approximate="tanh"` with `"silu"`.

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; Touvron et al. 2023 (LLaMA); Gemma Team 2024.
    """

    activation: str = "silu"  # (class defaults too: modules pickled before the attributes existed load)
    approximate: str = "none"

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None, *,
                 activation: str = "silu", approximate: str = "none"):
        if activation not in ("silu", "gelu"):
            raise ValueError(f"opforge.nn.GatedMLP: expected activation to be 'silu' or 'gelu', but got {activation!r}")
        if approximate not in F.GELU_APPROXIMATIONS:
            raise ValueError(f"opforge.nn.GatedMLP: expected approximate to be 'none' or 'tanh', but got "
                             f"{approximate!r}")
        if activation == "silu" and approximate != "none":
            raise ValueError(f"opforge.nn.GatedMLP: expected approximate='none' with activation='silu' (approximate "
                             f"selects gelu's form), but got {approximate!r}")
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, **kw)
        self.activation = activation
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return self.down_proj(F.geglu(self.gate_proj(x), self.up_proj(x), self.approximate))
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        if self.activation == "silu":
            return ""
        return f"activation={self.activation!r}, approximate={self.approximate!r}"


class RMSNorm(torch.nn.RMSNorm):
    """y = x / sqrt(mean(x², over the last len(normalized_shape) dims) + eps) · weight, as `torch.nn.RMSNorm`.

    Computed by `opforge.functional.rms_norm`. Drop-in for `torch.nn.RMSNorm`
    (it subclasses it: constructor, `weight` `(*normalized_shape)` initialised to ones, `eps`, `state_dict`
    keys and `isinstance` checks are torch's).

    Constructor arguments (`torch.nn.RMSNorm`'s own `__init__`, inherited):

    - `normalized_shape`: int or tuple. The trailing dims to normalize over, e.g. the hidden size N.
    - `eps`: float or None. Added to the mean square. Default: None (float32's machine epsilon, float64's for
      float64 input; what torch.nn.RMSNorm computes).
    - `elementwise_affine`: bool. Learn a per-element `weight`. Default: True.
    - `device`: torch.device or None. Factory keyword argument for the weight. Default: None.
    - `dtype`: torch.dtype or None. Factory keyword argument for the weight. Default: None.

    Shape: input `(*, *normalized_shape)` -> output of the same shape, in input's dtype.

    Raises:
        ValueError: in forward, as `opforge.functional.rms_norm`.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; `torch.nn.RMSNorm`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class FusedAddRMSNorm(torch.nn.Module):
    """(output, residual_out) = (rms_norm(x + residual), x + residual): the pre-norm transformer step in one pass.

    Computed by `opforge.functional.fused_add_rms_norm`. Same
    constructor, parameter (`weight`) and `state_dict` as `torch.nn.RMSNorm`, so an RMSNorm's state_dict loads
    unchanged; not a subclass of it, since `forward` takes two tensors.

    Args:
        normalized_shape: int or tuple. The trailing dims to normalize over.
        eps: float or None. As in `RMSNorm`. Default: None.
        elementwise_affine: bool. Learn a per-element `weight` (initialised to ones). Default: True.
        device: torch.device or None. Factory keyword argument for the weight. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the weight. Default: None.

    Shape: x and residual `(*, *normalized_shape)` -> output and residual_out of the same shape, in x's dtype.

    Raises:
        ValueError: in forward, as `opforge.functional.fused_add_rms_norm`.

    Source: Zhang & Sennrich 2019; the fused residual form of vLLM's fused_add_rms_norm.
    """

    def __init__(self, normalized_shape, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return F.fused_add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)


# ---- LinearCrossEntropyLoss -------------------------------------------------------------------------------

__all__ += ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(torch.nn.Module):
    """loss = cross_entropy(input · linear.weightᵀ + linear.bias, target) (+ z_loss · lse², softcap), no logits.

    The lm_head and the loss in one op,
    `opforge.functional.linear_cross_entropy`. Mirrors
    `torch.nn.LinearCrossEntropyLoss` (torch ≥ 2.13, class-index targets, `out_features=()`): an inner `linear`
    (`torch.nn.Linear`, `in_features` → `num_classes`) and the class `weight` buffer, so its `state_dict` keys
    (`weight`, `linear.weight`, `linear.bias`) load unchanged.

    Args:
        in_features: int. H, the size of each input sample.
        num_classes: int. V, the vocabulary size.
        bias: bool. The inner linear learns a bias. Default: False.
        device: torch.device or None. Factory keyword argument for the inner linear. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the inner linear. Default: None.
        reduction: str. `"mean"`, `"sum"` or `"none"`. Default: `"mean"`.
        weight: `(V,)` floating or None. Class weights (a buffer). Default: None.
        ignore_index: int or None. Target value to ignore; None means -100, as torch's module. Default: -100.
        label_smoothing: float in [0, 1]. Default: 0.0.
        z_loss: float. Coefficient of lse² per valid token (PaLM). Default: 0.0.
        softcap: float or None. Logit soft cap c (logits → c · tanh(logits / c), Gemma 2). Default: None.
        chunk_size: int or None. Tokens per chunk (see the functional). Default: None.

    Shape: input `(*, H)`, target `(*)` int64 -> `()` for mean/sum, `(*)` for none.

    Raises:
        ValueError: in forward, as `opforge.functional.linear_cross_entropy` (also TypeError, IndexError).

    Source: `torch.nn.LinearCrossEntropyLoss`.
    """

    def __init__(self, in_features: int, num_classes: int, *, bias: bool = False, device=None, dtype=None,
                 reduction: str = "mean", weight: Optional[torch.Tensor] = None, ignore_index: Optional[int] = -100,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                 chunk_size: Optional[int] = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.num_classes = num_classes
        self.linear = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)
        self.reduction = reduction
        self.ignore_index = -100 if ignore_index is None else ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.chunk_size = chunk_size

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.linear_cross_entropy(input, self.linear.weight, target, linear_bias=self.linear.bias,
                                      weight=self.weight, reduction=self.reduction, ignore_index=self.ignore_index,
                                      label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                                      chunk_size=self.chunk_size)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, num_classes={self.num_classes}, reduction={self.reduction}, "
             f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}")
        if self.z_loss:
            s += f", z_loss={self.z_loss}"
        if self.softcap is not None:
            s += f", softcap={self.softcap}"
        return s
# ---- FakeQuantLinear -------------------------------------------------------------------------------------
__all__ += ["FakeQuantLinear"]


def _check_fake_quant_settings(in_features: int, weight_bits: int, group_size: int) -> None:
    """Raises ValueError for the settings opforge::fake_quant_linear's checker refuses, in its words, so that a
    FakeQuantLinear fails where it is built rather than at its first forward."""
    prefix = "opforge.nn.FakeQuantLinear: expected"
    if not 2 <= weight_bits <= 8:
        raise ValueError(f"{prefix} weight_bits in [2, 8], but got {weight_bits}")
    if group_size < -1:
        raise ValueError(f"{prefix} group_size to be -1 (per channel), 0 (per tensor) or a positive divisor of "
                         f"in_features, but got {group_size}")
    if group_size > 0 and in_features % group_size != 0:
        raise ValueError(f"{prefix} group_size to divide in_features {in_features} (groups run along K; -1 for per "
                         f"channel, 0 for per tensor), but got {group_size}")


class FakeQuantLinear(torch.nn.Linear):
    """y = fq_a(x) · fq_w(weight)ᵀ + bias: a linear layer for quantization-aware training (QAT).

    Computed by `opforge.functional.fake_quant_linear`. Drop-in for
    `torch.nn.Linear` (a subclass: same parameters, initialisation and `state_dict` keys); the quantization
    settings are keyword-only and not part of the state_dict.

    Args:
        in_features: int. K, the size of each input sample.
        out_features: int. N, the size of each output sample.
        bias: bool. Learn an additive bias. Default: True.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.
        weight_bits: int in [2, 8]. The weight's integer range [−2^(b−1), 2^(b−1) − 1]. Default: 4.
        group_size: int. −1 per channel, 0 per tensor, g > 0 (dividing K) per group of g columns. Default: 32
            (torchao's Int8DynActInt4Weight default).
        symmetric: bool. Symmetric weight quantization (zero point 0). Default: True.
        act_quant: bool. Per-token asymmetric int8 fake-quantization of the input. Default: True (8da4w).

    Shape: input `(*, K)` -> output `(*, N)` in input's dtype.

    Raises:
        ValueError: at construction (and in `from_linear`), weight_bits outside [2, 8], group_size < −1 or a
            group_size that does not divide in_features, in the words of the op's own check; in forward, as
            `opforge.functional.fake_quant_linear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 weight_bits: int = 4, group_size: int = 32, symmetric: bool = True, act_quant: bool = True):
        _check_fake_quant_settings(in_features, int(weight_bits), int(group_size))
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight_bits = int(weight_bits)
        self.group_size = int(group_size)
        self.symmetric = bool(symmetric)
        self.act_quant = bool(act_quant)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, weight_bits: int = 4, group_size: int = 32,
                    symmetric: bool = True, act_quant: bool = True) -> "FakeQuantLinear":
        """A FakeQuantLinear sharing `linear`'s weight and bias Parameters (optimizer state stays valid).

        Args:
            linear: torch.nn.Linear. The layer whose Parameters the new module holds.
            weight_bits: int in [2, 8]. As in the constructor. Default: 4.
            group_size: int. As in the constructor. Default: 32.
            symmetric: bool. As in the constructor. Default: True.
            act_quant: bool. As in the constructor. Default: True.

        Returns:
            The new FakeQuantLinear.

        Raises:
            ValueError: settings the constructor refuses.
        """
        module = cls(linear.in_features, linear.out_features, bias=False, device="meta", weight_bits=weight_bits,
                     group_size=group_size, symmetric=symmetric, act_quant=act_quant)
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.fake_quant_linear(input, self.weight, self.bias, weight_bits=self.weight_bits,
                                   group_size=self.group_size, symmetric=self.symmetric, act_quant=self.act_quant)

    @torch.no_grad()
    def convert(self) -> dict:
        """The trained weight as integers, scales and zero points, in torchao's `Int8DynActInt4WeightLinear` layout.

        The buffer layout of `torchao.quantization.linear_quant_modules`; also the per-group `(1, g)` layout of
        `IntxFakeQuantizeConfig` / `Int8DynamicActivationIntxWeightConfig`.

        Returns:
            dict with `weight`: `(N, K)` int8, the integers q in [−2^(b−1), 2^(b−1) − 1] (unpacked, one per
                byte); `scales`: `(N, K // g)` float32 (`(N, 1)` per channel, `(1, 1)` per tensor); `zeros`: scales'
                shape, float32 holding the integer zero points (0 when symmetric); `bias`: `(N,)` or None (a copy in
                its dtype); and the settings `group_size` (K for per channel), `weight_bits`, `symmetric`,
                `act_quant`. Dequantized, (weight − zeros) · scales (each scale repeated over its g columns) equals
                the forward's fq_w(weight) in float32 bit for bit.
        """
        fq, _, scale, zero_point = F.fake_quantize_weight(self.weight, self.weight_bits, self.group_size,
                                                          self.symmetric)
        qmin, qmax = -(2 ** (self.weight_bits - 1)), 2 ** (self.weight_bits - 1) - 1
        N, K = self.weight.shape
        cols = K // scale.shape[1] if scale.shape[1] > 0 else K
        if self.group_size == 0:
            s = scale.expand(N, K)
            z = zero_point.expand(N, K)
        else:
            s = scale.repeat_interleave(cols, dim=1)
            z = zero_point.repeat_interleave(cols, dim=1)
        # the kernel's math: round_half_even(w · inv_scale) + zp, clamped, inv_scale = 1 / scale rounded to float32,
        # the product in float32 (in float64 for a float64 weight, as the kernel computes it)
        w = self.weight.detach()
        w = w.double() if w.dtype == torch.float64 else w.float()
        inv_scale = (1.0 / s).to(w.dtype)
        q = torch.clamp(torch.round(w * inv_scale) + z, qmin, qmax).to(torch.int8)
        return {
            "weight": q,
            "scales": scale.clone(),
            "zeros": zero_point.to(torch.float32),
            "bias": None if self.bias is None else self.bias.detach().clone(),
            "group_size": K if self.group_size < 0 else self.group_size,
            "weight_bits": self.weight_bits,
            "symmetric": self.symmetric,
            "act_quant": self.act_quant,
        }

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, weight_bits={self.weight_bits}, group_size={self.group_size}, "
                f"symmetric={self.symmetric}, act_quant={self.act_quant}")
# ---- linear variants ------------------------------------------------------------------------------------

class IndexedLinear(torch.nn.Module):
    """y[t] = x[t] · weight[index[t]]ᵀ + bias[index[t]]: a bank of `num_experts` linear layers, one per token.

    Computed by `opforge.functional.indexed_linear`; each token picks one
    layer by `index` (−1: none, a zero row).

    Args:
        in_features: int. K, the size of each input sample.
        out_features: int. N, the size of each output sample.
        num_experts: int. E, the number of layers in the bank.
        bias: bool. Learn a per-expert bias `(E, N)`. Default: True.
        device: torch.device or None. Factory keyword argument for the parameters. Default: None.
        dtype: torch.dtype or None. Factory keyword argument for the parameters. Default: None.

    Parameters: `weight` `(E, N, K)` and `bias` `(E, N)`, each expert initialised as torch.nn.Linear
    initialises its weight and bias (uniform in ±1/√K).

    Shape: input `(T, K)`, index `(T,)` int64 -> output `(T, N)`.

    Raises:
        ValueError: in forward, as `opforge.functional.indexed_linear` (also TypeError, IndexError).
    """

    def __init__(self, in_features: int, out_features: int, num_experts: int, bias: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.num_experts = in_features, out_features, num_experts
        self.weight = torch.nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / (self.in_features ** 0.5) if self.in_features > 0 else 0.0
        torch.nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return F.indexed_linear(input, self.weight, index, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"num_experts={self.num_experts}, bias={self.bias is not None}")
# ---- rope ------------------------------------------------------------------------------------------------------
__all__ += ["RotaryEmbedding"]


class RotaryEmbedding(torch.nn.Module):
    """(q_out, k_out) = rotary position embedding of q and k at `position_ids`, θ_i = position · base^(−2i/R).

    Computed in the kernel by `opforge.functional.rope_from_positions`.
    No parameters or buffers (nothing in the state_dict).

    Args:
        head_dim: int. D, the last dim of q and k (even).
        base: float. The RoPE base (`rope_theta`). Default: 10000.
        rotary_dim: int or None. R, the leading dims that rotate (even, ≤ D). Default: None, meaning head_dim.
        interleaved: bool. GPT-J's pairs (2i, 2i + 1) instead of rotate-half's (i, i + R/2). Default: False.

    Shape: q `(B, Hq, S, D)`, k `(B, Hk, S, D)`, position_ids `(S,)` or `(B or 1, S)` -> (q_out, k_out) of q's and
    k's shapes.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, rotary_dim: Optional[int] = None,
                 interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = float(base)
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.interleaved = interleaved

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(q_out, k_out) of `opforge.functional.rope_from_positions` at `position_ids`.

        Args:
            q: `(B, Hq, S, D)` floating, D = head_dim. The queries.
            k: `(B, Hk, S, D)` of q's dtype. The keys.
            position_ids: `(S,)` or `(B or 1, S)`, any integer dtype. The position of each token.

        Returns:
            (q_out, k_out) of q's and k's shapes and dtype.

        Raises:
            ValueError: q's or k's last dim is not this module's head_dim (the op alone would rotate the first
                rotary_dim dims of any head size); otherwise as `opforge.functional.rope_from_positions`.
        """
        for name, t in (("q", q), ("k", k)):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[-1] != self.head_dim:
                raise ValueError(f"opforge.nn.RotaryEmbedding: expected {name}'s last dim to be head_dim "
                                 f"{self.head_dim}, but got {t.shape[-1]} (shape {tuple(t.shape)})")
        return F.rope_from_positions(q, k, position_ids, self.base, interleaved=self.interleaved,
                                     rotary_dim=self.rotary_dim)

    def extra_repr(self) -> str:
        return "head_dim={head_dim}, base={base}, rotary_dim={rotary_dim}, interleaved={interleaved}".format(
            **self.__dict__)
