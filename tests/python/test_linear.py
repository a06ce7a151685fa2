"""linear and linear_backward: accuracy against float64, layouts, zero sizes, activations, GEMV, mixed dtypes.

The common checks of every op (opcheck, compile, gradcheck, Meta, bad inputs, ...): test_conformance.py.

Tolerance rule (opforge.testing): our error against the float64 reference is at most 2 x the error of
torch.nn.functional.linear in the same dtype (plus one eps).
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

import conformance
import opforge
from opforge.testing import (activation_reference, assert_matches_reference, gemm_error_bound, linear_leaves,
                             linear_reference)

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# (M, K, N): odd sizes from DESIGN §5, products kept small for the CPU run.
SHAPES = [(1, 1, 1), (7, 83, 769), (83, 7, 1), (769, 83, 7), (7, 3584, 83), (83, 769, 83)]
LAYOUTS = ["contiguous", "weight_t", "input_t", "sliced", "batch3d"]

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def make_operands(M, K, N, dtype, device, layout, bias=True):
    """input (*, K) with M rows in the given layout, weight (N, K), bias (N,) or None."""
    if layout == "input_t":
        x = torch.randn(K, M, device=device).to(dtype).t()
    elif layout == "sliced":
        x = torch.randn(M, 2 * K, device=device).to(dtype)[:, ::2]
    elif layout == "batch3d":  # (M, 3, K), non-contiguous: 3M rows
        x = torch.randn(3, M, K, device=device).to(dtype).transpose(0, 1)
    else:
        x = torch.randn(M, K, device=device).to(dtype)
    if layout == "weight_t":
        w = torch.randn(K, N, device=device).to(dtype).t()
    else:
        w = torch.randn(N, K, device=device).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    return x, w, b


def forward_backward(fn, x, w, b, dy):
    """fn's output and the grads of (x, w, b) for upstream gradient dy (None where b is None)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, (b.grad if b is not None else None)


def reference(x, w, b, dy):
    d = lambda t: t.detach().double() if t is not None else None  # noqa: E731
    return forward_backward(linear_reference, d(x), d(w), d(b), d(dy))


# ---- accuracy over dtype x shape x layout, forward and every gradient --------------------------------

# dtype x shape on contiguous operands, and dtype x layout on one odd shape: the full product would
# triple the CPU runtime without exercising anything new.
GRID = [(shape, "contiguous") for shape in SHAPES] + [((83, 769, 7), layout) for layout in LAYOUTS[1:]]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape,layout", GRID, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_reference(device, dtype, shape, layout, bias):
    M, K, N = shape
    x, w, b = make_operands(M, K, N, dtype, device, layout, bias)
    out_shape = x.shape[:-1] + (N,)
    dy = torch.randn(out_shape, device=device).to(dtype)
    ours = forward_backward(opforge.linear, x, w, b, dy)
    base = forward_backward(F.linear, x, w, b, dy)
    ref = reference(x, w, b, dy)
    assert ours[0].shape == out_shape and ours[0].is_contiguous()
    bounds = gemm_bounds(x, w, b, dy)
    for what, o, r, t in zip(["output", "grad_input", "grad_weight", "grad_bias"], ours, ref, base):
        if r is None:
            assert o is None, what
            continue
        assert o.dtype == dtype, what
        bound = bounds.get(what)
        check_accuracy(o, r, t, what, bound.reshape(r.shape) if bound is not None else None)


def gemm_bounds(x, w, b, dy):
    """A-priori rounding bounds (opforge.testing.gemm_error_bound) of output, grad_input, grad_weight."""
    dt = x.dtype
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    out = gemm_error_bound(x, w, dt)
    if b is not None:
        out = out + torch.finfo(dt).eps * b.detach().double().abs()
    return {"output": out, "grad_input": gemm_error_bound(dy, w.t(), dt),
            "grad_weight": gemm_error_bound(dy2.t(), x2.t(), dt)}


def check_accuracy(ours, ref64, baseline, what, bound=None):
    """The tolerance rule (optionally with a GEMM rounding bound); in float64 the reference *is*
    PyTorch's float64 math (baseline error 0), so there the rule degenerates and a plain float64
    closeness check replaces it."""
    if ours.dtype == torch.float64:
        torch.testing.assert_close(ours, ref64.to(ours.device), msg=lambda m: f"{what}: {m}")
    else:
        assert_matches_reference(ours, ref64, baseline, what=what, bound=bound)


