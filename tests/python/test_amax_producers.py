"""The amax producers of FP8 tensorwise current scaling: _rms_norm_forward_amax, _fused_add_rms_norm_forward_amax and
_swiglu_packed_amax return their op's outputs plus amax = max |output| as stored, reduced as the output is written.

Every check is exact: the other outputs bitwise the plain private op's (_rms_norm_forward, _fused_add_rms_norm_forward,
swiglu_packed), amax bitwise y.abs().max() in float32 (float64 for float64), NaN when an output is NaN, inf when one
is inf and none is NaN, 0 when the output is empty; gradients bitwise the plain op's; Meta shapes and dtypes; opcheck.
The CUDA cases (every rms_norm forward variant through the test hook rms_norm_forward) skip without a GPU."""
import pytest
import torch

import opforge  # noqa: F401  (loads the library)

from conftest import FLOAT_DTYPES

ops = torch.ops.opforge


def _amax_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expected_amax(y):
    """max |y| as stored, in amax's dtype, shape [1]; 0 for an empty y; NaN when y holds one."""
    if y.numel() == 0:
        return torch.zeros(1, dtype=_amax_dtype(y.dtype), device=y.device)
    return y.abs().max().to(_amax_dtype(y.dtype)).reshape(1)


def _assert_amax(amax, y):
    assert amax.shape == (1,) and amax.dtype == _amax_dtype(y.dtype) and amax.device == y.device
    assert not amax.requires_grad and amax.grad_fn is None
    torch.testing.assert_close(amax, _expected_amax(y), rtol=0, atol=0, equal_nan=True)


def _assert_same(a, b):
    """Bitwise equal (NaN where NaN), same dtype and shape."""
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _randn(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device, dtype=torch.float64) * scale).to(dtype)


NORM_SHAPES = [(7, 83), (3, 769), (2, 5, 64), (1, 4096), (33, 5120), (4, 16384), (5, 3)]


