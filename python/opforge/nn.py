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
        device, dtype: factory keyword arguments for the parameters.
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
        device, dtype: factory keyword arguments for the parameters.

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

    Args:
        normalized_shape: int or tuple, the trailing dims to normalize over, e.g. hidden size N.
        eps: added to the mean square. Default: None (float32's machine epsilon, float64's for
            float64 input; what torch.nn.RMSNorm computes).
        elementwise_affine: learn a per-element ``weight``. Default: True.
        device, dtype: factory keyword arguments for the weight.

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
        device, dtype: factory keyword arguments for the weight.

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
        device, dtype: factory keyword arguments for the inner linear.
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