# ---- zero sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)], ids=lambda s: "x".join(map(str, s)))
def test_zero_sizes(device, shape, bias):
    M, K, N = shape
    x, w, b = make_operands(M, K, N, torch.float32, device, "contiguous", bias)
    dy = torch.randn(M, N, device=device)
    y, gx, gw, gb = forward_backward(opforge.linear, x, w, b, dy)
    expected = forward_backward(F.linear, x, w, b, dy)
    for o, e in zip((y, gx, gw, gb), expected):
        if e is None:
            assert o is None
        else:
            assert o.shape == e.shape
            torch.testing.assert_close(o, e)


# ---- cases from bug reports -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposed_weight_and_batched_input(device, dtype):
    W = torch.randn(512, 256, device=device).to(dtype).t()
    x = torch.randn(7, 3, 512, device=device).to(dtype).transpose(0, 1)
    y = opforge.linear(x, W)
    expected = F.linear(x, W)
    assert y.shape == (3, 7, 256)
    # equal to F.linear up to rounding: both within the GEMM rounding bound of the float64 result
    assert_matches_reference(y, linear_reference(x, W), expected, bound=gemm_error_bound(x, W, dtype))


# The CPU kernel builds weightᵀ as a hand-made view of weight's storage (linear_cpu.cpp's transposed): weights with a
# storage offset, steps, zero or swapped strides make exactly F.linear's GEMM call (W.t()), so the results are equal.
WEIGHT_VIEWS = {
    "offset": lambda: torch.randn(20, 30)[3:9, 4:11],
    "steps": lambda: torch.randn(20, 30)[1::3, 2::4][:6, :7],
    "transposed_offset": lambda: torch.randn(9, 8).t()[1:7, 2:9],
    "expanded_rows": lambda: torch.randn(1, 7).expand(6, 7),
    "expanded_cols": lambda: torch.randn(6, 1).expand(6, 7),
    "one_row": lambda: torch.randn(3, 7)[2:],
    "no_rows": lambda: torch.empty_strided((0, 7), (0, 0)),
}


@pytest.mark.parametrize("view", list(WEIGHT_VIEWS))
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_weight_views_equal_f_linear(view, bias):
    W = WEIGHT_VIEWS[view]()
    b = torch.randn(W.shape[0]) if bias else None
    for x in (torch.randn(5, 7), torch.randn(2, 5, 7)):
        assert torch.equal(opforge.linear(x, W, b), F.linear(x, W, b))
    with torch.inference_mode():  # a normal weight read inside inference mode
        assert torch.equal(opforge.linear(x, W, b), F.linear(x, W, b))


def test_cpu_weight_changed_in_place_before_backward_raises_like_f_linear():
    for f in (opforge.linear, F.linear):
        x = torch.randn(5, 7, requires_grad=True)
        W = torch.randn(6, 7, requires_grad=True) * 1  # a non-leaf weight: changeable in place
        y = f(x, W[1:])
        W.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_zero_rows_give_zero_parameter_gradients(device):
    x, W, b = linear_leaves(0, 2100, 2100, device)
    y = opforge.linear(x, W, b)
    assert y.shape == (0, 2100)
    y.sum().backward()
    assert x.grad.shape == (0, 2100)
    assert torch.equal(W.grad, torch.zeros_like(W))
    assert torch.equal(b.grad, torch.zeros_like(b))


def test_zero_in_features_gives_the_bias(device):
    x, W, b = linear_leaves(5, 0, 3, device)
    y = opforge.linear(x, W, b)
    assert torch.equal(y, b.detach().expand(5, 3))
    assert y.data_ptr() != b.data_ptr()  # a new tensor, never a view of bias
    y.sum().backward()
    assert x.grad.shape == (5, 0) and W.grad.shape == (3, 0)
    assert torch.equal(b.grad, torch.full((3,), 5.0, device=device))
    assert torch.equal(opforge.linear(x.detach(), W.detach()), torch.zeros(5, 3, device=device))


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_every_requires_grad_combination(device, with_bias):
    for flags in itertools.product([False, True], repeat=3 if with_bias else 2):
        x = torch.randn(4, 3, 6, device=device, dtype=torch.float64, requires_grad=flags[0])
        W = torch.randn(5, 6, device=device, dtype=torch.float64, requires_grad=flags[1])
        b = torch.randn(5, device=device, dtype=torch.float64, requires_grad=flags[2]) if with_bias else None
        leaves = [t for t in (x, W, b) if t is not None]
        wanted = [t for t in leaves if t.requires_grad]
        y = opforge.linear(x, W, b)
        assert y.requires_grad == bool(wanted)
        if not wanted:
            continue
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, wanted, dy)
        expected = torch.autograd.grad(F.linear(x, W, b), wanted, dy)
        assert len(grads) == len(wanted)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e)
        # .backward() fills exactly the leaves that require grad
        opforge.linear(x, W, b).backward(dy)
        for t in leaves:
            assert (t.grad is not None) == t.requires_grad