# ---- _rms_norm_forward_amax, _fused_add_rms_norm_forward_amax ----------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_amax_matches_forward(device, dtype, shape, with_weight):
    x = _randn(shape, dtype, device, 3.0)
    w = _randn(shape[-1:], dtype, device) if with_weight else None
    y, rstd, amax = ops._rms_norm_forward_amax(x, [shape[-1]], w, None)
    y0, rstd0 = ops._rms_norm_forward(x, [shape[-1]], w, None)
    _assert_same(y, y0)
    _assert_same(rstd, rstd0)
    _assert_amax(amax, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("with_weight", [True, False])
def test_fused_add_rms_norm_amax_matches_forward(device, dtype, shape, with_weight):
    x = _randn(shape, dtype, device, 2.0)
    r = _randn(shape, dtype, device, 2.0)
    w = _randn(shape[-1:], dtype, device) if with_weight else None
    y, z, rstd, amax = ops._fused_add_rms_norm_forward_amax(x, r, [shape[-1]], w, 1e-6)
    y0, z0, rstd0 = ops._fused_add_rms_norm_forward(x, r, [shape[-1]], w, 1e-6)
    _assert_same(y, y0)
    _assert_same(z, z0)
    _assert_same(rstd, rstd0)
    _assert_amax(amax, y)  # of the normed output, not of residual_out


def test_fused_amax_is_of_output_not_residual_out(device):
    # residual_out has far larger entries than the normed output: amax must be the output's
    x = torch.full((4, 64), 100.0, device=device)
    r = torch.full((4, 64), 100.0, device=device)
    y, z, _, amax = ops._fused_add_rms_norm_forward_amax(x, r, [64], None, None)
    assert z.abs().max() == 200.0
    _assert_amax(amax, y)
    assert amax.item() < 2.0


def test_rms_norm_amax_multi_dim_normalized_shape(device):
    x = _randn((3, 4, 5, 6), torch.float32, device)
    w = _randn((5, 6), torch.float32, device)
    y, rstd, amax = ops._rms_norm_forward_amax(x, [5, 6], w, None)
    y0, rstd0 = ops._rms_norm_forward(x, [5, 6], w, None)
    _assert_same(y, y0)
    _assert_same(rstd, rstd0)
    _assert_amax(amax, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_amax_views_and_mixed_dtypes(device, dtype):
    # a row-strided input (a column slice), a transposed one, a residual and weight in another dtype
    base = _randn((9, 200), dtype, device)
    for x in (base[:, 3:131], base.t()[:64, :9].t().contiguous().t().t()):
        n = x.shape[-1]
        w = _randn((n,), torch.float32, device)
        y, rstd, amax = ops._rms_norm_forward_amax(x, [n], w, None)
        y0, rstd0 = ops._rms_norm_forward(x, [n], w, None)
        _assert_same(y, y0)
        _assert_same(rstd, rstd0)
        _assert_amax(amax, y)
        r = _randn(x.shape, torch.float32, device)
        outs = ops._fused_add_rms_norm_forward_amax(x, r, [n], w, None)
        outs0 = ops._fused_add_rms_norm_forward(x, r, [n], w, None)
        for a, b in zip(outs[:3], outs0):
            _assert_same(a, b)
        _assert_amax(outs[3], outs[0])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("special", ["nan", "inf", "-inf", "nan_and_inf"])
def test_rms_norm_amax_nan_inf(device, dtype, special):
    x = _randn((6, 96), dtype, device)
    if special in ("nan", "nan_and_inf"):
        x[2, 5] = float("nan")
    if special in ("inf", "nan_and_inf"):
        x[4, 7] = float("inf")
    if special == "-inf":
        x[1, 0] = float("-inf")
    y, rstd, amax = ops._rms_norm_forward_amax(x, [96], None, None)
    y0, _ = ops._rms_norm_forward(x, [96], None, None)
    _assert_same(y, y0)
    _assert_amax(amax, y)
    assert torch.isnan(amax).item() == bool(torch.isnan(y).any())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_amax_inf_in_output_only(device, dtype):
    # an output entry of inf without inf in input: a huge weight; no NaN in that row's output, so amax is inf
    x = torch.ones((3, 8), dtype=dtype, device=device)
    w = torch.ones((8,), dtype=dtype, device=device)
    w[3] = torch.finfo(dtype).max
    x[1, 3] = 4.0
    y, _, amax = ops._rms_norm_forward_amax(x, [8], w, None)
    assert torch.isinf(y).any() and not torch.isnan(y).any()
    _assert_amax(amax, y)
    assert amax.item() == float("inf")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_amax_zero_and_empty(device, dtype):
    x = torch.zeros((5, 40), dtype=dtype, device=device)
    y, _, amax = ops._rms_norm_forward_amax(x, [40], None, None)
    _assert_amax(amax, y)
    assert amax.item() == 0.0
    for shape in [(0, 40), (4, 0), (0, 0)]:
        x = torch.zeros(shape, dtype=dtype, device=device)
        y, rstd, amax = ops._rms_norm_forward_amax(x, [shape[-1]], None, None)
        y0, rstd0 = ops._rms_norm_forward(x, [shape[-1]], None, None)
        _assert_same(y, y0)
        _assert_same(rstd, rstd0)
        _assert_amax(amax, y)
        r = torch.zeros(shape, dtype=dtype, device=device)
        y, z, rstd, amax = ops._fused_add_rms_norm_forward_amax(x, r, [shape[-1]], None, None)
        _assert_amax(amax, y)
        assert z.shape == shape


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_amax_gradients_match_forward(device, dtype):
    shape = (6, 5, 72)
    x = _randn(shape, dtype, device).requires_grad_()
    w = _randn(shape[-1:], dtype, device).requires_grad_()
    gy = _randn(shape, dtype, device)
    y, rstd, amax = ops._rms_norm_forward_amax(x, [72], w, None)
    y0, rstd0 = ops._rms_norm_forward(x, [72], w, None)
    assert y.grad_fn is not None and y.grad_fn.name() == y0.grad_fn.name()
    assert not rstd.requires_grad and not amax.requires_grad
    for a, b in zip(torch.autograd.grad(y, (x, w), gy), torch.autograd.grad(y0, (x, w), gy)):
        _assert_same(a, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("which", ["both", "output", "residual_out"])
def test_fused_add_rms_norm_amax_gradients_match_forward(device, dtype, which):
    shape = (7, 96)
    x = _randn(shape, dtype, device).requires_grad_()
    r = _randn(shape, torch.float32, device).requires_grad_()
    w = _randn(shape[-1:], dtype, device).requires_grad_()
    gy, gz = _randn(shape, dtype, device), _randn(shape, dtype, device)
    y, z, rstd, amax = ops._fused_add_rms_norm_forward_amax(x, r, [96], w, None)
    y0, z0, rstd0 = ops._fused_add_rms_norm_forward(x, r, [96], w, None)
    assert not rstd.requires_grad and not amax.requires_grad and amax.grad_fn is None

    def grads(y_, z_):
        outs, gs = [], []
        if which in ("both", "output"):
            outs.append(y_)
            gs.append(gy)
        if which in ("both", "residual_out"):
            outs.append(z_)
            gs.append(gz)
        return torch.autograd.grad(outs, (x, r, w), gs, allow_unused=True)

    for a, b in zip(grads(y, z), grads(y0, z0)):
        assert (a is None) == (b is None)
        if a is not None:
            _assert_same(a, b)


def test_fused_amax_weight_only_grad_leaves_residual_out_without_history(device):
    x, r = _randn((3, 16), torch.float32, device), _randn((3, 16), torch.float32, device)
    w = _randn((16,), torch.float32, device).requires_grad_()
    y, z, _, amax = ops._fused_add_rms_norm_forward_amax(x, r, [16], w, None)
    assert y.requires_grad and not z.requires_grad and not amax.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_amax_meta(dtype):
    x = torch.empty((4, 7, 64), dtype=dtype, device="meta")
    w = torch.empty((64,), dtype=dtype, device="meta")
    y, rstd, amax = ops._rms_norm_forward_amax(x, [64], w, None)
    assert y.shape == x.shape and y.dtype == dtype and rstd.shape == (4, 7) and rstd.dtype == torch.float32
    assert amax.shape == (1,) and amax.dtype == torch.float32 and amax.device.type == "meta"
    y, z, rstd, amax = ops._fused_add_rms_norm_forward_amax(x, x, [64], w, None)
    assert z.shape == x.shape and amax.shape == (1,) and amax.dtype == torch.float32
    x64 = torch.empty((2, 8), dtype=torch.float64, device="meta")
    assert ops._rms_norm_forward_amax(x64, [8], None, None)[2].dtype == torch.float64


def test_rms_norm_amax_bad_input_names_op():
    with pytest.raises(ValueError, match="rms_norm.*normalized_shape"):
        ops._rms_norm_forward_amax(torch.randn(3, 4), [5], None, None)
    with pytest.raises(ValueError, match="fused_add_rms_norm.*residual"):
        ops._fused_add_rms_norm_forward_amax(torch.randn(3, 4), torch.randn(3, 5), [4], None, None)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@_CUDA
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("N", [8, 1000, 1024, 4096, 16384, 65536 + 8])
def test_rms_norm_amax_cuda_variants(knob, variant, dtype, N):
    # every forward variant (the test hook rms_norm_forward), vector and scalar rows, one row and many
    knob("rms_norm_forward", variant)
    for M in (1, 37, 300):
        x = _randn((M, N), dtype, "cuda", 2.0)
        w = _randn((N,), dtype, "cuda")
        r = _randn((M, N), dtype, "cuda")
        y, rstd, amax = ops._rms_norm_forward_amax(x, [N], w, None)
        y0, rstd0 = ops._rms_norm_forward(x, [N], w, None)
        _assert_same(y, y0)
        _assert_same(rstd, rstd0)
        _assert_amax(amax, y)
        outs = ops._fused_add_rms_norm_forward_amax(x, r, [N], None, None)
        outs0 = ops._fused_add_rms_norm_forward(x, r, [N], None, None)
        for a, b in zip(outs[:3], outs0):
            _assert_same(a, b)
        _assert_amax(outs[3], outs[0])


@_CUDA
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4])
def test_rms_norm_amax_cuda_nan_in_one_row(knob, variant):
    knob("rms_norm_forward", variant)
    x = _randn((513, 4096), torch.bfloat16, "cuda")
    x[400, 17] = float("nan")
    y, _, amax = ops._rms_norm_forward_amax(x, [4096], None, None)
    assert torch.isnan(amax).item()
    x[400, 17] = float("inf")
    y, _, amax = ops._rms_norm_forward_amax(x, [4096], None, None)
    _assert_amax(amax, y)


# ---- _swiglu_packed_amax --------------------------------------------------------------------------------------------

PACKED_SHAPES = [(2,), (7, 166), (3, 1538), (2, 3, 7168), (5, 16400), (1, 2)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", PACKED_SHAPES)
def test_swiglu_packed_amax_matches_swiglu_packed(device, dtype, shape):
    x = _randn(shape, dtype, device, 3.0)
    y, amax = ops._swiglu_packed_amax(x)
    _assert_same(y, ops.swiglu_packed(x))
    _assert_amax(amax, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("I", [1, 5, 8, 64, 1001])
def test_swiglu_packed_amax_row_strided_views(device, dtype, I):
    # the [gate | up] columns of a wider fused projection output (row stride > 2I), at an odd offset, transposed
    wide = _randn((37, 2 * I + 6), dtype, device, 2.0)
    for x in (wide[:, :2 * I], wide[:, 3:3 + 2 * I], wide[::2, 1:1 + 2 * I], wide.t().contiguous().t()[:, :2 * I]):
        y, amax = ops._swiglu_packed_amax(x)
        _assert_same(y, ops.swiglu_packed(x))
        _assert_amax(amax, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("special", ["nan", "inf", "zero", "empty_rows", "empty_cols"])
def test_swiglu_packed_amax_specials(device, dtype, special):
    if special == "empty_rows":
        x = torch.zeros((0, 16), dtype=dtype, device=device)
    elif special == "empty_cols":
        x = torch.zeros((4, 0), dtype=dtype, device=device)
    elif special == "zero":
        x = torch.zeros((9, 30), dtype=dtype, device=device)
    else:
        x = _randn((9, 30), dtype, device)
        if special == "nan":
            x[4, 20] = float("nan")  # an up entry: y NaN
        else:
            x[2, 3] = 100.0  # gate: silu(100) = 100
            x[2, 18] = float("inf")  # its up: y = inf
    y, amax = ops._swiglu_packed_amax(x)
    _assert_same(y, ops.swiglu_packed(x))
    _assert_amax(amax, y)
    if special == "nan":
        assert torch.isnan(amax).item()
    if special == "inf":
        assert amax.item() == float("inf")
    if special in ("zero", "empty_rows", "empty_cols"):
        assert amax.item() == 0.0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_swiglu_packed_amax_gradients_match(device, dtype):
    x = _randn((5, 3, 2 * 45), dtype, device).requires_grad_()
    gy = _randn((5, 3, 45), dtype, device)
    y, amax = ops._swiglu_packed_amax(x)
    y0 = ops.swiglu_packed(x)
    assert y.grad_fn.name() == y0.grad_fn.name() and not amax.requires_grad
    (g,) = torch.autograd.grad(y, x, gy)
    (g0,) = torch.autograd.grad(y0, x, gy)
    _assert_same(g, g0)


def test_swiglu_packed_amax_double_backward_matches():
    x = _randn((4, 12), torch.float64, "cpu").requires_grad_()
    gy = _randn((4, 6), torch.float64, "cpu").requires_grad_()
    (g,) = torch.autograd.grad(ops._swiglu_packed_amax(x)[0], x, gy, create_graph=True)
    (g0,) = torch.autograd.grad(ops.swiglu_packed(x), x, gy, create_graph=True)
    for a, b in zip(torch.autograd.grad(g.sum(), (x, gy)), torch.autograd.grad(g0.sum(), (x, gy))):
        _assert_same(a, b)


def test_swiglu_packed_amax_meta_and_errors():
    y, amax = ops._swiglu_packed_amax(torch.empty((3, 5, 8), dtype=torch.float16, device="meta"))
    assert y.shape == (3, 5, 4) and y.dtype == torch.float16 and amax.shape == (1,) and amax.dtype == torch.float32
    assert ops._swiglu_packed_amax(torch.empty((2, 4), dtype=torch.float64, device="meta"))[1].dtype == torch.float64
    with pytest.raises(ValueError, match="swiglu_packed.*even"):
        ops._swiglu_packed_amax(torch.randn(3, 5))
    with pytest.raises(TypeError, match="swiglu_packed"):
        ops._swiglu_packed_amax(torch.ones(3, 4, dtype=torch.int32))


# ---- opcheck, threads, sharding rules -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["rms_norm", "fused", "swiglu_packed"])
def test_opcheck(case):
    x = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, dtype=torch.float64, requires_grad=True)
    if case == "rms_norm":
        op, args = ops._rms_norm_forward_amax.default, (x, [32], w, None)
    elif case == "fused":
        r = torch.randn(6, 32, dtype=torch.float64, requires_grad=True)
        op, args = ops._fused_add_rms_norm_forward_amax.default, (x, r, [32], w, 1e-6)
    else:
        op, args = ops._swiglu_packed_amax.default, (x,)
    torch.library.opcheck(op, args)


def test_cpu_amax_independent_of_threads():
    x = _randn((257, 1030), torch.bfloat16, "cpu", 4.0)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [ops._rms_norm_forward_amax(x, [1030], None, None)[2], ops._swiglu_packed_amax(x)[1]]
        torch.set_num_threads(max(n, 2))
        many = [ops._rms_norm_forward_amax(x, [1030], None, None)[2], ops._swiglu_packed_amax(x)[1]]
    finally:
        torch.set_num_threads(n)
    for a, b in zip(one, many):
        _assert_same(a, b)


def test_sharding_rules_replicate_amax():
    from opforge.parallel.sharding import RULES, R
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    class Spec:  # what the rules read: the tensor's shape
        def __init__(self, shape):
            self.tensor_meta = TensorMeta(torch.Size(shape), (), torch.float32)

    x = Spec((4, 8, 64))
    for name, args in [("_rms_norm_forward_amax", (x, [64], Spec((64,)), None)),
                       ("_fused_add_rms_norm_forward_amax", (x, x, [64], Spec((64,)), None)),
                       ("_swiglu_packed_amax", (x,))]:
        strategies = RULES[name](*args)
        assert strategies, name
        for outs, ins in strategies:
            assert all(p == R for p in outs), (name, outs)
            assert all(p in (R, None) for p in ins), (name, ins)
