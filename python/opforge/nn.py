"""Drop-in ``torch.nn`` modules built on opforge operators.

Each module mirrors its ``torch.nn`` counterpart: same constructor arguments, same parameters and
``state_dict`` keys, same initialisation, so a ``torch.nn`` state_dict loads unchanged.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from . import functional as F

__all__ = ["FusedAddRMSNorm", "GatedMLP", "Linear", "RMSNorm", "Sigmoid"]
__all__ += ["IndexedLinear"]  # linear variants (issue 11)


class Linear(torch.nn.Linear):
    """y = act(x · weightᵀ + bias) through :func:`opforge.functional.linear`.

    Drop-in for :class:`torch.nn.Linear` (it subclasses it, so constructor, ``weight`` (out_features,
    in_features), ``bias`` (out_features,), initialisation, ``state_dict`` keys and ``isinstance``
    checks are torch's). The optional keyword-only ``activation`` fuses an activation into the layer;
    it is not part of the state_dict.

    Args:
        in_features: K, size of each input sample.
        out_features: N, size of each output sample.
        bias: learn an additive bias. Default: True.
        device: factory keyword argument for the parameters. (torch.device or None).
        dtype: factory keyword argument for the parameters. (torch.dtype or None).
        activation: keyword-only, one of ``opforge.functional.LINEAR_ACTIVATIONS`` ("none", "relu",
            "gelu", "gelu_tanh", "silu"). Default: "none" (torch.nn.Linear's math).

    Shape: input (*, K) -> output (*, N).

    Raises: ValueError at construction for an unknown activation; otherwise as
    :func:`opforge.functional.linear`.

    Source: torch.nn.Linear.
    """

    activation: str = "none"  # (a class default too: modules pickled before the attribute existed load)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 activation: str = "none") -> None:
        if activation not in F.LINEAR_ACTIVATIONS:
            raise ValueError(f"opforge.nn.Linear: expected activation to be one of "
                             f"{', '.join(repr(a) for a in F.LINEAR_ACTIVATIONS)}, but got {activation!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias, self.activation)

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        return extra if self.activation == "none" else f"{extra}, activation={self.activation!r}"


class Sigmoid(torch.nn.Module):
    """y = 1 / (1 + exp(−x)) through :func:`opforge.functional.sigmoid`; drop-in for torch.nn.Sigmoid.

    Shape: input (*) -> output (*), same dtype.

    Raises: TypeError for non-floating input.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(input)


class GatedMLP(torch.nn.Module):
    """y = down(silu(gate(x)) · up(x)): the SwiGLU feed-forward block of Llama-style transformers.

    Built from opforge ops: three :class:`Linear` projections and :func:`opforge.functional.swiglu`.
    Parameter names (``gate_proj``, ``up_proj``, ``down_proj``, no bias by default) follow Hugging Face's
    LlamaMLP, so its state_dict loads unchanged.

    Args:
        hidden_size: D, size of the model's hidden state.
        intermediate_size: F, size of the gated hidden layer.
        bias: add biases to the three projections. Default: False.
        device: factory keyword argument for the parameters. (torch.device or None).
        dtype: factory keyword argument for the parameters. (torch.dtype or None).

    Shape: input (*, D) -> output (*, D).

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; Touvron et al. 2023 (LLaMA).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


class RMSNorm(torch.nn.RMSNorm):
    """y = x / sqrt(mean(x², over the last len(normalized_shape) dims) + eps) · weight, through
    :func:`opforge.functional.rms_norm`.

    Drop-in for :class:`torch.nn.RMSNorm` (it subclasses it: constructor, ``weight`` (*normalized_shape)
    initialised to ones, ``eps``, ``state_dict`` keys and ``isinstance`` checks are torch's).

    Constructor arguments (torch.nn.RMSNorm's own ``__init__``, inherited):

        normalized_shape: int or tuple, the trailing dims to normalize over, e.g. hidden size N.
        eps: added to the mean square. Default: None (float32's machine epsilon, float64's for
            float64 input; what torch.nn.RMSNorm computes).
        elementwise_affine: learn a per-element ``weight``. Default: True.
        device: factory keyword argument for the weight. (torch.device or None).
        dtype: factory keyword argument for the weight. (torch.dtype or None).

    Shape: input (*, *normalized_shape) -> output of the same shape, in input's dtype.

    Raises: as :func:`opforge.functional.rms_norm`.

    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; torch.nn.RMSNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class FusedAddRMSNorm(torch.nn.Module):
    """(output, residual_out) = (rms_norm(x + residual), x + residual) through
    :func:`opforge.functional.fused_add_rms_norm`: the pre-norm transformer step in one pass.

    Same constructor, parameter (``weight``) and ``state_dict`` as :class:`torch.nn.RMSNorm`, so an
    RMSNorm's state_dict loads unchanged; not a subclass of it, since ``forward`` takes two tensors.

    Args:
        normalized_shape: int or tuple, the trailing dims to normalize over.
        eps: as :class:`RMSNorm`. Default: None.
        elementwise_affine: learn a per-element ``weight`` (initialised to ones). Default: True.
        device: factory keyword argument for the weight. (torch.device or None).
        dtype: factory keyword argument for the weight. (torch.dtype or None).

    Shape: x and residual (*, *normalized_shape) -> output and residual_out of the same shape, in x's dtype.

    Raises: as :func:`opforge.functional.fused_add_rms_norm`.

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


# ---- LinearCrossEntropyLoss (issue 10) ---------------------------------------------------------------------

__all__ += ["LinearCrossEntropyLoss"]


class LinearCrossEntropyLoss(torch.nn.Module):
    """loss = cross_entropy(input · linear.weightᵀ + linear.bias, target) (+ z_loss · lse², softcap) through
    :func:`opforge.functional.linear_cross_entropy`: the lm_head and the loss in one op, without the logits.

    Mirrors :class:`torch.nn.LinearCrossEntropyLoss` (torch ≥ 2.13, class-index targets, ``out_features=()``):
    an inner ``linear`` (:class:`torch.nn.Linear`, ``in_features`` → ``num_classes``) and the class ``weight``
    buffer, so its ``state_dict`` keys (``weight``, ``linear.weight``, ``linear.bias``) load unchanged.

    Args:
        in_features: H, size of each input sample.
        num_classes: V, the vocabulary size.
        bias: the inner linear learns a bias. Default: False.
        device: factory keyword argument for the inner linear. (torch.device or None).
        dtype: factory keyword argument for the inner linear. (torch.dtype or None).
        reduction: "mean", "sum" or "none". Default: "mean".
        weight: (V,) class weights or None (a buffer). Default: None.
        ignore_index: target value to ignore. Default: -100 (torch's module maps its None to -100 too).
        label_smoothing: in [0, 1]. Default: 0.0.
        z_loss: coefficient of lse² per valid token (PaLM). Default: 0.0.
        softcap: logit soft cap c (logits → c · tanh(logits / c), Gemma 2), or None. Default: None.
        chunk_size: tokens per chunk, or None (see the functional). Default: None.

    Shape: input (*, H), target (*) int64 -> () for mean/sum, (*) for none.

    Raises: as :func:`opforge.functional.linear_cross_entropy`.

    Source: torch.nn.LinearCrossEntropyLoss.
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
    """y = fq_a(x) · fq_w(weight)ᵀ + bias through :func:`opforge.functional.fake_quant_linear` (QAT).

    Drop-in for :class:`torch.nn.Linear` (a subclass: same parameters, initialisation and ``state_dict`` keys);
    the quantization settings are keyword-only and not part of the state_dict.

    Args:
        in_features: K. out_features: N. bias: learn an additive bias. Default: True.
        device: factory keyword argument for the parameters. (torch.device or None).
        dtype: factory keyword argument for the parameters. (torch.dtype or None).
        weight_bits: 2..8. Default: 4. group_size: −1 per channel, 0 per tensor, g > 0 (dividing K) per group.
            Default: 32 (torchao's Int8DynActInt4Weight default). symmetric: Default: True.
        act_quant: per-token asymmetric int8 fake-quantization of the input. Default: True (8da4w).

    Shapes: input (*, K) -> output (*, N) in input's dtype.
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
        """A FakeQuantLinear sharing ``linear``'s weight and bias Parameters (optimizer state stays valid)."""
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
        """The trained weight as integers, scales and zero points, in torchao's ``Int8DynActInt4WeightLinear``
        buffer layout (``torchao.quantization.linear_quant_modules``; also the per-group (1, g) layout of
        ``IntxFakeQuantizeConfig`` / ``Int8DynamicActivationIntxWeightConfig``).

        Returns:
            dict with ``weight``: (N, K) int8, the integers q in [−2^(b−1), 2^(b−1) − 1] (unpacked, one per
            byte); ``scales``: (N, K // g) float32 ((N, 1) per channel, (1, 1) per tensor); ``zeros``: scales'
            shape, float32 holding the integer zero points (0 when symmetric); ``bias``: (N,) or None (a copy in
            its dtype); and the settings ``group_size`` (K for per channel), ``weight_bits``, ``symmetric``,
            ``act_quant``. Dequantized, (weight − zeros) · scales (each scale repeated over its g columns) equals
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
# ---- linear variants (issue 11) -------------------------------------------------------------------------

class IndexedLinear(torch.nn.Module):
    """y[t] = x[t] · weight[index[t]]ᵀ + bias[index[t]] through :func:`opforge.functional.indexed_linear`.

    A bank of ``num_experts`` linear layers; each token picks one by ``index`` (−1: none, a zero row).

    Args:
        in_features: K.
        out_features: N.
        num_experts: E.
        bias: learn a per-expert bias (E, N). Default: True.
        device: factory keyword argument for the parameters. (torch.device or None).
        dtype: factory keyword argument for the parameters. (torch.dtype or None).

    Parameters: ``weight`` (E, N, K) and ``bias`` (E, N), each expert initialised as torch.nn.Linear
    initialises its weight and bias (uniform in ±1/√K).

    Shape: input (T, K), index (T,) int64 -> output (T, N).

    Raises: as :func:`opforge.functional.indexed_linear`.
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
    """(q_out, k_out) = rotary position embedding of q and k at ``position_ids``, through
    :func:`opforge.functional.rope_from_positions` (θ_i = position · base^(−2i/R), computed in the kernel).

    Args:
        head_dim: D, the last dim of q and k (even).
        base: the RoPE base (``rope_theta``). Default: 10000.
        rotary_dim: R, the leading dims that rotate (even, ≤ D). Default: None, meaning head_dim.
        interleaved: GPT-J's pairs (2i, 2i + 1) instead of rotate-half's (i, i + R/2). Default: False.

    Shape: q (B, Hq, S, D), k (B, Hk, S, D), position_ids (S,) or (B or 1, S) -> (q_out, k_out) of q's and k's shapes.
    No parameters or buffers (nothing in the state_dict).
    """

    def __init__(self, head_dim: int, base: float = 10000.0, rotary_dim: Optional[int] = None,
                 interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.base = float(base)
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.interleaved = interleaved

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(q_out, k_out) of :func:`opforge.rope_from_positions`. Raises ValueError when q's or k's last dim is not
        this module's head_dim (the op alone would rotate the first rotary_dim dims of any head size)."""
        for name, t in (("q", q), ("k", k)):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[-1] != self.head_dim:
                raise ValueError(f"opforge.nn.RotaryEmbedding: expected {name}'s last dim to be head_dim "
                                 f"{self.head_dim}, but got {t.shape[-1]} (shape {tuple(t.shape)})")
        return F.rope_from_positions(q, k, position_ids, self.base, interleaved=self.interleaved,
                                     rotary_dim=self.rotary_dim)

    def extra_repr(self) -> str:
        return "head_dim={head_dim}, base={base}, rotary_dim={rotary_dim}, interleaved={interleaved}".format(
            **self.__dict__)