# ---- double backward per activation (gradcheck, opcheck, compile, the rest: test_conformance.py) -------------


@pytest.mark.parametrize("activation", ["none", "relu", "gelu", "gelu_tanh", "silu"])
def test_double_backward(device, activation):
    x, W, b = linear_leaves(3, 4, 5, device, torch.float64)
    assert torch.autograd.gradgradcheck(lambda *a: opforge.linear(*a, activation), (x, W, b))


# ---- Meta, mixed dtypes ---------------------------------------------------------------------------------

def test_meta_matches_real_kernels():
    x, W, b = make_operands(7, 8, 5, torch.float16, "cpu", "batch3d")
    Wf, bf = W.float(), b.float()
    real = opforge.linear(x, Wf, bf)
    meta = opforge.linear(x.to("meta"), Wf.to("meta"), bf.to("meta"))
    assert (meta.shape, meta.dtype, meta.stride()) == (real.shape, real.dtype, real.stride())
    dy = torch.randn_like(real)
    args = (dy, x, Wf, [True, True, True], torch.float32)
    real_grads = torch.ops.opforge.linear_backward(*args)
    meta_grads = torch.ops.opforge.linear_backward(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    for r, m in zip(real_grads, meta_grads):
        assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride())
    assert [g.dtype for g in real_grads] == [torch.float16, torch.float32, torch.float32]
    gi, gw, gb = torch.ops.opforge.linear_backward(dy, x, Wf, [False, True, False])
    assert gi is None and gb is None and gw.shape == Wf.shape


# ---- mixed dtypes and nn.Linear --------------------------------------------------------------------

def test_mixed_dtype_policy(device):
    x = torch.randn(4, 6, 16, device=device, dtype=torch.float16, requires_grad=True)
    W = torch.randn(8, 16, device=device, dtype=torch.float32, requires_grad=True)
    b = torch.randn(8, device=device, dtype=torch.float32, requires_grad=True)
    y = opforge.linear(x, W, b)
    assert y.dtype == torch.float16
    dy = torch.randn_like(y)
    y.backward(dy)
    assert (x.grad.dtype, W.grad.dtype, b.grad.dtype) == (torch.float16, torch.float32, torch.float32)
    # values: the same math as converting the parameters to fp16 first
    base = forward_backward(F.linear, x, W.half(), b.half(), dy)
    ref = reference(x, W, b, dy)
    for what, o, r, t in zip(["output", "grad_input", "grad_weight", "grad_bias"], (y, x.grad, W.grad, b.grad), ref,
                             base):
        check_accuracy(o.to(t.dtype), r, t, what)


def test_nn_linear_drop_in(device):
    for bias in (True, False):
        ref = torch.nn.Linear(83, 7, bias=bias, device=device)
        ours = opforge.nn.Linear(83, 7, bias=bias, device=device)
        assert isinstance(ours, torch.nn.Linear)
        ours.load_state_dict(ref.state_dict())
        assert ours.state_dict().keys() == ref.state_dict().keys()
        x = torch.randn(3, 5, 83, device=device)
        torch.testing.assert_close(ours(x), ref(x))
        ours(x).sum().backward()
        ref(x).sum().backward()
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
        if bias:
            torch.testing.assert_close(ours.bias.grad, ref.bias.grad)


def test_nn_linear_mixed_dtype(device):
    layer = opforge.nn.Linear(16, 8, device=device)  # fp32 parameters
    x = torch.randn(5, 16, device=device, dtype=torch.float16)
    y = layer(x)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("case", ["in_features", "int_input", "rank0", "bias_shape"])
