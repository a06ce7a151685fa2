"""fake_quant_linear, its backward and fake_quantize_weight: bit-identity with torch.fake_quantize_*, values and
straight-through gradients against float64, group sizes, rounding, zero/tiny groups, NaN and infinite weights,
opcheck, compile, torch.func, FakeQuantLinear (its argument checks and its torchao-layout convert()), errors."""
import math

import pytest
import torch

import opforge
from opforge.testing import (
    assert_matches_reference,
    fake_quant_linear_reference,
    fake_quantize_per_token_reference,
    fake_quantize_weight_reference,
    gemm_error_bound,
    linear_leaves,
)

from conftest import FLOAT_DTYPES

GROUPINGS = [-1, 0, 32, 8]  # per channel, per tensor, two group sizes
fwd_op = torch.ops.opforge._fake_quant_linear_forward


def _equal_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point():  # bit patterns (−0 vs 0 and NaN payloads count)
        a = a.view(torch.int16 if a.element_size() == 2 else torch.int32 if a.element_size() == 4 else torch.int64)
        b = b.view(a.dtype)
    assert torch.equal(a, b), f"{what}: not bit-identical ({(a != b).sum().item()} elements differ)"


# ---- the quantization itself: bit-identical to torch.fake_quantize_* ----------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("group_size", GROUPINGS)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_weight_quantization_is_torchs_bit_for_bit(device, dtype, group_size, symmetric, bits):
    w = (torch.randn(24, 64, device=device) * torch.logspace(-3, 1, 64, device=device)).to(dtype)
    w[3] = 0  # an all-zero row
    w[5] = w[5].abs()  # a row without negative values (asymmetric zero point at qmin)
    out, mask, scale, zp = opforge.fake_quantize_weight(w, bits, group_size, symmetric)
    r_out, r_mask, r_scale, r_zp = fake_quantize_weight_reference(w.cpu(), bits, group_size, symmetric)
    _equal_bits(scale, r_scale, "scale")
    _equal_bits(zp, r_zp, "zero_point")
    _equal_bits(out, r_out, "fq weight")
    _equal_bits(mask, r_mask, "mask")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("K", [1, 7, 64, 769])
def test_per_token_activation_quantization_is_torchs_bit_for_bit(device, dtype, K):
    x = (torch.randn(2, 5, K, device=device) * 3 + 0.5).to(dtype)
    x[0, 1] = 0
    w = torch.randn(3, K, device=device, dtype=dtype)
    _, _, _, xq, xm = fwd_op(x, w, None, weight_bits=4, group_size=-1, symmetric=True, act_quant=True)
    r_xq, r_xm = fake_quantize_per_token_reference(x.cpu())
    _equal_bits(xq, r_xq, "fq input")
    _equal_bits(xm, r_xm, "input mask")


@pytest.mark.parametrize("symmetric", [True, False])
def test_float64_per_tensor_is_the_per_channel_kernel_not_the_per_tensor_one(device, symmetric):
    """float64 weights with one scale (group_size=0): opforge's values are those of
    torch.fake_quantize_per_channel_affine with one channel (the product in float64, as for every other grouping);
    torch.fake_quantize_per_tensor_affine rounds a float64 result to float32, so it equals opforge's values rounded
    to float32 and differs from them by less than one float32 ulp."""
    torch.manual_seed(0)  # a scale with more than 20 significant bits: many products (q − zp) · scale are inexact in float32
    w = torch.randn(32, 64, dtype=torch.float64)
    out, mask, scale, zp = opforge.fake_quantize_weight(w.to(device), 4, 0, symmetric)
    out, scale, zp = out.cpu(), scale.cpu(), zp.cpu()
    per_channel = torch.fake_quantize_per_channel_affine(w.reshape(1, -1), scale.reshape(1), zp.reshape(1), 0, -8, 7)
    _equal_bits(out, per_channel.reshape(w.shape), "float64 per tensor vs the per-channel kernel")
    per_tensor = torch.fake_quantize_per_tensor_affine(w, scale.item(), int(zp.item()), -8, 7)
    _equal_bits(out.float().double(), per_tensor, "float64 per tensor rounded to float32 vs the per-tensor kernel")
    differ = out != per_tensor
    assert differ.any(), "no element where the two torch kernels differ: the case pins nothing"
    ulp = torch.finfo(torch.float32).eps * per_tensor.abs().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((out - per_tensor).abs() < ulp).all()


# ---- group sizes, rounding, zero and tiny groups ----------------------------------------------------------------

def _blocked_weight(device):
    torch.manual_seed(11)
    w = torch.randn(16, 256, device=device)
    for g in range(8):  # 32-column blocks scaled by 10^((g mod 4) − 2)
        w[:, 32 * g:32 * (g + 1)] *= 10.0 ** ((g % 4) - 2)
    return w


