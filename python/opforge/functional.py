"""Functional API: one typed function per opforge operator.

Each function calls ``torch.ops.opforge.<op>``; the checks, kernels and gradients live in C++.

Mixed-dtype policy (the same on CPU, CUDA and Meta): the output, and all computation, take the dtype
of ``input``. A parameter of another floating dtype (``weight``, ``bias``, ``other``) is converted to
input's dtype once on entry, and its gradient is returned in the parameter's own dtype. float16 and
bfloat16 are computed in float32 (loads and stores in the storage dtype).

Every op accepts tensors of any strides (transposed, sliced, expanded views), zero-size tensors and
tensors on any one device; inputs on different devices, integer, bool or complex dtypes raise.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["linear", "sigmoid", "square", "square_add"]


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = input · weightᵀ + bias, as :func:`torch.nn.functional.linear`.

    Args:
        input: (*, K) float64, float32, float16 or bfloat16. Any batch dims (M = prod(*) rows, may be 0),
            any strides.
        weight: (N, K) floating, any strides. Converted to input's dtype if it differs; its gradient
            comes back in weight's own dtype.
        bias: (N,) floating, or None (no bias). Converted like weight; its gradient comes back in bias's
            dtype. Default: None.

    Returns:
        (*, N) contiguous tensor in input's dtype. With K = 0 the output is the bias broadcast (zeros
        without bias); with M = 0 the weight and bias gradients are zeros.

    Raises:
        ValueError: input of rank 0; weight not 2-D; input's last dim != weight's in_features K;
            bias not of shape (N,).
        TypeError: any tensor with an integer, bool or complex dtype.
        RuntimeError: tensors on different devices (the message names both); on CUDA, M, K or N above
            2**31 - 1 (cuBLAS takes int dimensions); double backward (``create_graph=True``).

    Numerics: CPU through ATen's GEMM (at::addmm / at::mm); CUDA through cuBLAS (cublasGemmEx) with
    float32 accumulation for float16/bfloat16 (float32 inputs use TF32 only when
    ``torch.backends.cuda.matmul.allow_tf32`` is set). grad_bias is the sum of grad_output over all rows,
    accumulated in float32 (float64 for float64) and rounded once to bias's dtype.

    Source: torch.nn.functional.linear; gradients dX = dY·W, dW = dYᵀ·X, db = Σ_rows dY
    (``torch.ops.opforge.linear_backward``).
    """
    return torch.ops.opforge.linear(input, weight, bias)


def sigmoid(input: Tensor) -> Tensor:
    """y = 1 / (1 + exp(−input)), elementwise, as :func:`torch.sigmoid`.

    Args:
        input: (*) float64, float32, float16 or bfloat16, any strides.

    Returns:
        Tensor of input's shape and dtype, contiguous.

    Raises:
        TypeError: integer, bool or complex input.

    Numerics: computed in float32 for float16/bfloat16 and rounded once, so the result equals
    ``torch.sigmoid(input.float()).to(input.dtype)``. Saturates to exactly 0 (input → −inf) and
    exactly 1 (input → +inf), never NaN for non-NaN input. Gradient: dy · y · (1 − y), from the saved output.

    Source: the logistic function; reference torch.sigmoid.
    """
    return torch.ops.opforge.sigmoid(input)


def square(input: Tensor) -> Tensor:
    """y = input², elementwise.

    Args:
        input: (*) float64, float32, float16 or bfloat16, any strides.

    Returns:
        Tensor of input's shape and dtype.

    Raises:
        TypeError: integer, bool or complex input.

    Numerics: float32 math for float16/bfloat16. Gradient: 2 · input · dy.

    Source: torch.square.
    """
    return torch.ops.opforge.square(input)


def square_add(input: Tensor, other: Tensor) -> Tensor:
    """y = input² + other, with ``other`` broadcastable to input's shape.

    Args:
        input: (*) float64, float32, float16 or bfloat16, any strides.
        other: any shape that broadcasts to input's shape (e.g. (N,) for input (M, N), or a scalar
            tensor); converted to input's dtype if it differs.

    Returns:
        Tensor of input's shape and dtype (the output never takes other's shape: other must broadcast
        to input, not the reverse).

    Raises:
        ValueError: other does not broadcast to input's shape.
        TypeError: integer, bool or complex tensors.
        RuntimeError: input and other on different devices.

    Numerics: float32 math for float16/bfloat16 (one rounding). Gradients: 2 · input · dy for input;
    dy summed over the broadcast dims for other (float32 accumulation), in other's dtype.

    Source: the seeds' elementwise example, y = x² + b.
    """
    return torch.ops.opforge.square_add(input, other)