def test_bad_inputs_meta(case):
    """Meta (FakeTensor, torch.compile) raises what the real kernels raise (conformance.py's linear table)."""
    (bad,) = [b for b in conformance.entry("linear").bad_inputs("cpu") if b.name == case]
    fn, args = bad.make("cpu")
    with pytest.raises(bad.exc, match=bad.match):
        fn(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])


@requires_cuda
def test_bad_inputs_cuda_devices():
    with pytest.raises(RuntimeError, match=r"expected input and weight to be on the same device, but got input on "
                                           r"cpu and weight on cuda:0"):
        opforge.linear(torch.randn(4, 8), torch.randn(3, 8, device="cuda"))
    with pytest.raises(RuntimeError, match=r"expected input and bias to be on the same device"):
        opforge.linear(torch.randn(4, 8, device="cuda"), torch.randn(3, 8, device="cuda"), torch.randn(3))


def test_bad_inputs_backward():
    dy, x, W = torch.randn(4, 3), torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"opforge::linear_backward: expected grad_output of shape \[4, 3\] .*but got "
                                         r"\[4, 2\]"):
        torch.ops.opforge.linear_backward(dy[:, :2], x, W, [True, True, True])
    with pytest.raises(TypeError, match=r"opforge::linear_backward: expected bias_dtype to be a floating dtype"):
        torch.ops.opforge.linear_backward(dy, x, W, [True, True, True], torch.int32)
    with pytest.raises(ValueError, match=r"opforge::linear_backward: expected input's last dimension"):
        torch.ops.opforge.linear_backward(dy, x[:, :7], W, [True, True, True])