def test_group_size_is_honoured(device):
    w = _blocked_weight(device)
    x = torch.randn(5, 256, device=device)
    results = {}
    for gs in [32, 64, 128, 256, -1, 0]:
        y = opforge.fake_quant_linear(x, w, weight_bits=4, group_size=gs, symmetric=True)
        ref = fake_quant_linear_reference(x.cpu(), w.cpu(), weight_bits=4, group_size=gs, symmetric=True)
        wq = fake_quantize_weight_reference(w.cpu(), 4, gs, True)[0]
        assert_matches_reference(y.cpu(), ref, torch.nn.functional.linear(x.cpu(), wq),
                                 bound=gemm_error_bound(x.cpu(), wq, torch.float32))
        results[gs] = opforge.fake_quantize_weight(w, 4, gs, True)[0]
    # 32, 64, 128, 256 (= per channel here: K is 256) and per tensor: five different quantizations
    distinct = [32, 64, 128, 256, 0]
    for i, a in enumerate(distinct):
        for b in distinct[i + 1:]:
            assert not torch.equal(results[a], results[b]), f"group sizes {a} and {b} gave the same weight"
    assert torch.equal(results[256], results[-1])
    small = results[32][:, 0:32]  # the ×0.01 block keeps its own scale at group 32 ...
    assert (small != 0).any()
    assert (results[-1][:, 0:32] == 0).all()  # ... and vanishes per channel
    with pytest.raises(ValueError, match=r"opforge::fake_quant_linear: expected group_size to divide in_features 256"
                                         r".*but got 48"):
        opforge.fake_quant_linear(x, w, group_size=48)


def _weight_with_scale(target, x, device):
    """A weight row [x, a, 0...] whose int4/int8 symmetric per-tensor scale is exactly `target` (fp32)."""
    s = torch.tensor(target, dtype=torch.float32)
    for bits in (4, 8, 3, 5, 6, 7):
        half = (2 ** bits - 1) / 2
        a = (s * half).reshape(1)
        for _ in range(64):
            if (a / half).item() == s.item() and a.item() > abs(x):
                w = torch.zeros(1, 8)
                w[0, 0], w[0, 1] = x, a.item()
                return w.to(device), bits
            a = torch.nextafter(a, torch.tensor([float("inf")]))
    raise AssertionError("no weight with that scale found")


def test_rounding_multiplies_by_the_float32_reciprocal(device):
    x = torch.tensor(2.119995355606079, dtype=torch.float32).item()
    s = 0.32615312933921814
    torch_value = torch.fake_quantize_per_tensor_affine(torch.tensor([x]), s, 0, -8, 7)
    assert torch_value.item() == pytest.approx(2.283072, abs=1e-6)  # x · (1/s) rounds to 7 (x / s to 6)
    w, bits = _weight_with_scale(s, x, device)
    for gs in (0, -1, 8):
        out, _, scale, _ = opforge.fake_quantize_weight(w, bits, gs, True)
        assert scale.flatten()[0].item() == torch.tensor(s, dtype=torch.float32).item()
        _equal_bits(out[0, :1].cpu(), torch.fake_quantize_per_tensor_affine(torch.tensor([x]), s, 0, -(2 ** (bits - 1)),
                                                                              2 ** (bits - 1) - 1), "x")
        assert out[0, 0].item() == pytest.approx(2.283072, abs=1e-6)


def test_ties_round_half_to_even(device):
    ties = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5]
    w = torch.tensor([ties + [127.5, 0.0]], device=device)  # int8 symmetric: scale = 127.5 / 127.5 = 1
    out, mask, scale, _ = opforge.fake_quantize_weight(w, 8, -1, True)
    assert scale.item() == 1.0
    assert out[0, :6].tolist() == [0.0, 2.0, 2.0, 0.0, -2.0, -2.0]
    assert out[0, 6].item() == 127.0 and not mask[0, 6]  # 127.5 rounds to 128: clamped, no gradient
    torch.testing.assert_close(out.cpu(), torch.fake_quantize_per_channel_affine(
        w.cpu(), torch.ones(1), torch.zeros(1, dtype=torch.int32), 0, -128, 127), rtol=0, atol=0)


def test_bfloat16_weight_is_upcast_before_quantizing(device):
    w = (torch.randn(8, 64, device=device) * 3).bfloat16()
    out = opforge.fake_quantize_weight(w, 4, 32, True)[0]
    w32 = w.float()
    _, _, scale, zp = opforge.fake_quantize_weight(w32, 4, 32, True)
    expected = torch.fake_quantize_per_channel_affine(w32.cpu().reshape(-1, 32), scale.cpu().flatten(),
                                                      zp.cpu().flatten(), 0, -8, 7).reshape(8, 64).bfloat16()
    _equal_bits(out, expected, "bf16 weight")


