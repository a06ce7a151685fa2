"""Functional API: one typed function per opforge operator.

Each function calls `torch.ops.opforge.<op>`; the checks, kernels and gradients live in C++.

Mixed-dtype policy (the same on CPU, CUDA and Meta): the output, and all computation, take the dtype
of `input`. A parameter of another floating dtype (`weight`, `bias`, `other`) is converted to
input's dtype once on entry, and its gradient is returned in the parameter's own dtype. float16 and
bfloat16 are computed in float32 (loads and stores in the storage dtype).

Every op accepts tensors of any strides (transposed, sliced, expanded views), zero-size tensors and
tensors on any one device; inputs on different devices, integer, bool or complex dtypes raise.
"""
from __future__ import annotations

import operator
import os
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = ["LINEAR_ACTIVATIONS", "fused_add_rms_norm", "linear", "rms_norm", "sigmoid", "square", "square_add", "swiglu"]
__all__ += ["swiglu_packed", "swiglu_linear"]
__all__ += ["GELU_APPROXIMATIONS", "geglu", "geglu_packed"]
__all__ += ["linear_cat", "indexed_linear"]  # linear variants


#: The activations of `linear`, by name.
LINEAR_ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")

#: The values of `geglu`'s `approximate`, as `torch.nn.functional.gelu`'s: the erf form and the tanh approximation.
GELU_APPROXIMATIONS = ("none", "tanh")

# The wrappers' bodies (docs/performance/overhead.md measures each layer, in instructions per call): the C++ op
# does every check, so the Python side is the wrapper's frame and one call into the dispatcher. Eagerly that call is
# the C++ callable behind the OpOverload (``OpOverload._op``): it skips OpOverload.__call__'s Python frame and the
# overload resolution of the packet ``torch.ops.opforge.<op>``. Dynamo cannot trace that pybind builtin, so while
# it traces (torch.compile, strict torch.export) the wrappers call the OpOverload itself, which becomes the graph's
# node. The test is torch.compiler.is_dynamo_compiling(): one frame returning False eagerly, constant-folded to
# True by Dynamo (torch.compiler.is_compiling() costs two frames). Non-strict export and make_fx trace the eager
# line: _op dispatches to their modes as OpOverload.__call__ would (it is that method's whole body).
_is_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)

# Bound once, at import: the wrappers read module globals (no attribute lookups per call).
def _bind(name: str):
    """(OpOverload, its C++ callable `_op`) of `torch.ops.opforge.<name>.default`."""
    op = getattr(torch.ops.opforge, name).default
    return op, op._op


_linear_op, _linear_call = _bind("linear")
_sigmoid_op, _sigmoid_call = _bind("sigmoid")
_square_op, _square_call = _bind("square")
_square_add_op, _square_add_call = _bind("square_add")
_swiglu_op, _swiglu_call = _bind("swiglu")
_swiglu_packed_op, _swiglu_packed_call = _bind("swiglu_packed")
_swiglu_linear_op, _swiglu_linear_call = _bind("swiglu_linear")
_geglu_op, _geglu_call = _bind("geglu")
_geglu_packed_op, _geglu_packed_call = _bind("geglu_packed")
_rms_norm_op, _rms_norm_call = _bind("rms_norm")
_fused_add_rms_norm_op, _fused_add_rms_norm_call = _bind("fused_add_rms_norm")



def _missing_tensor(op: str, **args) -> None:
    """Raises the op's own error for a None where it needs a tensor.

    Called only after the dispatcher failed (no argument was a tensor, so it could pick no kernel and its message
    names no op): the fast path pays nothing (an exception handler costs nothing until it runs). Returns if no
    argument is None.
    """
    for name, value in args.items():
        if value is None:
            raise ValueError(f"opforge::{op}: expected {name} to be a tensor, but got None") from None


def linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    """y = act(input · weightᵀ + bias); with `activation="none"` exactly `torch.nn.functional.linear`.

    Args:
        input: `(*, K)` float64, float32, float16 or bfloat16. The rows: any batch dims (M = prod of the batch
            dims, may be 0), any strides.
        weight: `(N, K)` floating, any strides. The weight; converted to input's dtype if it differs, its
            gradient comes back in weight's own dtype.
        bias: `(N,)` floating, or None. The bias; converted like weight, its gradient comes back in bias's
            dtype. Default: None (no bias).
        activation: str. Applied to z = input · weightᵀ + bias: `"none"` (y = z), `"relu"` (max(z, 0)),
            `"gelu"` (z · Φ(z), the erf form, `F.gelu(z)`), `"gelu_tanh"` (the tanh approximation,
            `F.gelu(z, approximate="tanh")`) or `"silu"` (z · σ(z)). Default: `"none"`.

    Returns:
        `(*, N)` contiguous tensor in input's dtype. With K = 0, z is the bias broadcast (zeros without
            bias); with M = 0 the weight and bias gradients are zeros.

    Raises:
        ValueError: input of rank 0; weight not 2-D; input's last dim != weight's in_features K;
            bias not of shape `(N,)`; an activation not in `LINEAR_ACTIVATIONS` (the message lists them
            and names the given one).
        TypeError: any tensor with an integer, bool or complex dtype.
        RuntimeError: tensors on different devices (the message names both); on CUDA, M, K or N above
            2**31 - 1 (cuBLAS takes int dimensions).

    Numerics: CPU through ATen's GEMM (at::addmm / at::mm) and ATen's activation functions. CUDA through
    cuBLASLt with the bias, relu and gelu_tanh fused into the GEMM's epilogue (gelu and silu: one
    elementwise pass after it, in float32 math), falling back to cublasGemmEx where cuBLASLt declines
    (float64, unusual alignments); float16/bfloat16 accumulate in float32, float32 uses TF32 only when
    `torch.backends.cuda.matmul.allow_tf32` is set. Backward: dz = dy · act'(z) in float32 math, from
    the pre-activation z kept by the forward only when a gradient is needed (relu keeps nothing extra: its
    output decides); grad_bias is the sum of dz over all rows, accumulated in float32 (float64 for
    float64) and rounded once to bias's dtype (on CUDA fused into the grad_weight GEMM, cuBLASLt BGRADB).
    Double backward (`create_graph=True`, `gradgradcheck`, nested `torch.func` transforms) is supported:
    the backward is itself differentiable.

    Source: `torch.nn.functional.linear` and `torch.nn.functional.relu` / `gelu` / `silu`; gradients
    dX = dZ·W, dW = dZᵀ·X, db = Σ_rows dZ (`torch.ops.opforge.linear_backward`).
    """
    if _is_dynamo_compiling():
        return _linear_op(input, weight, bias, activation)
    try:
        if activation == "none":  # the schema's default: one argument fewer to convert (~4% of a tiny call)
            return _linear_call(input, weight, bias)
        return _linear_call(input, weight, bias, activation)
    except NotImplementedError:
        _missing_tensor("linear", input=input, weight=weight)
        raise


def sigmoid(input: Tensor) -> Tensor:
    """y = 1 / (1 + exp(−input)), elementwise, as `torch.sigmoid`.

    Args:
        input: `(*)` float64, float32, float16 or bfloat16, any strides. The values.

    Returns:
        Tensor of input's shape and dtype, contiguous.

    Raises:
        TypeError: integer, bool or complex input.

    Numerics: computed in float32 for float16/bfloat16 and rounded once, so the result equals
    `torch.sigmoid(input.float()).to(input.dtype)`. Saturates to exactly 0 (input → −inf) and
    exactly 1 (input → +inf), never NaN for non-NaN input. Gradient: dy · y · (1 − y), from the saved output.

    Source: the logistic function; reference `torch.sigmoid`.
    """
    if _is_dynamo_compiling():
        return _sigmoid_op(input)
    try:
        return _sigmoid_call(input)
    except NotImplementedError:
        _missing_tensor("sigmoid", input=input)
        raise


def square(input: Tensor) -> Tensor:
    """y = input², elementwise.

    Args:
        input: `(*)` float64, float32, float16 or bfloat16, any strides. The values.

    Returns:
        Tensor of input's shape and dtype.

    Raises:
        TypeError: integer, bool or complex input.

    Numerics: float32 math for float16/bfloat16. Gradient: 2 · input · dy.

    Source: `torch.square`.
    """
    if _is_dynamo_compiling():
        return _square_op(input)
    try:
        return _square_call(input)
    except NotImplementedError:
        _missing_tensor("square", input=input)
        raise