# ---- every forward path: the small-M GEMV (CUDA, M <= 16, K a multiple of the 16-byte vector) and cuBLAS ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 8, 16, 17])
@pytest.mark.parametrize("K, N", [(64, 83), (4096, 769), (5120, 7), (136, 4097)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gemv", ["default", "0"])
def test_small_batch_paths_match_reference(knob, device, dtype, M, K, N, bias, gemv):
    # default: M == 1 takes the GEMV kernel on CUDA; the test hook linear_gemv = 0 sends it to cuBLAS(Lt)
    knob("linear_gemv", 0 if gemv == "0" else -1)
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
    b = torch.randn(N, device=device, dtype=dtype) if bias else None
    y = opforge.linear(x, w, b)
    assert_matches_reference(y, linear_reference(x, w, b), F.linear(x, w, b), bound=gemm_error_bound(x, w, dtype))
    # an unaligned base pointer takes the fallback path and gives the same values within tolerance
    buf = torch.randn(M * K + 1, device=device, dtype=dtype)
    xu = buf[1:].view(M, K)
    assert_matches_reference(opforge.linear(xu, w, b), linear_reference(xu, w, b), F.linear(xu, w, b),
                             bound=gemm_error_bound(xu, w, dtype))


def test_mixed_dtype_weight_grad_accumulates_in_weight_dtype(device):
    # fp16 input, fp32 weight: dW = Σ over 70000 rows of 1 overflows fp16 (max 65504) but not fp32
    x = torch.ones(70000, 1, dtype=torch.half, device=device)
    w = torch.ones(1, 1, device=device, requires_grad=True)
    b = torch.zeros(1, device=device, requires_grad=True)
    opforge.linear(x, w, b).float().sum().backward()
    assert w.grad.dtype == torch.float32 and w.grad.item() == 70000.0
    assert b.grad.item() == 70000.0


# ---- activations: y = act(x · Wᵀ + b) ----------------------------------------------------------------

ACTIVATIONS = ["none", "relu", "gelu", "gelu_tanh", "silu"]
# M = 1, 3, 16, 17 with K and N not multiples of 8, plus one N % 8 == 0 shape (CUDA: gelu_tanh's AUX epilogue).
ACT_SHAPES = [(1, 83, 7), (3, 83, 769), (16, 129, 33), (17, 769, 83), (16, 72, 136)]


def act_fn(activation):
    """PyTorch's own act(F.linear(...)): the baseline of the tolerance rule."""
    return lambda x, w, b: activation_reference(F.linear(x, w, b), activation)


def act_reference(x, w, b, dy, activation):
    d = lambda t: t.detach().double() if t is not None else None  # noqa: E731
    return forward_backward(lambda x_, w_, b_: linear_reference(x_, w_, b_, activation), d(x), d(w), d(b), d(dy))


def act_bounds(x, w, b, dy, activation, dtype):
    """A-priori elementwise rounding bounds (float64) of output, grad_input, grad_weight, grad_bias of
    act(x · Wᵀ + b) in ``dtype`` with any summation order, from first-order error propagation (Higham
    §3.5): z's error δz ≤ K·u·|x||W|ᵀ + u·|b| + u·|z|; y's ≤ 1.2·δz + u·|y| (|act'| ≤ 1.2); dz's ≤
    |dy|·δz + u·|dz| (|act''| ≤ 1; relu: all of |dy| where |z| ≤ δz, the kink); then each GEMM's bound
    of |dz| plus δdz carried through it. Doubled, for the products of first-order terms."""
    u = torch.finfo(dtype).eps / 2
    xd, wd, dyd = x.detach().double(), w.detach().double(), dy.detach().double()
    x2, dy2 = xd.reshape(-1, xd.shape[-1]), dyd.reshape(-1, dyd.shape[-1])
    K, M = xd.shape[-1], x2.shape[0]
    z = F.linear(x2, wd, b.detach().double() if b is not None else None)
    zb = K * u * (x2.abs() @ wd.abs().t()) + u * z.abs()
    if b is not None:
        zb = zb + u * b.detach().double().abs()
    zr = z.detach().requires_grad_()
    y = activation_reference(zr, activation)
    (dz,) = torch.autograd.grad(y, zr, dy2) if activation != "none" else (dy2,)
    y, dz = y.detach(), dz.detach()
    yb = 1.2 * zb + u * y.abs()
    dzb = dy2.abs() * zb + u * dz.abs() if activation != "none" else torch.zeros_like(dz)
    if activation == "relu":
        dzb = torch.where(z.abs() <= zb, dy2.abs(), dzb)
    N = wd.shape[0]
    gi = N * u * (dz.abs() @ wd.abs()) + dzb @ wd.abs() + u * (dz @ wd).abs()
    gw = M * u * (dz.abs().t() @ x2.abs()) + dzb.t() @ x2.abs() + u * (dz.t() @ x2).abs()
    gb = M * u * dz.abs().sum(0) + dzb.sum(0) + u * dz.sum(0).abs()
    return {"output": 2 * yb.reshape(dy.shape), "grad_input": 2 * gi.reshape(x.shape), "grad_weight": 2 * gw,
            "grad_bias": 2 * gb}


def check_activation_case(device, dtype, shape, activation, bias, layout="contiguous"):
    M, K, N = shape
    x, w, b = make_operands(M, K, N, dtype, device, layout, bias)
    w = (w.float() / K ** 0.5).to(dtype)  # z of unit scale: every activation's curved part is exercised
    out_shape = x.shape[:-1] + (N,)
    dy = torch.randn(out_shape, device=device).to(dtype)
    ours = forward_backward(lambda x_, w_, b_: opforge.linear(x_, w_, b_, activation), x, w, b, dy)
    base = forward_backward(act_fn(activation), x, w, b, dy)
    ref = act_reference(x, w, b, dy, activation)
    assert ours[0].shape == out_shape and ours[0].is_contiguous() and ours[0].dtype == dtype
    bounds = act_bounds(x, w, b, dy, activation, dtype)
    for what, o, r, t in zip(["output", "grad_input", "grad_weight", "grad_bias"], ours, ref, base):
        if r is None:
            assert o is None, what
            continue
        assert o.dtype == dtype, what
        check_accuracy(o, r, t, what, bounds[what].reshape(r.shape))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_matches_reference(device, activation, dtype, shape, bias):
    check_activation_case(device, dtype, shape, activation, bias)


@requires_cuda
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(3, 83, 769), (16, 72, 136)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_gemmex_fallback_matches_reference(knob, activation, dtype, shape, bias):
    # linear_lt = 0: the cublasGemmEx + elementwise path that serves whatever cuBLASLt declines
    knob("linear_lt", 0)
    check_activation_case("cuda", dtype, shape, activation, bias)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_activation_layouts(device, activation, layout):
    for dtype in (torch.float32, torch.bfloat16):
        check_activation_case(device, dtype, (17, 83, 40), activation, True, layout)


@requires_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_unaligned_pointers(activation):
    # base pointers off 16-byte alignment (input, weight, bias): cuBLASLt with a lower alignment, or the fallback
    M, K, N = 5, 64, 48
    for dtype in (torch.float16, torch.float32):
        buf = torch.randn(M * K + K * N + N + 3, device="cuda").to(dtype)
        x = buf[1:1 + M * K].view(M, K)
        w = (buf[1 + M * K:1 + M * K + N * K].view(N, K) / 8).requires_grad_()
        b = buf[2 + M * K + N * K:2 + M * K + N * K + N]
        y = opforge.linear(x, w, b, activation)
        assert_matches_reference(y, linear_reference(x, w, b, activation), act_fn(activation)(x, w, b),
                                 bound=act_bounds(x, w, b, torch.ones_like(y), activation, dtype)["output"])


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_activation_zero_sizes(device, activation, shape, bias):
    M, K, N = shape
    x, w, b = make_operands(M, K, N, torch.float32, device, "contiguous", bias)
    dy = torch.randn(M, N, device=device)
    ours = forward_backward(lambda x_, w_, b_: opforge.linear(x_, w_, b_, activation), x, w, b, dy)
    expected = forward_backward(act_fn(activation), x, w, b, dy)
    for o, e in zip(ours, expected):
        if e is None:
            assert o is None
        else:
            assert o.shape == e.shape
            torch.testing.assert_close(o, e)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_gradcheck(device, activation, bias):
    x = torch.randn(2, 3, 4, device=device, dtype=torch.float64, requires_grad=True)
    W = torch.randn(4, 5, device=device, dtype=torch.float64).t().requires_grad_()  # (5, 4), transposed view
    b = torch.randn(5, device=device, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(lambda x_, w_, b_: opforge.linear(x_, w_, b_, activation), (x, W, b))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_requires_grad_combinations(device, activation):
    for flags in itertools.product([False, True], repeat=3):
        if not any(flags):
            continue
        x = torch.randn(4, 3, 6, device=device, dtype=torch.float64, requires_grad=flags[0])
        W = torch.randn(5, 6, device=device, dtype=torch.float64, requires_grad=flags[1])
        b = torch.randn(5, device=device, dtype=torch.float64, requires_grad=flags[2])
        wanted = [t for t in (x, W, b) if t.requires_grad]
        y = opforge.linear(x, W, b, activation)
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, wanted, dy)
        expected = torch.autograd.grad(act_fn(activation)(x, W, b), wanted, dy)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e)


def test_activation_no_graph_without_grad(device):
    x, W, b = (torch.randn(3, 8, device=device), torch.randn(5, 8, device=device), torch.randn(5, device=device))
    y = opforge.linear(x, W, b, "gelu")
    assert y.grad_fn is None and not y.requires_grad
    with torch.no_grad():
        assert opforge.linear(x, W.requires_grad_(), b, "silu").grad_fn is None


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_forward_op_returns_pre_activation(device, activation):
    x, W, b = make_operands(7, 16, 9, torch.float64, device, "batch3d")
    y, z = torch.ops.opforge._linear_forward(x, W, b, activation)
    torch.testing.assert_close(z, F.linear(x, W, b))
    torch.testing.assert_close(y, act_fn(activation)(x, W, b))
    assert z.data_ptr() != y.data_ptr()
    # differentiable in its output, z is not
    xs = x.detach().requires_grad_()
    y, z = torch.ops.opforge._linear_forward(xs, W, b, activation)
    assert not z.requires_grad
    (gx,) = torch.autograd.grad(y, xs, torch.ones_like(y))
    (ex,) = torch.autograd.grad(act_fn(activation)(xs, W, b), xs, torch.ones_like(y))
    torch.testing.assert_close(gx, ex)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_opcheck_linear_activation(device, activation, bias):
    x = torch.randn(2, 3, 8, device=device, requires_grad=True)
    W = torch.randn(5, 8, device=device, requires_grad=True)
    b = torch.randn(5, device=device, requires_grad=True) if bias else None
    torch.library.opcheck(torch.ops.opforge.linear.default, (x, W, b, activation))
    torch.library.opcheck(torch.ops.opforge.linear.default, (x.detach(), W.detach(), b, activation))
    torch.library.opcheck(torch.ops.opforge._linear_forward.default, (x, W, b, activation))


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True), (False, False, True)],
                         ids=str)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_opcheck_linear_backward_activation(device, activation, mask):
    dy = torch.randn(2, 3, 5, device=device)
    x = torch.randn(2, 3, 8, device=device)
    W = torch.randn(5, 8, device=device)
    z = torch.randn(2, 3, 5, device=device)
    torch.library.opcheck(torch.ops.opforge.linear_backward.default,
                          (dy, x, W, list(mask), torch.float32, activation, z))


