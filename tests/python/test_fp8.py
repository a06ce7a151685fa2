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
