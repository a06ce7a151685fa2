"""quantize_fp8 and fp8_linear: bit-exact quantization against torch's recipe, the FP8 GEMMs against the float64
reference of the same quantized math."""
import pytest
import torch

import opforge
import opforge.testing as T

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GRANS = ["tensorwise", "rowwise"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(7, 33), (4, 3, 64), (0, 16), (5, 0), (1000, 24)])
def test_quantize_fp8_bit_exact(device, granularity, fp8, dtype, shape):
    x = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype=dtype, device=device)
    if x.numel():
        x.view(-1)[0] = 0
    d, s = opforge.quantize_fp8(x, fp8, granularity)
    rd, rs = T.quantize_fp8_reference(x.cpu(), fp8, granularity)
    assert d.dtype == fp8 and s.dtype == torch.float32 and d.shape == x.shape and s.shape == rs.shape
    assert torch.equal(d.cpu().view(torch.uint8), rd.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_quantize_fp8_special_values(device, granularity):
    x = torch.tensor([[1.0, float("nan"), 2.0], [1.0, float("inf"), 2.0], [0.0, 0.0, 0.0]], device=device)
    d, s = opforge.quantize_fp8(x, None, granularity)
    rd, rs = T.quantize_fp8_reference(x.cpu(), None, granularity)
    assert torch.equal(d.cpu().view(torch.uint8), rd.view(torch.uint8))
    torch.testing.assert_close(s.cpu(), rs, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_is_torchao_recipe(device, granularity, fp8, dtype):
    """Data and scales bit-identical to torchao's float8 training recipe on the same inputs (its
    hp_tensor_to_float8_dynamic: current scaling, rowwise as its axiswise scaling along the last dim), over values
    spread across the formats' range, an all-zero row and a saturating row. Runs where torchao imports (the GPU
    machine carries it)."""
    S = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import LinearMMConfig

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g) * torch.logspace(-6, 4, 40)
    x[2] = 0
    x[4, 7] = 3e4
    x = x.to(device=device, dtype=dtype)
    d, s = opforge.quantize_fp8(x, fp8, granularity)
    axiswise = granularity == "rowwise"
    t = S.hp_tensor_to_float8_dynamic(
        x, fp8, LinearMMConfig(),
        scaling_granularity=ScalingGranularity.AXISWISE if axiswise else ScalingGranularity.TENSORWISE,
        axiswise_dim=-1 if axiswise else None)
    assert torch.equal(s, t._scale.reshape(s.shape)), granularity
    assert torch.equal(d.view(torch.uint8), t._data.view(torch.uint8))


def _bound(a, b, out_dtype, rowwise, device):
    """Rounding bound of the scaled GEMM on dequantized operands (opforge.testing.fp8_gemm_bound: fp32
    accumulation, the dequantization, the product's rounding (bf16 for rowwise), the output's; on CUDA the FP8
    tensor cores' truncating accumulation)."""
    return T.fp8_gemm_bound(a, b, out_dtype, rowwise, device == "cuda") + 1e-30


def _deq(x, fp8, rowwise):
    q, s = T.quantize_fp8_reference(x, fp8, "rowwise" if rowwise else "tensorwise")
    return q.double() * s.reciprocal().double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("MKN", [(32, 64, 48), (7, 33, 17), (128, 256, 96)])
def test_fp8_linear_matches_quantized_reference(device, granularity, dtype, MKN):
    M, K, N = MKN
    rowwise = granularity == "rowwise"
    x = torch.randn(M, K, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(N, K, dtype=dtype, device=device) * 0.1).requires_grad_()
    y = opforge.fp8_linear(x, w, granularity=granularity)
    e4 = torch.float8_e4m3fn
    xd, wd = _deq(x.detach().cpu(), e4, rowwise), _deq(w.detach().cpu(), e4, rowwise)
    ref = xd @ wd.t()
    assert y.dtype == dtype and y.shape == (M, N)
    assert ((y.detach().cpu().double() - ref).abs() <= _bound(xd, wd, dtype, rowwise, device)).all()
    g = torch.randn(M, N, dtype=dtype, device=device)
    y.backward(g)
    gdt = torch.float8_e4m3fn if rowwise else torch.float8_e5m2
    gc, xc, wc = g.cpu(), x.detach().cpu(), w.detach().cpu()
    a, b = _deq(gc, gdt, rowwise), _deq(wc.t(), e4, rowwise)
    assert ((x.grad.cpu().double() - a @ b.t()).abs() <= _bound(a, b, dtype, rowwise, device)).all()
    a, b = _deq(gc.t(), gdt, rowwise), _deq(xc.t(), e4, rowwise)
    assert ((w.grad.cpu().double() - a @ b.t()).abs() <= _bound(a, b, dtype, rowwise, device)).all()
    # against the unquantized product: e4m3's relative rounding 2^-4 per operand
    exact = x.detach().cpu().double() @ w.detach().cpu().double().t()
    err = (y.detach().cpu().double() - exact).norm() / exact.norm()
    assert err < 2 * 2 ** -4


def _check_gemms_within_bounds(x, w, g, granularity, grad_dtype, fast_fwd, fast_bwd):
    """fp8_linear(x, w) and its backward with g: each of the three GEMMs within the rounding bound of its
    accumulation (opforge.testing.fp8_gemm_bound; fast_fwd / fast_bwd: one truncating accumulator over the whole
    contraction, as fast accumulation runs on CUDA) of the float64 product of the same quantized operands."""
    rowwise, cuda, e4 = granularity == "rowwise", x.is_cuda, torch.float8_e4m3fn
    gdt = grad_dtype or (e4 if rowwise else torch.float8_e5m2)
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = opforge.fp8_linear(x, w, granularity=granularity, grad_dtype=grad_dtype)
    y.backward(g)
    M, K, N = x.shape[:-1].numel(), w.shape[1], w.shape[0]
    xc, wc, gc = x.detach().cpu().reshape(M, K), w.detach().cpu(), g.cpu().reshape(M, N)
    for what, ours, (a, b), fast in (
            ("output", y, (_deq(xc, e4, rowwise), _deq(wc, e4, rowwise)), fast_fwd),
            ("grad_input", x.grad, (_deq(gc, gdt, rowwise), _deq(wc.t(), e4, rowwise)), fast_bwd),
            ("grad_weight", w.grad, (_deq(gc.t(), gdt, rowwise), _deq(xc.t(), e4, rowwise)), fast_bwd)):
        bound = T.fp8_gemm_bound(a, b, ours.dtype, rowwise, cuda, fast_accum=cuda and fast) + 1e-30
        err = (ours.detach().cpu().double().reshape(a.shape[0], b.shape[0]) - a @ b.t()).abs()
        assert (err <= bound).all(), (what, (err - bound).max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("mode", [1, 2])
def test_fp8_fast_accumulation_within_its_bound(device, granularity, mode, knob):
    """OPFORGE_FP8_FAST_ACCUM=1 (the forward GEMM) and 2 (all three GEMMs): each GEMM within the rounding bound of
    its accumulation (the CPU ignores the knob), K = 1024 so that the bound differs from the default's."""
    knob("OPFORGE_FP8_FAST_ACCUM", mode)
    M, K, N = 64, 1024, 48
    x = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    w = torch.randn(N, K, dtype=torch.bfloat16, device=device) * 0.05
    g = torch.randn(M, N, dtype=torch.bfloat16, device=device)
    _check_gemms_within_bounds(x, w, g, granularity, None, True, mode == 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="opforge's cuBLASLt FP8 engine runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("fast", [0, 1, 2])
@pytest.mark.parametrize("shape", [(64, 1024, 48), (7, 33, 17), (2, 65, 40, 24), (1, 16, 16), (300, 80, 144)])
def test_fp8_gemm_engine_within_bounds(dtype, grad_dtype, fast, shape, knob):
    """The tensorwise GEMMs through opforge's cuBLASLt engine (test hook fp8_gemm = 2: the engine runs every one or
    raises), with and without fast accumulation, every output dtype, both gradient formats, aligned shapes and
    shapes that take the padding: each GEMM within the rounding bound of its accumulation."""
    knob("fp8_gemm", 2)
    knob("OPFORGE_FP8_FAST_ACCUM", fast)
    *lead, K, N = shape
    torch.manual_seed(0)
    x = torch.randn(*lead, K, dtype=torch.float64).to(dtype=dtype, device="cuda")
    w = (torch.randn(N, K, dtype=torch.float64) * 0.05).to(dtype=dtype, device="cuda")
    g = torch.randn(*lead, N, dtype=torch.float64).to(dtype=dtype, device="cuda")
    _check_gemms_within_bounds(x, w, g, "tensorwise", grad_dtype, fast >= 1, fast == 2)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_linear_bad_inputs(device):
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="opforge::fp8_linear: expected granularity"):
        opforge.fp8_linear(x, w, granularity="blockwise")
    with pytest.raises(ValueError, match="opforge::fp8_linear: expected grad_dtype"):
        opforge.fp8_linear(x, w, grad_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="opforge::quantize_fp8: expected dtype"):
        opforge.quantize_fp8(x, torch.float16)
    with pytest.raises(TypeError, match="opforge::quantize_fp8: expected input to have a floating dtype"):
        opforge.quantize_fp8(x.int())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_nn_linear_fp8_is_fp8_linear(device, granularity):
    torch.manual_seed(0)
    m = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    x = torch.randn(3, 5, 48, device=device, requires_grad=True)
    y = m(x)
    w, b = m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref = opforge.fp8_linear(x2, w, b, granularity=granularity)
    assert torch.equal(y, ref)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(m.weight.grad, w.grad) and torch.equal(m.bias.grad, b.grad)
    assert set(m.state_dict()) == {"weight", "bias"} and f"fp8={granularity!r}" in repr(m)
    # the unquantized layer differs by e4m3's rounding, not more
    plain = torch.nn.functional.linear(x.detach(), m.weight.detach(), m.bias.detach())
    assert 0 < T.relative_error(y.detach(), plain) < 2 * 2 ** -4


def test_nn_linear_fp8_bad_options():
    with pytest.raises(ValueError, match=r"opforge.nn.Linear: expected fp8 to be None, 'tensorwise' or 'rowwise' "
                                         r"with activation 'none', but got fp8='blockwise'"):
        opforge.nn.Linear(4, 3, fp8="blockwise")
    with pytest.raises(ValueError, match=r"but got fp8='rowwise', activation='silu'"):
        opforge.nn.Linear(4, 3, fp8="rowwise", activation="silu")


# ---- the backward's quantizations of transposes (read from the untransposed tensors) against quantize_fp8 of a
# transposed copy, through fp8_linear's gradients compared bit for bit with the same GEMMs composed from torch ops

def _bits(t):
    """t's bit patterns as integers (NaN payloads and signed zeros included), for bitwise comparisons."""
    return t.view({torch.float64: torch.int64, torch.float32: torch.int32}.get(t.dtype, torch.int16))


def _quantized(x, fp8, granularity):
    """(data, 1-D scale) of opforge.quantize_fp8 on a row-major copy of the 2-D x: for x = t.t(), q(tᵀ) as the
    row quantizer gives it from a transposed copy."""
    d, s = opforge.quantize_fp8(x.contiguous(), fp8, granularity)
    return d, s.reshape(-1)


def _pad_fp8(t, rows, cols):
    """The 2-D FP8 t zero-padded to (rows, cols) through its bytes (as fp8.cpp's pad_fp8)."""
    return torch.nn.functional.pad(t.view(torch.uint8), (0, cols - t.shape[1], 0, rows - t.shape[0])).view(t.dtype)


def _scaled_gemm(a, b, rowwise, out_dtype):
    """(A · Bᵀ) / (s_a ⊗ s_b) of quantized operands a = (A [R_a, C], s_a), b = (B [R_b, C], s_b) composed as
    fp8_linear composes it: torch._scaled_mm with the reciprocal scales, bfloat16 for rowwise (float32 for a float64
    out_dtype), on CUDA C and R_b zero-padded to multiples of 16 and the padding's columns dropped."""
    (A, sa), (B, sb) = a, b
    Ra, Rb, C = A.shape[0], B.shape[0], A.shape[1]
    if Ra == 0 or Rb == 0 or C == 0:
        return torch.zeros(Ra, Rb, dtype=out_dtype, device=A.device)
    ia, ib = sa.reciprocal(), sb.reciprocal()
    Rb_pad = Rb
    if A.is_cuda:
        C_pad, Rb_pad = -(-C // 16) * 16, -(-Rb // 16) * 16
        A, B = _pad_fp8(A, Ra, C_pad), _pad_fp8(B, Rb_pad, C_pad)
        if rowwise:
            ib = torch.nn.functional.pad(ib, (0, Rb_pad - Rb), value=1.0)
    ia, ib = (ia.view(Ra, 1), ib.view(1, Rb_pad)) if rowwise else (ia.reshape(()), ib.reshape(()))
    gemm_dtype = torch.bfloat16 if rowwise else (torch.float32 if out_dtype == torch.float64 else out_dtype)
    y = torch._scaled_mm(A, B.t(), ia, ib, out_dtype=gemm_dtype, use_fast_accum=False)
    return y[:, :Rb].to(out_dtype)


def _check_grads_against_composition(x, w, g, granularity, grad_dtype):
    """fp8_linear's input and weight gradients (those x and w require) equal bit for bit the GEMMs of
    quantize_fp8 of dY, of transposed copies of W, dY and x, composed by _scaled_gemm."""
    rowwise, e4 = granularity == "rowwise", torch.float8_e4m3fn
    gdt = grad_dtype or (e4 if rowwise else torch.float8_e5m2)
    M, K, N = x.shape[:-1].numel(), w.shape[1], w.shape[0]
    G, X = g.reshape(M, N), x.detach().reshape(M, K)
    ref_x = _scaled_gemm(_quantized(G, gdt, granularity), _quantized(w.detach().t(), e4, granularity), rowwise,
                         x.dtype).view(x.shape)
    ref_w = _scaled_gemm(_quantized(G.t(), gdt, granularity), _quantized(X.t(), e4, granularity), rowwise, w.dtype)
    opforge.fp8_linear(x, w, granularity=granularity, grad_dtype=grad_dtype).backward(g)
    if x.requires_grad:
        assert x.grad.dtype == x.dtype and torch.equal(_bits(x.grad), _bits(ref_x))
    if w.requires_grad:
        assert w.grad.dtype == w.dtype and torch.equal(_bits(w.grad), _bits(ref_w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("grad_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("x_shape, N", [((1, 33), 17), ((17, 1), 33), ((17, 33), 1), ((130, 257), 17),
                                        ((256, 80), 144), ((2, 65, 40), 24), ((0, 16), 8), ((4, 0), 8)])
def test_fp8_linear_backward_equals_transposed_copies(device, granularity, grad_dtype, dtype, x_shape, N):
    torch.manual_seed(0)
    x = (torch.randn(x_shape, dtype=torch.float64) * 3).to(dtype=dtype, device=device).requires_grad_()
    w = torch.randn(N, x_shape[-1], dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_()
    g = torch.randn(*x_shape[:-1], N, dtype=torch.float64).to(dtype=dtype, device=device)
    _check_grads_against_composition(x, w, g, granularity, grad_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_backward_special_values(device, granularity, dtype):
    # a NaN, an inf and an all-zero column in each of x, dY and W (the columns the backward's transposes quantize
    # as rows), and a NaN and an inf in a row of each
    torch.manual_seed(0)
    x = torch.randn(40, 24, dtype=dtype)
    w = torch.randn(16, 24, dtype=dtype)
    g = torch.randn(40, 16, dtype=dtype)
    for t in (x, w, g):
        t[3, 2], t[5, 4], t[:, 6], t[7, 9], t[7, 11] = float("nan"), -float("inf"), 0, float("nan"), float("inf")
    x, w, g = x.to(device).requires_grad_(), w.to(device).requires_grad_(), g.to(device)
    for grad_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x.grad = w.grad = None
        _check_grads_against_composition(x, w, g, granularity, grad_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_fp8_linear_backward_one_gradient(device, granularity, needs):
    # only dX (dY quantized along its rows) or only dW (along its columns), the weight given as a transposed view
    torch.manual_seed(0)
    x = torch.randn(96, 48, device=device).requires_grad_(needs[0])
    w = torch.randn(48, 32, device=device).t().requires_grad_(needs[1])
    g = torch.randn(96, 32, device=device)
    _check_grads_against_composition(x, w, g, granularity, None)
    if needs[1]:
        w2 = w.detach().contiguous().requires_grad_()
        opforge.fp8_linear(x.detach(), w2, granularity=granularity).backward(g)
        assert torch.equal(w2.grad, w.grad)