@pytest.mark.parametrize("activation,dynamic", [(a, False) for a in ACTIVATIONS] + [("gelu", True), ("relu", True)])
def test_activation_compile_matches_eager(device, activation, dynamic):
    torch._dynamo.reset()  # f's code object is shared by every case: without a reset they pile up to the recompile limit

    def f(x, w, b):
        return opforge.linear(x, w, b, activation)

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    x, W, b = make_operands(6, 8, 5, torch.float32, device, "batch3d")
    dy = torch.randn(6, 3, 5, device=device)
    results = []
    for fn in (f, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (x, W, b)]
        y = fn(*leaves)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    for ours, eager in zip(results[1], results[0]):
        torch.testing.assert_close(ours, eager)


def test_meta_activation_matches_real_kernels():
    x, W, b = make_operands(7, 8, 5, torch.bfloat16, "cpu", "batch3d")
    for activation in ACTIVATIONS:
        real = torch.ops.opforge._linear_forward(x, W.float(), b, activation)
        meta = torch.ops.opforge._linear_forward(x.to("meta"), W.float().to("meta"), b.to("meta"), activation)
        for r, m in zip(real, meta):
            assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride())
        dy = torch.randn_like(real[0])
        args = (dy, x, W.float(), [True, True, True], torch.float32, activation, real[1])
        real_g = torch.ops.opforge.linear_backward(*args)
        meta_g = torch.ops.opforge.linear_backward(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
        for r, m in zip(real_g, meta_g):
            assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride())


