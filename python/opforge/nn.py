"""Drop-in ``torch.nn`` modules built on opforge operators.

Each module mirrors its ``torch.nn`` counterpart: same constructor arguments, same parameters and
``state_dict`` keys, same initialisation, so a ``torch.nn`` state_dict loads unchanged.
"""
from __future__ import annotations

import torch

from . import functional as F

__all__ = ["Linear", "Sigmoid"]


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