@pytest.mark.parametrize("value", [0.0, 1e-30, torch.finfo(torch.float32).tiny, -torch.finfo(torch.float32).tiny])
@pytest.mark.parametrize("symmetric", [True, False])
def test_zero_and_tiny_groups_stay_finite(device, value, symmetric):
    w = torch.randn(4, 64, device=device)
    w[1] = value  # a whole row (every group of it) of zeros or tiny values
    w[2, :32] = value
    w.requires_grad_()
    x = torch.randn(3, 64, device=device)
    x[1] = value  # a token of zeros or tiny values
    x.requires_grad_()
    b = torch.randn(4, device=device, requires_grad=True)
    for gs in (-1, 0, 32):
        y = opforge.fake_quant_linear(x, w, b, group_size=gs, symmetric=symmetric, act_quant=True)
        assert torch.isfinite(y).all()
        gx, gw, gb = torch.autograd.grad(y.square().sum(), (x, w, b))
        assert torch.isfinite(gx).all() and torch.isfinite(gw).all() and torch.isfinite(gb).all()
        out, _, scale, _ = opforge.fake_quantize_weight(w.detach(), 4, gs, symmetric)
        assert torch.isfinite(out).all() and (scale > 0).all()


# ---- the linear: values and straight-through gradients --------------------------------------------------------

def _ste_reference_grads(x, w, b, dy, kw):
    """float64 gradients of the straight-through estimator, and PyTorch's same math in x's dtype (the baseline)."""
    wq, wm = fake_quantize_weight_reference(w.detach().cpu(), kw["weight_bits"], kw["group_size"], kw["symmetric"])[:2]
    wq = wq.to(x.dtype)
    if kw["act_quant"]:
        xq, xm = fake_quantize_per_token_reference(x.detach().cpu())
    else:
        xq, xm = x.detach().cpu(), torch.ones(x.shape, dtype=torch.bool)
    dy = dy.cpu()
    K, N = w.shape[1], w.shape[0]
    d2, x2, m2 = dy.reshape(-1, N), xq.reshape(-1, K), xm.reshape(-1, K)
    ref = {"grad_input": ((d2.double() @ wq.double()) * m2).reshape(x.shape),
           "grad_weight": (d2.double().t() @ x2.double()) * wm,
           "grad_bias": d2.double().sum(0)}
    base = {"grad_input": ((d2 @ wq) * m2).reshape(x.shape).to(x.dtype),
            "grad_weight": ((d2.t() @ x2) * wm).to(w.dtype),
            "grad_bias": d2.sum(0).to(b.dtype)}
    bounds = {"grad_input": gemm_error_bound(d2, wq.t(), x.dtype).reshape(x.shape),
              "grad_weight": gemm_error_bound(d2.t(), x2.t(), x.dtype), "grad_bias": None}
    return ref, base, bounds


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kw", [
    dict(weight_bits=4, group_size=32, symmetric=True, act_quant=True),   # 8da4w
    dict(weight_bits=4, group_size=-1, symmetric=False, act_quant=False),
    dict(weight_bits=8, group_size=0, symmetric=True, act_quant=True),
    dict(weight_bits=3, group_size=16, symmetric=False, act_quant=False),
])
def test_forward_and_gradients_match_float64(device, dtype, kw):
    x = torch.randn(3, 7, 64, device=device).to(dtype).requires_grad_()
    w = (torch.randn(40, 64, device=device) * 0.2).to(dtype).requires_grad_()
    b = torch.randn(40, device=device).to(dtype).requires_grad_()
    y = opforge.fake_quant_linear(x, w, b, **kw)
    ref = fake_quant_linear_reference(x.cpu(), w.cpu(), b.cpu(), **kw)
    wq = fake_quantize_weight_reference(w.detach().cpu(), kw["weight_bits"], kw["group_size"], kw["symmetric"])[0]
    xq = fake_quantize_per_token_reference(x.cpu())[0] if kw["act_quant"] else x.detach().cpu()
    base = torch.nn.functional.linear(xq, wq.to(dtype), b.detach().cpu())
    assert_matches_reference(y.cpu(), ref, base, bound=gemm_error_bound(xq, wq, dtype))
    dy = torch.randn(y.shape, device=device).to(dtype)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    ref_g, base_g, bounds = _ste_reference_grads(x, w, b, dy, kw)
    for name, got in (("grad_input", gx), ("grad_weight", gw), ("grad_bias", gb)):
        assert_matches_reference(got.cpu(), ref_g[name], base_g[name], what=name, bound=bounds[name])
    # the mask matters: clamped weights get exactly zero gradient (a group whose largest magnitude is positive
    # clamps it: (qmax − qmin) / 2 rounds up to qmax + 1)
    wm = fake_quantize_weight_reference(w.detach().cpu(), kw["weight_bits"], kw["group_size"], kw["symmetric"])[1]
    assert (gw.cpu()[~wm] == 0).all()
    if kw["symmetric"] and kw["group_size"] != 0:
        assert (~wm).any()