BAD_ACTIVATION = r'opforge::linear: expected activation to be one of "none", "relu", "gelu", "gelu_tanh", "silu", ' \
                 r'but got "tanh"'


@pytest.mark.parametrize("where", ["cpu", "meta", pytest.param("cuda", marks=requires_cuda)])
def test_bad_activation(where):
    x, W, b = torch.randn(4, 8, device=where), torch.randn(3, 8, device=where), torch.randn(3, device=where)
    with pytest.raises(ValueError, match=BAD_ACTIVATION):
        opforge.linear(x, W, b, "tanh")
    with pytest.raises(ValueError, match=BAD_ACTIVATION):
        opforge.linear(x.requires_grad_(), W, b, "tanh")
    with pytest.raises(ValueError, match=r'expected activation to be one of .* but got "GELU"'):
        torch.ops.opforge._linear_forward(x, W, b, "GELU")
    dy = torch.randn(4, 3, device=where)
    with pytest.raises(ValueError, match=r'opforge::linear_backward: expected activation to be one of .*but got "x"'):
        torch.ops.opforge.linear_backward(dy, x.detach(), W, [True, True, True], None, "x", dy)


def test_bad_pre_activation():
    dy, x, W = torch.randn(4, 3), torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r'opforge::linear_backward: expected pre_activation .* for activation "gelu", '
                                         r'but got None'):
        torch.ops.opforge.linear_backward(dy, x, W, [True, True, True], None, "gelu")
    with pytest.raises(ValueError, match=r"opforge::linear_backward: expected pre_activation of shape \[4, 3\] "
                                         r"\(grad_output's shape\), but got \[4, 2\]"):
        torch.ops.opforge.linear_backward(dy, x, W, [True, True, True], None, "silu", dy[:, :2])
    with pytest.raises(TypeError, match=r"expected pre_activation to have a floating dtype"):
        torch.ops.opforge.linear_backward(dy, x, W, [True, True, True], None, "relu", dy.int())


def test_nn_linear_activation(device):
    for activation in ACTIVATIONS:
        ref = torch.nn.Linear(83, 7, device=device)
        ours = opforge.nn.Linear(83, 7, device=device, activation=activation)
        ours.load_state_dict(ref.state_dict())
        assert ours.state_dict().keys() == ref.state_dict().keys()
        x = torch.randn(3, 5, 83, device=device)
        torch.testing.assert_close(ours(x), activation_reference(ref(x), activation))
        assert ("activation" in repr(ours)) == (activation != "none")
    with pytest.raises(ValueError, match=r"opforge.nn.Linear: expected activation to be one of .* but got 'tanh'"):
        opforge.nn.Linear(4, 4, activation="tanh")


