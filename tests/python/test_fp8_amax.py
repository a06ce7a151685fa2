"""input_amax of the FP8 private ops: `_fp8_linear_forward`, `_fp8_linear_quantized` and
`_fp8_linear_quantized_backward` take max|input| from the kernel that wrote input in place of their own amax pass. With
the input's true amax every output and gradient is bit-identical to the call without it (bf16/fp16/fp32/fp64, ragged
shapes, zeros, NaN, inf, save_input on and off, with and without a weight gradient); a given amax is the one the
scale comes from (checked against the recipe computed here); malformed ones raise errors naming the op (Meta kernels
too); the amax gets no gradient; `_fp8_cache.input_amax` hands it down through a module call to
`_fp8_cache.linear` for that very tensor only; the DTensor rules take it replicated."""
import contextlib
import threading

import pytest
import torch

import opforge
from conftest import ALL_DEVICES, spawn_gloo
from opforge import _fp8_cache, testing

OPS = torch.ops.opforge
E4 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


_same = testing.same_bits


def _amax(x):
    """max|x| as the producers return it: [1], float32 (float64 for float64), NaN/inf propagated, 0 when empty."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.numel() == 0:
        return torch.zeros(1, dtype=dt, device=x.device)
    return x.abs().max().to(dt).reshape(1)


def _input(shape, dtype, device, special):
    x = (torch.randn(shape, dtype=torch.float64) * 3).to(dtype)
    if special == "zeros":
        x.zero_()
    elif x.numel() and special == "nan":
        x.view(-1)[x.numel() // 2] = float("nan")
    elif x.numel() and special == "inf":
        x.view(-1)[-1] = float("-inf")
    return x.to(device)


def _weight_operands(w):
    return tuple(OPS._quantize_fp8_weight(w.detach(), "tensorwise"))


# ---- bit-identical with the true amax ---------------------------------------------------------------------------

SHAPES = [((37, 53), 19), ((3, 5, 23), 9), ((1, 7), 5), ((130, 70), 65), ((0, 16), 8), ((16, 32), 16)]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, N", SHAPES)
@pytest.mark.parametrize("special", ["normal", "zeros", "nan", "inf"])
@pytest.mark.parametrize("save_input", [False, True])
@pytest.mark.parametrize("weight_grad", [True, False])
def test_given_amax_is_bitwise_the_amax_pass(device, dtype, x_shape, N, special, save_input, weight_grad):
    x = _input(x_shape, dtype, device, special)
    w = (torch.randn(N, x_shape[-1], dtype=torch.float64) * 0.2).to(dtype).to(device)
    b = torch.randn(N, dtype=dtype, device=device)
    q = _weight_operands(w)
    g = torch.randn(*x_shape[:-1], N, dtype=dtype, device=device)
    results = []
    for amax in (None, _amax(x)):
        xi = x.clone().requires_grad_()
        wi = w.clone().requires_grad_(weight_grad)
        y = OPS._fp8_linear_quantized(xi, wi, *q, b, save_input=save_input, input_amax=amax)
        y.backward(g)
        results.append((y.detach(), xi.grad, wi.grad))
    for a, c in zip(*results):
        assert _same(a, c)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape, N", SHAPES)
@pytest.mark.parametrize("special", ["normal", "nan", "inf"])
def test_private_forward_and_backward_ops_with_amax_are_bitwise(device, dtype, x_shape, N, special):
    x = _input(x_shape, dtype, device, special)
    w = (torch.randn(N, x_shape[-1], dtype=torch.float64) * 0.2).to(dtype).to(device)
    a = _amax(x)
    for out, ref in zip(OPS._fp8_linear_forward(x, w, input_amax=a), OPS._fp8_linear_forward(x, w)):
        assert _same(out, ref)
    g = torch.randn(*x_shape[:-1], N, dtype=dtype, device=device)
    _, _, wt, wt_inv = _weight_operands(w)
    for mask in ([True, True, True], [False, True, False]):
        ref = OPS._fp8_linear_quantized_backward(g, x, None, None, w, wt, wt_inv, mask, "tensorwise", None, dtype)
        out = OPS._fp8_linear_quantized_backward(g, x, None, None, w, wt, wt_inv, mask, "tensorwise", None, dtype,
                                                 input_amax=a)
        for o, r in zip(out, ref):
            assert _same(o, r)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_transposed_and_sliced_inputs_take_the_amax(device):
    """A transposed view (the backward's row kernel on Xᵀ) and a sliced input (an offset, unaligned data)."""
    base = torch.randn(40, 66, dtype=torch.bfloat16, device=device)
    w = torch.randn(9, 33, dtype=torch.bfloat16, device=device)
    _, _, wt, wt_inv = _weight_operands(w)
    for x in (base[:, 1:34], base[:33, :40].t()):
        g = torch.randn(x.shape[0], 9, dtype=torch.bfloat16, device=device)
        for o, r in zip(OPS._fp8_linear_forward(x, w, input_amax=_amax(x)), OPS._fp8_linear_forward(x, w)):
            assert _same(o, r)
        mask = [False, True, False]
        out = OPS._fp8_linear_quantized_backward(g, x, None, None, w, wt, wt_inv, mask, input_amax=_amax(x))
        ref = OPS._fp8_linear_quantized_backward(g, x, None, None, w, wt, wt_inv, mask)
        assert _same(out[1], ref[1])


# ---- the scale comes from the given amax ------------------------------------------------------------------------

@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scale_comes_from_the_given_amax(device, dtype):
    """With amax = 3·max|x| (not a power of 2, which would scale the FP8 values exactly) the quantized input is the
    recipe's for that amax rounded to x's dtype (fp8_math.h: scale = float32(448 / amax) in float64, data =
    e4m3(clamp(float32(x) · scale, ±448))), in every path that quantizes input or inputᵀ."""
    x = (torch.randn(21, 35, dtype=torch.float64) * 2).to(dtype).to(device)
    w = (torch.randn(11, 35, dtype=torch.float64) * 0.2).to(dtype).to(device)
    a = _amax(x) * 3
    scale = torch.tensor(448.0 / a.to(dtype).double().item(), dtype=torch.float32)
    q_ref = (x.float().cpu() * scale).clamp(-448, 448).to(E4)
    inv_ref = (1.0 / scale).reshape(1)
    y, qt, qt_inv = OPS._fp8_linear_forward(x, w, input_amax=a)
    assert _same(qt.cpu(), q_ref.t().contiguous()) and _same(qt_inv.cpu(), inv_ref)
    y_own = OPS._fp8_linear_forward(x, w)[0]
    assert not _same(y, y_own)  # the amax changed the input's quantization
    # _fp8_linear_quantized's row quantization gives the same forward
    q = _weight_operands(w)
    assert _same(OPS._fp8_linear_quantized(x, w, *q, None, input_amax=a), y)
    # the backward's q(inputᵀ) from a saved input: the grad_weight of the operand computed here
    g = torch.randn(21, 11, dtype=dtype, device=device)
    mask = [False, True, False]
    out = OPS._fp8_linear_quantized_backward(g, x, None, None, w, None, None, mask, input_amax=a)
    ref = OPS._fp8_linear_quantized_backward(g, None, q_ref.t().contiguous().to(device), inv_ref.to(device), w, None,
                                             None, mask)
    assert _same(out[1], ref[1])


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_amax_of_the_higher_precision_tensor_is_rounded_to_input_dtype(device, dtype):
    """The kernels round a given amax to input's dtype: the float32 amax of a tensor that input was rounded from
    (what autocast's cast of the input makes of a producer's output) gives input's own amax, bit for bit."""
    x32 = torch.randn(19, 45, device=device) * 3
    x = x32.to(dtype)
    w = torch.randn(7, 45, dtype=dtype, device=device)
    assert not _same(_amax(x32), _amax(x))
    for o, r in zip(OPS._fp8_linear_forward(x, w, input_amax=_amax(x32)), OPS._fp8_linear_forward(x, w)):
        assert _same(o, r)


def test_autocast_with_the_amax_of_the_float32_input_is_bitwise():
    x = torch.randn(13, 40) * 2
    w = torch.randn(6, 40, requires_grad=True)
    q = _weight_operands(w)
    outs = []
    for amax in (None, _amax(x)):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = OPS._fp8_linear_quantized(xi, w, *q, None, save_input=True, input_amax=amax)
        w.grad = None
        y.float().sum().backward()
        outs.append((y.detach(), xi.grad, w.grad))
    assert outs[0][0].dtype == torch.bfloat16
    for a, c in zip(*outs):
        assert _same(a, c)


# ---- autograd: no gradient to the amax ----------------------------------------------------------------------------

def test_amax_gets_no_gradient_and_is_saved_only_with_the_input():
    x = torch.randn(9, 24, requires_grad=True)
    w = torch.randn(5, 24, requires_grad=True)
    q = _weight_operands(w)
    amax = _amax(x.detach()).requires_grad_()
    for save_input in (False, True):
        y = OPS._fp8_linear_quantized(x, w, *q, None, save_input=save_input, input_amax=amax)
        y.sum().backward()
        assert amax.grad is None and x.grad is not None and w.grad is not None
        with pytest.raises(RuntimeError):  # not in the graph: no path from y to the amax
            torch.autograd.grad(OPS._fp8_linear_quantized(x, w, *q, None, input_amax=amax).sum(), amax)


# ---- errors -------------------------------------------------------------------------------------------------------

def test_input_amax_errors():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(3, 8, dtype=torch.bfloat16)
    q = _weight_operands(w)
    qr = tuple(OPS._quantize_fp8_weight(w, "rowwise"))
    a = _amax(x)
    g = torch.randn(4, 3, dtype=torch.bfloat16)
    mask = [True, True, False]
    cases = [
        (lambda t: OPS._fp8_linear_quantized(x, w, *q, None, input_amax=t), "_fp8_linear_quantized"),
        (lambda t: OPS._fp8_linear_forward(x, w, input_amax=t), "_fp8_linear_forward"),
        (lambda t: OPS._fp8_linear_quantized_backward(g, x, None, None, w, None, None, mask, input_amax=t),
         "_fp8_linear_quantized_backward"),
    ]
    for call, op in cases:
        with pytest.raises(TypeError, match=f"{op}.*input_amax to be Float for a BFloat16 input, but got BFloat16"):
            call(a.to(torch.bfloat16))
        with pytest.raises(TypeError, match=f"{op}.*input_amax to be Float.*but got Double"):
            call(a.double())
        with pytest.raises(ValueError, match=rf"{op}.*input_amax of shape \[1\].*but got \[\]"):
            call(a.reshape(()))
        with pytest.raises(ValueError, match=rf"{op}.*input_amax of shape \[1\].*but got \[2\]"):
            call(a.repeat(2))
        with pytest.raises(RuntimeError, match=f"{op}.*input_amax and input to be on the same device"):
            call(a.to("meta"))
    with pytest.raises(TypeError, match="_fp8_linear_forward.*input_amax to be Double for a Double input"):
        OPS._fp8_linear_forward(x.double(), w.double(), input_amax=a)
    with pytest.raises(ValueError, match="_fp8_linear_quantized: expected input_amax only with granularity"):
        OPS._fp8_linear_quantized(x, w, *qr, None, granularity="rowwise", input_amax=a)
    with pytest.raises(ValueError, match="_fp8_linear_quantized_backward: expected input_amax only with granularity"):
        OPS._fp8_linear_quantized_backward(g, x, None, None, w, None, None, mask, "rowwise", input_amax=a)
    with pytest.raises(ValueError, match="_fp8_linear_quantized_backward: expected input with input_amax"):
        xt, xt_inv = OPS._fp8_linear_forward(x, w)[1:]
        OPS._fp8_linear_quantized_backward(g, None, xt, xt_inv, w, None, None, mask, input_amax=a)


def test_meta_kernels_check_input_amax():
    x = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    w = torch.empty(3, 8, dtype=torch.bfloat16, device="meta")
    d, s = torch.empty(3, 8, dtype=E4, device="meta"), torch.empty(1, device="meta")
    dt = torch.empty(8, 3, dtype=E4, device="meta")
    good = torch.empty(1, device="meta")
    assert OPS._fp8_linear_quantized(x, w, d, s, dt, s, None, input_amax=good).shape == (4, 3)
    assert OPS._fp8_linear_forward(x, w, input_amax=good)[1].shape == (8, 4)
    with pytest.raises(TypeError, match="_fp8_linear_quantized: expected input_amax to be Float"):
        OPS._fp8_linear_quantized(x, w, d, s, dt, s, None, input_amax=good.double())
    with pytest.raises(ValueError, match=r"_fp8_linear_forward: expected input_amax of shape \[1\]"):
        OPS._fp8_linear_forward(x, w, input_amax=torch.empty(1, 1, device="meta"))
    g = torch.empty(4, 3, dtype=torch.bfloat16, device="meta")
    out = OPS._fp8_linear_quantized_backward(g, x, None, None, w, None, None, [True, True, False], input_amax=good)
    assert out[1].shape == (3, 8)
    with pytest.raises(ValueError, match="_fp8_linear_quantized_backward: expected input_amax only with"):
        OPS._fp8_linear_quantized_backward(g, x, None, None, w, None, None, [True, True, False], "rowwise",
                                           input_amax=good)


# ---- _fp8_cache: linear's input_amax and the input_amax block ----------------------------------------------------

def _layer(dtype=torch.float32, fp8="tensorwise"):
    return opforge.nn.Linear(24, 10, fp8=fp8, dtype=dtype)


def _run(m, h, amax=None):
    """The layer's output and input gradient on a fresh leaf copy of h, inside an `input_amax` block for it when
    `amax` is given."""
    h = h.detach().requires_grad_()
    with _fp8_cache.input_amax(h, amax) if amax is not None else contextlib.nullcontext():
        y = m(h)
    y.sum().backward()
    return y.detach(), h.grad


def _with_amax(m, t, a):
    """The private op itself on the layer's cached operands, given amax `a` (what the layer should run)."""
    ops = _fp8_cache.operands(m.weight, m.fp8)
    return OPS._fp8_linear_quantized(t, m.weight, *ops, m.bias, granularity=m.fp8, input_amax=a).detach()


def test_cache_linear_forwards_the_blocks_amax():
    m = _layer()
    h = torch.randn(6, 24)
    ref = _run(m, h)
    assert all(_same(a, b) for a, b in zip(_run(m, h, _amax(h)), ref))
    wrong = _run(m, h, _amax(h) * 3)
    assert not _same(wrong[0], ref[0])  # the given amax is used
    # rowwise ignores it (a wrong one changes nothing)
    mr = _layer(fp8="rowwise")
    assert _same(_run(mr, h, _amax(h) * 3)[0], _run(mr, h)[0])


def test_input_amax_block_hands_the_amax_to_that_tensor_only():
    m = _layer()
    h = torch.randn(6, 24)
    wrong = _amax(h) * 3  # a wrong amax shows where it was used
    ref = m(h).detach()
    used = _with_amax(m, h, wrong)
    assert not _same(used, ref)
    with _fp8_cache.input_amax(h, wrong):
        assert _same(m(h), used)
        assert _same(m(h.clone()), ref)  # another tensor with the same values
        assert _same(m(h.view(6, 24)), ref)  # a view is another object
    assert _same(m(h), ref)  # nothing stays after the block
    # an in-place write after the block opened: the amax no longer describes h
    h2 = torch.randn(6, 24)
    with _fp8_cache.input_amax(h2, _amax(h2) * 3):
        h2.mul_(1.0)
        assert _same(m(h2), m(h2.clone()))


def test_input_amax_block_hands_nothing_for_an_inference_tensor():
    """An inference tensor has no version counter (an in-place write to it could not be seen): the block is accepted
    and the GEMM computes the amax itself (a wrong amax given has no effect)."""
    m = _layer()
    with torch.inference_mode():
        h = torch.randn(6, 24)
        ref = m(h.clone())
        with _fp8_cache.input_amax(h, _amax(h) * 3):
            assert _same(m(h), ref)
    assert not getattr(_fp8_cache._LOCAL, "amax", [])


def test_input_amax_blocks_nest_and_stay_in_their_thread():
    m = _layer()
    h, k = torch.randn(6, 24), torch.randn(6, 24)
    a3, a5 = _amax(h) * 3, _amax(h) * 5
    with _fp8_cache.input_amax(h, a3):
        with _fp8_cache.input_amax(k, _amax(k) * 3):
            assert _same(m(h), _with_amax(m, h, a3))  # the outer entry still serves h
            assert _same(m(k), _with_amax(m, k, _amax(k) * 3))
        with _fp8_cache.input_amax(h, a5):
            assert _same(m(h), _with_amax(m, h, a5))  # the innermost entry wins
        assert _same(m(h), _with_amax(m, h, a3))
        seen = []
        t = threading.Thread(target=lambda: seen.append(m(h).detach()))
        t.start()
        t.join()
        assert _same(seen[0], m(h.clone()))  # another thread sees no block
    assert not getattr(_fp8_cache._LOCAL, "amax", [])


def test_input_amax_block_under_saving_input_is_bitwise():
    """The patch's recompute mode: the GEMM saves its input and amax; the backward's q(inputᵀ) takes the amax."""
    m = _layer(torch.bfloat16)
    h = torch.randn(33, 24, dtype=torch.bfloat16)
    ref = _run(m, h)
    ref_w = m.weight.grad.clone()
    m.weight.grad = None
    with _fp8_cache.saving_input():
        hh = h.detach().requires_grad_()
        with _fp8_cache.input_amax(hh, _amax(h)):
            y = m(hh)
        y.sum().backward()
    assert _same(y.detach(), ref[0]) and _same(hh.grad, ref[1]) and _same(m.weight.grad, ref_w)


# ---- DTensor: input_amax replicated ------------------------------------------------------------------------------

def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    import opforge.parallel  # noqa: F401  (registers the rules)

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    w = torch.randn(4, 16)
    q = _weight_operands(w)
    a = _amax(x)
    R = [Replicate()]

    def d(t):
        return DTensor.from_local(t, mesh, R)

    y = OPS._fp8_linear_quantized(d(x), d(w), *[d(t) for t in q], None, input_amax=d(a))
    assert _same(y.to_local(), OPS._fp8_linear_quantized(x, w, *q, None))
    f = OPS._fp8_linear_forward(d(x), d(w), input_amax=d(a))
    assert all(_same(o.to_local(), r) for o, r in zip(f, OPS._fp8_linear_forward(x, w)))
    g = torch.randn(8, 4)
    mask = [True, True, False]
    out = OPS._fp8_linear_quantized_backward(d(g), d(x), None, None, d(w), None, None, mask, input_amax=d(a))
    ref = OPS._fp8_linear_quantized_backward(g, x, None, None, w, None, None, mask)
    assert _same(out[0].to_local(), ref[0]) and _same(out[1].to_local(), ref[1])


def test_dtensor_rules_take_input_amax_replicated(tmp_path):
    spawn_gloo(tmp_path, _dtensor_worker, world=2)


# ---- opcheck: Meta/fake kernels, autograd registration, AOT dispatch with input_amax ---------------------------
# (opcheck's test_schema multiplies the FP8 operands, which the CPU's mul lacks: left out)
UTILS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")

@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("save_input", [False, True])
def test_opcheck_with_input_amax(device, save_input):
    x = torch.randn(6, 24, device=device, requires_grad=True)
    w = torch.randn(5, 24, device=device, requires_grad=True)
    q = _weight_operands(w)
    a = _amax(x.detach())
    torch.library.opcheck(OPS._fp8_linear_quantized.default, (x, w, *q, None),
                          {"save_input": save_input, "input_amax": a}, test_utils=UTILS)
    torch.library.opcheck(OPS._fp8_linear_forward.default, (x.detach(), w.detach()), {"input_amax": a},
                          test_utils=UTILS)
    g = torch.randn(6, 5, device=device)
    torch.library.opcheck(OPS._fp8_linear_quantized_backward.default,
                          (g, x.detach(), None, None, w.detach(), None, None, [True, True, False]), {"input_amax": a},
                          test_utils=UTILS)