def test_mixed_dtypes_and_meta(device):
    x = torch.randn(4, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 32, device=device, requires_grad=True)  # float32 master weight
    b = torch.randn(16, device=device, dtype=torch.float64, requires_grad=True)
    y = opforge.fake_quant_linear(x, w, b, group_size=8, act_quant=True)
    assert y.dtype == torch.bfloat16
    gx, gw, gb = torch.autograd.grad(y.sum(), (x, w, b))
    assert (gx.dtype, gw.dtype, gb.dtype) == (torch.bfloat16, torch.float32, torch.float64)
    # the weight is quantized in float32, then converted: not the same as quantizing its bf16 rounding
    wq = fake_quantize_weight_reference(w.detach().cpu(), 4, 8, True)[0].bfloat16()
    _, wq_op, _, _, _ = fwd_op(x, w, b, weight_bits=4, group_size=8, symmetric=True, act_quant=True)
    _equal_bits(wq_op, wq, "fq weight (float32 weight, bf16 input)")
    meta = opforge.fake_quant_linear(x.to("meta"), w.to("meta"), b.to("meta"), group_size=8, act_quant=True)
    assert meta.shape == y.shape and meta.dtype == y.dtype


def test_autocast_quantizes_the_float32_weight(device):
    x = torch.randn(4, 64, device=device)
    w = torch.randn(8, 64, device=device)
    dt = torch.bfloat16
    with torch.autocast(device_type=device, dtype=dt):
        y = opforge.fake_quant_linear(x, w, group_size=32, act_quant=True)
    assert y.dtype == dt
    _equal_bits(y, opforge.fake_quant_linear(x.to(dt), w, group_size=32, act_quant=True), "autocast")


def test_zero_size(device):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    w = torch.randn(4, 16, device=device, requires_grad=True)
    y = opforge.fake_quant_linear(x, w, act_quant=True, group_size=8)
    assert y.shape == (0, 4)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    out, mask, scale, zp = opforge.fake_quantize_weight(torch.randn(0, 16, device=device), 4, 0)
    assert out.shape == (0, 16) and scale.shape == (1, 1)
    assert opforge.fake_quantize_weight(torch.randn(3, 0, device=device), 4, 8)[2].shape == (3, 0)


def test_only_requested_gradients(device):
    x = torch.randn(5, 16, device=device, requires_grad=True)
    w = torch.randn(4, 16, device=device)
    y = opforge.fake_quant_linear(x, w, act_quant=True)
    (gx,) = torch.autograd.grad(y.sum(), (x,))
    assert gx.shape == x.shape
    _, wq, wm, xq, xm = fwd_op(x.detach(), w, None, weight_bits=4, group_size=-1, symmetric=True, act_quant=True)
    dy = torch.ones(5, 4, device=device)
    gi, gw, gb = torch.ops.opforge.fake_quant_linear_backward(dy, xq, wq, wm, xm, [False, True, False])
    assert gi is None and gb is None and gw.shape == w.shape


def test_double_backward_is_a_clear_error(device):
    x = torch.randn(3, 8, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 8, device=device, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(opforge.fake_quant_linear(x, w).sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        gx.sum().backward()


def test_opcheck(device):
    x, w, b = linear_leaves(6, 32, 5, device)
    kw = dict(weight_bits=4, group_size=8, symmetric=False, act_quant=True)
    torch.library.opcheck(torch.ops.opforge.fake_quant_linear, (x, w, b), kw)
    torch.library.opcheck(fwd_op, (x, w, b), kw)
    _, wq, wm, xq, xm = fwd_op(x.detach(), w.detach(), b.detach(), **kw)
    dy = torch.randn(6, 5, device=device)
    torch.library.opcheck(torch.ops.opforge.fake_quant_linear_backward,
                          (dy, xq, wq, wm, xm, [True, True, True], torch.float32, torch.float32))
    torch.library.opcheck(torch.ops.opforge.fake_quantize_weight, (w.detach(), 4, 8, True))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(device, dynamic):
    x, w, b = linear_leaves(8, 32, 6, device)

    def f(x, w, b):
        return opforge.fake_quant_linear(x, w, b, group_size=16, act_quant=True).square().sum()

    out = torch.compile(f, fullgraph=True, dynamic=dynamic)(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b))
    ref = f(x, w, b)
    ref_grads = torch.autograd.grad(ref, (x, w, b))
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_torch_func_grad(device):
    x = torch.randn(4, 16, device=device)
    w = torch.randn(3, 16, device=device)
    gw = torch.func.grad(lambda w: opforge.fake_quant_linear(x, w, group_size=8, act_quant=True).sum())(w)
    w2 = w.clone().requires_grad_()
    opforge.fake_quant_linear(x, w2, group_size=8, act_quant=True).sum().backward()
    torch.testing.assert_close(gw, w2.grad, rtol=0, atol=0)


def test_gradcheck_float64(device):
    # the STE gradient is the derivative of y = fq_a(x) · fq_w(w)ᵀ + b with the quantizers held fixed: checked
    # with respect to the bias exactly, and the input/weight gradients against the formula above
    x = torch.randn(3, 8, device=device, dtype=torch.float64)
    w = torch.randn(4, 8, device=device, dtype=torch.float64)
    b = torch.randn(4, device=device, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda b: opforge.fake_quant_linear(x, w, b, group_size=4, act_quant=True), (b,))


# ---- errors ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, kw, exc, match", [
    ((torch.randn(2, 8), torch.randn(3, 8)), dict(weight_bits=1), ValueError,
     r"opforge::fake_quant_linear: expected weight_bits in \[2, 8\], but got 1"),
    ((torch.randn(2, 8), torch.randn(3, 8)), dict(weight_bits=9), ValueError, r"expected weight_bits in \[2, 8\], but got 9"),
    ((torch.randn(2, 8), torch.randn(3, 8)), dict(group_size=3), ValueError,
     r"expected group_size to divide in_features 8 .*but got 3"),
    ((torch.randn(2, 8), torch.randn(3, 8)), dict(group_size=-2), ValueError, r"expected group_size to be -1 .*but got -2"),
    ((torch.randn(2, 8), torch.randn(3, 7)), {}, ValueError, r"expected input's last dimension to equal weight's in_features 7"),
    ((torch.randn(2, 8), torch.randn(3, 8, 1)), {}, ValueError, r"expected weight to be 2-D"),
    ((torch.ones(2, 8, dtype=torch.int32), torch.randn(3, 8)), {}, TypeError, r"expected input to have a floating dtype"),
    ((torch.randn(2, 8), torch.randn(3, 8), torch.randn(4)), {}, ValueError, r"expected bias of shape \[3\]"),
])
def test_bad_inputs_raise_clear_errors(args, kw, exc, match):
    with pytest.raises(exc, match=match):
        opforge.fake_quant_linear(*args, **kw)