# ---- the small-M GEMV kernel at every M <= 16 (CUDA, the test hook linear_gemv = 1) ------------------------------

@requires_cuda
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(1, 64, 83), (3, 4096, 769), (8, 136, 33), (16, 72, 136), (17, 64, 40),
                                   (2, 83, 9)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemv_path_matches_reference(knob, activation, dtype, shape, bias):
    # M <= 16 with K % (16 bytes / element) == 0 takes the GEMV kernel (forward, and _linear_forward's
    # pre-activation for the backward); (17, ...) and K = 83 check that the rest still goes to cuBLAS(Lt)
    knob("linear_gemv", 1)
    check_activation_case("cuda", dtype, shape, activation, bias)


@requires_cuda
@pytest.mark.parametrize("gemv", [False, True], ids=["cublaslt", "gemv"])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu_tanh", "silu"])
def test_cuda_graph_capture_matches_eager(knob, activation, gemv):
    # stream-ordered, no host synchronization: forward + backward capture in a CUDA graph and replay
    if gemv:
        knob("linear_gemv", 1)
    x, w, b = linear_leaves(4, 64, 136, "cuda", torch.bfloat16)
    dy = torch.randn(4, 136, device="cuda", dtype=torch.bfloat16)

    def step():
        y = opforge.linear(x, w, b, activation)
        return (y.detach(),) + torch.autograd.grad(y, (x, w, b), dy)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = step()
    g.replay()
    torch.cuda.synchronize()
    for c, e in zip(captured, eager):
        torch.testing.assert_close(c, e)


# ---- the GEMV kernel at 1 <= M <= 16 over its tiles, N and M tails, bias and activations fused ---------------------

GEMV_SHAPES = [(1, 8, 1), (7, 3584, 83), (16, 5120, 769), (5, 8200, 7), (13, 16384, 17), (9, 1024, 3584),
               (2, 768, 8200), (1, 16384, 83)]


# every activation with a bias; without one, two activations suffice
GEMV_ACT_BIAS = [(a, True) for a in ACTIVATIONS] + [("none", False), ("gelu", False)]


@requires_cuda
@pytest.mark.parametrize("activation,bias", GEMV_ACT_BIAS, ids=lambda v: v if isinstance(v, str) else ("bias" if v else "nobias"))
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gemv_shapes_match_reference(knob, activation, dtype, shape, bias):
    # forward (and the pre-activation the backward uses) through the GEMV kernel: each tile of rows of X
    # (M 1, 2, 4, 8, 16), N not a multiple of a block's rows, K long and short
    knob("linear_gemv", 1)
    check_activation_case("cuda", dtype, shape, activation, bias)


@requires_cuda
@pytest.mark.parametrize("layout", ["sliced", "batch3d", "weight_t", "input_t"])
def test_gemv_layouts(knob, layout):
    knob("linear_gemv", 1)
    check_activation_case("cuda", torch.bfloat16, (5, 4096, 136), "silu", True, layout)


@requires_cuda
@pytest.mark.parametrize("M", [1, 8, 16])
def test_gemv_deterministic_and_unaligned_fallback(knob, M):
    knob("linear_gemv", 1)
    x = torch.randn(M, 16384, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(40, 16384, device="cuda") / 128).to(torch.bfloat16)
    b = torch.randn(40, device="cuda", dtype=torch.bfloat16)
    y1, y2 = opforge.linear(x, w, b, "gelu_tanh"), opforge.linear(x, w, b, "gelu_tanh")
    assert torch.equal(y1, y2)  # each output is one warp's sum in a fixed order
    ref = linear_reference(x.double(), w.double(), b.double(), "gelu_tanh")
    assert_matches_reference(y1, ref, F.gelu(F.linear(x, w, b), approximate="tanh"))
    # an unaligned weight (K % 8 == 0 but the base pointer 2 bytes off) goes to cuBLAS(Lt), still right
    wu = torch.empty(40 * 16384 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(40, 16384)
    wu.copy_(w)
    assert_matches_reference(opforge.linear(x, wu, b, "gelu_tanh"), ref, F.gelu(F.linear(x, wu, b), approximate="tanh"))
