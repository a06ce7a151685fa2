"""torch.autocast: each op follows the policy of the native op it mirrors -- linear the lower
precision list (as torch's linear), the norms and elementwise ops their input dtype -- identically in eager,
torch.compile and FakeTensor/Meta, and gradients come back in each parameter's dtype, as with torch's modules.
The per-op check of every conformance entry is test_conformance.py::test_autocast; here the cases of the issue."""
import pytest
import torch
import torch.nn.functional as TF
from torch._subclasses.fake_tensor import FakeTensorMode

import opforge


def _lowp(device):
    return torch.bfloat16 if device == "cpu" else torch.float16


def test_linear_eager_compiled_meta_agree(device):
    """Was: eager bfloat16, compiled and Meta float32, values up to 0.024 apart."""
    torch._dynamo.reset()
    x, w, b = torch.randn(8, 64, device=device), torch.randn(32, 64, device=device), torch.randn(32, device=device)
    lowp = _lowp(device)
    with torch.autocast(device, dtype=lowp):
        eager = opforge.linear(x, w, b)
        native = TF.linear(x, w, b)
        compiled = torch.compile(opforge.linear, fullgraph=True)(x, w, b)
    with FakeTensorMode() as mode:
        fx, fw, fb = (mode.from_tensor(t) for t in (x, w, b))
        with torch.autocast(device, dtype=lowp):
            fake = opforge.linear(fx, fw, fb)
    assert eager.dtype == compiled.dtype == fake.dtype == native.dtype == lowp
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    # the same lower-precision GEMM as torch's (both accumulate in float32): within bf16/fp16 rounding
    torch.testing.assert_close(eager, native, rtol=2 * torch.finfo(lowp).eps, atol=1e-2)


def test_modules_under_autocast_match_torch(device):
    torch.manual_seed(0)
    lowp = _lowp(device)
    ours = torch.nn.Sequential(opforge.nn.Linear(32, 48), opforge.nn.RMSNorm(48), opforge.nn.Linear(48, 8)).to(device)
    ref = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.RMSNorm(48), torch.nn.Linear(48, 8)).to(device)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 32, device=device)
    outs = []
    for m in (ours, ref):
        with torch.autocast(device, dtype=lowp):
            y = m(x)
        y.float().sum().backward()
        outs.append((y, [p.grad for p in m.parameters()]))
    (y, grads), (yr, grads_r) = outs
    assert y.dtype == yr.dtype
    for g, gr in zip(grads, grads_r):
        assert g.dtype == gr.dtype == torch.float32
        torch.testing.assert_close(g, gr, rtol=0.05, atol=0.05)
    torch.testing.assert_close(y.float(), yr.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "sigmoid", "square", "swiglu", "geglu", "square_add"])
def test_input_dtype_ops_are_not_cast(device, name):
    """Norms and elementwise ops keep their input's dtype under autocast (float32 in, float32 out; bf16 in, bf16 out),
    and autocast does not reach the ATen calls inside their kernels. The one exception follows torch: on CUDA
    autocast runs torch.square (pow) in float32, so opforge.square does too (checked against torch's own op)."""
    lowp = _lowp(device)
    if name == "square" and device == "cuda":
        for dtype in (torch.float32, lowp):
            x = torch.randn(4, 16, device=device, dtype=dtype)
            with torch.autocast(device, dtype=lowp):
                auto, native = opforge.square(x), torch.square(x)
            assert auto.dtype == native.dtype == torch.float32
            torch.testing.assert_close(auto, opforge.square(x.float()), rtol=0, atol=0)
        return
    for dtype in (torch.float32, lowp):
        x = torch.randn(4, 16, device=device, dtype=dtype)
        args = {"rms_norm": (x, 16), "fused_add_rms_norm": (x, x, 16), "sigmoid": (x,), "square": (x,),
                "swiglu": (x, x), "geglu": (x, x, "tanh"), "square_add": (x, x[0])}[name]
        plain = getattr(opforge, name)(*args)
        with torch.autocast(device, dtype=lowp):
            auto = getattr(opforge, name)(*args)
        for p, a in zip(plain if isinstance(plain, tuple) else (plain,), auto if isinstance(auto, tuple) else (auto,)):
            assert a.dtype == dtype
            assert torch.equal(a, p)


def test_autocast_disabled_inside_compiled_region(device):
    """autocast entered inside a compiled function: the same dtypes as eager."""
    torch._dynamo.reset()
    lowp = _lowp(device)

    def f(x, w):
        with torch.autocast(device, dtype=lowp):
            return opforge.linear(x, w), opforge.rms_norm(x, x.shape[-1])

    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    eager = f(x, w)
    comp = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    assert [t.dtype for t in eager] == [t.dtype for t in comp] == [lowp, torch.float32]