def test_fake_quantize_weight_errors():
    with pytest.raises(ValueError, match=r"opforge::fake_quantize_weight: expected weight to be 2-D"):
        opforge.fake_quantize_weight(torch.randn(8))
    with pytest.raises(ValueError, match=r"opforge::fake_quantize_weight: expected group_size to divide in_features 8"):
        opforge.fake_quantize_weight(torch.randn(2, 8), 4, 5)
    with pytest.raises(TypeError, match=r"expected weight to have a floating dtype"):
        opforge.fake_quantize_weight(torch.ones(2, 8, dtype=torch.int64))


# ---- CPU and CUDA give the same bits ----------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape, group_size", [((64, 4096), 32), ((33, 768), -1), ((7, 12), 4), ((5, 4100), -1),
                                               ((40, 256), 0), ((3, 8200), 8200), ((16, 96), 48)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_cpu_and_cuda_bit_identical(dtype, shape, group_size, symmetric):
    w = (torch.randn(shape) * torch.logspace(-3, 1, shape[1])).to(dtype)
    for a, b, name in zip(opforge.fake_quantize_weight(w, 4, group_size, symmetric),
                          opforge.fake_quantize_weight(w.cuda(), 4, group_size, symmetric),
                          ("output", "mask", "scale", "zero_point")):
        _equal_bits(a, b.cpu(), name)
    x = torch.randn(shape[0], shape[1]).to(dtype)
    wc = torch.randn(3, shape[1]).to(dtype)
    cpu = fwd_op(x, wc, None, weight_bits=4, group_size=-1, symmetric=True, act_quant=True)
    gpu = fwd_op(x.cuda(), wc.cuda(), None, weight_bits=4, group_size=-1, symmetric=True, act_quant=True)
    for i in (1, 2, 3, 4):
        _equal_bits(cpu[i], gpu[i].cpu(), f"forward output {i}")
    # an unaligned (sliced) weight takes the scalar path: same bits
    buf = torch.randn(shape[0] * shape[1] + 1).to(dtype)
    wu = buf[1:].view(shape)
    _equal_bits(opforge.fake_quantize_weight(wu, 4, group_size, symmetric)[0],
                opforge.fake_quantize_weight(buf.cuda()[1:].view(shape), 4, group_size, symmetric)[0].cpu(), "unaligned")


# ---- the module ------------------------------------------------------------------------------------------------

def test_fake_quant_linear_module_and_torchao_layout(device):
    lin = torch.nn.Linear(64, 24).to(device)
    m = opforge.nn.FakeQuantLinear.from_linear(lin, weight_bits=4, group_size=32, act_quant=True)
    assert m.weight is lin.weight and m.bias is lin.bias
    x = torch.randn(5, 64, device=device)
    torch.testing.assert_close(m(x), opforge.fake_quant_linear(x, lin.weight, lin.bias, weight_bits=4, group_size=32,
                                                               act_quant=True), rtol=0, atol=0)
    m.weight.data[0, 0] = 10.0  # a clamped value
    for gs, sym in ((32, True), (-1, False), (0, True)):
        m.group_size, m.symmetric = gs, sym
        c = m.convert()
        ng = {32: 2, -1: 1, 0: 1}[gs]
        assert c["weight"].dtype == torch.int8 and c["weight"].shape == (24, 64)
        assert c["scales"].dtype == torch.float32 and c["scales"].shape == ((1, 1) if gs == 0 else (24, ng))
        assert c["zeros"].shape == c["scales"].shape and c["zeros"].dtype == torch.float32
        assert int(c["weight"].min()) >= -8 and int(c["weight"].max()) <= 7
        cols = 64 if gs in (-1, 0) else gs
        s = c["scales"].expand(24, 64) if gs == 0 else c["scales"].repeat_interleave(cols, 1)
        z = c["zeros"].expand(24, 64) if gs == 0 else c["zeros"].repeat_interleave(cols, 1)
        deq = (c["weight"].float() - z) * s
        _equal_bits(deq, opforge.fake_quantize_weight(m.weight.detach(), 4, gs, sym)[0], "dequantized convert()")
        if sym:
            assert (c["zeros"] == 0).all()
    assert "group_size=0" in repr(m)


