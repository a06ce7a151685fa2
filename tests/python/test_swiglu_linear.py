"""swiglu_linear and swiglu_linear_backward: values and gradients against float64 over dtypes and odd shapes, bias or
none, views; on an H100/H200 with CUTLASS the fused GEMM + SwiGLU epilogue kernels (bfloat16: the ping-pong kernel with
z and h, its h-only inference form) and the unfused path (float16, shapes they do not take), with the test hook
gemm_sm90 proving which ran (2: the ping-pong kernel, raising where it cannot take the problem; 1: the fused kernel
where it can run, else two passes).

The common checks of every op (opcheck, compile, gradcheck, gradgradcheck, Meta, bad inputs, ...): test_conformance.py."""
import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, gemm_error_bound, swiglu_linear_reference

from conftest import FLOAT_DTYPES

# (leading dims, K, I): one row, odd rows, K off the 64-wide k-tile, I off the tile.
SHAPES = [((1,), 8, 4), ((7,), 72, 68), ((3, 43), 136, 132), ((300,), 520, 1000)]


def _sm90_engine() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and torch.ops.opforge._has_cutlass())


needs_sm90 = pytest.mark.skipif(not _sm90_engine(),
                                reason="needs a CUDA GPU of compute capability 9.0 and a build with CUTLASS")


def _baseline(x, w, b):
    z = TF.linear(x, w, b)
    return TF.silu(z[..., 0::2]) * z[..., 1::2]


def _leaves(lead, K, I, device, dtype, with_bias=True):
    x = torch.randn(*lead, K, device=device).to(dtype).requires_grad_()
    w = (torch.randn(2 * I, K, device=device) / K**0.5).to(dtype).requires_grad_()
    b = (torch.randn(2 * I, device=device) * 0.5).to(dtype).requires_grad_() if with_bias else None
    return x, w, b


def _output_bound(x, w, b):
    """An a-priori elementwise bound on the rounding error of silu(g) * u, z = x·wᵀ + b in x's dtype.

    z's error: the GEMM's (gemm_error_bound), the bias add's and z's own rounding. It reaches y through
    |silu'| <= 1.1 on the gate and |silu(g)| on the up column; the activation and the product add a few
    roundings of |y|."""
    u = torch.finfo(x.dtype).eps / 2
    z = TF.linear(x.detach().double(), w.detach().double(), None if b is None else b.detach().double())
    dz = gemm_error_bound(x, w, x.dtype) + u * z.abs()
    if b is not None:
        dz = dz + u * b.detach().double().abs()
    g, up, dg, du = z[..., 0::2], z[..., 1::2], dz[..., 0::2], dz[..., 1::2]
    silu = TF.silu(g)
    return 1.1 * dg * (up.abs() + du) + silu.abs() * du + 4 * u * (silu * up).abs()


