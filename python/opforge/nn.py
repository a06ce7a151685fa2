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


# ---- linear variants (issue 11) -------------------------------------------------------------------------

class IndexedLinear(torch.nn.Module):
    """y[t] = x[t] · weight[index[t]]ᵀ + bias[index[t]] through :func:`opforge.functional.indexed_linear`.

    A bank of ``num_experts`` linear layers; each token picks one by ``index`` (−1: none, a zero row).

    Args:
        in_features: K.
        out_features: N.
        num_experts: E.
        bias: learn a per-expert bias (E, N). Default: True.
        device, dtype: factory keyword arguments for the parameters.

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