@pytest.mark.parametrize("kw", [dict(weight_bits=1), dict(weight_bits=9), dict(group_size=-3), dict(group_size=-2),
                                dict(group_size=48)])
def test_fake_quant_linear_module_checks_its_settings_at_construction(kw):
    """weight_bits outside [2, 8], group_size < -1 and a group_size not dividing in_features raise at construction
    (and in from_linear), with the words of the op's own check after the module's name."""
    x, w = torch.randn(2, 64), torch.randn(4, 64)
    with pytest.raises(ValueError) as op_error:
        opforge.fake_quant_linear(x, w, **kw)
    op_words = str(op_error.value).split(": ", 1)[1]
    assert str(op_error.value).startswith("opforge::fake_quant_linear: ")
    with pytest.raises(ValueError) as module_error:
        opforge.nn.FakeQuantLinear(64, 4, **kw)
    assert str(module_error.value) == f"opforge.nn.FakeQuantLinear: {op_words}"
    with pytest.raises(ValueError, match=r"^opforge\.nn\.FakeQuantLinear: expected "):
        opforge.nn.FakeQuantLinear.from_linear(torch.nn.Linear(64, 4), **kw)


def test_fake_quant_linear_module_accepts_every_valid_setting():
    x = torch.randn(3, 64)
    for bits in (2, 8):
        for gs in (-1, 0, 1, 64):
            m = opforge.nn.FakeQuantLinear(64, 4, weight_bits=bits, group_size=gs)
            _equal_bits(m(x), opforge.fake_quant_linear(x, m.weight, m.bias, weight_bits=bits, group_size=gs,
                                                        act_quant=True), f"bits {bits}, group_size {gs}")


# ---- NaN propagates, extreme ranges stay finite ------------------------------------------------------------------

def _nan_group(group_size, shape, at):
    """Bool mask (N, K) of the quantization group containing element `at`."""
    N, K = shape
    g = torch.zeros(shape, dtype=torch.bool)
    if group_size == 0:
        g[:] = True
    elif group_size < 0:
        g[at[0]] = True
    else:
        c0 = at[1] // group_size * group_size
        g[at[0], c0:c0 + group_size] = True
    return g


def _assert_same_where_finite(ours, ref, where, what):
    """ours equals ref bit for bit at `where` (the elements outside the NaN group)."""
    _equal_bits(ours.detach().cpu()[where], ref.detach().cpu()[where], what)


