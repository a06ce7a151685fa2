"""opforge's sm90 GEMM engine (csrc/core/gemm_sm90.h, CUTLASS): values against float64 over odd shapes, with and
without bias, bfloat16 and float16; the fallback to cuBLASLt for what the engine cannot take (K or N not a multiple
of 8, unaligned operands, other dtypes) and the test hook that proves which path ran (gemm_sm90 = 2 raises where the
engine cannot take a problem). The engine serves every op through core/gemm.h; these tests reach it through
opforge.linear. The CUDA cases need an H100/H200 (compute capability 9.0) and a build with CUTLASS; they skip
elsewhere.
"""
import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, gemm_error_bound, linear_reference


def _sm90_engine() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and torch.ops.opforge._has_cutlass())


needs_sm90 = pytest.mark.skipif(not _sm90_engine(),
                                reason="needs a CUDA GPU of compute capability 9.0 and a build with CUTLASS")

# (M, K, N): tile-exact, ragged M and N edges, K not a multiple of the 64-wide k-tile, one row, tiny K.
ENGINE_SHAPES = [(128, 64, 256), (1, 64, 8), (7, 72, 136), (300, 520, 264), (1000, 2048, 1000), (4099, 8, 16),
                 (513, 4104, 3072)]


def test_has_cutlass_is_a_build_flag():
    assert isinstance(torch.ops.opforge._has_cutlass(), bool)


def _check_linear(x, w, b):
    y = opforge.linear(x, w, b)
    assert_matches_reference(y, linear_reference(x, w, b), TF.linear(x, w, b),
                             bound=gemm_error_bound(x, w, x.dtype))
    return y


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ENGINE_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_engine_matches_float64_cuda(knob, dtype, shape, with_bias):
    knob("gemm_sm90", 2)  # the engine must take every one of these problems (else the call raises)
    M, K, N = shape
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype) if with_bias else None
    _check_linear(x, w, b)


@needs_sm90
@pytest.mark.parametrize("shape", ENGINE_SHAPES)
def test_pingpong_variant_matches_float64_cuda(knob, shape):
    knob("gemm_sm90", 3)  # bfloat16's ping-pong kernel, measured against the chosen one by bench_gemm
    M, K, N = shape
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    _check_linear(x, w, torch.randn(N, device="cuda", dtype=torch.bfloat16))


@needs_sm90
def test_engine_and_cublaslt_agree_cuda(knob):
    x = torch.randn(3, 333, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2056, 1024, device="cuda", dtype=torch.bfloat16) / 32
    b = torch.randn(2056, device="cuda", dtype=torch.bfloat16)
    knob("gemm_sm90", 0)
    y_lt = opforge.linear(x, w, b)
    knob("gemm_sm90", 2)
    y_sm90 = opforge.linear(x, w, b)
    # both fp32-accumulated, one rounding: equal within one bf16 ulp of the magnitude
    torch.testing.assert_close(y_sm90, y_lt, rtol=2**-7, atol=2**-7 * y_lt.abs().max().item())


@needs_sm90
@pytest.mark.parametrize("case", ["k_not_multiple_of_8", "n_not_multiple_of_8", "unaligned_bias", "float32"])
def test_fallback_where_engine_cannot_take_cuda(knob, case):
    M, K, N, dtype = 65, 64, 96, torch.bfloat16
    if case == "k_not_multiple_of_8":
        K = 83
    elif case == "n_not_multiple_of_8":
        N = 97
    elif case == "float32":
        dtype = torch.float32
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    if case == "unaligned_bias":  # a bias that starts 2 bytes into a buffer: core/gemm copies it to alignment
        b = torch.randn(N + 1, device="cuda", dtype=dtype)[1:]
    knob("gemm_sm90", 1)  # wherever it can: the rest falls back to cuBLASLt
    _check_linear(x, w, b)
    knob("gemm_sm90", 2)
    if case == "unaligned_bias":
        _check_linear(x, w, b)  # the aligned copy makes the engine's problem
    else:
        with pytest.raises(RuntimeError, match="sm90 kernel cannot take this problem"):
            opforge.linear(x, w, b)


@needs_sm90
def test_engine_gradients_cuda(knob):
    knob("gemm_sm90", 1)
    x = torch.randn(129, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(384, 256, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    b = torch.randn(384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(129, 384, device="cuda", dtype=torch.bfloat16)
    opforge.linear(x, w, b).backward(dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    linear_reference(x64, w64, b64).backward(dy.double())
    xb, wb, bb = (t.detach().clone().requires_grad_() for t in (x, w, b))
    TF.linear(xb, wb, bb).backward(dy)
    assert_matches_reference(x.grad, x64.grad, xb.grad, what="grad_input")
    assert_matches_reference(w.grad, w64.grad, wb.grad, what="grad_weight")
    assert_matches_reference(b.grad, b64.grad, bb.grad, what="grad_bias")


@needs_sm90
def test_engine_captures_in_cuda_graph_cuda(knob):
    knob("gemm_sm90", 2)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) / 16
    expected = opforge.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = opforge.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
