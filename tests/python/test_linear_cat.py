"""linear_cat and linear_cat_backward: values and gradients against float64, one rounding, degenerate pieces,
no concatenated buffer saved, mixed dtypes, errors. opcheck, torch.compile, gradcheck and gradgradcheck,
torch.func and autocast: its entry in conformance.py (test_conformance.py)."""
import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, gemm_error_bound, linear_cat_reference, relative_error

from conftest import FLOAT_DTYPES

# (leading dims, piece widths, N)
CASES = [
    ((7,), (5, 11), 13),
    ((3, 4), (16, 0, 9), 8),  # a zero-width piece, batch dims
    ((1,), (33,), 17),        # a single piece, M = 1
    ((83,), (64, 64, 1), 31),
    ((0,), (4, 6), 5),        # zero rows
]


def _make(device, dtype, lead, widths, N, bias=True, requires_grad=True):
    xs = [torch.randn(*lead, k, device=device).to(dtype).requires_grad_(requires_grad) for k in widths]
    w = (torch.randn(N, sum(widths), device=device) / max(1, sum(widths)) ** 0.5).to(dtype).requires_grad_(requires_grad)
    b = torch.randn(N, device=device).to(dtype).requires_grad_(requires_grad) if bias else None
    return xs, w, b


def _torch_grads(xs, w, b, dy):
    xs2 = [x.detach().requires_grad_() for x in xs]
    w2 = w.detach().requires_grad_()
    b2 = b.detach().requires_grad_() if b is not None else None
    TF.linear(torch.cat(xs2, -1), w2, b2).backward(dy)
    return [x.grad for x in xs2], w2.grad, (b2.grad if b2 is not None else None)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("lead, widths, N", CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_float64(device, dtype, lead, widths, N, bias):
    xs, w, b = _make(device, dtype, lead, widths, N, bias)
    y = opforge.linear_cat(xs, w, b)
    ref = linear_cat_reference(xs, w, b)
    base = TF.linear(torch.cat(xs, -1), w, b)
    x_cat = torch.cat([x.detach() for x in xs], -1)
    assert_matches_reference(y, ref, base, bound=gemm_error_bound(x_cat.reshape(-1, x_cat.shape[-1]), w, dtype).reshape(ref.shape) + (b.detach().double().abs() * torch.finfo(dtype).eps if b is not None else 0))
    dy = torch.randn_like(y)
    y.backward(dy)
    xs64 = [x.detach().double().requires_grad_() for x in xs]
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    linear_cat_reference(xs64, w64, b64).backward(dy.double())
    gx, gw, gb = _torch_grads(xs, w, b, dy)
    for i, x in enumerate(xs):
        assert x.grad.shape == x.shape and x.grad.dtype == dtype
        assert_matches_reference(x.grad, xs64[i].grad, gx[i], what=f"grad_inputs[{i}]", factor=3.0)
    assert_matches_reference(w.grad, w64.grad, gw, what="grad_weight", factor=3.0)
    if b is not None:
        assert_matches_reference(b.grad, b64.grad, gb, what="grad_bias", factor=3.0)


@pytest.mark.parametrize("widths", [(2048, 2048), (1000, 24, 3072)])
def test_one_rounding_bfloat16(device, widths):
    """The pieces' products are summed in fp32, rounded once: error ≤ 1.2× one GEMM's error."""
    torch.manual_seed(0)
    M, N = 512, 1024
    xs = [torch.randn(M, k, device=device).bfloat16() for k in widths]
    w = (torch.randn(N, sum(widths), device=device) / sum(widths) ** 0.5).bfloat16()
    b = torch.randn(N, device=device).bfloat16()
    ref = linear_cat_reference(xs, w, b)
    single = TF.linear(torch.cat(xs, -1), w, b)
    ours = opforge.linear_cat(xs, w, b)
    e_single, e_ours = relative_error(single, ref), relative_error(ours, ref)
    assert e_ours <= 1.2 * e_single, f"linear_cat error {e_ours:.3e} > 1.2 x single GEMM's {e_single:.3e}"
    # what this guards against: each piece rounded to bf16 and then summed
    k0, pieces = 0, []
    for x in xs:
        pieces.append(TF.linear(x, w[:, k0:k0 + x.shape[1]]))
        k0 += x.shape[1]
    rounded_sum = sum(pieces[1:], pieces[0]) + b
    assert relative_error(rounded_sum, ref) > e_ours


def test_concatenated_buffer_is_not_saved(device):
    xs = [torch.randn(6, k, device=device, requires_grad=True) for k in (4, 5)]
    w = torch.randn(3, 9, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = opforge.linear_cat(xs, w)
    assert (6, 9) not in saved and sorted(saved) == sorted([(6, 4), (6, 5), (3, 9)])
    y.sum().backward()
    assert all(x.grad is not None for x in xs)


def test_only_requested_gradients(device):
    x1 = torch.randn(4, 3, device=device, requires_grad=True)
    x2 = torch.randn(4, 5, device=device)
    w = torch.randn(2, 8, device=device)
    opforge.linear_cat([x1, x2], w).sum().backward()
    assert x1.grad is not None and x2.grad is None and w.grad is None
    torch.testing.assert_close(x1.grad, torch.ones(4, 2, device=device) @ w[:, :3])


def test_weight_gradient_slices(device):
    """dW[:, k_i : k_i + K_i] = dYᵀ · X_i, each slice its own piece."""
    xs = [torch.randn(5, k, device=device, dtype=torch.float64) for k in (3, 0, 4)]
    w = torch.randn(6, 7, device=device, dtype=torch.float64)
    dy = torch.randn(5, 6, device=device, dtype=torch.float64)
    gi, gw, gb = torch.ops.opforge.linear_cat_backward(dy, xs, w, [True, True, True], torch.float32)
    torch.testing.assert_close(gw[:, :3], dy.t() @ xs[0])
    torch.testing.assert_close(gw[:, 3:], dy.t() @ xs[2])
    assert gi[1].shape == (5, 0) and gb.dtype == torch.float32
    gi, gw, gb = torch.ops.opforge.linear_cat_backward(dy, xs, w, [False, True, False])
    assert gi == [] and gb is None


def test_mixed_dtypes_and_meta(device):
    xs = [torch.randn(4, k, device=device, dtype=torch.bfloat16, requires_grad=True) for k in (3, 5)]
    w = torch.randn(6, 8, device=device, dtype=torch.float32, requires_grad=True)
    b = torch.randn(6, device=device, dtype=torch.float32, requires_grad=True)
    y = opforge.linear_cat(xs, w, b)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    assert xs[0].grad.dtype == torch.bfloat16
    ym = opforge.linear_cat([x.detach().to("meta") for x in xs], w.detach().to("meta"), b.detach().to("meta"))
    assert ym.shape == y.shape and ym.dtype == y.dtype and ym.stride() == y.stride()


def test_non_contiguous_pieces(device):
    base = torch.randn(10, 12, device=device)
    xs = [base[:, ::2], base.t()[:6, :10].t(), torch.randn(10, 3, device=device)]
    w = torch.randn(4, 6 + 6 + 3, device=device)
    y = opforge.linear_cat(xs, w)
    torch.testing.assert_close(y, TF.linear(torch.cat(xs, -1), w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: ([], torch.randn(2, 3), None), ValueError, r"opforge::linear_cat: expected a non-empty list of inputs"),
        (lambda: ([torch.randn(2, 3), torch.randn(3, 2)], torch.randn(4, 5), None), ValueError,
         r"opforge::linear_cat: expected every input to have inputs\[0\]'s leading dims \[2\], but got inputs\[1\] of shape \[3, 2\]"),
        (lambda: ([torch.randn(2, 3), torch.randn(2, 2)], torch.randn(4, 6), None), ValueError,
         r"opforge::linear_cat: expected the inputs' last dims to sum to weight's in_features 6, but got 5"),
        (lambda: ([torch.randn(2, 3)], torch.randn(4, 3), torch.randn(5)), ValueError,
         r"opforge::linear_cat: expected bias of shape \[4\]"),
        (lambda: ([torch.randn(2, 3), torch.randn(2, 2).double()], torch.randn(4, 5), None), TypeError,
         r"opforge::linear_cat: expected every input to have inputs\[0\]'s dtype Float, but got Double for inputs\[1\]"),
        (lambda: ([torch.ones(2, 3, dtype=torch.int64)], torch.randn(4, 3), None), TypeError,
         r"opforge::linear_cat: expected inputs\[0\] to have a floating dtype"),
        (lambda: ([torch.randn(2, 3)], torch.randn(4, 3, 1), None), ValueError,
         r"opforge::linear_cat: expected weight to be 2-D"),
        (lambda: ([torch.tensor(1.0)], torch.randn(4, 1), None), ValueError,
         r"opforge::linear_cat: expected inputs\[0\] to have at least 1 dimension"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, exc, match):
    xs, w, b = make()
    with pytest.raises(exc, match=match):
        opforge.linear_cat(xs, w, b)
    with pytest.raises(exc, match=match):  # the Meta kernel runs the same checker
        opforge.linear_cat([x.to("meta") for x in xs], w.to("meta"), None if b is None else b.to("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inputs_on_different_devices_raise():
    with pytest.raises(RuntimeError, match="opforge::linear_cat: expected inputs\\[0\\] and weight to be on the same device"):
        opforge.linear_cat([torch.randn(2, 3, device="cuda")], torch.randn(4, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_memory_has_no_concatenated_buffer():
    """Forward keeps no (M, ΣK_i) buffer: memory held after the forward is the output only (nothing saved but
    the caller's own pieces and weight)."""
    M, N = 4096, 256
    xs = [torch.randn(M, k, device="cuda", dtype=torch.bfloat16, requires_grad=True) for k in (1024, 1024)]
    w = torch.randn(N, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = opforge.linear_cat(xs, w)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert held <= y.numel() * y.element_size() + (1 << 20), f"{held} bytes held after forward"
