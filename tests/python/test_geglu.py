"""geglu and geglu_backward: values and gradients against float64 for both forms of gelu (approximate "none" and
"tanh") over dtypes, sizes and layouts, mixed dtypes, GatedMLP with activation="gelu" (and Hugging Face's GemmaMLP);
geglu_packed and geglu_packed_backward: bitwise equal to geglu on the two halves, views, zero-size, double backward.

The common checks of every op (opcheck, compile, gradcheck, gradgradcheck, Meta, bad inputs, ...): test_conformance.py.
The engine is swiglu's (core/gated.h): test_swiglu.py covers the layouts it reads in place in more detail."""
import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, geglu_packed_reference, geglu_reference

from conftest import FLOAT_DTYPES

APPROX = ["none", "tanh"]
SHAPES = [(1,), (7, 83), (3, 769), (2, 3584), (5120,), (2, 8200)]


def _baseline(gate, up, approximate):
    return TF.gelu(gate, approximate=approximate) * up


def _baseline_grads(gate, up, dy, approximate):
    g = gate.detach().requires_grad_()
    u = up.detach().requires_grad_()
    _baseline(g, u, approximate).backward(dy)
    return g.grad, u.grad


def _float64_grads(gate, up, dy, approximate):
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    geglu_reference(g64, u64, approximate).backward(dy.double())
    return g64.grad, u64.grad