def square_add(input: Tensor, other: Tensor) -> Tensor:
    """y = input² + other, with `other` broadcastable to input's shape.

    Args:
        input: `(*)` float64, float32, float16 or bfloat16, any strides. The squared term.
        other: any shape that broadcasts to input's (e.g. `(N,)` for input `(M, N)`, or a scalar tensor),
            floating. The added term; converted to input's dtype if it differs.

    Returns:
        Tensor of input's shape and dtype (the output never takes other's shape: other must broadcast
            to input, not the reverse).

    Raises:
        ValueError: other does not broadcast to input's shape.
        TypeError: integer, bool or complex tensors.
        RuntimeError: input and other on different devices.

    Numerics: float32 math for float16/bfloat16 (one rounding). Gradients: 2 · input · dy for input;
    dy summed over the broadcast dims for other (float32 accumulation), in other's dtype.

    Source: the elementwise example op y = x² + b.
    """
    if _is_dynamo_compiling():
        return _square_add_op(input, other)
    try:
        return _square_add_call(input, other)
    except NotImplementedError:
        _missing_tensor("square_add", input=input, other=other)
        raise


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """y = silu(gate) · up = gate · σ(gate) · up, elementwise: the gated activation of Llama-style MLPs.

    Args:
        gate: `(*)` float64, float32, float16 or bfloat16, any strides. The pre-activation x·W_gateᵀ.
        up: `(*)` of gate's shape, floating. The value x·W_upᵀ; converted to gate's dtype if it differs.

    Returns:
        Tensor of gate's shape and dtype.

    Raises:
        ValueError: gate and up of different shapes.
        TypeError: integer, bool or complex tensors.
        RuntimeError: gate and up on different devices.

    Numerics: float32 math for float16/bfloat16, one rounding. Backward is one fused pass: with
    s = σ(gate), grad_gate = dy · up · s · (1 + gate · (1 − s)), grad_up = dy · gate · s (grad_up in up's
    dtype).

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; reference `F.silu(gate) * up`.
    """
    if _is_dynamo_compiling():
        return _swiglu_op(gate, up)
    try:
        return _swiglu_call(gate, up)
    except NotImplementedError:
        _missing_tensor("swiglu", gate=gate, up=up)
        raise


def swiglu_packed(input: Tensor) -> Tensor:
    """y = silu(input[..., :I]) · input[..., I:]: `swiglu` over one packed `[gate | up]` tensor.

    The output of a fused gate/up projection (one GEMM, `(*, 2I)`) goes in as it is; the gradient comes back as
    one `(*, 2I)` tensor written by one fused pass, where `swiglu(gu[..., :I], gu[..., I:])` returns two
    gradients that autograd then concatenates.

    Args:
        input: `(*, 2I)` float64, float32, float16 or bfloat16, any strides; at least 1-D, last dimension even.
            gate = `input[..., :I]` (the pre-activation x·W_gateᵀ), up = `input[..., I:]` (x·W_upᵀ).

    Returns:
        Tensor `(*, I)` of input's dtype, contiguous.

    Raises:
        ValueError: input None or 0-d, or its last dimension odd
            (`opforge::swiglu_packed: expected input's last dimension to be even ..., but got 7`).
        TypeError: an integer, bool or complex input.

    Numerics: float32 math for float16/bfloat16, one rounding; bitwise equal to `swiglu` on the two halves,
    forward and both halves of the gradient. Backward (`opforge::swiglu_packed_backward`): with s = σ(gate),
    grad_input[..., :I] = dy · up · s · (1 + gate · (1 − s)), grad_input[..., I:] = dy · gate · s, in input's
    dtype, contiguous. On CUDA row-strided inputs (a column slice of a wider row) are read in place and both
    gradient halves are written by one pass; other layouts go through one contiguous copy. On the CPU any input
    whose last dimension has stride 1 is read in place and both gradient halves are written by one pass too.

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; reference
    `F.silu(input[..., :I]) * input[..., I:]`.
    """
    if _is_dynamo_compiling():
        return _swiglu_packed_op(input)
    try:
        return _swiglu_packed_call(input)
    except NotImplementedError:
        _missing_tensor("swiglu_packed", input=input)
        raise


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """y = gelu(gate) · up, elementwise, gelu as `torch.nn.functional.gelu(gate, approximate=approximate)`.

    The gated activation of Gemma-style MLPs: Gemma, Gemma 2 and Gemma 3 use the tanh form (transformers'
    `gelu_pytorch_tanh`), other GeGLU models the erf form.

    Args:
        gate: `(*)` float64, float32, float16 or bfloat16, any strides. The pre-activation x·W_gateᵀ.
        up: `(*)` of gate's shape, floating. The value x·W_upᵀ; converted to gate's dtype if it differs.
        approximate: str. `"none"`: gelu(g) = g · Φ(g) = g/2 · (1 + erf(g/√2)); `"tanh"`:
            gelu(g) = g/2 · (1 + tanh(√(2/π) · (g + 0.044715 · g³))). Default: `"none"`.

    Returns:
        Tensor of gate's shape and dtype, contiguous.

    Raises:
        ValueError: gate and up of different shapes; approximate not `"none"` or `"tanh"`
            (`opforge::geglu: expected approximate to be "none" or "tanh", but got "erf"`).
        TypeError: integer, bool or complex tensors.
        RuntimeError: gate and up on different devices.

    Numerics: float32 math for float16/bfloat16, one rounding (torch's `F.gelu(gate) * up` rounds twice).
    Backward is one fused pass: grad_gate = dy · up · gelu'(gate), grad_up = dy · gelu(gate) (in up's dtype),
    with gelu'(g) = Φ(g) + g · φ(g) (erf form) or ½(1 + t) + ½g(1 − t²) · √(2/π)(1 + 3 · 0.044715 · g²),
    t = tanh(√(2/π)(g + 0.044715 · g³)) (tanh form).

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; Hendrycks & Gimpel 2016 (GELU); reference
    `F.gelu(gate, approximate=approximate) * up`.
    """
    if _is_dynamo_compiling():
        return _geglu_op(gate, up, approximate)
    try:
        return _geglu_call(gate, up, approximate)
    except NotImplementedError:
        _missing_tensor("geglu", gate=gate, up=up)
        raise


def geglu_packed(input: Tensor, approximate: str = "none") -> Tensor:
    """y = gelu(input[..., :I]) · input[..., I:]: `geglu` over one packed `[gate | up]` tensor.

    The output of a fused gate/up projection (one GEMM, `(*, 2I)`) goes in as it is; the gradient comes back as
    one `(*, 2I)` tensor written by one fused pass, where `geglu(gu[..., :I], gu[..., I:])` returns two gradients
    that autograd then concatenates.

    Args:
        input: `(*, 2I)` float64, float32, float16 or bfloat16, any strides; at least 1-D, last dimension even.
            gate = `input[..., :I]` (the pre-activation x·W_gateᵀ), up = `input[..., I:]` (x·W_upᵀ).
        approximate: str. `"none"` (the erf form) or `"tanh"`, as `geglu`. Default: `"none"`.

    Returns:
        Tensor `(*, I)` of input's dtype, contiguous.

    Raises:
        ValueError: input None or 0-d, its last dimension odd
            (`opforge::geglu_packed: expected input's last dimension to be even ..., but got 7`), or approximate
            not `"none"` or `"tanh"`.
        TypeError: an integer, bool or complex input.

    Numerics: float32 math for float16/bfloat16, one rounding; bitwise equal to `geglu` on the two halves, forward
    and both halves of the gradient. Backward (`opforge::geglu_packed_backward`):
    grad_input[..., :I] = dy · up · gelu'(gate), grad_input[..., I:] = dy · gelu(gate), in input's dtype,
    contiguous. Layouts as `swiglu_packed`: row-strided inputs (a column slice of a wider row) are read in place.

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; reference
    `F.gelu(input[..., :I], approximate=approximate) * input[..., I:]`.
    """
    if _is_dynamo_compiling():
        return _geglu_packed_op(input, approximate)
    try:
        return _geglu_packed_call(input, approximate)
    except NotImplementedError:
        _missing_tensor("geglu_packed", input=input)
        raise


