"""Tests of the elementwise ops sigmoid, square, square_add and their backward ops (tolerances: opforge.testing).

Every numeric check follows the tolerance rule of opforge.testing.assert_matches_reference: opforge's
error against the float64 reference is at most 2x the error of the same PyTorch math in the same dtype
(torch.sigmoid, torch.square, x * x + b). Gradients are checked the same way against float64 autograd.
"""
from __future__ import annotations

import math

import pytest
import torch

import opforge
from opforge.testing import (assert_matches_reference, sigmoid_reference, square_add_reference,
                             square_reference)

from conftest import FLOAT_DTYPES, ODD_SIZES

ops = torch.ops.opforge
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

# Every odd size of DESIGN §5 appears in at least one 2-D shape (M, N); small enough for the CPU budget.
SHAPES_2D = [(1, 1), (7, 8200), (83, 769), (3584, 7), (1, 5120)]
assert {s for shape in SHAPES_2D for s in shape} >= set(ODD_SIZES)
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded", "unaligned"]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    """The grid runs single-threaded on CPU: on a small shared machine, intra-op threads waiting on each
    other cost 10-50x the work itself. test_cpu_parallel_chunks covers the multi-threaded paths."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def make_layout(layout, M, N, dtype, device, scale=1.0):
    """A leaf tensor and a view function giving an (M, N) tensor of the requested layout over it."""
    if layout == "contiguous":
        return _randn((M, N), dtype, device, scale), lambda t: t
    if layout == "transposed":
        return _randn((N, M), dtype, device, scale), lambda t: t.t()
    if layout == "sliced":  # every second column: stride (2N, 2)
        return _randn((M, 2 * N), dtype, device, scale), lambda t: t[:, ::2]
    if layout == "expanded":  # zero stride over rows
        return _randn((1, N), dtype, device, scale), lambda t: t.expand(M, N)
    if layout == "unaligned":  # base pointer one element past an allocation's start
        return _randn((M * N + 1,), dtype, device, scale), lambda t: t[1:].view(M, N)
    raise ValueError(layout)


def check_against_reference(fn, ref_fn, base_fn, leaves, views, grad_output=None):
    """Run fn (opforge), ref_fn (float64) and base_fn (PyTorch, same dtype) on views of the same leaves;
    assert the tolerance rule on the output and on every leaf's gradient. Returns opforge's output."""
    def run(f, cast):
        ls = [cast(l).detach().clone().requires_grad_() for l in leaves]
        out = f(*[v(l) for v, l in zip(views, ls)])
        return ls, out

    ours_l, ours = run(fn, lambda t: t)
    ref_l, ref = run(ref_fn, lambda t: t.double())
    base_l, base = run(base_fn, lambda t: t)
    assert_matches_reference(ours, ref, base, what="output")
    assert ours.is_contiguous()
    go = grad_output if grad_output is not None else torch.randn_like(ours)
    for ls, out, g in ((ours_l, ours, go), (ref_l, ref, go.double()), (base_l, base, go)):
        out.backward(g)
    for i, (a, r, b) in enumerate(zip(ours_l, ref_l, base_l)):
        assert a.grad.dtype == a.dtype, f"grad {i}: dtype {a.grad.dtype}, expected {a.dtype}"
        # a float64 parameter of a lower-precision input gets a gradient computed in input's dtype:
        # judge it in that dtype (the float64 rule would ask for float64 accuracy)
        d = ours.dtype if a.dtype == torch.float64 else a.dtype
        assert_matches_reference(a.grad.to(d), r.grad, b.grad.to(d), what=f"grad of argument {i}")
    return ours


UNARY = {
    # name: (opforge op, float64 reference, PyTorch same-dtype baseline, input scale)
    "sigmoid": (opforge.sigmoid, sigmoid_reference, torch.sigmoid, 4.0),
    "square": (opforge.square, square_reference, torch.square, 1.0),
}


# ---- forward and gradients against float64 references ------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES_2D, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["sigmoid", "square", "square_add"])
def test_matches_reference(device, name, dtype, shape, layout):
    M, N = shape
    if name == "square_add":
        x, view = make_layout(layout, M, N, dtype, device)
        b = _randn((N,), dtype, device)
        check_against_reference(opforge.square_add, square_add_reference, lambda x, b: x * x + b,
                                [x, b], [view, lambda t: t])
    else:
        fn, ref, base, scale = UNARY[name]
        x, view = make_layout(layout, M, N, dtype, device, scale)
        check_against_reference(fn, ref, base, [x], [view])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["sigmoid", "square", "square_add"])
