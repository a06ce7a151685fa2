"""swiglu and swiglu_backward: values and gradients against float64 over sizes and layouts, mixed dtypes, GatedMLP.

The common checks of every op (opcheck, compile, gradcheck, gradgradcheck, Meta, bad inputs, ...): test_conformance.py."""
import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, swiglu_reference

from conftest import FLOAT_DTYPES

SHAPES = [(1,), (7, 83), (3, 769), (2, 3584), (5120,), (2, 8200)]


def _baseline(gate, up):
    return TF.silu(gate) * up


def _baseline_grads(gate, up, dy):
    g = gate.detach().requires_grad_()
    u = up.detach().requires_grad_()
    (TF.silu(g) * u).backward(dy)
    return g.grad, u.grad


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_float64(device, dtype, shape):
    gate = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    y = opforge.swiglu(gate, up)
    assert_matches_reference(y, swiglu_reference(gate, up), _baseline(gate, up))
    y.backward(dy)
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    swiglu_reference(g64, u64).backward(dy.double())
    bg, bu = _baseline_grads(gate, up, dy)
    assert_matches_reference(gate.grad, g64.grad, bg, what="grad_gate")
    assert_matches_reference(up.grad, u64.grad, bu, what="grad_up")


@pytest.mark.parametrize("layout", ["transposed", "strided", "unaligned", "expanded"])
def test_non_contiguous_inputs(device, layout):
    base = torch.randn(64, 96, device=device)
    if layout == "transposed":
        gate, up = base.t(), torch.randn(96, 64, device=device).t().t().contiguous().t().t()
    elif layout == "strided":
        gate, up = base[:, ::2], torch.randn(64, 96, device=device)[:, 1::2]
    elif layout == "unaligned":
        buf = torch.randn(2 * 769 + 1, device=device)
        gate, up = buf[1:770].view(1, 769), buf[770:].view(1, 769)
    else:
        gate, up = torch.randn(1, 96, device=device).expand(64, 96), base
    y = opforge.swiglu(gate, up)
    torch.testing.assert_close(y, opforge.swiglu(gate.contiguous(), up.contiguous()), rtol=0, atol=0)
    assert_matches_reference(y, swiglu_reference(gate, up), _baseline(gate, up))


def test_zero_size(device):
    gate = torch.randn(0, 5, device=device, requires_grad=True)
    up = torch.randn(0, 5, device=device, requires_grad=True)
    y = opforge.swiglu(gate, up)
    y.sum().backward()
    assert y.shape == (0, 5) and gate.grad.shape == (0, 5) and up.grad.shape == (0, 5)


def test_only_requested_gradient_is_returned(device):
    gate = torch.randn(4, 8, device=device, requires_grad=True)
    up = torch.randn(4, 8, device=device)
    opforge.swiglu(gate, up).sum().backward()
    assert gate.grad is not None and up.grad is None


def test_mixed_dtypes_follow_gate_and_match_meta(device):
    gate = torch.randn(4, 8, device=device, dtype=torch.float16, requires_grad=True)
    up = torch.randn(4, 8, device=device, dtype=torch.float32, requires_grad=True)
    y = opforge.swiglu(gate, up)
    y.float().sum().backward()
    assert y.dtype == torch.float16 and gate.grad.dtype == torch.float16 and up.grad.dtype == torch.float32
    ym = opforge.swiglu(gate.detach().to("meta"), up.detach().to("meta"))
    assert ym.dtype == y.dtype and ym.shape == y.shape and ym.stride() == y.stride()
    gm, um = torch.ops.opforge.swiglu_backward(y.detach().to("meta"), gate.detach().to("meta"), up.detach().to("meta"))
    assert gm.dtype == torch.float16 and um.dtype == torch.float32
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inputs_on_different_devices_raise():
    with pytest.raises(RuntimeError, match="opforge::swiglu: expected gate and up to be on the same device"):
        opforge.swiglu(torch.randn(3, device="cuda"), torch.randn(3))


def test_gated_mlp_matches_torch_composition(device):
    torch.manual_seed(1)
    mlp = opforge.nn.GatedMLP(32, 80).to(device)
    x = torch.randn(4, 7, 32, device=device, requires_grad=True)
    y = mlp(x)
    ref = mlp.down_proj.weight.double() @ (TF.silu(x.double() @ mlp.gate_proj.weight.double().t())
                                          * (x.double() @ mlp.up_proj.weight.double().t())).transpose(-1, -2)
    torch.testing.assert_close(y.double(), ref.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())