def swiglu_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = silu(z[..., 0::2]) · z[..., 1::2], z = input · weightᵀ + bias: a gated MLP's gate and up projections
    and their SwiGLU in one op.

    The gate's and the up projection's weights are interleaved row by row in one weight (row 2j the gate's row j,
    row 2j + 1 the up projection's row j; bias likewise), so that every (gate, up) pair of an output lands in one
    GEMM tile: on an H100/H200 (compute capability 9.0) a bfloat16 call runs one CUTLASS GEMM whose epilogue
    writes y beside z, with no second pass over z. `torch.stack([w_gate, w_up], 1).flatten(0, 1)` builds the
    interleaved weight from the two `(I, K)` weights.

    Args:
        input: `(*, K)` float64, float32, float16 or bfloat16, any strides; at least 1-D.
        weight: `(2I, K)` floating, the gate's and up projection's rows interleaved; converted to input's dtype.
        bias: `(2I,)` floating or None, interleaved as weight's rows. Default: None.

    Returns:
        Tensor `(*, I)` of input's dtype, contiguous.

    Raises:
        ValueError: input or weight None, input 0-d, weight not 2-D or with an odd number of rows, input's last
            dimension not weight's in_features, bias not of shape `(2I,)`
            (`opforge::swiglu_linear: expected weight's rows to be even ..., but got 7`).
        TypeError: an integer, bool or complex tensor.
        RuntimeError: tensors on different devices.

    Numerics: z accumulates in float32 for float16/bfloat16 (float64 for float64) and is rounded to input's dtype
    once; y is computed from the float32 z in the fused kernel, from the rounded z on the unfused path (CPU, other
    GPUs, float16, shapes the kernel does not take: `linear` then `swiglu`), so the two paths agree within one
    rounding of z. Backward (`opforge::swiglu_linear_backward`) reads the forward's z: dz by `swiglu_backward` on the
    interleaved columns, then `linear`'s backward GEMMs; grad_bias accumulates in float32.

    Source: Shazeer 2020, "GLU Variants Improve Transformer"; reference
    `F.silu(z[..., 0::2]) * z[..., 1::2]` with `z = F.linear(input, weight, bias)`.
    """
    if _is_dynamo_compiling():
        return _swiglu_linear_op(input, weight, bias)
    try:
        return _swiglu_linear_call(input, weight, bias)
    except NotImplementedError:
        _missing_tensor("swiglu_linear", input=input, weight=weight)
        raise


_Shape = Union[int, Sequence[int], torch.Size]


def _as_shape(normalized_shape: _Shape, op: str = "rms_norm") -> list:
    """normalized_shape as a list of ints (or SymInts); TypeError naming `op` for anything else."""
    if isinstance(normalized_shape, (int, torch.SymInt)):
        return [normalized_shape]
    if isinstance(normalized_shape, (list, tuple)):
        return list(normalized_shape)
    try:  # any other iterable of integers (a numpy array, a 1-D integer tensor); not a str, bytes, set or dict
        if isinstance(normalized_shape, (str, bytes, set, frozenset, dict)):
            raise TypeError
        shape = list(normalized_shape)
        if any(isinstance(d, bool) for d in shape):
            raise TypeError
        return [d if isinstance(d, torch.SymInt) else operator.index(d) for d in shape]
    except TypeError:
        raise TypeError(f"opforge::{op}: expected normalized_shape to be an int or a sequence of ints (e.g. (N,)), "
                        f"but got {type(normalized_shape).__name__}") from None


def rms_norm(input: Tensor, normalized_shape: _Shape, weight: Optional[Tensor] = None,
             eps: Optional[float] = None) -> Tensor:
    """y = input / sqrt(mean(input², over the normalized dims) + eps) · weight, as `torch.nn.functional.rms_norm`.

    Args:
        input: `(*, *normalized_shape)` float64, float32, float16 or bfloat16, any strides. The values.
        normalized_shape: int or sequence of ints. The trailing dims normalized over, e.g. `(N,)` or `N`; at
            least one dim.
        weight: `(*normalized_shape)` floating, or None. The scale; converted to input's dtype if it differs.
            Default: None (no scale).
        eps: float or None. Added to the mean square before the square root. Default: None, meaning the machine
            epsilon of the compute type: `torch.finfo(torch.float32).eps` (1.19e-07) for float32,
            float16 and bfloat16 input, `torch.finfo(torch.float64).eps` for float64. This is what
            `torch.nn.functional.rms_norm` computes (ATen uses the epsilon of its float32 compute type;
            torch's docs say `finfo(input.dtype).eps`, which would be 60000x larger for bfloat16),
            so a model moved from torch to opforge keeps its (default) eps.

    Returns:
        Tensor of input's shape and dtype (contiguous).

    Raises:
        ValueError: normalized_shape empty or not equal to input's trailing dims; weight's shape not
            normalized_shape; eps < 0.
        TypeError: integer, bool or complex input or weight; normalized_shape not an int or a sequence of ints.
        RuntimeError: input and weight on different devices.

    Numerics: loads and stores in the storage dtype; the mean square, the scaling and the gradient
    sums are computed in float32 (float64 for float64 input), so a float16 row whose Σx² exceeds
    65504 still normalizes correctly. y is rounded once (torch rounds x·rstd before multiplying by
    weight). Mixed dtypes: the output takes input's dtype (torch would promote to weight's); weight's
    gradient is accumulated over rows in float32 and returned in weight's dtype. The backward saves
    rstd = 1/sqrt(mean(x²) + eps) per row (float32) and computes
    dx = rstd·(w·dy) − x·rstd³·mean(w·dy·x), dw = Σ_rows dy·x·rstd.

    Source: B. Zhang and R. Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019;
    reference `torch.nn.functional.rms_norm`.
    """
    if _is_dynamo_compiling():
        return _rms_norm_op(input, _as_shape(normalized_shape), weight, eps)
    return _rms_norm_call(input, _as_shape(normalized_shape), weight, eps)


def fused_add_rms_norm(input: Tensor, residual: Tensor, normalized_shape: _Shape, weight: Optional[Tensor] = None,
                       eps: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """residual_out = input + residual; output = rms_norm(residual_out, normalized_shape, weight, eps), in one pass.

    The pre-norm transformer step `h = x + h; y = norm(h)`: one read of input and residual, one
    write of output and residual_out, instead of three passes for an add followed by a norm.

    Args:
        input: `(*, *normalized_shape)` float64, float32, float16 or bfloat16, any strides. The new values.
        residual: input's shape, floating. The residual stream; converted to input's dtype if it differs.
        normalized_shape: int or sequence of ints. The trailing dims normalized over, e.g. `(N,)` or `N`.
        weight: `(*normalized_shape)` floating, or None. The scale; converted to input's dtype. Default: None.
        eps: float or None. As in `rms_norm`. Default: None (float32's machine
            epsilon; float64's for float64).

    Returns:
        (output, residual_out): both of input's shape and dtype. residual_out is input + residual
            rounded to input's dtype, and output is exactly rms_norm of that stored residual_out.

    Raises:
        ValueError: as `rms_norm`, and residual's shape differs from input's.
        TypeError: non-floating input, residual or weight.
        RuntimeError: tensors on different devices.

    Numerics: the add and the norm are computed in float32 (float64 for float64 input). Gradients:
    input and residual both receive rms_norm's input gradient plus residual_out's gradient (each in
    its own dtype); weight's gradient as in `rms_norm`.

    Source: B. Zhang and R. Sennrich, "Root Mean Square Layer Normalization", NeurIPS 2019; the fused
    residual form as in vLLM's `fused_add_rms_norm`.
    """
    shape = _as_shape(normalized_shape, "fused_add_rms_norm")
    if _is_dynamo_compiling():
        return _fused_add_rms_norm_op(input, residual, shape, weight, eps)
    try:
        return _fused_add_rms_norm_call(input, residual, shape, weight, eps)
    except NotImplementedError:
        _missing_tensor("fused_add_rms_norm", input=input, residual=residual)
        raise


# ---- linear_cross_entropy ----------------------------------------------------------------------------------

__all__ += ["linear_cross_entropy"]

_linear_cross_entropy_op = torch.ops.opforge.linear_cross_entropy.default


def linear_cross_entropy(input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Optional[Tensor] = None,
                         weight: Optional[Tensor] = None, reduction: str = "mean", ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                         chunk_size: Optional[int] = None) -> Tensor:
    """loss = cross_entropy(cap(input · linear_weightᵀ + linear_bias), target) + z_loss · lse², without logits.

    The argument names and meanings of `torch.nn.functional.linear_cross_entropy` (class-index targets),
    plus `z_loss` (PaLM) and `softcap` (Gemma 2); the `(*, V)` logits are never materialised. Per token i with
    target t (z = the capped logits, lse = logsumexp_j z_j, w = class weights, ε = label_smoothing):

        loss_i = (1 − ε) · w_t · (lse − z_t) + ε / V · Σ_j w_j · (lse − z_j) + z_loss · lse²
        loss_i = 0                                                       where t == ignore_index

    Args:
        input: `(*, H)` float32, float16, bfloat16 or float64, any strides. The hidden states.
        linear_weight: `(V, H)` floating. The lm_head weight; converted to input's dtype, its gradient comes back
            in its own dtype. With `requires_grad=False` no `(V, H)` gradient buffer is allocated.
        target: `(*)` int64. Class indices in [0, V), or `ignore_index`.
        linear_bias: `(V,)` floating or None. The lm_head bias. Default: None.
        weight: `(V,)` floating or None. Class weights (as `F.cross_entropy`'s `weight`); receives no gradient.
            Default: None.
        reduction: str. `"mean"` (Σ loss_i / Σ_{valid i} w_{t_i}), `"sum"` or `"none"`. Default: `"mean"`.
        ignore_index: int. Target value that contributes neither loss nor gradient. Default: -100.
        label_smoothing: float. ε in [0, 1], as `F.cross_entropy`. Default: 0.0.
        z_loss: float. Coefficient ≥ 0 of lse² per valid token. Default: 0.0.
        softcap: float or None. c > 0 caps the logits to c · tanh(logits / c) before the loss. Default: None.
        chunk_size: int or None. Tokens per chunk (at most `chunk_size × V` float32 logits exist at a time).
            Default: None: the environment variable `OPFORGE_LCE_CHUNK_SIZE` (read once per process) if set,
            else a memory budget (CUDA: 512 MiB of 16-bit logits in lean mode, the default for 16-bit inputs, else
            768 MiB of float32 logits plus their 16-bit gradient copy; 32 MiB on CPU), rounded down to a multiple
            of 64 tokens.

    Returns:
        `()` for `"mean"`/`"sum"`, `(*)` for `"none"`, in float32 (float64 for float64 input): the dtype the loss
            is computed in, also for float16/bfloat16 input (as Liger-Kernel's fused loss and transformers'
            causal-LM loss return it; torch's `F.linear_cross_entropy` returns the input's dtype, one rounding of
            that value). Under `torch.autocast` input, linear_weight and linear_bias go to the autocast dtype as
            for `F.linear`; the loss is float32 all the same.

    Raises:
        ValueError: input of rank 0; linear_weight not 2-D or without rows; input's H != linear_weight's H;
            target not of input's leading shape; linear_bias/weight not `(V,)`; label_smoothing outside [0, 1];
            z_loss negative or not finite; softcap ≤ 0; chunk_size < 1; an unknown reduction.
        TypeError: non-floating input/linear_weight/linear_bias/weight; target not int64.
        IndexError: (CPU) a target outside [0, V) that is not ignore_index. On CUDA nothing is read out of
            bounds: such a token gets a NaN loss and NaN gradients (no host synchronisation to raise).
        RuntimeError: tensors on different devices; double backward.

    Numerics: logits per chunk from a GEMM with float32 output (float64 for float64 input); the row max is
    subtracted before any exponent and kept apart from log Σ exp (so a common logit offset of 1e8 in float32
    still gives log V); every sum (logsumexp, the loss, the weight and bias gradients across chunks) accumulates
    in float32 (the knob `OPFORGE_LCE_DW_ACCUM=1`: the weight and bias gradients of float16/bfloat16 parameters
    of input's dtype accumulate in that dtype, one rounding per chunk, as Liger-Kernel's default; no float32 V x H
    buffer). On CUDA, where input, weight and bias share one float16/bfloat16 dtype, lean mode (the default; the
    knob `OPFORGE_LCE_LEAN=0` turns it off) holds each chunk's logits in that dtype instead (rounded once by the GEMM before the softmax, as Hugging Face's own lm_head
    output is: a relative error of at most 2^-8 per bf16 logit), the logit gradient in place, dW accumulated in
    the 16-bit gradient and 2048-row chunks at V = 128256: one 16-bit [chunk, V] buffer, no float32 V x H buffer.
    `"mean"` with every target ignored gives NaN and zero gradients, as `F.cross_entropy`.
    Gradients: for `"mean"` and `"sum"` they are computed in the forward's chunk loop (3 GEMMs in all; only
    for inputs that require grad) and backward scales them by the scalar grad_output; for `"none"` they are
    recomputed in backward (one more logits GEMM per chunk) with the given per-token grad_output, so per-token
    weights are exact. The knob `OPFORGE_LCE_GRAD_IN_FORWARD=0` forces the recompute path for every reduction.

    Source: `torch.nn.functional.linear_cross_entropy` / `cross_entropy`; z-loss: Chowdhery et al. 2022 (PaLM);
    softcap: Gemma 2 (Team Gemma 2024); chunking: Liger-Kernel's fused linear cross-entropy, Wijmans et al. 2024
    ("Cut Your Losses in Large-Vocabulary Language Models").
    """
    try:
        return _linear_cross_entropy_op(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                        float(label_smoothing), float(z_loss),
                                        None if softcap is None else float(softcap), chunk_size)
    except NotImplementedError:
        _missing_tensor("linear_cross_entropy", input=input, linear_weight=linear_weight, target=target)
        raise
# ---- linear_log_probs ------------------------------------------------------------------------------------

__all__ += ["linear_log_probs"]

_linear_log_probs_op = torch.ops.opforge.linear_log_probs.default


#: linear_log_probs' and linear_jsd's float32 logits per chunk on the CPU where the call passes no chunk_size (and
#: OPFORGE_LCE_CHUNK_SIZE is unset): 128 MiB, 1024 rows at V = 32000. The engine's own CPU budget (32 MiB, 256 rows
#: there) suits linear_cross_entropy's gradient-in-forward loop; these two ops' chunk loops add each chunk's weight
#: gradient into a float32 V x H accumulator (the backward's recompute, the teacher's second GEMM), whose traffic
#: four times the chunks multiply: at 2048 x 512 x 32000 forward+backward, 1024-row chunks took 0.4-0.6 of the time
#: of 256-row ones (docs/performance/post_training.md).
CPU_LOG_PROBS_CHUNK_BYTES = 128 << 20


def _cpu_chunk(chunk_size: Optional[int], input: Tensor, linear_weight: Tensor) -> Optional[int]:
    """chunk_size, or on the CPU without one (and without OPFORGE_LCE_CHUNK_SIZE) the rows of
    `CPU_LOG_PROBS_CHUNK_BYTES` of float32 logits (a multiple of 64, at least 64); None elsewhere (the engine's)."""
    if chunk_size is not None or not isinstance(input, Tensor) or input.device.type != "cpu" \
            or os.environ.get("OPFORGE_LCE_CHUNK_SIZE", "").strip() or linear_weight.dim() != 2:
        return chunk_size
    rows = CPU_LOG_PROBS_CHUNK_BYTES // (4 * max(1, linear_weight.shape[0]))
    return max(64, rows - rows % 64)


def linear_log_probs(input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Optional[Tensor] = None, *,
                     temperature: float = 1.0, ignore_index: int = -100, softcap: Optional[float] = None,
                     return_entropy: bool = False,
                     chunk_size: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """log p(target) = z_target − logsumexp(z), z = cap(input · linear_weightᵀ + linear_bias) / temperature, without logits.

    The per-token log-probabilities of post-training (DPO and its relatives, GRPO, distillation): what TRL's
    `selective_log_softmax(logits / temperature, labels)` computes, and with `return_entropy` the per-token entropy
    of TRL's `entropy_from_logits`, from the hidden states and the lm_head, so the `(*, V)` logits are never
    materialised (the same chunk engine as `linear_cross_entropy`: one chunk of `chunk_size × V` float32 logits at a
    time, recomputed in backward). Per token i with target t (p = softmax(z)):

        log_probs_i = z_t − logsumexp_j z_j,          entropy_i = −Σ_j p_j log p_j
        log_probs_i = entropy_i = 0                   where t == ignore_index (and their gradient is zero)

    Args:
        input: `(*, H)` float32, float16, bfloat16 or float64, any strides. The hidden states.
        linear_weight: `(V, H)` floating. The lm_head weight; converted to input's dtype, its gradient comes back
            in its own dtype.
        target: `(*)` int64. Token ids in [0, V), or `ignore_index`.
        linear_bias: `(V,)` floating or None. The lm_head bias. Default: None.
        temperature: float > 0. The logits are divided by it (TRL's `temperature`). Default: 1.0.
        ignore_index: int. Target value whose token gets 0 and no gradient. Default: -100.
        softcap: float or None. c > 0 caps the logits to c · tanh(logits / c) before the temperature (Gemma 2's
            final logit softcapping). Default: None.
        return_entropy: bool. Also return the per-token entropy (one more pass over each chunk's logits in the
            forward). Default: False.
        chunk_size: int or None. Tokens per chunk. Default: None: as `linear_cross_entropy`'s on CUDA; on the CPU
            the rows of `CPU_LOG_PROBS_CHUNK_BYTES` of float32 logits (1024 at V = 32000).

    Returns:
        log_probs `(*)`, or `(log_probs, entropy)` with `return_entropy`, float32 (float64 for float64 input),
            the dtype they are computed in, also for float16/bfloat16 input. Both are differentiable: backward
            takes a per-token gradient of each (recomputing each chunk's logits: 2 GEMMs forward, 4 with backward).

    Raises:
        ValueError: input of rank 0; linear_weight not 2-D or without rows; input's H != linear_weight's H;
            target not of input's leading shape; linear_bias not `(V,)`; temperature ≤ 0 or not finite;
            softcap ≤ 0; chunk_size < 1.
        TypeError: non-floating input/linear_weight/linear_bias; target not int64.
        IndexError: (CPU) a target outside [0, V) that is not ignore_index (CUDA: NaN for such a token).
        RuntimeError: tensors on different devices; double backward.

    Numerics: as `linear_cross_entropy` (float32 logits and accumulation, the row max kept apart from
    log Σ exp); the entropy is computed as r + Σ_j p_j (m − z_j) with m the row max and r = log Σ exp(z − m), two
    non-negative terms, so a peaked distribution's entropy has no cancellation error.

    Source: TRL's `selective_log_softmax` and `entropy_from_logits` (the unfused math); the chunk engine of
    Wijmans et al. 2024 ("Cut Your Losses in Large-Vocabulary Language Models").
    """
    try:
        lp, ent = _linear_log_probs_op(input, linear_weight, target, linear_bias, float(temperature), ignore_index,
                                       None if softcap is None else float(softcap), bool(return_entropy),
                                       _cpu_chunk(chunk_size, input, linear_weight))
    except NotImplementedError:
        _missing_tensor("linear_log_probs", input=input, linear_weight=linear_weight, target=target)
        raise
    return (lp, ent) if return_entropy else lp


# ---- linear_jsd ------------------------------------------------------------------------------------------

__all__ += ["linear_jsd"]

_linear_jsd_op = torch.ops.opforge.linear_jsd.default


def linear_jsd(input: Tensor, linear_weight: Tensor, teacher_input: Tensor, teacher_linear_weight: Tensor,
               target: Optional[Tensor] = None, *, linear_bias: Optional[Tensor] = None,
               teacher_linear_bias: Optional[Tensor] = None, beta: float = 0.5, temperature: float = 1.0,
               ignore_index: int = -100, reduction: str = "mean", chunk_size: Optional[int] = None) -> Tensor:
    """Generalised JSD between a student head and a teacher head, per token over the vocabulary, without logits.

    Distillation's loss (GKD, Agarwal et al. 2024) from both models' final hidden states and lm_heads: neither model's
    `(*, V)` logits exist beyond one chunk of tokens (two GEMMs per chunk, the teacher's without gradient). With
    p_s = softmax((input · linear_weightᵀ + linear_bias) / temperature), p_t the same of the teacher and
    m = β p_t + (1 − β) p_s, per token:

        β = 0:       KL(p_t ‖ p_s) = Σ_j p_t,j (log p_t,j − log p_s,j)         (forward KL)
        β = 1:       KL(p_s ‖ p_t)                                              (reverse KL)
        0 < β < 1:   β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m)                        (β = 0.5: the Jensen-Shannon divergence)

    as TRL's `GKDTrainer.generalized_jsd_loss` (which, as here, defines β = 0 and β = 1 as the two KLs, although the
    mixture form tends to 0 at both ends).

    Args:
        input: `(*, H)` float32, float16, bfloat16 or float64. The student's hidden states.
        linear_weight: `(V, H)` floating. The student's lm_head weight (gradient in its own dtype).
        teacher_input: `(*, Ht)` floating, input's leading shape. The teacher's hidden states, converted to input's
            dtype; must not require grad (the teacher gets no gradient: compute it under `torch.no_grad()`).
        teacher_linear_weight: `(V, Ht)` floating. The teacher's lm_head weight; must not require grad.
        target: `(*)` int64 or None. Tokens equal to `ignore_index` count for nothing (TRL's labels mask); None:
            every token counts. Default: None.
        linear_bias: `(V,)` floating or None. The student's lm_head bias. Default: None.
        teacher_linear_bias: `(V,)` floating or None. The teacher's; must not require grad. Default: None.
        beta: float in [0, 1]. Default: 0.5.
        temperature: float > 0. Both heads' logits are divided by it. Default: 1.0.
        ignore_index: int. Default: -100.
        reduction: str. `"mean"` (over the counted tokens: TRL's "batchmean" with labels) or `"sum"`. Default:
            `"mean"`.
        chunk_size: int or None. Tokens per chunk (two `chunk_size × V` float32 logit buffers). Default: None: as
            `linear_cross_entropy`'s, for the two buffers, on CUDA; on the CPU as `linear_log_probs`'s.

    Returns:
        `()` float32 (float64 for float64 input). `"mean"` with no counted token is NaN (0/0) and its gradients
            are zeros, also for a non-finite grad_output (the unfused math's gradient is zero there).

    Raises:
        ValueError: shapes (input rank 0; linear_weight not `(V, H)`; teacher_input not of input's leading shape;
            teacher_linear_weight not `(V, Ht)`; a bias not `(V,)`; target not input's leading shape); beta outside
            [0, 1]; temperature ≤ 0 or not finite; reduction not "mean"/"sum"; chunk_size < 1.
        TypeError: non-floating tensors; target not int64.
        RuntimeError: tensors on different devices; a teacher tensor that requires grad; double backward.

    Numerics: float32 logits, log-softmax with the row max kept apart, float32 sums; the mixture's log by
    log-add-exp. The student's gradient is computed in the forward's chunk loop (the loss is a scalar) and scaled by
    grad_output in backward: (1 − β) p_s (log p_s − log m − KL(p_s ‖ m)) / temperature per logit (p_s − p_t for
    β = 0, p_s (log p_s − log p_t − KL(p_s ‖ p_t)) for β = 1).

    Source: TRL's `GKDTrainer.generalized_jsd_loss`; Agarwal et al. 2024 ("On-Policy Distillation of Language
    Models: Learning from Self-Generated Mistakes"); the fused form as Liger-Kernel's fused linear JSD.
    """
    try:
        return _linear_jsd_op(input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias,
                              teacher_linear_bias, float(beta), float(temperature), ignore_index, reduction,
                              _cpu_chunk(chunk_size, input, linear_weight))
    except NotImplementedError:
        _missing_tensor("linear_jsd", input=input, linear_weight=linear_weight, teacher_input=teacher_input,
                        teacher_linear_weight=teacher_linear_weight)
        raise


# ---- fake_quant_linear -------------------------------------------------------------------------------
__all__ += ["fake_quant_linear", "fake_quantize_weight"]


def fake_quant_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, weight_bits: int = 4,
                      group_size: int = -1, symmetric: bool = True, act_quant: bool = False) -> Tensor:
    """y = fq_a(input) · fq_w(weight)ᵀ + bias: a linear layer for quantization-aware training (QAT).

    `fq_w` fake-quantizes the weight (rounds it to `weight_bits`-bit signed integers on a grid and back),
    `fq_a` with `act_quant` each row (token) of the input to int8 (dynamic, asymmetric); the GEMM then runs
    on the fake-quantized tensors, in input's dtype, as `linear`.

    Args:
        input: `(*, K)` float64, float32, float16 or bfloat16, any strides. The rows: any batch dims
            (M = prod of the batch dims).
        weight: `(N, K)` floating. Quantized in its own precision (bfloat16/float16 upcast to float32 first), then
            converted to input's dtype for the GEMM; its gradient comes back in weight's dtype.
        bias: `(N,)` floating or None. Converted to input's dtype, never quantized. Default: None.
        weight_bits: int in [2, 8]. The integer range [−2^(b−1), 2^(b−1) − 1] (4: [−8, 7]). Default: 4.
        group_size: int. −1: one scale per output channel (row of weight); 0: one for the whole weight; g > 0: one
            per group of g consecutive columns of each row (a divisor of K, e.g. 32, 64, 128, 256). Default: −1.
        symmetric: bool. True: zero point 0, scale = max|w| / ((qmax − qmin) / 2); False: scale =
            (max(w, 0) − min(w, 0)) / (qmax − qmin), integer zero point = clamp(qmin − round(min(w, 0) / scale)).
            Default: True.
        act_quant: bool. Fake-quantize each input row to int8 [−128, 127] with its own asymmetric scale and zero
            point (torchao's per-token dynamic activation quantization). Default: False.

    Returns:
        `(*, N)` contiguous tensor in input's dtype.

    Raises:
        ValueError: linear's shape errors (weight not 2-D, K mismatch, bias not `(N,)`, input of rank 0);
            weight_bits outside [2, 8]; group_size < −1 or not dividing K (the message names K and the group size).
        TypeError: a tensor of an integer, bool or complex dtype.
        RuntimeError: tensors on different devices; double backward (`create_graph=True` then differentiating
            the gradients); forward-mode AD.

    Numerics: q = round_half_even(x · (1/scale)) + zp with 1/scale in float32, clamp to [qmin, qmax],
    (q − zp) · scale, with scales and zero points chosen as `torch.ao.quantization`'s MinMaxObserver and
    torchao's `choose_qparams_affine` do, in float32 with eps = float32's machine epsilon (an all-zero or tiny
    group gets scale eps: finite outputs and gradients). Given the same scales and zero points the values are
    bit-identical to `torch.fake_quantize_per_channel_affine` for every dtype and grouping, and to
    `torch.fake_quantize_per_tensor_affine` for float32, float16 and bfloat16 weights. For a float64 weight with
    one scale (`group_size=0`) torch's per-tensor kernel rounds its result to float32: it equals opforge's values
    (the per-channel kernel's, with one channel) rounded to float32, less than one float32 ulp from them. CPU and
    CUDA share the scalar code and give the same bits.

    NaN and extreme ranges: a NaN is never hidden. A weight group (channel, group of columns, or the whole tensor
    per tensor) or, with act_quant, a token containing NaN gets scale NaN and zero point 0: all of its
    fake-quantized values are NaN and its in-range mask false, as torch's MinMaxObserver + fake_quantize give. So
    the output columns (rows) it feeds are NaN, the input gradient those columns reach is NaN, and the weight
    gradient of that group is 0 (masked, as torch's). A group holding ±inf gets scale inf and every value of it
    NaN, the infinite entry too (mask false there, true for the finite entries; torch gives −inf for the
    infinite entry of a symmetric group). Asymmetric groups spanning more than float32's range (hi − lo
    overflowing, e.g. ±3e38) get scale hi/(qmax − qmin) − lo/(qmax − qmin) and stay finite where torch's scale
    would be inf and its output NaN; elsewhere the scale is torch's bit for bit.

    Gradients (straight-through estimator, scales as constants):
    grad_input = (grad · fq_w(W)) ⊙ [input in range], grad_weight = (gradᵀ · fq_a(input)) ⊙ [weight in range],
    grad_bias = Σ_rows grad (float32 accumulation). Under `torch.autocast` the input and bias are cast to the
    autocast dtype and the weight is quantized in its own (e.g. float32 master) precision.

    Source: Jacob et al. 2018, "Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-Only
    Inference" (fake quantization, STE); torchao's QAT `Int8DynActInt4WeightQATQuantizer` /
    `IntxFakeQuantizeConfig` (the same math composed from PyTorch ops); `opforge.nn.FakeQuantLinear.convert`
    exports the integers in torchao's layout.
    """
    try:
        return torch.ops.opforge.fake_quant_linear(input, weight, bias, weight_bits=weight_bits, group_size=group_size,
                                                   symmetric=symmetric, act_quant=act_quant)
    except NotImplementedError:
        _missing_tensor("fake_quant_linear", input=input, weight=weight)
        raise


def fake_quantize_weight(weight: Tensor, bits: int = 4, group_size: int = -1,
                         symmetric: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(fq_w(weight), in-range mask, scale, zero_point): the weight fake-quantization of `fake_quant_linear`.

    Args:
        weight: `(N, K)` floating, any strides. The weight to quantize.
        bits: int in [2, 8]. The integer range [−2^(b−1), 2^(b−1) − 1]. Default: 4.
        group_size: int. −1 per channel, 0 per tensor, g > 0 (dividing K) per group of g columns. Default: −1.
        symmetric: bool. As in `fake_quant_linear`. Default: True.

    Returns:
        (output, mask, scale, zero_point): output `(N, K)` in weight's dtype; mask `(N, K)` bool (the integer
            was within [qmin, qmax] before clamping); scale float32 and zero_point int32, both of shape `(1, 1)`
            per tensor, `(N, 1)` per channel, `(N, K // g)` per group. The integers are
            clamp(round(weight.float() · (1 / scale)) + zero_point, qmin, qmax).

    Raises:
        ValueError: weight not 2-D; bits outside [2, 8]; group_size < −1 or not dividing K.
        TypeError: a non-floating weight.

    NaN and infinities: a group containing NaN gets scale NaN and zero_point 0, all of its outputs NaN and its
    mask false; a group holding ±inf gets scale inf and all of its outputs NaN; an asymmetric group whose
    hi − lo overflows float32 gets a finite scale (see `fake_quant_linear`).

    Not differentiable (its outputs carry no autograd history); `fake_quant_linear` is.
    """
    try:
        return torch.ops.opforge.fake_quantize_weight(weight, bits, group_size, symmetric)
    except NotImplementedError:
        _missing_tensor("fake_quantize_weight", weight=weight)
        raise
# ---- fp8: quantize_fp8, fp8_linear ---------------------------------------------------------------------
__all__ += ["quantize_fp8", "fp8_linear", "fp8_cache_clear", "FP8_GRANULARITIES"]

#: The scale granularities of `quantize_fp8` and `fp8_linear`.
FP8_GRANULARITIES = ("tensorwise", "rowwise")


def quantize_fp8(input: Tensor, dtype: Optional[torch.dtype] = None,
                 granularity: str = "tensorwise") -> Tuple[Tensor, Tensor]:
    """(data, scale) = (fp8(clamp(float32(input) · scale, ±fp8_max)), fp8_max / max(amax, 1e-12)): current scaling.

    FP8 quantization with a scale chosen from the tensor itself ("current" or dynamic scaling): the largest
    magnitude of each group maps to the format's largest finite value.

    Args:
        input: `(*, K)` float64, float32, float16 or bfloat16, any strides (0-d allowed for tensorwise).
        dtype: `torch.float8_e4m3fn` (max 448, the forward format) or `torch.float8_e5m2` (max 57344, wider range
            for gradients). None means `torch.float8_e4m3fn`. Default: None.
        granularity: str. `"tensorwise"`: one scale for the whole tensor; `"rowwise"`: one scale per row of the last
            dim (per token of an activation, per output channel of a weight). Default: `"tensorwise"`.

    Returns:
        (data, scale): data of input's shape in `dtype`, contiguous; scale float32 of shape `()` (tensorwise) or
        input's shape with the last dim 1, `(*, 1)` (rowwise). input ≈ data.float() / scale.

    Raises:
        TypeError: a non-floating input.
        ValueError: dtype not one of the two FP8 formats; an unknown granularity; rowwise for a 0-d input.

    Numerics (torchao's recipe, bit for bit): amax = max |input| over the group, exact, then in float64;
    scale = float32(fp8_max / max(amax, 1e-12)); data = (float32(input) · scale).clamp(−fp8_max, fp8_max)
    .to(dtype), the fp32 product rounded to nearest even by torch's own conversion; CPU and CUDA give the same
    bits. Special values follow from these formulas, as in torchao: a group holding a NaN gets scale NaN and all
    of its data NaN; a group holding ±inf gets scale 0, its finite entries 0 and the infinite ones NaN; an
    all-zero group (or an empty one) gets scale fp8_max · 1e12 and data 0. Every NaN is the positive NaN (bits
    0x7F): torch's own cast keeps the sign of inf · 0's NaN, which differs between CPUs and GPUs.

    Not differentiable: its outputs carry no autograd history (the quantization inside `fp8_linear` is part of
    that op's gradient).

    Source: torchao's float8 training (`torchao/float8/float8_utils.py`: `amax_to_scale`, `to_fp8_saturated`;
    `float8_scaling_utils.py`: `hp_tensor_to_float8_dynamic`); Micikevicius et al. 2022, "FP8 Formats for Deep
    Learning" (the e4m3 and e5m2 formats).
    """
    try:
        return torch.ops.opforge.quantize_fp8(input, dtype, granularity)
    except NotImplementedError:
        _missing_tensor("quantize_fp8", input=input)
        raise


def fp8_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, granularity: str = "tensorwise",
               grad_dtype: Optional[torch.dtype] = None) -> Tensor:
    """y = (q(input) · q(weight)ᵀ) / (s_input ⊗ s_weight) + bias: a linear layer computed by an FP8 GEMM.

    The input and the weight are quantized to `torch.float8_e4m3fn` by `quantize_fp8` (current scaling) and
    multiplied by the scaled FP8 GEMM (`torch._scaled_mm`, fp32 accumulation); the backward computes both
    gradient GEMMs in FP8 too, with the output gradient in `grad_dtype`.

    Args:
        input: `(*, K)` float64, float32, float16 or bfloat16, any strides. M = prod of the batch dims.
        weight: `(N, K)` floating. Quantized from its own precision (e.g. float32 master weights under autocast);
            its gradient comes back in weight's dtype.
        bias: `(N,)` floating or None. Converted to input's dtype and added after the GEMM, never quantized.
            Default: None.
        granularity: str. `"tensorwise"`: one scale for the input, one for the weight (and one per tensor in the
            backward); `"rowwise"`: one per token of the input and one per output channel of the weight, and in
            the backward one per row of each GEMM operand along its contraction (see Gradients). Default:
            `"tensorwise"`.
        grad_dtype: `torch.float8_e5m2`, `torch.float8_e4m3fn` or None: the format of the output gradient in the
            backward GEMMs. None: e5m2 for tensorwise, e4m3 for rowwise (torchao's tensorwise and rowwise
            recipes). Default: None.

    Returns:
        `(*, N)` contiguous tensor in input's dtype.

    Raises:
        ValueError: linear's shape errors (weight not 2-D, K mismatch, bias not `(N,)`, input of rank 0); an unknown
            granularity; grad_dtype not an FP8 format.
        TypeError: a tensor of an integer, bool or complex dtype.
        RuntimeError: tensors on different devices; double backward; forward-mode AD.

    Numerics: the quantized operands are exactly `quantize_fp8`'s; the GEMM sums their products in fp32 and applies
    the dequantization scales (1 / scale, fp32) to the sums. Tensorwise writes the product in input's dtype
    (float32 for a float64 input, then converted); rowwise writes it in bfloat16 (the scaled GEMM's rowwise output
    type on CUDA; the CPU rounds alike), then input's dtype. The bias is added in input's dtype. Against the
    unquantized product the error is that of e4m3: each operand's relative rounding is at most 2⁻⁴ (half an ulp of
    a 3-bit mantissa) for values within a factor 2⁶ of the group's amax (smaller ones lose relative precision to
    the format's subnormals). On CUDA, K and N that are not multiples of 16 are zero-padded for the GEMM (exact),
    and the FP8 tensor cores sum each block of 128 products with a truncating 13-fraction-bit accumulator before
    fp32 (about 10⁻⁴ relative for a float32 output; `opforge.testing.fp8_gemm_bound` gives the bound).

    Gradients (the quantization's rounding is not differentiated; each GEMM quantizes its own operands with the
    same recipe): grad_input = q(grad)·q(weightᵀ)ᵀ / scales, grad_weight = q(gradᵀ)·q(inputᵀ)ᵀ / scales, with
    rowwise scales per row of grad and per column of weight (grad_input), per column of grad and of input
    (grad_weight): the scale of each operand is constant along the contraction, as the scaled GEMM needs.
    grad_bias = Σ_rows grad, float32 accumulation, not quantized. Autograd saves the weight and, tensorwise with a
    weight gradient to compute, q(inputᵀ) (the forward's q(input) transposed, same scale: FP8, written by the forward's
    quantization pass) in place of the input; otherwise the high-precision input. Under `torch.autocast` the input and bias are cast to the autocast dtype and the weight is quantized
    in its own precision.

    Source: torchao's `Float8Linear` (`torchao/float8/float8_linear.py`: the three GEMMs and their scaling axes;
    `config.py`: the tensorwise and rowwise recipes); Micikevicius et al. 2022, "FP8 Formats for Deep Learning".
    """
    try:
        return torch.ops.opforge.fp8_linear(input, weight, bias, granularity=granularity, grad_dtype=grad_dtype)
    except NotImplementedError:
        _missing_tensor("fp8_linear", input=input, weight=weight)
        raise


def fp8_cache_clear() -> None:
    """Drops the FP8 weight operands that opforge's FP8 layers cached: each layer quantizes its weight again at its next
    forward.

    `opforge.nn.Linear(..., fp8=...)` and the projections of `opforge.patch.apply(model, fp8=...)` keep each weight's
    quantized operands (q(W) and q(Wᵀ) with their scales) and reuse them while the weight is unchanged: the same
    Parameter, version counter, storage, data_ptr, dtype and device, and no `torch.optim` step since they were made
    (docs/ops/fp8.md: The weight cache). A write that none of these record — through `weight.data`, a
    `torch.distributed` collective into the weight outside an optimizer step, or code outside torch — is not seen:
    call this after it. The cache is used under DDP; under FSDP (FSDP2 and FSDP1), DTensor, torch.compile and
    torch.func the layers quantize in the op.

    Returns:
        None.

    Source: opforge (the cache lives in `opforge/_fp8_cache.py`).
    """
    from . import _fp8_cache

    _fp8_cache.clear()


# ---- linear variants: linear_cat, indexed_linear ----------------------------------------------------------

def linear_cat(inputs: Sequence[Tensor], weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = linear(cat(inputs, -1), weight, bias) = Σ_i inputs[i] · weight[:, k_i : k_i + K_i]ᵀ + bias, no cat.

    Neither the forward nor the backward materialises `torch.cat(inputs, -1)`: each piece is multiplied by
    its column slice of `weight` (read in place), and autograd saves the pieces themselves, not their
    concatenation. Each piece gets its own gradient; the weight gradient is written slice by slice into one
    tensor.

    Args:
        inputs: sequence of P ≥ 1 tensors `(*, K_i)`, float64, float32, float16 or bfloat16, all of one dtype and
            one leading shape (M = prod of the leading dims, may be 0); K_i may be 0; any strides. The pieces.
        weight: `(N, ΣK_i)` floating. Converted to the inputs' dtype if it differs; its gradient comes back in
            weight's own dtype.
        bias: `(N,)` floating, or None. Converted like weight; its gradient comes back in bias's dtype.
            Default: None.

    Returns:
        `(*, N)` contiguous tensor in the inputs' dtype.

    Raises:
        ValueError: an empty sequence; a 0-dim piece; pieces with different leading dims; weight not 2-D;
            ΣK_i != weight's in_features; bias not of shape `(N,)`.
        TypeError: inputs not a sequence of tensors; a non-floating tensor; pieces of different dtypes.
        RuntimeError: tensors on different devices; on CUDA, M, N or a K_i above 2**31 - 1.

    Numerics: one rounding. The pieces' products are summed in float32 (float64 for float64) together with
    the bias and rounded once to the output dtype, as one GEMM over the concatenation does (rounding each
    piece's product to bfloat16 and adding would raise the error by about 1.5×). CPU: ATen's addmm into a
    float32 buffer (16-bit pieces are converted to float32 for it). CUDA: cublasGemmEx per piece into a
    float32 buffer with beta = 1 (16-bit A, B; float32 C; at most 2**24 floats, row block by row block), then
    one rounding pass; float32/float64 accumulate in the output itself. grad_bias sums in float32.

    Source: `torch.nn.functional.linear` over `torch.cat`; gradients dX_i = dY·W_i,
    dW[:, k_i:k_i+K_i] = dYᵀ·X_i, db = Σ_rows dY (`torch.ops.opforge.linear_cat_backward`).
    """
    if inputs is None or isinstance(inputs, (Tensor, str, bytes)):  # list(tensor) would split it into its rows
        raise TypeError(f"opforge::linear_cat: expected inputs to be a sequence of tensors (the pieces of the "
                        f"concatenation), but got {type(inputs).__name__}")
    pieces = list(inputs)
    try:
        return torch.ops.opforge.linear_cat(pieces, weight, bias)
    except (NotImplementedError, RuntimeError):
        _missing_tensor("linear_cat", **{f"inputs[{i}]": t for i, t in enumerate(pieces)}, weight=weight)
        raise


# torch.func.vmap over linear_cat: a Tensor[] argument gets no batching fallback from functorch, so linear_cat and
# linear_cat_backward (the backward op that vmap(grad(...)) reaches) carry their own rules, registered here for the
# FuncTorchBatched key (torch.library.register_vmap; the ops themselves stay C++).

def _vmap_sample(t: Optional[Tensor], dim: Optional[int], b: int) -> Optional[Tensor]:
    """Sample b of a vmapped argument (t itself where it is not batched). A batch of size 0 has no sample: a zero
    stand-in of the sample's shape takes its place (the per-sample loops run once on it and drop the result)."""
    if t is None or dim is None:
        return t
    if t.size(dim) == 0:
        return t.new_zeros(t.shape[:dim] + t.shape[dim + 1:])
    return t.select(dim, b)


def _samples(info) -> range:
    """The per-sample loop's range: one stand-in sample for a batch of size 0, so its results have a shape."""
    return range(max(info.batch_size, 1))


def _stack(outs: list, batch_size: int) -> Tensor:
    """The per-sample results stacked along a new dim 0 (none of them for a batch of size 0)."""
    return torch.stack(outs)[:batch_size]


def _stack_samples(outs: list, batch_size: int) -> Tuple[Optional[Tensor], Optional[int]]:
    """The per-sample results stacked along a new dim 0, and that out_dim (None, None where none was computed)."""
    if outs[0] is None:
        return None, None
    return _stack(outs, batch_size), 0


def _linear_cat_vmap(info, in_dims, inputs, weight, bias=None):
    """Batching rule of opforge::linear_cat. With an unbatched weight and bias (per-sample gradients, batched
    activations) the batch dim becomes one more leading dim of every piece: one call, the same kernels and bits as
    unbatched calls. A batched weight or bias: one call per sample. The dispatcher leaves out a bias of None (the
    schema's default), in_dims then has no entry for it."""
    x_dims, w_dim = in_dims[0], in_dims[1]
    b_dim = in_dims[2] if len(in_dims) > 2 else None
    if w_dim is None and b_dim is None:
        xs = [x.movedim(d, 0) if d is not None else x.expand(info.batch_size, *x.shape)
              for x, d in zip(inputs, x_dims)]
        return torch.ops.opforge.linear_cat(xs, weight, bias), 0
    outs = [torch.ops.opforge.linear_cat([_vmap_sample(x, d, b) for x, d in zip(inputs, x_dims)],
                                         _vmap_sample(weight, w_dim, b), _vmap_sample(bias, b_dim, b))
            for b in _samples(info)]
    return _stack(outs, info.batch_size), 0


def _linear_cat_backward_vmap(info, in_dims, grad_output, inputs, weight, output_mask, bias_dtype=None):
    """Batching rule of opforge::linear_cat_backward: one call per sample (each sample's weight and bias gradients
    are its own, so the batch cannot be folded into the rows), the results stacked."""
    g_dim, x_dims, w_dim = in_dims[0], in_dims[1], in_dims[2]
    per = [torch.ops.opforge.linear_cat_backward(
        _vmap_sample(grad_output, g_dim, b), [_vmap_sample(x, d, b) for x, d in zip(inputs, x_dims)],
        _vmap_sample(weight, w_dim, b), output_mask, bias_dtype) for b in _samples(info)]
    n_inputs = len(per[0][0])
    grad_inputs = [_stack([p[0][i] for p in per], info.batch_size) for i in range(n_inputs)]
    grad_weight, w_out = _stack_samples([p[1] for p in per], info.batch_size)
    grad_bias, b_out = _stack_samples([p[2] for p in per], info.batch_size)
    return (grad_inputs, grad_weight, grad_bias), ([0] * n_inputs, w_out, b_out)


if hasattr(torch.library, "register_vmap"):
    torch.library.register_vmap("opforge::linear_cat", _linear_cat_vmap)
    torch.library.register_vmap("opforge::linear_cat_backward", _linear_cat_backward_vmap)


def indexed_linear(input: Tensor, weight: Tensor, index: Tensor, bias: Optional[Tensor] = None, *,
                   index_sorted: bool = False) -> Tensor:
    """y[t] = input[t] · weight[index[t]]ᵀ + bias[index[t]]: each token picks its weight from a bank.

    The per-token (mixture-of-experts, multi-LoRA) linear layer, differentiable in input, weight and bias.

    Args:
        input: `(T, K)` float64, float32, float16 or bfloat16, any strides. The tokens.
        weight: `(E, N, K)` floating. E weights (out_features N, in_features K), any strides (a transposed
            `(E, K, N)` bank's `.transpose(1, 2)` or a slice `w13[:, :N]` work; a non-contiguous bank is
            copied once). Converted to input's dtype if it differs; its gradient comes back in its own dtype.
        index: `(T,)` int64. index[t] in [0, E) picks weight[index[t]]; −1 means "no weight": row t of the
            output is exactly zero and input[t] gets a zero gradient.
        bias: `(E, N)` floating, or None. One bias per weight. Default: None.
        index_sorted: the caller promises the rows already in expert order: index non-decreasing over the rows
            that have an expert, rows of −1 last (a mixture-of-experts layer that sorts its (token, expert) pairs
            once for both of its GEMMs). On CUDA the grouped GEMM then reads and writes the rows in place: no
            sort, no gather, no scatter, forward and backward. The values are the same either way. Default: False.

    Returns:
        `(T, N)` contiguous tensor in input's dtype.

    Raises:
        IndexError: (CPU) an index ≥ E or < −1. On CUDA, where checking would need a host synchronisation,
            such a row is treated as −1 (zero output, no gradient); nothing out of bounds is ever read.
        ValueError: (CPU) `index_sorted=True` with an index out of order. On CUDA the rows that break the order
            come out NaN (and so do the weight's and bias's gradients), never silently wrong; with T ≤ 16 (the
            gather-GEMV, which never groups) their values are right.
        ValueError: input not 2-D, weight not 3-D, index not 1-D or not of length T, K mismatch, bias not
            `(E, N)`.
        TypeError: a non-floating input/weight/bias; index not int64.
        RuntimeError: tensors on different devices.

    Gradients: grad_weight[e] = Σ_{t: index[t]=e} dy[t]ᵀ·input[t] and grad_bias[e] = Σ dy[t]; an expert that
    received no token gets exactly zero gradients.

    Numerics: float32 accumulation (float64 for float64). CPU: tokens grouped by expert (stable argsort),
    one ATen GEMM per expert. CUDA, two regimes by shape, no host synchronisation (CUDA-graph capturable):
    T ≤ 16 a gather-GEMV (one block per token, the selected rows of the bank streamed once); more tokens are
    sorted by expert on the device and run through a grouped GEMM with device-side offsets:
    `torch._grouped_mm` for bfloat16 on sm_90 with K, N multiples of 8 (the bias then added after the
    bfloat16 rounding of the product: two roundings), our tiled fp32-accumulating kernel otherwise.

    Source: the batched GEMV of multi-LoRA serving (Punica's BGMV / S-LoRA) and mixture-of-experts grouped
    GEMMs; reference: a loop over experts (`opforge.testing.indexed_linear_reference`).
    """
    try:
        return torch.ops.opforge.indexed_linear(input, weight, index, bias, index_sorted=index_sorted)
    except NotImplementedError:
        _missing_tensor("indexed_linear", input=input, weight=weight, index=index)
        raise
# ---- rope ------------------------------------------------------------------------------------------------------
__all__ += ["rope", "rope_from_positions"]


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
         rotary_dim: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """(q_out, k_out) = (x·cos + rotate(x)·sin for x in q, k) on the first rotary_dim dims: rotary position embedding.

    The drop-in for Hugging Face's `q, k = apply_rotary_pos_emb(q, k, cos, sin)` (q, k after the
    `transpose(1, 2)`, cos/sin from the model's rotary embedding): one kernel for q and k, no `cat`.

    Args:
        q: `(B, Hq, S, D)` float64, float32, float16 or bfloat16, any strides (e.g. a transposed view of a fused
            QKV projection); D even. The queries.
        k: `(B, Hk, S, D)` of q's dtype, device, B, S and D; Hk may differ from Hq (GQA, MQA). The keys.
        cos: `(S, R)`, `(B or 1, S, R)` or `(B or 1, 1, S, R)` floating, any strides; R = rotary_dim. As transformers
            passes it: one value per rotary dim, i.e. the R/2 frequencies with the halves duplicated (rotate-half)
            or each repeated twice (interleaved). A float32 table with float16/bfloat16 q is used as float32;
            another dtype is converted to float32 (float64 for float64 q).
        sin: cos's shape, floating. As cos.
        interleaved: bool. False: rotate-half (Llama, GPT-NeoX, HF `rotate_half`): dim i pairs with
            i + R/2, `rotate(x) = cat(−x[R/2:R], x[:R/2])`. True: GPT-J's interleaved pairs (2i, 2i + 1),
            `rotate(x)[2i] = −x[2i+1], rotate(x)[2i+1] = x[2i]`. Default: False.
        rotary_dim: int or None. R, the leading dims that rotate; even, ≤ D. Dims R..D−1 are copied bit-identical
            (partial rotary: Phi, GPT-NeoX, ChatGLM). Default: None, meaning `cos.size(-1)`.

    Returns:
        (q_out, k_out) of q's and k's shape and dtype, each with its input's strides where the input is dense
            (e.g. HF's transposed q keeps its `(B, S, H, D)` memory), contiguous otherwise. New tensors (never in
            place).

    Raises:
        ValueError: q or k not 4-D; q, k of different batch, seq or head_dim; odd head_dim; cos/sin of
            different shapes or not matching q's (batch, seq); rotary_dim odd, ≤ 0, > head_dim or ≠ cos.size(-1).
        TypeError: non-floating tensors; q and k of different dtypes.
        RuntimeError: tensors on different devices; on CUDA a rotary_dim above 6144 (3072 for float64).
        NotImplementedError: cos or sin requiring grad (no gradient for the tables).

    Numerics: float32 math (float64 for float64), one rounding per output: y[j] = x[j]·cos[j] + x[partner]·(±sin[j]),
    exactly HF's formula evaluated in float32. Backward (`rope_backward`) is its transpose, the rotation by −θ;
    it is again differentiable (double backward is rope itself). cos and sin get no gradient.

    Source: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding";
    `transformers.models.llama.modeling_llama.apply_rotary_pos_emb` (reference: `opforge.testing.rope_reference`).
    """
    try:
        return torch.ops.opforge.rope(q, k, cos, sin, interleaved=interleaved,
                                      rotary_dim=-1 if rotary_dim is None else rotary_dim)
    except NotImplementedError:
        _missing_tensor("rope", q=q, k=k, cos=cos, sin=sin)
        raise


def rope_from_positions(q: Tensor, k: Tensor, position_ids: Tensor, base: float = 10000.0, *,
                        interleaved: bool = False, rotary_dim: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """rope with θ_i = position_ids · base^(−2i/R), i < R/2, computed inside the kernel (no cos/sin tensors).

    Args:
        q: `(B, Hq, S, D)` floating, any strides; D even. The queries.
        k: `(B, Hk, S, D)` of q's dtype, device, B, S and D. The keys.
        position_ids: `(S,)` or `(B or 1, S)`, any integer dtype. The position of each token.
        base: float. The RoPE base (θ in Llama's config: 10000, 500000 for Llama 3). Default: 10000.
        interleaved: bool. As in `rope`. Default: False.
        rotary_dim: int or None. R, even, ≤ D; dims past R are copied. Default: None, meaning D.

    Returns:
        (q_out, k_out) as `rope`.

    Raises:
        ValueError: as `rope`; position_ids not of shape `(S,)` or `(B or 1, S)`; base ≤ 0 or not finite.
        TypeError: non-floating q/k; position_ids not of an integer dtype.
        RuntimeError: tensors on different devices.

    Numerics: inv_freq, the angle and its cos/sin in float64, rounded once to float32 (exact to float32's
    rounding at any position: at position 2**20 a float32 angle would be off by up to 0.06 rad, a bfloat16
    cos/sin table by whole radians); the rotation in float32. This is the default (`"rope_type": "default"`)
    RoPE; scaled variants (llama3, yarn, dynamic) change the frequencies: pass their cos/sin to `rope`.
    Transformers computes inv_freq and the angle in float32 and rounds cos/sin to the model dtype, so its
    result differs from this (more accurate) one by that rounding.

    Source: Su et al. 2021 (RoFormer); transformers' `LlamaRotaryEmbedding` (default rope type).
    """
    try:
        return torch.ops.opforge.rope_from_positions(q, k, position_ids, base, interleaved=interleaved,
                                                     rotary_dim=-1 if rotary_dim is None else rotary_dim)
    except NotImplementedError:
        _missing_tensor("rope_from_positions", q=q, k=k, position_ids=position_ids)
        raise