def test_nd_views(device, name, dtype):
    """N-D batch dims through permuted and sliced 4-D views."""
    views = [lambda t: t.permute(2, 0, 3, 1), lambda t: t[:, 1:, ::3, :].transpose(-1, -2), lambda t: t]
    for view in views:
        x = _randn((3, 5, 7, 83), dtype, device)
        if name == "square_add":
            n_last = view(x).shape[-1]
            b = _randn((n_last,), dtype, device)
            check_against_reference(opforge.square_add, square_add_reference, lambda x, b: x * x + b,
                                    [x, b], [view, lambda t: t])
        else:
            fn, ref, base, _ = UNARY[name]
            check_against_reference(fn, ref, base, [x], [view])


# (input shape, other shape or builder) for square_add's `other`; a builder makes a non-contiguous other
# (the leaf, its view) of the input's shape.
BROADCASTS = {
    "same": ((83, 769), (83, 769)),
    "row_N": ((83, 769), (769,)),
    "row_1N": ((83, 769), (1, 769)),
    "col_M1": ((83, 769), (83, 1)),
    "scalar_0d": ((83, 769), ()),
    "one_1": ((83, 769), (1,)),
    "K1N_into_JKMN": ((3, 5, 7, 83), (5, 1, 83)),
    "KMN_into_JKMN": ((3, 5, 7, 83), (5, 7, 83)),
    "J1M1_into_JKMN": ((3, 5, 7, 83), (3, 1, 7, 1)),
    "11MN_into_JKMN": ((3, 5, 7, 83), (1, 1, 7, 83)),
    "N_into_JKMN": ((3, 5, 7, 83), (83,)),
    "same_1MN": ((1, 7, 83), (1, 7, 83)),
    "other_transposed": ((83, 769), lambda d, dev: (_randn((769, 83), d, dev), lambda t: t.t())),
    "other_sliced": ((83, 769), lambda d, dev: (_randn((83, 1538), d, dev), lambda t: t[:, ::2])),
    "other_expanded": ((83, 769), lambda d, dev: (_randn((769,), d, dev), lambda t: t.expand(83, 769))),
    "other_unaligned": ((83, 769), lambda d, dev: (_randn((83 * 769 + 1,), d, dev), lambda t: t[1:].view(83, 769))),
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("pattern", list(BROADCASTS))
def test_square_add_broadcast(device, pattern, dtype):
    x_shape, other = BROADCASTS[pattern]
    x = _randn(x_shape, dtype, device)
    if callable(other):
        b, b_view = other(dtype, device)
    else:
        b, b_view = _randn(other, dtype, device), (lambda t: t)
    check_against_reference(opforge.square_add, square_add_reference, lambda x, b: x * x + b,
                            [x, b], [lambda t: t, b_view])


# ---- the backward ops called directly (non-contiguous grad_output, masks) ----------------------------

def _grad_outputs(shape, dtype, device):
    """grad_output layouts: contiguous, transposed, and the zero-stride gradient of .sum()."""
    M, N = shape
    return {
        "contiguous": _randn((M, N), dtype, device),
        "transposed": _randn((N, M), dtype, device).t(),
        "expanded": torch.ones((), dtype=dtype, device=device).expand(M, N),
    }


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_backward_ops_direct(device, dtype):
    shape = (83, 769)
    x = _randn(shape, dtype, device, 3.0)
    y = torch.sigmoid(x)
    b = _randn((769,), dtype, device)
    for kind, go in _grad_outputs(shape, dtype, device).items():
        go_copy = go.clone()
        g64 = go.double()
        assert_matches_reference(ops.sigmoid_backward(go, y), g64 * y.double() * (1 - y.double()),
                                 torch.ops.aten.sigmoid_backward(go, y), what=f"sigmoid_backward {kind}")
        assert_matches_reference(ops.square_backward(go, x), 2 * x.double() * g64, 2 * x * go,
                                 what=f"square_backward {kind}")
        gi, gb = ops.square_add_backward(go, x, b, [True, True])
        assert_matches_reference(gi, 2 * x.double() * g64, 2 * x * go, what=f"square_add_backward input {kind}")
        assert_matches_reference(gb, g64.sum(0), go.sum(0), what=f"square_add_backward other {kind}")
        assert torch.equal(go, go_copy), "backward modified grad_output"


def test_square_add_backward_mask(device):
    x, b = torch.randn(7, 83, device=device), torch.randn(83, device=device)
    go = torch.randn(7, 83, device=device)
    for mask in ([True, True], [True, False], [False, True], [False, False]):
        gi, gb = ops.square_add_backward(go, x, b, mask)
        assert (gi is not None) == mask[0] and (gb is not None) == mask[1], mask
        if mask[0]:
            torch.testing.assert_close(gi, 2 * x * go)
        if mask[1]:
            torch.testing.assert_close(gb, go.sum(0))
    # autograd asks only for what is needed: other alone, input alone
    xr, br = x.clone().requires_grad_(), b.clone().requires_grad_()
    (gb,) = torch.autograd.grad(opforge.square_add(x, br), br, go)
    torch.testing.assert_close(gb, go.sum(0))
    (gi,) = torch.autograd.grad(opforge.square_add(xr, b), xr, go)
    torch.testing.assert_close(gi, 2 * x * go)


# ---- zero-size inputs --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0,), (0, 7), (7, 0), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("name", ["sigmoid", "square", "square_add"])
def test_zero_size(device, name, shape):
    x = torch.randn(shape, device=device, requires_grad=True)
    if name == "square_add":
        b = torch.randn(shape[-1:], device=device, requires_grad=True)
        y = opforge.square_add(x, b)
    else:
        b = None
        y = getattr(opforge, name)(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    y.backward(torch.randn_like(y))
    assert x.grad.shape == x.shape
    if b is not None:
        assert b.grad.shape == b.shape and torch.all(b.grad == 0)
    # a one-element other broadcast over nothing gets a zero gradient
    b1 = torch.randn((1,), device=device, requires_grad=True)
    opforge.square_add(x.detach(), b1).sum().backward()
    assert torch.equal(b1.grad, torch.zeros_like(b1))
    # the backward ops on empty tensors
    e = torch.empty(shape, device=device)
    assert ops.sigmoid_backward(e, e).shape == shape and ops.square_backward(e, e).shape == shape


def test_zero_dim_tensors(device):
    x = torch.tensor(-1.5, device=device, requires_grad=True)
    b = torch.tensor(0.25, device=device, requires_grad=True)
    for fn, ref in ((opforge.sigmoid, torch.sigmoid), (opforge.square, torch.square)):
        torch.testing.assert_close(fn(x), ref(x))
    y = opforge.square_add(x, b)
    assert y.shape == ()
    y.backward()
    torch.testing.assert_close(x.grad, torch.tensor(-3.0, device=device))
    torch.testing.assert_close(b.grad, torch.tensor(1.0, device=device))


# ---- devices (the other bad inputs: conformance.py) ------------------------------------------------
# Also: gradcheck, gradgradcheck, opcheck, torch.compile, Meta, bad inputs, compiled autograd, torch.func and autocast of
# every op: test_conformance.py (the table: conformance.py).

@pytest.mark.parametrize("devices", [("cpu", "meta"), pytest.param(("cuda", "cpu"), marks=needs_cuda)],
                         ids=["meta", "cuda"])
def test_different_devices(devices):
    """Tensors on two devices raise the device message, forward and backward ops (meta pairs with the CPU, so it runs
    without a GPU; every backend runs the same checks)."""
    x = torch.randn(3, 4, device=devices[0])
    y = torch.randn(3, 4, device=devices[1])
    dev = f"({x.device}|{y.device})"
    with pytest.raises(RuntimeError, match=rf"opforge::square_add: expected input and other to be on the same "
                                           rf"device, but got input on {dev} and other on {dev}"):
        opforge.square_add(x, y[0])
    for op, saved in (("sigmoid_backward", "output"), ("square_backward", "input")):
        with pytest.raises(RuntimeError, match=rf"opforge::{op}: expected grad_output and {saved} to be on the same "
                                               rf"device, but got grad_output on {dev} and {saved} on {dev}"):
            getattr(ops, op)(x, y)
    with pytest.raises(RuntimeError, match=r"opforge::square_add_backward: expected grad_output and input to be on "
                                           r"the same device"):
        ops.square_add_backward(y, x, x[0], [False, True])


# ---- mixed dtypes: output in input's dtype, other's gradient in other's dtype; CPU == Meta ------------

MIXED = [(torch.float16, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
         (torch.float32, torch.float64), (torch.float64, torch.bfloat16), (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("x_dtype,b_dtype", MIXED, ids=lambda d: str(d).replace("torch.", ""))
def test_square_add_mixed_dtypes(device, x_dtype, b_dtype):
    x = _randn((83, 769), x_dtype, device)
    b = _randn((769,), b_dtype, device)
    y = check_against_reference(opforge.square_add, square_add_reference,
                                lambda x, b: x * x + b.to(x.dtype), [x, b], [lambda t: t, lambda t: t])
    assert y.dtype == x_dtype
    # the same policy on Meta (FakeTensor / torch.compile): shapes, dtypes and strides of outputs and grads
    results = {}
    for dev in (device, "meta"):
        xd = x.detach().to(dev).requires_grad_()
        bd = b.detach().to(dev).requires_grad_()
        yd = opforge.square_add(xd, bd)
        yd.backward(torch.ones_like(yd))
        results[dev] = [(t.shape, t.dtype, t.stride()) for t in (yd, xd.grad, bd.grad)]
    assert results[device] == results["meta"]
    assert results["meta"][1][1] == x_dtype and results["meta"][2][1] == b_dtype


@pytest.mark.parametrize("name", ["sigmoid_backward", "square_backward"])
def test_backward_ops_mixed_dtypes(device, name):
    """The saved tensor is converted to grad_output's dtype; output in grad_output's dtype, CPU == Meta."""
    go = torch.randn(7, 83, dtype=torch.float16, device=device)
    s = torch.rand(7, 83, dtype=torch.float32, device=device)
    out = getattr(ops, name)(go, s)
    meta = getattr(ops, name)(go.to("meta"), s.to("meta"))
    assert out.dtype == meta.dtype == torch.float16 and out.shape == meta.shape and out.stride() == meta.stride()
    torch.testing.assert_close(out, getattr(ops, name)(go, s.half()), rtol=0, atol=0)

# ---- cases from real bug reports ------------------------------------------------------------------

def test_views_of_chunk_slice_transpose(device):
    """sigmoid and square_add on one half of h.chunk(2, -1) of an (8, 2304) fp16 tensor, on
    h[:, ::2] and on h.t(): equal to the result on the contiguous copy; h unchanged."""
    h = torch.randn(8, 2304, dtype=torch.float16, device=device)
    h_before = h.clone()
    first, second = h.chunk(2, -1)
    for label, v in (("chunk[0]", first), ("chunk[1]", second), ("[:, ::2]", h[:, ::2]), ("t()", h.t())):
        c = v.contiguous()
        assert torch.equal(opforge.sigmoid(v), opforge.sigmoid(c)), label
        assert torch.equal(opforge.sigmoid(v), torch.sigmoid(c.float()).half()), label
        other = torch.randn(v.shape[-1], dtype=torch.float16, device=device)
        assert torch.equal(opforge.square_add(v, other), opforge.square_add(c, other)), label
        # fp32 math rounded once; an fma (CPU fmadd, nvcc's contraction) may round the last fp16 bit apart
        torch.testing.assert_close(opforge.square_add(v, other), (c.float() ** 2 + other.float()).half(),
                                   rtol=torch.finfo(torch.float16).eps, atol=0, msg=label)
        assert torch.equal(h, h_before), f"{label}: h was modified"


def test_sigmoid_saturation(device):
    """No NaN, exact 0 and 1 at saturation, fp16 equal to torch.sigmoid(x.float()).half()
    (about 3.9e-4 near -7.85, not 0), finite gradient."""
    x32 = torch.tensor([-1662.7, 3212.5, -89, 89, -7.85, 7.33, 0, -0.5, -math.inf, math.inf], device=device,
                       requires_grad=True)
    y32 = opforge.sigmoid(x32)
    assert not torch.isnan(y32).any()
    assert y32[0].item() == 0.0 and y32[8].item() == 0.0  # -1662.7, -inf
    assert y32[1].item() == 1.0 and y32[3].item() == 1.0 and y32[9].item() == 1.0  # 3212.5, 89, inf
    assert 0.0 <= y32[2].item() < 1e-30  # -89: 0 or a denormal, never negative or NaN
    assert y32[6].item() == 0.5
    torch.testing.assert_close(y32, torch.sigmoid(x32.detach()), rtol=2e-6, atol=1e-38)
    y32.backward(torch.ones_like(y32))
    assert torch.isfinite(x32.grad).all()
    torch.testing.assert_close(x32.grad, (torch.sigmoid(x32) * (1 - torch.sigmoid(x32))).detach(),
                               rtol=2e-6, atol=1e-38)

    x16 = torch.tensor([-7.8477, 7.332, -7.8008, 6.6016], dtype=torch.float16, device=device, requires_grad=True)
    y16 = opforge.sigmoid(x16)
    assert not torch.isnan(y16).any()
    assert torch.equal(y16, torch.sigmoid(x16.detach().float()).half())
    assert 3.5e-4 < y16[0].item() < 4.3e-4  # about 3.9e-4, not 0
    y16.backward(torch.ones_like(y16))
    assert torch.isfinite(x16.grad).all() and (x16.grad > 0).all()
    # the same in a vectorized body (long tensor), not only in the scalar tail
    xl = x16.detach().repeat(64)
    assert torch.equal(opforge.sigmoid(xl), torch.sigmoid(xl.float()).half())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_one_rounding(device, dtype):
    """fp16/bf16 are computed in fp32 and rounded once: square equals the fp32 math rounded; square_add
    within one ulp of it (an fma rounds once where x*x + b rounds twice); sigmoid within exp's ulps."""
    x = _randn((7, 8200), dtype, device, 6.0)
    torch.testing.assert_close(opforge.square(x), (x.float() * x.float()).to(dtype), rtol=0, atol=0)
    b = _randn((8200,), dtype, device)
    torch.testing.assert_close(opforge.square_add(x, b), (x.float() * x.float() + b.float()).to(dtype),
                               rtol=torch.finfo(dtype).eps, atol=0)
    torch.testing.assert_close(opforge.sigmoid(x), torch.sigmoid(x.float()).to(dtype))


def test_cpu_parallel_chunks():
    """Multi-threaded CPU paths (chunks of at::parallel_for, the rows of square_add's period path) give
    the single-threaded result exactly: at 2..8 threads, chunk ends fall inside vectors, where core/vec.h's
    partial-vector tails compute the body's Vectorized math (scalar tails, whose exp differs in the last bit for ~4%
    of fp32 inputs, failed the fp32 sigmoid here)."""
    x = torch.randn(3 * 32768 + 5, dtype=torch.bfloat16)
    xf = torch.randn(8 * 32768 + 5) * 3
    xr = torch.randn(1001, 769)
    b = torch.randn(769)

    def run():
        return [opforge.sigmoid(x), opforge.square(x), opforge.square_add(xr, b), ops.sigmoid_backward(xr, xr),
                opforge.sigmoid(xf)]

    single = run()
    n = torch.get_num_threads()
    try:
        multi = []
        for threads in range(2, 9):
            torch.set_num_threads(threads)
            multi.append(run())
    finally:
        torch.set_num_threads(n)
    for m in multi:
        for s, t in zip(single, m):
            assert torch.equal(s, t)
    torch.testing.assert_close(single[2], xr * xr + b)


# ---- CUDA only: big indices, graphs, device guard ------------------------------------------------------

@needs_cuda
def test_cuda_past_2_pow_31_elements():
    """64-bit offsets: the last elements of a tensor past 2^31 elements (the period path too)."""
    N = 4099
    M = (2**31) // N + 3
    x = torch.randn(M, N, dtype=torch.float16, device="cuda")
    tail = x[-2:].clone()
    y = opforge.square(x)
    assert torch.equal(y[-2:], opforge.square(tail))
    del y
    b = torch.randn(N, dtype=torch.float16, device="cuda")
    y = opforge.square_add(x, b)
    assert torch.equal(y[-2:], opforge.square_add(tail, b))
    del y, x
    torch.cuda.empty_cache()


@needs_cuda
def test_cuda_graph_capture():
    """No host sync or allocation outside the caching allocator: the ops capture into a CUDA graph."""
    x = torch.randn(83, 769, device="cuda")
    b = torch.randn(769, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as CUDA graphs require
        for _ in range(2):
            opforge.square_add(opforge.sigmoid(x), b)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = opforge.square_add(opforge.sigmoid(x), b)
        dx = ops.square_backward(y, x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.sigmoid(x) ** 2 + b)
    torch.testing.assert_close(dx, 2 * x * y)


@needs_cuda
def test_cuda_side_stream():
    """Kernels run on the current stream: results on a side stream are ready after that stream's sync."""
    x = torch.randn(4096, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = opforge.square(x)
        s.synchronize()
        torch.testing.assert_close(y, x * x)


@needs_2_gpus
def test_cuda_second_device():
    """The device guard: tensors on cuda:1 while cuda:0 is current."""
    with torch.cuda.device(0):
        x = torch.randn(83, 769, device="cuda:1", requires_grad=True)
        b = torch.randn(769, device="cuda:1", requires_grad=True)
        y = opforge.square_add(opforge.sigmoid(x), b)
        y.sum().backward()
        assert y.device == x.grad.device == b.grad.device == torch.device("cuda:1")
        torch.testing.assert_close(y, torch.sigmoid(x) ** 2 + b)


def test_mixed_dtype_other_grad_accumulates_in_float32(device):
    # fp16 input, fp32 other: other's gradient is a sum of 2049 ones, which fp16 cannot hold exactly
    x = torch.ones(2049, dtype=torch.half, device=device, requires_grad=True)
    o = torch.zeros((), device=device, requires_grad=True)
    opforge.square_add(x, o).sum().backward()
    assert o.grad.dtype == torch.float32 and o.grad.item() == 2049.0