@pytest.mark.parametrize("group_size", [-1, 0, 32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_nan_in_a_group_gives_nan_for_that_group(device, group_size, symmetric, dtype):
    """A NaN weight is not hidden: its group (channel, group of columns, or the whole tensor) has scale NaN,
    zero_point 0, every fake-quantized value NaN and the in-range mask false (torch's PerChannelMinMaxObserver +
    fake_quantize_per_channel_affine give the same); the other groups are exactly as without the NaN."""
    torch.manual_seed(0)
    shape, at = (8, 64), (3, 37)
    clean = torch.randn(shape, dtype=torch.float32).to(dtype)
    w = clean.clone()
    w[at] = float("nan")
    group = _nan_group(group_size, shape, at)
    out, mask, scale, zp = opforge.fake_quantize_weight(w.to(device), 4, group_size, symmetric)
    out, mask, scale, zp = out.cpu(), mask.cpu(), scale.cpu(), zp.cpu()
    assert torch.isnan(out[group]).all() and not mask[group].any()
    assert torch.isnan(scale).sum() == 1  # the one group holding the NaN
    assert (zp[torch.isnan(scale)] == 0).all()
    if group_size != 0:
        ref_out, ref_mask, ref_scale, ref_zp = opforge.fake_quantize_weight(clean.to(device), 4, group_size, symmetric)
        _assert_same_where_finite(out, ref_out, ~group, "output outside the NaN group")
        assert torch.equal(mask[~group], ref_mask.cpu()[~group])
        keep = ~torch.isnan(scale)
        _assert_same_where_finite(scale, ref_scale, keep, "scale of the other groups")
        assert torch.equal(zp[keep], ref_zp.cpu()[keep])
        assert not torch.isnan(out[~group]).any()


@pytest.mark.parametrize("symmetric", [True, False])
def test_nan_weight_reaches_the_output_and_the_input_gradient(device, symmetric):
    """fake_quant_linear with one NaN weight: the output channel of the NaN row is NaN (no silent finite value),
    so is every input gradient that channel feeds (dX = dY · fq_w(W)); the weight gradient of the NaN group is 0
    (its mask is false, as torch's fake_quantize backward), the other rows' gradients are those of the clean
    weight."""
    torch.manual_seed(1)
    x = torch.randn(5, 64, device=device, requires_grad=True)
    clean = torch.randn(6, 64, device=device)
    w = clean.clone()
    w[2, 10] = float("nan")
    w.requires_grad_(True)
    y = opforge.fake_quant_linear(x, w, None, weight_bits=4, group_size=-1, symmetric=symmetric)
    assert torch.isnan(y[:, 2]).all()
    dy = torch.randn_like(y)
    y.backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(True), clean.clone().requires_grad_(True)
    y2 = opforge.fake_quant_linear(x2, w2, None, weight_bits=4, group_size=-1, symmetric=symmetric)
    y2.backward(dy)
    others = [0, 1, 3, 4, 5]
    _equal_bits(y[:, others], y2[:, others], "output channels without NaN")
    assert torch.isnan(x.grad).all()
    assert (w.grad[2] == 0).all()
    _equal_bits(w.grad[others], w2.grad[others], "weight gradient of the rows without NaN")


def test_nan_in_an_input_row_with_act_quant(device):
    """With act_quant a NaN in a token makes that token's row of fq_a(x) NaN (per-token asymmetric int8): the row
    of the output is NaN, the other rows are those of the clean input."""
    torch.manual_seed(2)
    clean = torch.randn(4, 32, device=device)
    x = clean.clone()
    x[1, 7] = float("nan")
    w = torch.randn(8, 32, device=device)
    y = opforge.fake_quant_linear(x, w, None, act_quant=True)
    y2 = opforge.fake_quant_linear(clean, w, None, act_quant=True)
    assert torch.isnan(y[1]).all()
    _equal_bits(y[[0, 2, 3]], y2[[0, 2, 3]], "rows without NaN")


@pytest.mark.parametrize("group_size", [-1, 0, 32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_infinite_weight_gives_nan_for_its_whole_group(device, group_size, symmetric, value, dtype):
    """A group holding ±inf gets scale inf: every fake-quantized value of it is NaN, the infinite entry included
    (torch's observer + fake_quantize give −inf there in a symmetric group: its NaN integer converts to qmin), the
    finite entries keep mask True, the infinite one has mask False; the other groups are torch's bits."""
    torch.manual_seed(7)
    shape, at = (8, 64), (3, 37)
    clean = torch.randn(shape, dtype=torch.float32).to(dtype)
    w = clean.clone()
    w[at] = value
    group = _nan_group(group_size, shape, at)
    out, mask, scale, zp = (t.cpu() for t in opforge.fake_quantize_weight(w.to(device), 4, group_size, symmetric))
    assert torch.isnan(out[group]).all()
    assert not mask[at] and mask[group].sum() == group.sum() - 1
    infinite = torch.isinf(scale)
    assert infinite.sum() == 1 and (scale[infinite] > 0).all() and torch.isfinite(scale[~infinite]).all()
    if symmetric:
        assert (zp == 0).all()
    r_out, r_mask, r_scale, r_zp = fake_quantize_weight_reference(clean, 4, group_size, symmetric)
    _assert_same_where_finite(out, r_out, ~group, "output outside the infinite group")
    assert torch.equal(mask[~group], r_mask[~group])
    _assert_same_where_finite(scale, r_scale, ~infinite, "scale of the other groups")
    assert torch.equal(zp[~infinite], r_zp[~infinite])
    if symmetric:  # the documented difference: torch's fake_quantize turns the infinite entry into qmin · inf
        assert torch.fake_quantize_per_tensor_affine(torch.tensor([0.5, value]), float("inf"), 0, -8, 7)[1] == -math.inf
    y = opforge.fake_quant_linear(torch.randn(2, 64, device=device, dtype=dtype), w.to(device), None,
                                  group_size=group_size, symmetric=symmetric).cpu()
    assert torch.isnan(y[:, at[0]]).all()


def test_float64_weight_beyond_float32_range_gives_nan_for_its_group(device):
    """A float64 weight of 1e39 makes its group's float32 scale inf: the whole group is NaN, its finite entries
    keep mask True."""
    w = torch.randn(4, 16, dtype=torch.float64)
    w[1, 3] = 1e39
    out, mask, scale, _ = (t.cpu() for t in opforge.fake_quantize_weight(w.to(device), 4, -1, True))
    assert torch.isnan(out[1]).all() and torch.isinf(scale[1]).all()
    assert mask[1].all() and not torch.isnan(out[[0, 2, 3]]).any()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [-1, 0, 16])
def test_asymmetric_range_near_float32_max_stays_finite(device, bits, group_size):
    """Weights spanning about ±3e38: hi − lo overflows float32 (torch's MinMaxObserver then gives scale inf and NaN
    outputs); opforge's scale is hi/(qmax − qmin) − lo/(qmax − qmin), so scale, outputs and masks are finite and
    every value is within scale/2 of its input where it is in range."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    torch.manual_seed(3)
    w = torch.empty(4, 32).uniform_(-1, 1) * 3e38
    w[:, 0], w[:, 1] = 3e38, -3e38  # every group (of 16 columns, a row, the tensor) spans the whole range
    w[:, 16], w[:, 17] = 3e38, -3e38
    out, mask, scale, zp = opforge.fake_quantize_weight(w.to(device), bits, group_size, False)
    out, mask, scale, zp = out.cpu(), mask.cpu(), scale.cpu(), zp.cpu()
    assert torch.isfinite(scale).all() and torch.isfinite(out).all(), (scale, out)
    r = float(qmax - qmin)
    hi, lo = torch.tensor(3e38), torch.tensor(-3e38)
    expected = (hi / r) - (lo / r)  # float32 arithmetic, as the kernel
    assert torch.equal(scale, torch.full_like(scale, expected.item()))
    s = scale.reshape(-1, 1).repeat_interleave(w.numel() // scale.numel(), 1).reshape(w.shape) if group_size else scale
    err = (out.double() - w.double()).abs()
    assert (err[mask] <= s.double().expand_as(w)[mask] * (0.5 + 1e-4)).all()
    assert mask.float().mean() > 0.9
    # the same weights shifted to an ordinary range are still torch's bits (the fallback only serves on overflow)
    small = w / 1e36
    for a, b, name in zip(opforge.fake_quantize_weight(small.to(device), bits, group_size, False),
                          fake_quantize_weight_reference(small, bits, group_size, False), ("output", "mask", "scale", "zp")):
        _equal_bits(a.cpu(), b.to(a.dtype), name)


def test_asymmetric_near_float32_max_through_fake_quant_linear(device):
    """The forward and the weight gradient of fake_quant_linear stay finite for ±3e38 weights (asymmetric); the
    output is compared with a float64 product of torch's own cast of those fake-quantized weights."""
    torch.manual_seed(4)
    w = torch.empty(3, 16).uniform_(-1, 1) * 3e38
    w[:, 0], w[:, 1] = 3e38, -3e38
    x = torch.randn(2, 16) * 1e-30  # keeps the products inside float32
    wq = opforge.fake_quantize_weight(w.to(device), 4, -1, False)[0]
    assert torch.isfinite(wq).all()
    wd = w.to(device).requires_grad_(True)
    y = opforge.fake_quant_linear(x.to(device), wd, None, weight_bits=4, group_size=-1, symmetric=False)
    ref = x.double() @ wq.cpu().double().T
    bound = (x.double().abs() @ wq.cpu().double().abs().T) * 1e-3  # float32 (or TF32) products of 16 terms
    assert ((y.detach().cpu().double() - ref).abs() <= bound).all()
    y.sum().backward()
    assert torch.isfinite(wd.grad).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("group_size", [-1, 0, 32, 256])
@pytest.mark.parametrize("symmetric", [True, False])
def test_nan_and_extreme_ranges_cpu_equals_cuda(dtype, group_size, symmetric):
    """With NaN, ±inf and ±3e38 weights the NaN pattern and every non-NaN bit agree between CPU and CUDA (NaN
    payloads may differ: the CPU keeps its operand's, the GPU writes the canonical one); the vectorized, team-of-8,
    warp and block paths all run (group lengths 32, 256, 512 and K 1024)."""
    torch.manual_seed(5)
    w = torch.randn(16, 1024)
    w[3, 100] = float("nan")
    w[7, 0] = float("nan")
    w[11, 600] = float("inf")  # its group's scale is inf and all of it NaN
    w[13, 5] = float("-inf")
    if dtype != torch.float16:
        w[9] = torch.linspace(-3e38, 3e38, 1024)
    w = w.to(dtype)
    for a, b, name in zip(opforge.fake_quantize_weight(w, 4, group_size, symmetric),
                          opforge.fake_quantize_weight(w.cuda(), 4, group_size, symmetric),
                          ("output", "mask", "scale", "zero_point")):
        b = b.cpu()
        if a.is_floating_point():
            assert torch.equal(torch.isnan(a), torch.isnan(b)), name
            keep = ~torch.isnan(a)
            _equal_bits(a[keep], b[keep], name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("act_quant", [False, True])
def test_second_derivative_through_the_quantized_operands_raises(act_quant):
    """d(x.grad)/dW goes through fq_w(W) and d(W.grad)/dx through fq_a(x): neither may come out as a silent zero
    (or torch's 'not used in the graph'); differentiating the first-order gradient again raises naming the op."""
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 64, dtype=torch.float64, requires_grad=True)
    y = opforge.fake_quant_linear(x, w, None, weight_bits=4, group_size=32, act_quant=act_quant)
    gx, gw = torch.autograd.grad(y.sum(), (x, w), create_graph=True)
    for first, other in ((gx, w), (gw, x)):
        with pytest.raises(RuntimeError, match=r"opforge::fake_quant_linear\w*: double backward is not supported"):
            torch.autograd.grad(first.sum(), other)
