"""Drop-in ``torch.nn`` modules built on opforge operators.

Each module mirrors its ``torch.nn`` counterpart: same constructor arguments, same parameters and
``state_dict`` keys, same initialisation, so a ``torch.nn`` state_dict loads unchanged.
"""
from __future__ import annotations

import torch

from . import functional as F

__all__ = ["GatedMLP", "Linear", "Sigmoid"]


class Linear(torch.nn.Linear):
    """y = x · weightᵀ + bias through :func:`opforge.functional.linear`.

    Drop-in for :class:`torch.nn.Linear` (it subclasses it, so constructor, ``weight`` (out_features,
    in_features), ``bias`` (out_features,), initialisation, ``state_dict`` keys and ``isinstance``
    checks are torch's).

    Args:
        in_features: K, size of each input sample.
        out_features: N, size of each output sample.
        bias: learn an additive bias. Default: True.
        device, dtype: factory keyword arguments for the parameters.

    Shape: input (*, K) -> output (*, N).

    Raises: as :func:`opforge.functional.linear`.

    Source: torch.nn.Linear.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


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