def _check(x, w, b, dy, before_backward=None):
    y = opforge.swiglu_linear(x, w, b)
    assert_matches_reference(y, swiglu_linear_reference(x, w, b), _baseline(x, w, b), bound=_output_bound(x, w, b))
    if before_backward is not None:
        before_backward()
    y.backward(dy)
    leaves = [t for t in (x, w, b) if t is not None]
    r64 = [t.detach().double().requires_grad_() for t in leaves]
    swiglu_linear_reference(*r64, *([None] if b is None else [])).backward(dy.double())
    base = [t.detach().clone().requires_grad_() for t in leaves]
    _baseline(*base, *([None] if b is None else [])).backward(dy)
    for name, t, r, bl in zip(("grad_input", "grad_weight", "grad_bias"), leaves, r64, base):
        assert_matches_reference(t.grad, r.grad, bl.grad, what=name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_gradients_match_float64(device, dtype, shape, with_bias):
    lead, K, I = shape
    x, w, b = _leaves(lead, K, I, device, dtype, with_bias)
    dy = torch.randn(*lead, I, device=device).to(dtype)
    _check(x, w, b, dy)


def test_interleaved_weight_equals_separate_projections(device):
    x = torch.randn(5, 64, device=device)
    w_gate, w_up = torch.randn(48, 64, device=device), torch.randn(48, 64, device=device)
    w = torch.stack([w_gate, w_up], 1).flatten(0, 1)  # row 2j gate j, row 2j + 1 up j
    y = opforge.swiglu_linear(x, w)
    torch.testing.assert_close(y, TF.silu(x @ w_gate.t()) * (x @ w_up.t()))


def test_views_and_zero_size(device):
    x = torch.randn(64, 80, device=device)[:, 8:72]  # row-strided view
    w = torch.randn(96, 64, device=device).t().contiguous().t()  # a transposed-and-back (column-major) weight
    y = opforge.swiglu_linear(x, w)
    torch.testing.assert_close(y, opforge.swiglu_linear(x.contiguous(), w.contiguous()), rtol=0, atol=0)
    empty = opforge.swiglu_linear(torch.randn(0, 64, device=device), w)
    assert empty.shape == (0, 48)
    k0 = opforge.swiglu_linear(torch.randn(3, 0, device=device), torch.randn(8, 0, device=device),
                               torch.randn(8, device=device))
    assert k0.shape == (3, 4)


def test_odd_weight_rows_raise(device):
    with pytest.raises(ValueError, match="expected weight's rows to be even"):
        opforge.swiglu_linear(torch.randn(2, 8, device=device), torch.randn(7, 8, device=device))


# The ping-pong SwiGLU kernel stores h by TMA: I (h's row stride) a multiple of 8. One row, odd rows, K off the
# k-tile, z's columns off the 128-wide tile (2 I = 2000), several tiles each way.
PINGPONG_SHAPES = [((1,), 8, 8), ((7,), 72, 72), ((3, 43), 136, 136), ((300,), 520, 1000), ((2, 1024), 2048, 2048)]


@needs_sm90
@pytest.mark.parametrize("shape", PINGPONG_SHAPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_epilogue_cuda(knob, shape, with_bias):
    knob("gemm_sm90", 2)  # the ping-pong SwiGLU kernel must run (h alone without gradients); raises where it cannot
    lead, K, I = shape
    x, w, b = _leaves(lead, K, I, "cuda", torch.bfloat16, with_bias)
    dy = torch.randn(*lead, I, device="cuda").to(torch.bfloat16)
    # backward's GEMMs (dX, dW) are not of the engine's form: gemm_sm90 = 2 would refuse them
    _check(x, w, b, dy, before_backward=lambda: knob("gemm_sm90", 1))
    knob("gemm_sm90", 2)
    # the fused path's z is what backward reads: equal to the unfused GEMM within one rounding
    y_fused, z_fused = torch.ops.opforge._swiglu_linear_forward(x.detach(), w.detach(), b)
    # without gradients the public op asks for y alone (the ping-pong kernel then never stores z): the same y
    with torch.no_grad():
        y_alone = opforge.swiglu_linear(x, w, b)
    assert_matches_reference(y_alone, swiglu_linear_reference(x, w, b), _baseline(x, w, b),
                             bound=_output_bound(x, w, b))
    torch.testing.assert_close(y_alone, y_fused, rtol=0, atol=0)  # one kernel configuration, one summation order
    knob("gemm_sm90", 0)
    y_plain, z_plain = torch.ops.opforge._swiglu_linear_forward(x.detach(), w.detach(), b)
    tol = 2**-7 * max(z_plain.abs().max().item(), 1.0)
    torch.testing.assert_close(z_fused, z_plain, rtol=2**-7, atol=tol)
    torch.testing.assert_close(y_fused, y_plain, rtol=2**-6, atol=tol)


@needs_sm90
@pytest.mark.parametrize("I", [4, 68, 132])
def test_pingpong_declines_unaligned_h_rows_cuda(knob, I):
    # h's rows of I elements are not whole 16-byte TMA granules: the ping-pong kernel cannot store them
    x, w, b = _leaves((33,), 136, I, "cuda", torch.bfloat16)
    knob("gemm_sm90", 2)
    with pytest.raises(RuntimeError, match="sm90 kernel cannot take this problem.*H's row stride"):
        opforge.swiglu_linear(x.detach(), w.detach(), b.detach())
    knob("gemm_sm90", 1)  # the fused kernel where it can run, else two passes: two passes here
    dy = torch.randn(33, I, device="cuda").to(torch.bfloat16)
    _check(x, w, b, dy)
    with torch.no_grad():
        y = opforge.swiglu_linear(x, w, b)
    assert_matches_reference(y, swiglu_linear_reference(x, w, b), _baseline(x, w, b), bound=_output_bound(x, w, b))


@needs_sm90
def test_default_path_matches_float64_cuda(knob):
    knob("gemm_sm90", -1)  # the measured table's choice (fused or two passes) at a Llama-like shape
    x, w, b = _leaves((2, 256), 2048, 1024, "cuda", torch.bfloat16, with_bias=False)
    dy = torch.randn(2, 256, 1024, device="cuda").to(torch.bfloat16)
    _check(x, w, b, dy)
    with torch.no_grad():
        y = opforge.swiglu_linear(x, w, b)
    assert_matches_reference(y, swiglu_linear_reference(x, w, b), _baseline(x, w, b), bound=_output_bound(x, w, b))


@needs_sm90
@pytest.mark.parametrize("case", ["float16", "k_not_multiple_of_8"])
def test_unfused_path_where_fused_kernel_cannot_run_cuda(knob, case):
    dtype, K = (torch.float16, 64) if case == "float16" else (torch.bfloat16, 83)
    x, w, b = _leaves((33,), K, 40, "cuda", dtype)
    dy = torch.randn(33, 40, device="cuda").to(dtype)
    knob("gemm_sm90", 1)
    _check(x, w, b, dy)
    for mode in (2, 3):
        knob("gemm_sm90", mode)
        with pytest.raises(RuntimeError, match="sm90 kernel cannot take this problem"):
            opforge.swiglu_linear(x.detach(), w.detach(), b.detach())