def _exact(a, b, what):
    """a equal to b bit for bit (values, shape and dtype)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_float64(device, dtype, shape, approximate):
    gate = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    y = opforge.geglu(gate, up, approximate)
    assert y.grad_fn.name() == "opforge::GegluBackward"
    assert_matches_reference(y, geglu_reference(gate, up, approximate), _baseline(gate, up, approximate))
    y.backward(dy)
    g64, u64 = _float64_grads(gate, up, dy, approximate)
    bg, bu = _baseline_grads(gate, up, dy, approximate)
    assert_matches_reference(gate.grad, g64, bg, what="grad_gate")
    assert_matches_reference(up.grad, u64, bu, what="grad_up")


def test_reference_is_torchs_gelu_in_float64():
    # the written-out reference against torch's own float64 gelu, both forms, over a wide range of gate values
    gate = torch.linspace(-12, 12, 4097, dtype=torch.float64)
    up = torch.randn(4097, dtype=torch.float64)
    for a in APPROX:
        torch.testing.assert_close(geglu_reference(gate, up, a), TF.gelu(gate, approximate=a) * up,
                                   rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="approximate"):
        geglu_reference(gate, up, "erf")


def test_the_two_forms_differ_and_default_is_erf(device):
    # approximate reaches the kernels (forward and both gradients): the two forms differ by up to ~1e-3 at |g| ~ 2
    gate = torch.linspace(-4, 4, 257, device=device, dtype=torch.float64).requires_grad_()
    up = torch.ones(257, device=device, dtype=torch.float64).requires_grad_()
    outs = {}
    for a in APPROX:
        y = opforge.geglu(gate, up, a)
        dg, du = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
        outs[a] = (y, dg, du)
        torch.testing.assert_close(y, TF.gelu(gate, approximate=a), rtol=1e-14, atol=1e-14)
    for x, z in zip(outs["none"], outs["tanh"]):
        assert (x - z).abs().max() > 1e-5
    _exact(opforge.geglu(gate.detach(), up.detach()), outs["none"][0].detach(), "default approximate")
    _exact(opforge.geglu_packed(torch.cat([gate, up]).detach().view(1, -1)).view(-1), outs["none"][0].detach(),
           "packed default approximate")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("layout", ["transposed", "strided", "unaligned", "expanded"])
def test_non_contiguous_inputs(device, layout, approximate):
    base = torch.randn(64, 96, device=device) * 3
    if layout == "transposed":
        gate, up = base.t(), torch.randn(96, 64, device=device)
    elif layout == "strided":
        gate, up = base[:, ::2], torch.randn(64, 96, device=device)[:, 1::2]
    elif layout == "unaligned":
        buf = torch.randn(2 * 769 + 1, device=device) * 3
        gate, up = buf[1:770].view(1, 769), buf[770:].view(1, 769)
    else:
        gate, up = torch.randn(1, 96, device=device).expand(64, 96), base
    dy = torch.randn(gate.shape, device=device)
    y = opforge.geglu(gate, up, approximate)
    _exact(y, opforge.geglu(gate.contiguous(), up.contiguous(), approximate), "forward vs contiguous copies")
    assert_matches_reference(y, geglu_reference(gate, up, approximate), _baseline(gate, up, approximate))
    dg, du = torch.ops.opforge.geglu_backward(dy, gate, up, approximate)
    cg, cu = torch.ops.opforge.geglu_backward(dy, gate.contiguous(), up.contiguous(), approximate)
    _exact(dg, cg, "grad_gate vs contiguous copies")
    _exact(du, cu, "grad_up vs contiguous copies")
    g64, u64 = _float64_grads(gate, up, dy, approximate)
    bg, bu = _baseline_grads(gate, up, dy, approximate)
    assert_matches_reference(dg, g64, bg, what="grad_gate")
    assert_matches_reference(du, u64, bu, what="grad_up")


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cols", [7, 64, 83])
def test_column_views_of_fused_projection(device, dtype, cols, approximate):
    # gate/up as the column views of one fused gate/up GEMM, grad_output a view itself (read in place)
    fused = (torch.randn(2, 3, 2 * cols, device=device) * 3).to(dtype)
    gate, up = fused[..., :cols], fused[..., cols:]
    dy = torch.randn(2, 3, cols + 3, device=device).to(dtype)[..., 3:]
    y = opforge.geglu(gate, up, approximate)
    assert y.is_contiguous() and y.shape == gate.shape
    _exact(y, opforge.geglu(gate.contiguous(), up.contiguous(), approximate), "forward vs contiguous copies")
    assert_matches_reference(y, geglu_reference(gate, up, approximate), _baseline(gate, up, approximate))
    dg, du = torch.ops.opforge.geglu_backward(dy, gate, up, approximate)
    assert dg.is_contiguous() and du.is_contiguous()
    g64, u64 = _float64_grads(gate, up, dy, approximate)
    bg, bu = _baseline_grads(gate, up, dy, approximate)
    assert_matches_reference(dg, g64, bg, what="grad_gate")
    assert_matches_reference(du, u64, bu, what="grad_up")


def test_extreme_gates_stay_finite_and_exact(device):
    # far tails: gelu(g) -> 0 for g -> -inf, -> g for g -> +inf; no NaN from erf/tanh/exp saturation
    gate = torch.tensor([-1e4, -60.0, -10.0, -0.0, 0.0, 10.0, 60.0, 1e4], device=device, requires_grad=True)
    up = torch.full_like(gate, 2.0, requires_grad=True)
    for a in APPROX:
        y = opforge.geglu(gate, up, a)
        dg, du = torch.autograd.grad(y, (gate, up), torch.ones_like(y))
        for t in (y, dg, du):
            assert torch.isfinite(t).all(), (a, t)
        torch.testing.assert_close(y, TF.gelu(gate, approximate=a) * up)
        torch.testing.assert_close(dg, torch.autograd.grad((TF.gelu(gate, approximate=a) * up).sum(), gate)[0])


def test_zero_size(device):
    for a in APPROX:
        gate = torch.randn(0, 5, device=device, requires_grad=True)
        up = torch.randn(0, 5, device=device, requires_grad=True)
        y = opforge.geglu(gate, up, a)
        y.sum().backward()
        assert y.shape == (0, 5) and gate.grad.shape == (0, 5) and up.grad.shape == (0, 5)


def test_only_requested_gradient_is_returned(device):
    gate = torch.randn(4, 8, device=device, requires_grad=True)
    up = torch.randn(4, 8, device=device)
    opforge.geglu(gate, up, "tanh").sum().backward()
    assert gate.grad is not None and up.grad is None


def test_mixed_dtypes_follow_gate_and_match_meta(device):
    gate = torch.randn(4, 8, device=device, dtype=torch.float16, requires_grad=True)
    up = torch.randn(4, 8, device=device, dtype=torch.float32, requires_grad=True)
    y = opforge.geglu(gate, up, "tanh")
    y.float().sum().backward()
    assert y.dtype == torch.float16 and gate.grad.dtype == torch.float16 and up.grad.dtype == torch.float32
    ym = opforge.geglu(gate.detach().to("meta"), up.detach().to("meta"), "tanh")
    assert ym.dtype == y.dtype and ym.shape == y.shape and ym.stride() == y.stride()
    gm, um = torch.ops.opforge.geglu_backward(y.detach().to("meta"), gate.detach().to("meta"), up.detach().to("meta"),
                                              "tanh")
    assert gm.dtype == torch.float16 and um.dtype == torch.float32


@pytest.mark.parametrize("bad", ["erf", "Tanh", "gelu_tanh", "", "tanh "])
def test_bad_approximate_raises_on_every_op_and_device(device, bad):
    g = torch.randn(3, 4, device=device)
    msg = rf'opforge::{{}}: expected approximate to be "none" or "tanh", but got "{bad}"'
    calls = {"geglu": lambda: opforge.geglu(g, g, bad),
             "geglu_backward": lambda: torch.ops.opforge.geglu_backward(g, g, g, bad),
             "geglu_packed": lambda: opforge.geglu_packed(g, bad),
             "geglu_packed_backward": lambda: torch.ops.opforge.geglu_packed_backward(g[:, :2], g, bad)}
    for where in (device, "meta"):
        for name, call in calls.items():
            if where == "meta":
                g = g.to("meta")
            with pytest.raises(ValueError, match=msg.format(name).replace("(", r"\(")):
                call()
    with pytest.raises(ValueError, match=msg.format("geglu")):  # through autograd too
        opforge.geglu(torch.randn(3, device=device, requires_grad=True), torch.randn(3, device=device), bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inputs_on_different_devices_raise():
    with pytest.raises(RuntimeError, match="opforge::geglu: expected gate and up to be on the same device"):
        opforge.geglu(torch.randn(3, device="cuda"), torch.randn(3))


# ---- opforge.nn.GatedMLP with activation="gelu" --------------------------------------------------------------------


@pytest.mark.parametrize("approximate", APPROX)
def test_gated_mlp_gelu_matches_torch_composition(device, approximate):
    torch.manual_seed(1)
    mlp = opforge.nn.GatedMLP(32, 80, activation="gelu", approximate=approximate).to(device)
    x = torch.randn(4, 7, 32, device=device, requires_grad=True)
    y = mlp(x)
    x64 = x.detach().double()
    w = {n: p.detach().double() for n, p in mlp.named_parameters()}
    h = TF.gelu(x64 @ w["gate_proj.weight"].t(), approximate=approximate) * (x64 @ w["up_proj.weight"].t())
    torch.testing.assert_close(y.double(), h @ w["down_proj.weight"].t(), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters()) and x.grad is not None
    assert f"approximate={approximate!r}" in repr(mlp)


def test_gated_mlp_default_is_swiglu_and_bad_arguments_raise():
    torch.manual_seed(2)
    silu, gelu = opforge.nn.GatedMLP(8, 16), opforge.nn.GatedMLP(8, 16, activation="gelu")
    gelu.load_state_dict(silu.state_dict())
    assert set(silu.state_dict()) == set(gelu.state_dict())
    x = torch.randn(3, 8)
    g, u = silu.gate_proj(x), silu.up_proj(x)
    _exact(silu(x), silu.down_proj(opforge.swiglu(g, u)), "default GatedMLP is swiglu")
    _exact(gelu(x), silu.down_proj(opforge.geglu(g, u)), "activation='gelu' is geglu (erf form)")
    for kw, what in [({"activation": "relu"}, "activation"), ({"activation": "gelu", "approximate": "erf"}, "approximate"),
                     ({"approximate": "tanh"}, "with activation='silu'")]:
        with pytest.raises(ValueError, match=f"opforge.nn.GatedMLP: expected .*{what}"):
            opforge.nn.GatedMLP(8, 16, **kw)


def test_gated_mlp_equals_hugging_face_gemma_mlp():
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    config = pytest.importorskip("transformers").GemmaConfig(hidden_size=32, intermediate_size=80,
                                                             hidden_activation="gelu_pytorch_tanh")
    torch.manual_seed(3)
    hf = gemma.GemmaMLP(config).double()
    ours = opforge.nn.GatedMLP(32, 80, activation="gelu", approximate="tanh", dtype=torch.float64)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-12, atol=1e-12)


# ---- geglu_packed: input = [gate | up] (*, 2I) -> (*, I); one gradient (*, 2I) -------------------------------------


def _check_packed(x, dy, approximate):
    """geglu_packed and geglu_packed_backward on (x, dy): contiguous outputs in x's dtype, bitwise equal to geglu /
    geglu_backward on the halves (both gradient halves) and to geglu_packed on contiguous copies; within the
    tolerance rule of the float64 reference."""
    I = x.shape[-1] // 2
    gate, up = x[..., :I], x[..., I:]
    y = opforge.geglu_packed(x, approximate)
    assert y.is_contiguous() and y.dtype == x.dtype and y.shape == (*x.shape[:-1], I)
    _exact(y, opforge.geglu(gate, up, approximate), "forward vs geglu on the halves")
    _exact(y, opforge.geglu_packed(x.contiguous(), approximate), "forward vs a contiguous copy")
    assert_matches_reference(y, geglu_packed_reference(x, approximate), _baseline(gate, up, approximate))
    dx = torch.ops.opforge.geglu_packed_backward(dy, x, approximate)
    assert dx.is_contiguous() and dx.dtype == x.dtype and dx.shape == x.shape
    dg, du = torch.ops.opforge.geglu_backward(dy, gate, up, approximate)
    _exact(dx[..., :I], dg, "grad_input[..., :I] vs geglu's grad_gate")
    _exact(dx[..., I:], du, "grad_input[..., I:] vs geglu's grad_up")
    _exact(dx, torch.ops.opforge.geglu_packed_backward(dy.contiguous(), x.contiguous(), approximate),
           "backward vs contiguous copies")
    r = x.detach().double().requires_grad_()
    geglu_packed_reference(r, approximate).backward(dy.double())
    b = x.detach().requires_grad_()
    _baseline(*b.chunk(2, dim=-1), approximate).backward(dy)
    assert_matches_reference(dx, r.grad, b.grad, what="grad_input")


PACKED_SHAPES = [(2,), (1, 2), (7, 166), (3, 1538), (2, 7168), (2, 16400), (2, 3, 14)]


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_equals_geglu_on_halves_and_float64(device, dtype, shape, approximate):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, device=device).to(dtype)
    _check_packed(x, dy, approximate)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["column_slice", "column_slice_unaligned", "transposed", "expanded",
                                    "permuted_leading", "row_stride_odd"])
def test_packed_views(device, dtype, layout, approximate):
    I = 83

    def r(*shape):
        return (torch.randn(*shape, device=device) * 3).to(dtype)
    x = {
        "column_slice": lambda: r(6, 2 * I + 16)[:, 8:8 + 2 * I],
        "column_slice_unaligned": lambda: r(2, 3, 2 * I + 5)[..., 3:3 + 2 * I],
        "transposed": lambda: r(2 * I, 6).t(),
        "expanded": lambda: r(1, 2 * I).expand(6, 2 * I),
        "permuted_leading": lambda: r(3, 2, 2 * I).transpose(0, 1),
        "row_stride_odd": lambda: r(6, 2 * I + 1)[:, :2 * I],
    }[layout]()
    assert not x.is_contiguous()
    dy = torch.randn(*x.shape[:-1], I + 1, device=device).to(dtype)[..., 1:]
    _check_packed(x, dy, approximate)


@pytest.mark.parametrize("approximate", APPROX)
def test_packed_autograd_equals_geglu_on_views_bitwise(device, approximate):
    # Gemma's MLP with one fused gate/up projection: geglu_packed(gu) against geglu(gu[..., :I], gu[..., I:])
    I = 83
    w = (torch.randn(2, 5, 2 * I, device=device) * 3).to(torch.bfloat16)
    dy = torch.randn(2, 5, I, device=device).to(torch.bfloat16)
    a = w.clone().requires_grad_()
    y = opforge.geglu_packed(a, approximate)
    y.backward(dy)
    assert y.grad_fn.name() == "opforge::GegluPackedBackward"
    b = w.clone().requires_grad_()
    yb = opforge.geglu(b[..., :I], b[..., I:], approximate)
    yb.backward(dy)
    _exact(y.detach(), yb.detach(), "forward")
    _exact(a.grad, b.grad, "grad(gu)")


@pytest.mark.parametrize("shape", [(0, 10), (3, 0), (2, 0, 6), (0,)], ids=str)
def test_packed_zero_size(device, shape):
    x = torch.randn(shape, device=device, requires_grad=True)
    y = opforge.geglu_packed(x, "tanh")
    assert y.shape == (*shape[:-1], shape[-1] // 2)
    y.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("shape,given", [((3, 5), "5"), ((7,), "7"), ((2, 4, 1), "1")])
def test_packed_odd_last_dim_raises(device, shape, given):
    x = torch.randn(shape, device=device)
    msg = rf"opforge::geglu_packed: expected input's last dimension to be even .*, but got {given}"
    with pytest.raises(ValueError, match=msg):
        opforge.geglu_packed(x, "tanh")
    with pytest.raises(ValueError, match=msg.replace("geglu_packed:", "geglu_packed_backward:")):
        torch.ops.opforge.geglu_packed_backward(torch.randn(*shape[:-1], 1, device=device), x)


@pytest.mark.parametrize("approximate", APPROX)
def test_double_backward_matches_torch_and_packed_equals_halves(device, approximate):
    # second derivatives through geglu's and geglu_packed's double backward against torch's gelu (float64)
    w = torch.randn(3, 2 * 5, device=device, dtype=torch.float64) * 2
    dy = torch.randn(3, 5, device=device, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2 * 5, device=device, dtype=torch.float64)
    out = []
    for kind in ("packed", "halves", "torch"):
        x = w.clone().requires_grad_()
        if kind == "packed":
            y = opforge.geglu_packed(x, approximate)
        elif kind == "halves":
            y = opforge.geglu(x[:, :5], x[:, 5:], approximate)
        else:
            y = _baseline(x[:, :5], x[:, 5:], approximate)
        (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
        out.append((gx.detach(), *torch.autograd.grad((gx * v).sum(), (x, dy))))
    for other in out[1:]:
        for a, b, what in zip(out[0], other, ("grad", "d(grad·v)/dx", "d(grad·v)/d(dy)")):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, what=what: f"{what}: {m}")


def test_third_derivative_is_available():
    # the double backward is in ATen ops all the way down (no gelu_backward): a third derivative exists too
    for a in APPROX:
        g = torch.randn(6, dtype=torch.float64, requires_grad=True)
        u = torch.randn(6, dtype=torch.float64)
        assert torch.autograd.gradgradcheck(lambda g: opforge.geglu(g, u, a), (g,), check_fwd_over_rev=False)
        d1 = torch.autograd.grad(opforge.geglu(g, u, a).sum(), g, create_graph=True)[0]
        d2 = torch.autograd.grad(d1.sum(), g, create_graph=True)[0]
        d3 = torch.autograd.grad(d2.sum(), g)[0]
        t1 = torch.autograd.grad((TF.gelu(g, approximate=a) * u).sum(), g, create_graph=True)[0]
        t2 = torch.autograd.grad(t1.sum(), g, create_graph=True)[0]
        torch.testing.assert_close(d2, t2, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(d3).all()


# ---- CPU: each element's value depends on its inputs only (core/vec.h's partial-vector tails), not on rows, chunks,
# threads, alignment or offset (as test_swiglu.py's; 257 x 1031 is more than 8 chunks of at::parallel_for's grain).


def _cpu_geglu_results(gate, up, dy, x, dyp, approximate):
    return [opforge.geglu(gate, up, approximate), *torch.ops.opforge.geglu_backward(dy, gate, up, approximate),
            opforge.geglu_packed(x, approximate), torch.ops.opforge.geglu_packed_backward(dyp, x, approximate)]


def _cpu_strided_inputs(T, I, dtype):
    fused = (torch.randn(T, 2 * I + 3) * 3).to(dtype)[:, 3:]
    dy = torch.randn(T, I + 5).to(dtype)[:, 5:]
    dyp = torch.randn(T, I + 1).to(dtype)[:, 1:]
    return fused[:, :I], fused[:, I:], dy, fused, dyp


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_strided_views_equal_contiguous_copies_bitwise(dtype, approximate):
    views = _cpu_strided_inputs(37, 1031, dtype)
    got = _cpu_geglu_results(*views, approximate)
    want = _cpu_geglu_results(*(v.contiguous() for v in views), approximate)
    for what, a, b in zip(("y", "grad_gate", "grad_up", "packed y", "packed grad_input"), got, want):
        _exact(a, b, what)


@pytest.mark.parametrize("approximate", APPROX)
def test_cpu_results_bitwise_equal_across_thread_counts(approximate):
    inputs = _cpu_strided_inputs(257, 1031, torch.float32)
    n = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 8):
            torch.set_num_threads(threads)
            results.append(_cpu_geglu_results(*inputs, approximate))
    finally:
        torch.set_num_threads(n)
    for threads, res in zip((2, 3, 8), results[1:]):
        for what, a, b in zip(("y", "grad_gate", "grad_up", "packed y", "packed grad_input"), res, results[0]):
            _exact(a, b, f"{what}, {threads} threads vs 1")


def test_forward_ad_is_refused_naming_the_op():
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(3, 4), torch.randn(3, 4))
        with pytest.raises(NotImplementedError, match="opforge::geglu_packed: forward-mode AD is not supported"):
            opforge.geglu_packed(x, "tanh")
        with pytest.raises(NotImplementedError, match="opforge::geglu: forward-mode AD is not supported"):
            opforge.geglu(x, torch.randn(3, 4))
