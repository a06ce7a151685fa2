"""linear_cross_entropy: values and gradients against float64, the five cases from real bug reports,
opcheck, torch.compile, gradcheck, torch.func, bad inputs and agreement with torch's F.linear_cross_entropy. On CUDA
every test runs in both modes of OPFORGE_LCE_LEAN (ids "cuda" and "cuda-lean", conftest.lce_device_fixture); lean
mode's own checks are at the end."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, linear_cross_entropy_reference, relative_error

from conftest import _NO_CUDA, LCE_LEAN, lce_device_fixture, lce_lean, lce_lean_loss_bound

LOSS_DTYPES = [torch.float32, torch.bfloat16]

device = lce_device_fixture()  # "cpu", "cuda" (OPFORGE_LCE_LEAN=0), "cuda-lean" (OPFORGE_LCE_LEAN=1)
# the tests of OPFORGE_LCE_DW_ACCUM, which lean mode overrides (it accumulates dW in the 16-bit dtype): the default
# mode only (the knob OPFORGE_LCE_LEAN is 0 unless set, and these tests set nothing else)
_DEFAULT_MODE_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_NO_CUDA)])


def _data(N, H, V, dtype, device, *, bias=False, ignore_frac=0.0, scale=1.0):
    x = (torch.randn(N, H, device=device) * scale).to(dtype)
    w = (torch.randn(V, H, device=device) / math.sqrt(H)).to(dtype)
    b = torch.randn(V, device=device).to(dtype) if bias else None
    t = torch.randint(0, V, (N,), device=device)
    if ignore_frac:
        t[torch.rand(N, device=device) < ignore_frac] = -100
    return x, w, b, t


def _grads(fn, x, w, b, **kw):
    """(loss, grad_input, grad_linear_weight, grad_linear_bias) of fn(...).sum()-or-weighted backward."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = None if b is None else b.detach().clone().requires_grad_()
    gw = kw.pop("grad_weights", None)
    loss = fn(x, w, linear_bias=b, **kw)
    (loss * gw).sum().backward() if gw is not None else loss.sum().backward()
    return loss.detach(), x.grad, w.grad, None if b is None else b.grad


def _ours(x, w, t):
    return lambda xx, ww, **kw: opforge.linear_cross_entropy(xx, ww, t, **kw)


def _ref(x, w, t, dtype=torch.float64):
    def f(xx, ww, chunk_size=None, **kw):
        return linear_cross_entropy_reference(xx, ww, t, compute_dtype=dtype, **kw)
    return f


def _lean_terms(x, w, b, t, kw):
    """In lean mode (conftest.lce_lean): (the rule's factor for grad_linear_weight, lean_rounding_bound of the
    loss) for a call with keyword arguments kw; (None, None) otherwise. The weight gradient accumulates in its
    16-bit dtype over the chunks (_accum_factor(k), k > 1 chunks; the bias gradient stays fp32-accumulated), and the
    loss carries the rounding of the logits to the storage dtype (conftest.lce_lean_loss_bound: lean_rounding_bound
    from the float64 loss as a function of the raw logits)."""
    if not lce_lean(x, w, b):
        return None, None
    N = t.numel()
    k = math.ceil(N / (kw.get("chunk_size") or max(N, 1)))
    rkw = {n: v for n, v in kw.items() if n != "grad_weights"}
    return (_accum_factor(k) if k > 1 else None), lce_lean_loss_bound(x, w, t, b, **rkw)


def _check_all(x, w, b, t, *, param_factor=2.0, **kw):
    """ours vs float64 with the tolerance rule (baseline: the same eager math in the input's dtype); param_factor:
    the rule's factor for grad_linear_weight and grad_linear_bias (2, the rule's own, unless they accumulate in a
    16-bit dtype: _accum_factor). In lean mode the weight gradient's factor is at least _accum_factor(k) and the
    loss may also pass by the a-priori bound of its logits' rounding (_lean_terms)."""
    lean_factor, loss_bound = _lean_terms(x, w, b, t, kw)
    ours = _grads(_ours(x, w, t), x, w, b, **kw)
    ref = _grads(_ref(x, w, t), x, w, b, **kw)
    base = _grads(_ref(x, w, t, x.dtype), x, w, b, **kw)
    for name, o, r, bl in zip(["loss", "grad_input", "grad_linear_weight", "grad_linear_bias"], ours, ref, base):
        if r is None:
            assert o is None, name
            continue
        factor = param_factor if name in ("grad_linear_weight", "grad_linear_bias") else 2.0
        if name == "grad_linear_weight" and lean_factor is not None:
            factor = max(factor, lean_factor)
        assert_matches_reference(o, r.to(o.dtype) if o.dtype == torch.float64 else r, bl.to(o.dtype), what=name,
                                 factor=factor, bound=loss_bound.reshape(r.shape) if name == "loss" and
                                 loss_bound is not None else None)
    return ours, ref


# ---- values and gradients over the options ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0}, {"classw": True},
                                  {"label_smoothing": 0.2, "classw": True, "z_loss": 1e-4, "softcap": 3.0}])
def test_matches_float64(device, dtype, reduction, opts):
    opts = dict(opts)
    x, w, b, t = _data(37, 24, 83, dtype, device, bias=True, ignore_frac=0.2, scale=2.0)
    if opts.pop("classw", False):
        opts["weight"] = torch.rand(83, device=device) + 0.5
    grad_weights = torch.randn(37, device=device).to(dtype) if reduction == "none" else None
    _check_all(x, w, b, t, reduction=reduction, chunk_size=8, grad_weights=grad_weights, **opts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("autocast", [False, True])
def test_loss_is_float32_for_16bit_inputs(device, dtype, reduction, autocast):
    """16-bit inputs (or float32 inputs under autocast): the loss is returned in float32 at float32 precision, not
    a float32 copy of a 16-bit rounding (bf16's step at a loss near 7 is 0.03; a 16-bit loss is off by up to
    2e-3 relative, more than this test's 1e-4 bound). The reference: float64 math on the same 16-bit values. The
    data make every logit exact in both 16-bit dtypes (x in {-1, 0, 1}, w in multiples of 1/8 up to 1/2, H = 64: each
    logit is a multiple of 1/8 of magnitude at most 32, 8 significant bits), so lean mode's rounding of the logits to
    the storage dtype (OPFORGE_LCE_LEAN=1) is exact here and the bound holds in both modes."""
    torch.manual_seed(7)
    N, H, V = 512, 64, 100
    x = torch.randint(-1, 2, (N, H), device=device).float()
    w = torch.randint(-4, 5, (V, H), device=device).float() / 8
    t = torch.randint(0, V, (N,), device=device)
    if autocast:
        with torch.autocast(device, dtype=dtype):
            loss = opforge.linear_cross_entropy(x, w, t, reduction=reduction)
    else:
        x, w = x.to(dtype), w.to(dtype)
        loss = opforge.linear_cross_entropy(x, w, t, reduction=reduction)
    assert loss.dtype == torch.float32
    ref = linear_cross_entropy_reference(x.to(dtype), w.to(dtype), t, reduction=reduction)
    err = ((loss.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-4, f"relative error {err:.2e}"


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_chunk_size_does_not_change_the_result(device, chunk):
    x, w, b, t = _data(50, 16, 129, torch.float64, device, bias=True, ignore_frac=0.3)
    ours = _grads(_ours(x, w, t), x, w, b, chunk_size=chunk, label_smoothing=0.1)
    ref = _grads(_ref(x, w, t), x, w, b, label_smoothing=0.1)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 11, 64])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_16bit_chunk_sizes(device, chunk, reduction):
    """bfloat16 with N = 11 tokens at chunk sizes that give full and partial last chunks (CUDA runs one dW GEMM per
    chunk from its bf16 logit gradient): every gradient against float64 by the tolerance rule, at every chunk size, on
    the gradient-in-forward ("mean") and the recompute ("none") path."""
    x, w, b, t = _data(11, 24, 70, torch.bfloat16, device, bias=True, ignore_frac=0.2, scale=2.0)
    gw = torch.rand(11, device=device).to(torch.bfloat16) if reduction == "none" else None
    _check_all(x, w, b, t, reduction=reduction, chunk_size=chunk, grad_weights=gw)


def test_batch_dims_and_non_contiguous(device):
    x = torch.randn(3, 16, 5, device=device).transpose(1, 2)  # (3, 5, 16), non-contiguous
    w = torch.randn(16, 40, device=device).t()                 # (40, 16), transposed
    t = torch.randint(0, 40, (3, 5), device=device)
    loss = opforge.linear_cross_entropy(x, w, t, reduction="none")
    assert loss.shape == (3, 5)
    torch.testing.assert_close(loss, linear_cross_entropy_reference(x, w, t, reduction="none").float(),
                               rtol=1e-5, atol=1e-5)


# ---- the cases from real bug reports ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_case1_per_token_weighted_none_reduction(device, dtype):
    N, H, V = 8, 10, 15
    x, w, b, t = _data(N, H, V, dtype, device, bias=True)
    t[1] = -100
    t[6] = -100
    pw = torch.tensor([0, 1, 2, .5, 3, 0, 1, 4], device=device, dtype=dtype)
    (loss, gi, gw, gb), _ = _check_all(x, w, b, t, reduction="none", grad_weights=pw, chunk_size=3)
    for row in (0, 1, 5, 6):
        assert torch.equal(gi[row], torch.zeros_like(gi[row])), row
    assert loss[1] == 0 and loss[6] == 0


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_case1_large(device, dtype):
    # the bug report's size on CUDA; on CPU a smaller one of the same shape of problem (CI's 2 cores)
    N, H, V, chunk = (4096, 256, 32000, 1000) if device == "cuda" else (768, 64, 5000, 200)
    x, w, b, t = _data(N, H, V, dtype, device, bias=True, ignore_frac=0.1)
    pw = torch.rand(N, device=device).to(dtype) * 4
    pw[::7] = 0
    (loss, gi, _, _), _ = _check_all(x, w, b, t, reduction="none", grad_weights=pw, chunk_size=chunk)
    zero_rows = (pw == 0) | (t == -100)
    assert torch.equal(gi[zero_rows], torch.zeros_like(gi[zero_rows]))


def test_case2_weight_gradient_across_chunks(device):
    """bf16 weight gradient over 1 to 256 chunks against float64: within 3e-3 (norm-relative) at every chunk size, and
    no worse than 1.5x the best (fp32 accumulation across chunks). In lean mode dW accumulates in bf16, one rounding
    per chunk (k chunks), each off by at most u = 2^-8 of its partial sum A_c elementwise, so the bound adds
    u · Σ_c ‖A_c‖ / ‖dW‖ (the triangle inequality over the k roundings; A_c from the float64 logit gradient) and the
    1.5x comparison across chunk sizes does not apply."""
    N, H, V = 8192, 512, 1024
    x, w, _, t = _data(N, H, V, torch.bfloat16, device)
    lean = lce_lean(x, w)
    w64 = w.double().requires_grad_()
    linear_cross_entropy_reference(x, w64, t).backward()
    dL = _logit_grad64(x, w, None, t) if lean else None
    errs, bounds = [], []
    for chunk in (8192, 1024, 128, 32):
        wq = w.detach().clone().requires_grad_()
        opforge.linear_cross_entropy(x, wq, t, chunk_size=chunk).backward()
        errs.append(relative_error(wq.grad, w64.grad))
        extra = 0.0
        if lean:
            A = torch.zeros(V, H, dtype=torch.float64, device=device)
            for s0 in range(0, N, chunk):
                A += dL[s0:s0 + chunk].t() @ x[s0:s0 + chunk].double()
                extra += 2.0 ** -8 * A.norm().item()
            extra /= w64.grad.norm().item()
        bounds.append(3e-3 + extra)
    assert all(e <= bd for e, bd in zip(errs, bounds)), (errs, bounds)
    if not lean:
        assert max(errs) <= 1.5 * min(errs), errs


def test_case2_frozen_lm_head_allocates_no_weight_gradient(device):
    N, H, V = 1024, 256, 4096
    x, w, _, t = _data(N, H, V, torch.bfloat16, device)
    x.requires_grad_()
    out = torch.ops.opforge.linear_cross_entropy_backward(
        torch.tensor(1.0, device=device), x, w, t, torch.zeros(N, 2, device=device), None, None, "mean", -100, 0.0,
        0.0, None, [True, False, False])
    assert out[0] is not None and out[1] is None and out[2] is None
    if device != "cuda":
        return
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opforge.linear_cross_entropy(x, w, t, chunk_size=256).backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert w.grad is None
    # one fp32 chunk + its bf16 copy + grad_input + small vectors; a V x H fp32 buffer would add 4 MiB
    assert peak < 256 * V * 6 + N * H * 2 + V * H * 4 // 2, peak


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_case3_dominating_bias(device, dtype):
    N, H, V = 512, 64, 1000
    x, w, _, t = _data(N, H, V, dtype, device)
    b = 2 * torch.randn(V, device=device)
    b[17] = 8.0
    b = b.to(dtype)
    t[: N // 4] = 17
    t[torch.rand(N, device=device) < 0.1] = -100
    (loss, *_), _ = _check_all(x, w, b, t, reduction="none", chunk_size=100)
    assert (loss >= 0).all()
    _check_all(x, w, b, t, reduction="mean", chunk_size=100)
    no_bias = _grads(_ours(x, w, t), x, w, None, reduction="none")
    zero_bias = _grads(_ours(x, w, t), x, w, torch.zeros(V, device=device, dtype=dtype), reduction="none")
    for a, z in zip(no_bias[:3], zero_bias[:3]):
        assert torch.equal(a, z)


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_case4_large_common_offsets(device, dtype):
    V, N, H = 50, 6, 8
    offsets = [0.0, 1e4, 1e6, 1e8] if dtype == torch.float32 else [0.0, 256.0, 4096.0, 65536.0]
    for C in offsets:
        x = torch.randn(N, H, device=device, dtype=dtype)
        w = torch.zeros(V, H, device=device, dtype=dtype)
        b = torch.full((V,), C, device=device, dtype=dtype)
        t = torch.randint(0, V, (N,), device=device)
        loss = opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none")
        torch.testing.assert_close(loss.float(), torch.full((N,), math.log(V), device=device),
                                   rtol=0, atol=1e-6 if dtype == torch.float32 else 2e-2, msg=f"C={C}")
        b2 = torch.tensor([C + 8, C], device=device, dtype=dtype)
        if b2[0] - b2[1] != 8:  # C + 8 not representable in dtype
            continue
        w2 = torch.zeros(2, H, device=device, dtype=dtype, requires_grad=True)
        b2.requires_grad_()
        x2 = torch.randn(2, H, device=device, dtype=dtype)
        loss2 = opforge.linear_cross_entropy(x2, w2, torch.tensor([0, 1], device=device), linear_bias=b2,
                                             reduction="none")
        tol = 1e-6 if dtype == torch.float32 else 4e-2
        torch.testing.assert_close(loss2.float(), torch.tensor([3.354064e-4, 8.000335], device=device),
                                   rtol=tol, atol=tol * 1e-2, msg=f"C={C}")
        loss2.sum().backward()
        assert w2.grad.abs().sum() > 0 and b2.grad.abs().sum() > 0, f"C={C}"


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_case5_every_target_ignored(device, dtype):
    x, w, b, t = _data(16, 8, 30, dtype, device, bias=True)
    t[:] = -100
    for reduction in ["mean", "sum", "none"]:
        loss, gi, gw, gb = _grads(_ours(x, w, t), x, w, b, reduction=reduction, chunk_size=5)
        ref = TF.cross_entropy((x.float() @ w.float().t() + b.float()), t, reduction=reduction)
        if reduction == "mean":
            assert torch.isnan(loss) and torch.isnan(ref)
        else:
            assert torch.equal(loss.float(), ref)
        for g, like in ((gi, x), (gw, w), (gb, b)):
            assert g is not None and g.shape == like.shape and torch.equal(g, torch.zeros_like(like)), reduction


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("scale", [0.0, float("nan")])
def test_case5_every_target_ignored_with_a_non_finite_grad_output(device, recompute, scale):
    # transformers divides a "sum" loss by num_items_in_batch, 0 for a batch without a target: loss / 0. The unfused
    # loss's gradients are then zero (no token has a logit gradient); none may become NaN.
    x, w, b, t = _data(16, 8, 30, torch.float32, device, bias=True)
    t[:] = -100

    def grads(fn):
        xx, ww, bb = (v.detach().clone().requires_grad_() for v in (x, w, b))
        loss = fn(xx, ww, bb)
        (loss / scale if scale == 0.0 else loss * scale).backward()
        return xx.grad, ww.grad, bb.grad

    with (_recompute_path() if recompute else contextlib.nullcontext()):
        ours = grads(lambda xx, ww, bb: opforge.linear_cross_entropy(xx, ww, t, linear_bias=bb, reduction="sum",
                                                                     chunk_size=5))
    ref = grads(lambda xx, ww, bb: TF.cross_entropy(TF.linear(xx, ww, bb), t, reduction="sum"))
    for g, r in zip(ours, ref):
        assert torch.equal(r, torch.zeros_like(r))  # what the unfused loss gives
        assert torch.equal(g, r)


def test_case5_ignored_tokens_get_no_share_of_a_non_finite_grad_output(device):
    # reduction "none": an ignored token's grad_output (here inf) does not reach the gradients, as in the unfused loss
    x, w, b, t = _data(16, 8, 30, torch.float32, device, bias=True, ignore_frac=0.5)
    t[0] = -100
    gout = torch.ones(16, device=device)
    gout[t == -100] = float("inf")

    def grads(fn):
        xx, ww, bb = (v.detach().clone().requires_grad_() for v in (x, w, b))
        fn(xx, ww, bb).backward(gout)
        return xx.grad, ww.grad, bb.grad

    ours = grads(lambda xx, ww, bb: opforge.linear_cross_entropy(xx, ww, t, linear_bias=bb, reduction="none",
                                                                 chunk_size=5))
    ref = grads(lambda xx, ww, bb: TF.cross_entropy(TF.linear(xx, ww, bb), t, reduction="none"))
    for g, r in zip(ours, ref):
        assert torch.isfinite(r).all() and torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_case5_an_ignored_chunk_changes_nothing(device, dtype):
    x, w, b, t = _data(40, 8, 30, dtype, device, bias=True)
    t[10:20] = -100  # exactly the second chunk of 10
    a = _grads(_ours(x, w, t), x, w, b, chunk_size=10)
    keep = torch.ones(40, dtype=torch.bool, device=device)
    keep[10:20] = False
    c = _grads(lambda xx, ww, **kw: opforge.linear_cross_entropy(xx[keep], ww, t[keep], **kw), x, w, b, chunk_size=10)
    torch.testing.assert_close(a[0], c[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a[2], c[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[3], c[3], rtol=1e-5, atol=1e-6)
    assert torch.equal(a[1][10:20], torch.zeros_like(a[1][10:20]))


# ---- conformance ------------------------------------------------------------------------------------------

def _sample(device, dtype=torch.float32, requires_grad=True):
    x, w, b, t = _data(12, 8, 20, dtype, device, bias=True, ignore_frac=0.2)
    for v in (x, w, b):
        v.requires_grad_(requires_grad)
    return x, w, b, t


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_opcheck(device, reduction):
    x, w, b, t = _sample(device)
    cw = torch.rand(20, device=device) + 0.5
    torch.library.opcheck(torch.ops.opforge.linear_cross_entropy.default,
                          (x, w, t, b, cw, reduction, -100, 0.1, 1e-3, 4.0, 5))
    torch.library.opcheck(torch.ops.opforge._linear_cross_entropy_forward.default, (x, w, t, b, None, reduction))
    stats = torch.ops.opforge._linear_cross_entropy_forward(x.detach(), w.detach(), t, b.detach(), None, reduction)[1]
    go = torch.randn(12, device=device) if reduction == "none" else torch.tensor(1.5, device=device)
    torch.library.opcheck(torch.ops.opforge.linear_cross_entropy_backward.default,
                          (go, x.detach(), w.detach(), t, stats, b.detach(), None, reduction, -100, 0.0, 0.0, None,
                           [True, True, True]))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, dynamic):
    torch._dynamo.reset()

    def f(x, w, b, t):
        return opforge.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, chunk_size=5)

    cf = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n in (12, 17):
        x, w, b, t = _data(n, 8, 20, torch.float32, device, bias=True, ignore_frac=0.2)
        e = _grads(lambda xx, ww, linear_bias: f(xx, ww, linear_bias, t), x, w, b)
        c = _grads(lambda xx, ww, linear_bias: cf(xx, ww, linear_bias, t), x, w, b)
        for a, z in zip(e, c):
            torch.testing.assert_close(a, z, rtol=1e-6, atol=1e-6)


def test_gradcheck(device):
    x, w, b, t = _data(6, 5, 7, torch.float64, device, bias=True)
    t[2] = -100
    cw = torch.rand(7, device=device, dtype=torch.float64) + 0.5
    for v in (x, w, b):
        v.requires_grad_()
    for reduction in ["mean", "none"]:
        assert torch.autograd.gradcheck(
            lambda x, w, b: opforge.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction,
                                                         label_smoothing=0.2, z_loss=0.01, softcap=2.0, chunk_size=4),
            (x, w, b))


def test_torch_func_grad(device):
    x, w, b, t = _data(10, 6, 9, torch.float64, device, bias=True)
    g = torch.func.grad(lambda x, w: opforge.linear_cross_entropy(x, w, t, linear_bias=b), argnums=(0, 1))(x, w)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear_cross_entropy_reference(x2, w2, t, linear_bias=b).backward()
    torch.testing.assert_close(g[0], x2.grad)
    torch.testing.assert_close(g[1], w2.grad)


def test_double_backward_is_refused_lazily(device):
    x, w, b, t = _sample(device, torch.float64)
    loss = opforge.linear_cross_entropy(x, w, t, linear_bias=b)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


def test_autocast_lowers_gemm_inputs_loss_in_float32():
    x, w, b, t = _sample("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = opforge.linear_cross_entropy(x, w, t, linear_bias=b)
    assert loss.dtype == torch.float32
    ref = opforge.linear_cross_entropy(x.bfloat16(), w.bfloat16(), t, linear_bias=b.bfloat16()).float()
    torch.testing.assert_close(loss, ref)
    loss.backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyLoss"), reason="torch < 2.13 has no nn.LinearCrossEntropyLoss")
def test_module(device):
    torch.manual_seed(0)
    m = opforge.nn.LinearCrossEntropyLoss(8, 20, bias=True, device=device, label_smoothing=0.1)
    tm = torch.nn.LinearCrossEntropyLoss(8, 20, bias=True, device=device, label_smoothing=0.1)
    tm.load_state_dict(m.state_dict())
    x = torch.randn(12, 8, device=device)  # torch's module takes (N, H) only; ours also (*, H)
    t = torch.randint(0, 20, (12,), device=device)
    torch.testing.assert_close(m(x, t), tm(x, t))
    assert m(x.view(4, 3, 8), t.view(4, 3)).shape == ()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("kw", [{}, {"reduction": "sum", "label_smoothing": 0.3}, {"reduction": "none"},
                                {"weight": "w", "reduction": "mean"}])
def test_agrees_with_torch_linear_cross_entropy(device, chunked, kw):
    if not hasattr(TF, "linear_cross_entropy"):
        pytest.skip("torch has no F.linear_cross_entropy")
    kw = dict(kw)
    x, w, b, t = _data(64, 16, 50, torch.float32, device, bias=True, ignore_frac=0.2)
    if kw.get("weight") == "w":
        kw["weight"] = torch.rand(50, device=device) + 0.5
    tkw = dict(kw)
    if chunked:
        tkw["options"] = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=16) \
            if hasattr(torch.nn, "LinearCrossEntropyOptions") else None
    ours = _grads(lambda xx, ww, **k: opforge.linear_cross_entropy(xx, ww, t, **k), x, w, b, **kw)
    theirs = _grads(lambda xx, ww, **k: TF.linear_cross_entropy(xx, ww, t, ignore_index=-100, **k), x, w, b, **tkw)
    for a, z in zip(ours, theirs):
        torch.testing.assert_close(a, z, rtol=2e-5, atol=2e-6)


# ---- bad inputs -------------------------------------------------------------------------------------------

def test_target_out_of_range_raises_on_cpu():
    x, w, _, t = _data(5, 4, 6, torch.float32, "cpu")
    t[3] = 6
    with pytest.raises(IndexError, match=r"expected every target in \[0, 6\).*got target 6 at flat position 3"):
        opforge.linear_cross_entropy(x, w, t)
    t[3] = -1
    with pytest.raises(IndexError, match="got target -1"):
        opforge.linear_cross_entropy(x, w, t)


def test_target_out_of_range_on_cuda_is_flagged_nan():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x, w, _, t = _data(5, 4, 6, torch.float32, "cuda")
    t[3] = 1 << 40
    x.requires_grad_()
    loss = opforge.linear_cross_entropy(x, w, t, reduction="none")
    assert torch.isnan(loss[3]) and torch.isfinite(loss[[0, 1, 2, 4]]).all()
    loss.sum().backward()
    assert torch.isnan(x.grad[3]).all() and torch.isfinite(x.grad[[0, 1, 2, 4]]).all()


@pytest.mark.parametrize("case,exc,msg", [
    ("int_input", TypeError, "expected input to have a floating dtype"),
    ("float_target", TypeError, "expected target of dtype int64"),
    ("h_mismatch", ValueError, "expected input's last dimension to equal linear_weight's H 4, but got 5"),
    ("weight_1d", ValueError, "expected linear_weight to be 2-D"),
    ("target_shape", ValueError, "expected target of input's leading shape"),
    ("bias_shape", ValueError, r"expected linear_bias of shape \[6\]"),
    ("class_weight_shape", ValueError, r"expected weight of shape \[6\]"),
    ("smoothing_high", ValueError, r"expected label_smoothing in \[0, 1\], but got 1.5"),
    ("smoothing_low", ValueError, r"expected label_smoothing in \[0, 1\], but got -0.1"),
    ("z_loss", ValueError, "expected z_loss >= 0"),
    ("softcap", ValueError, "expected softcap > 0"),
    ("chunk", ValueError, "expected chunk_size >= 1"),
    ("reduction", ValueError, "expected reduction to be one of"),
])
def test_bad_inputs(case, exc, msg):
    x, w, b, t = _data(5, 4, 6, torch.float32, "cpu", bias=True)
    kw = {}
    if case == "int_input":
        x = x.long()
    elif case == "float_target":
        t = t.float()
    elif case == "h_mismatch":
        x = torch.randn(5, 5)
    elif case == "weight_1d":
        w = w.reshape(-1)
    elif case == "target_shape":
        t = t[:4]
    elif case == "bias_shape":
        kw["linear_bias"] = torch.randn(5)
    elif case == "class_weight_shape":
        kw["weight"] = torch.randn(7)
    elif case == "smoothing_high":
        kw["label_smoothing"] = 1.5
    elif case == "smoothing_low":
        kw["label_smoothing"] = -0.1
    elif case == "z_loss":
        kw["z_loss"] = -1.0
    elif case == "softcap":
        kw["softcap"] = 0.0
    elif case == "chunk":
        kw["chunk_size"] = 0
    elif case == "reduction":
        kw["reduction"] = "avg"
    with pytest.raises(exc, match=msg):
        opforge.linear_cross_entropy(x, w, t, **kw)
    with pytest.raises(exc, match=msg):  # Meta runs the same checker
        opforge.linear_cross_entropy(x.to("meta"), w.to("meta"), t.to("meta"),
                                     **{k: v.to("meta") if torch.is_tensor(v) else v for k, v in kw.items()})


def test_zero_tokens(device):
    x = torch.randn(0, 4, device=device, requires_grad=True)
    w = torch.randn(6, 4, device=device, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    loss = opforge.linear_cross_entropy(x, w, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and x.grad.shape == (0, 4) and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.isnan(opforge.linear_cross_entropy(x, w, t))


# ---- the two autograd paths: gradient in forward (mean/sum) and recompute (none, or the knob) ----------------

_KNOB = "OPFORGE_LCE_GRAD_IN_FORWARD"


class _recompute_path:
    """Within: the knob sends reduction mean/sum to the recompute path (4 GEMMs) instead of the gradient in forward."""

    def __enter__(self):
        self.prev = torch.ops.opforge._set_knob(_KNOB, 0)

    def __exit__(self, *exc):
        torch.ops.opforge._set_knob(_KNOB, self.prev)


def _saved_tensors(fn):
    """(result of fn(), [tensors autograd saved while it ran]) through the saved-tensor hooks, which see every
    SavedVariable, the C++ nodes' included."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1, "classw": True}, {"z_loss": 1e-3, "softcap": 4.0},
                                  {"label_smoothing": 0.2, "z_loss": 1e-4, "softcap": 3.0, "ignore_index": 5}])
def test_grad_in_forward_equals_recompute(device, dtype, reduction, opts):
    opts = dict(opts)
    x, w, b, t = _data(45, 24, 83, dtype, device, bias=True, ignore_frac=0.2, scale=2.0)
    if opts.pop("classw", False):
        opts["weight"] = torch.rand(83, device=device) + 0.5
    if opts.get("ignore_index") == 5:
        t[t == -100] = 5
    # grad_weights: a non-unit grad_output (the saved gradients are scaled by it in backward)
    gout = torch.tensor(2.5, device=device, dtype=dtype)
    fwd = _grads(_ours(x, w, t), x, w, b, reduction=reduction, chunk_size=16, grad_weights=gout, **opts)
    with _recompute_path():
        rec = _grads(_ours(x, w, t), x, w, b, reduction=reduction, chunk_size=16, grad_weights=gout, **opts)
    for name, a, r in zip(["loss", "grad_input", "grad_linear_weight", "grad_linear_bias"], fwd, rec):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        # two rounding orders of the same math (the grad_output scale folded into the logit gradient before
        # rounding, or applied to the rounded gradient): a few ulps of the dtype apart, relative to the tensor's scale
        scale = r.abs().max().item() if r.numel() else 0.0
        tol = ({"rtol": 3e-2, "atol": 3e-2 * scale} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5 * scale})
        torch.testing.assert_close(a, r, **tol, msg=name)
    # and both against float64 (the tolerance rule)
    _check_all(x, w, b, t, reduction=reduction, chunk_size=16, **opts)


def test_grad_in_forward_op_equals_backward_op(device):
    x, w, b, t = _data(30, 16, 50, torch.float32, device, bias=True, ignore_frac=0.2)
    kw = dict(weight=None, reduction="sum", ignore_index=-100, label_smoothing=0.1, z_loss=1e-3, softcap=5.0,
              chunk_size=7)
    loss, stats, gi, gw, gb = torch.ops.opforge._linear_cross_entropy_forward(x, w, t, b, **kw,
                                                                             grad_mask=[True, True, True])
    go = torch.tensor(1.0, device=device)
    ri, rw, rb = torch.ops.opforge.linear_cross_entropy_backward(
        go, x, w, t, stats, b, None, "sum", -100, 0.1, 1e-3, 5.0, [True, True, True], 7)
    for a, r in ((gi, ri), (gw, rw), (gb, rb)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    # "none": the gradients of loss.sum()
    _, _, ni, nw, nb = torch.ops.opforge._linear_cross_entropy_forward(x, w, t, b, **{**kw, "reduction": "none"},
                                                                      grad_mask=[True, True, True])
    for a, r in ((ni, ri), (nw, rw), (nb, rb)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
    # only what the mask asks for
    out = torch.ops.opforge._linear_cross_entropy_forward(x, w, t, b, **kw, grad_mask=[False, True, False])
    assert out[2] is None and out[3] is not None and out[4] is None
    out = torch.ops.opforge._linear_cross_entropy_forward(x, w, t, None, **kw, grad_mask=[True, True, True])
    assert out[4] is None
    out = torch.ops.opforge._linear_cross_entropy_forward(x, w, t, b, **kw)
    assert out[2] is None and out[3] is None and out[4] is None


def test_grad_in_forward_saves_gradients_not_inputs(device):
    N, H, V = 64, 16, 300
    x, w, b, t = _data(N, H, V, torch.float32, device, bias=True, ignore_frac=0.1)
    x.requires_grad_()
    w.requires_grad_()
    loss, saved = _saved_tensors(lambda: opforge.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=16))
    shapes = sorted(tuple(s.shape) for s in saved)
    # grad_input, grad_linear_weight and the 0-dim any-target flag; no bias gradient (b is frozen)
    assert shapes == [(), (N, H), (V, H)], shapes
    assert all(s.data_ptr() not in (x.data_ptr(), w.data_ptr()) for s in saved)
    loss.backward()
    assert x.grad is not None and w.grad is not None
    # the recompute path (reduction "none") saves the inputs and the (m, r) stats instead
    _, saved = _saved_tensors(lambda: opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none"))
    assert any(s.data_ptr() == x.data_ptr() for s in saved) and any(tuple(s.shape) == (N, 2) for s in saved)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_in_forward_frozen_lm_head_computes_no_weight_gradient(device, reduction):
    N, H, V = 128, 32, 1000
    x, w, b, t = _data(N, H, V, torch.bfloat16, device, bias=True, ignore_frac=0.1)
    x.requires_grad_()  # linear_weight and linear_bias frozen
    loss, saved = _saved_tensors(lambda: opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction,
                                                                      chunk_size=32))
    # grad_input and the 0-dim any-target flag (Note [all targets ignored]): no V x H (nor V) buffer kept
    assert [tuple(s.shape) for s in saved] == [(N, H), ()]
    loss.backward()
    assert w.grad is None and b.grad is None
    with _recompute_path():
        xr = x.detach().clone().requires_grad_()
        opforge.linear_cross_entropy(xr, w, t, linear_bias=b, reduction=reduction, chunk_size=32).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    if device == "cuda":  # the peak: no V x H fp32 accumulator, no V x H gradient
        torch.cuda.synchronize()
        x.grad = None
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction, chunk_size=32).backward()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < 32 * V * 6 + 3 * N * H * 2 + 64 * V + (1 << 16), peak


def test_grad_in_forward_grad_of_grad_raises_lazily(device):
    x, w, b, t = _sample(device, torch.float64)
    # first order under create_graph=True (what torch.func does) works
    loss = opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction="sum")
    gx, gw = torch.autograd.grad(loss, (x, w), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.func.grad(lambda xx: torch.func.grad(
            lambda x2: opforge.linear_cross_entropy(x2, w.detach(), t))(xx).sum())(x.detach())


def test_grad_in_forward_retain_graph_and_repeat(device):
    x, w, b, t = _sample(device)
    loss = opforge.linear_cross_entropy(x, w, t, linear_bias=b)
    loss.backward(retain_graph=True)
    g1 = [v.grad.clone() for v in (x, w, b)]
    (loss * 3).backward()  # the saved gradients are not scaled in place
    for v, g in zip((x, w, b), g1):
        torch.testing.assert_close(v.grad, 4 * g)


def _saved_storages(run):
    """The data pointers of the tensors an autograd node saves while `run()` records the graph."""
    ptrs = []

    def pack(t):
        ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, ptrs


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd"])
def test_grad_in_forward_hands_its_saved_gradients_over(device, op):
    """Without retain_graph, the backward scales the gradients the forward saved in place and they become .grad (no
    second copy of the V x H weight gradient); with retain_graph it leaves them as they were, so a second backward
    gives the same gradients. Both ways the values are grad_output times the forward's gradients."""
    x, w, b, t = _sample(device)
    if op == "linear_cross_entropy":
        run = lambda: opforge.linear_cross_entropy(x, w, t, linear_bias=b)  # noqa: E731
    else:
        teacher = torch.randn_like(w).detach()
        run = lambda: opforge.linear_jsd(x, w, x.detach(), teacher, t, linear_bias=b)  # noqa: E731
    loss, ptrs = _saved_storages(run)
    (2.5 * loss).backward(retain_graph=True)
    kept = [v.grad.clone() for v in (x, w, b)]
    assert not {v.grad.untyped_storage().data_ptr() for v in (x, w, b)} & set(ptrs)
    for v in (x, w, b):
        v.grad = None
    (2.5 * loss).backward()
    for v, g in zip((x, w, b), kept):
        assert torch.equal(v.grad, g)
    assert {v.grad.untyped_storage().data_ptr() for v in (x, w, b)} <= set(ptrs)


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_jsd", "linear_preference_loss"])
@pytest.mark.parametrize("retain", [False, True])
def test_grad_in_forward_gradients_carry_no_history(device, op, retain):
    """The gradients the backward hands on are plain tensors, as every backward's without create_graph, whether the
    saved gradients were scaled in place (graph released) or by the scale op (graph kept): torch.autograd.grad
    returns them without requires_grad or grad_fn, and so does a hook on the weight see them. (The saved gradients
    carry a node that refuses double backward; the in-place path must not hand that history on.)"""
    import opforge.losses  # noqa: F401

    x, w, b, t = _sample(device)
    if op == "linear_cross_entropy":
        loss = opforge.linear_cross_entropy(x, w, t, linear_bias=b)
    elif op == "linear_jsd":
        loss = opforge.linear_jsd(x, w, x.detach(), torch.randn_like(w).detach(), t, linear_bias=b)
    else:  # 2 pairs of 3-token sequences: (2B, T, H) = (4, 3, 8)
        loss = opforge.losses.linear_preference_loss(x.view(4, 3, 8), w, t.view(4, 3).clamp(min=0), b,
                                                    loss_type="simpo")[0]
    seen = []
    w.register_hook(lambda g: seen.append((g.requires_grad, g.grad_fn)))
    grads = torch.autograd.grad(2.5 * loss, (x, w, b), retain_graph=retain)
    assert [(g.requires_grad, g.grad_fn) for g in grads] == [(False, None)] * 3
    assert seen == [(False, None)]


def test_grad_in_forward_compiled_autograd(device):
    torch._dynamo.reset()
    x, w, b, t = _sample(device)
    ref = _grads(_ours(x, w, t), x, w, b, label_smoothing=0.1)
    xs, ws, bs = (v.detach().clone().requires_grad_() for v in (x, w, b))

    def step():
        return opforge.linear_cross_entropy(xs, ws, t, linear_bias=bs, label_smoothing=0.1)

    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager", fullgraph=True)):
        loss = step()
        loss.backward()
    for a, r in zip((loss.detach(), xs.grad, ws.grad, bs.grad), ref):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]])
def test_opcheck_grad_in_forward(device, mask):
    x, w, b, t = _sample(device, requires_grad=False)
    torch.library.opcheck(torch.ops.opforge._linear_cross_entropy_forward.default,
                          (x, w, t, b, None, "mean", -100, 0.1, 1e-3, 4.0, 5, mask))
    _, _, gi, gw, gb = torch.ops.opforge._linear_cross_entropy_forward(x, w, t, b, grad_mask=mask)
    torch.library.opcheck(torch.ops.opforge._linear_cross_entropy_scale_grads.default,
                          (torch.tensor(1.5, device=device), gi, gw, gb))


# ---- the knob OPFORGE_LCE_DW_ACCUM=1: dW and db accumulated in the 16-bit parameter dtype ----------------------

_ACCUM = "OPFORGE_LCE_DW_ACCUM"  # set through conftest's knob fixture: restored after each test


def _accum_factor(k):
    """The tolerance rule's factor for a parameter gradient accumulated in its 16-bit dtype over k chunks: 2 × k.

    Derivation: the rule's baseline (the eager math in the 16-bit dtype) rounds dW once, at the end of its one GEMM;
    the knob rounds the accumulator once per dW GEMM, k times (one GEMM per chunk), each rounding off by at most
    half an ulp of the partial sum, whose magnitude is that of dW. So the error is at most
    the float32 accumulation's (within the rule's 2 × baseline) plus k roundings of the size of the baseline's one:
    2 + k ≤ 2k times the baseline's error for k ≥ 2 (k = 1 is the rule itself). Linear in k, the worst case (the
    roundings' errors add up with one sign); independent roundings would give √k. The bound still fails every wrong
    accumulation of test_dw_accum_tolerance_detects_broken_accumulation."""
    return 2.0 * k


def _logit_grad64(x, w, b, t, gw=None, **kw):
    """The float64 reference's gradient of the loss (weighted by gw for "none") with respect to the raw logits
    x · wᵀ + b, [N, V] (from linear_cross_entropy_reference on the logits with an identity weight)."""
    L = (x.double() @ w.double().t() + (0 if b is None else b.double())).detach().requires_grad_()
    eye = torch.eye(w.shape[0], dtype=torch.float64, device=x.device)
    loss = linear_cross_entropy_reference(L, eye, t, **kw)
    (dL,) = torch.autograd.grad(loss if gw is None else (loss * gw.double()).sum(), L)
    return dL


def _emulate_accum(dL, x, chunk, dtype, chunks=None):
    """dW accumulated as OPFORGE_LCE_DW_ACCUM=1 does, from the logit gradient dL [N, V]: per chunk c (those of
    `chunks`, default all, in that order) dW = round(dW + round(dL_c)ᵀ · X_c) with float32 math, one rounding to
    `dtype` per chunk (the dW GEMM reads the logit gradient in the storage dtype)."""
    N = x.shape[0]
    starts = list(range(0, N, chunk))
    acc = torch.zeros(dL.shape[1], x.shape[1], dtype=dtype, device=x.device)
    for i in (range(len(starts)) if chunks is None else chunks):
        s0 = starts[i]
        D, X = dL[s0:s0 + chunk].to(dtype).float(), x[s0:s0 + chunk].float()
        acc = (acc.float() + D.t() @ X).to(dtype)
    return acc


_PATHS = [("mean", "forward"), ("mean", "recompute"), ("sum", "forward"), ("sum", "recompute"), ("none", "recompute")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [48, 16, 7])  # k = 1, 3, 7 chunks of N = 48 tokens (the last one partial at 7)
@pytest.mark.parametrize("reduction,path", _PATHS)
@_DEFAULT_MODE_DEVICES
def test_dw_accum_matches_float64(device, knob, dtype, chunk, reduction, path):
    """OPFORGE_LCE_DW_ACCUM=1: grad_linear_weight and grad_linear_bias in the parameters' 16-bit dtype against
    float64 by the rule with _accum_factor(k) (loss and grad_input by the plain rule), with a bias, ignored tokens
    (ignore_index 5), every reduction, both autograd paths; the loss and grad_input are bit-identical to the knob's
    0 (it changes only the parameter gradients), the parameter gradients are not (for k > 1: the knob took effect)."""
    N = 48
    x, w, b, t = _data(N, 24, 83, dtype, device, bias=True, ignore_frac=0.2, scale=2.0)
    t[t == -100] = 5
    gw = torch.rand(N, device=device).to(dtype) if reduction == "none" else None
    kw = dict(reduction=reduction, chunk_size=chunk, ignore_index=5, grad_weights=gw)
    knob(_KNOB, 0 if path == "recompute" else 1)
    knob(LCE_LEAN, 0)  # the default mode, whatever the build's default
    knob(_ACCUM, 1)
    k = math.ceil(N / chunk)
    (on, _) = _check_all(x, w, b, t, param_factor=_accum_factor(k), **kw)
    assert on[2].dtype == dtype and on[3].dtype == dtype
    knob(_ACCUM, 0)
    off = _grads(_ours(x, w, t), x, w, b, **kw)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    if k > 1:
        assert not torch.equal(on[2], off[2])


@pytest.mark.parametrize("chunk", [2, 3, 5])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_dw_accum_partial_last_chunk(device, knob, chunk, reduction):
    """OPFORGE_LCE_DW_ACCUM=1 (CUDA: one 16-bit dW GEMM per chunk, beta = 0 on the first) where N = 11 tokens leave a
    partial last chunk: the rule with _accum_factor(chunk count), both paths ("mean": gradient in forward, "none":
    recompute)."""
    x, w, b, t = _data(11, 24, 70, torch.bfloat16, device, bias=True, ignore_frac=0.2, scale=2.0)
    gw = torch.rand(11, device=device).to(torch.bfloat16) if reduction == "none" else None
    knob(_ACCUM, 1)
    _check_all(x, w, b, t, reduction=reduction, chunk_size=chunk, grad_weights=gw,
               param_factor=_accum_factor(math.ceil(11 / chunk)))


@pytest.mark.parametrize("reduction,path", [("mean", "forward"), ("sum", "recompute"), ("none", "recompute")])
@_DEFAULT_MODE_DEVICES
def test_dw_accum_rounds_once_per_chunk(device, knob, reduction, path):
    """The knob's dW is the 16-bit accumulation, one rounding per chunk: 8 chunks' result is close to the emulation
    _emulate_accum (from the float64 logit gradient) — at most a quarter of the knob-0 result's distance from it
    (float32 accumulation, one rounding at the end) — not merely within the tolerance of the right answer."""
    N, H, V, chunk = 256, 64, 300, 32
    x, w, b, t = _data(N, H, V, torch.bfloat16, device, bias=True, ignore_frac=0.1)
    gw = torch.rand(N, device=device).to(torch.bfloat16) if reduction == "none" else None
    knob(_KNOB, 0 if path == "recompute" else 1)
    knob(LCE_LEAN, 0)  # the default mode, whatever the build's default
    knob(_ACCUM, 1)
    on = _grads(_ours(x, w, t), x, w, b, reduction=reduction, chunk_size=chunk, grad_weights=gw)[2]
    knob(_ACCUM, 0)
    off = _grads(_ours(x, w, t), x, w, b, reduction=reduction, chunk_size=chunk, grad_weights=gw)[2]
    emu = _emulate_accum(_logit_grad64(x, w, b, t, gw, reduction=reduction), x, chunk, torch.bfloat16)
    e_on, e_off = relative_error(on, emu), relative_error(off, emu)
    assert e_off > 0 and e_on <= 0.25 * e_off, (e_on, e_off)


@pytest.mark.parametrize("chunk", [16, 7])
def test_dw_accum_tolerance_detects_broken_accumulation(device, chunk):
    """The rule of test_dw_accum_matches_float64 (factor _accum_factor(k)) can fail: on its problem ("mean"), the
    emulated correct 16-bit accumulation passes, and each broken one fails it: the last chunk dropped, every chunk
    overwriting instead of adding (beta = 0 throughout), the first chunk added twice."""
    N = 48
    x, w, b, t = _data(N, 24, 83, torch.bfloat16, device, bias=True, ignore_frac=0.2, scale=2.0)
    t[t == -100] = 5
    kw = dict(reduction="mean", ignore_index=5)
    k = math.ceil(N / chunk)
    ref = _grads(_ref(x, w, t), x, w, b, **kw)[2]
    base = _grads(_ref(x, w, t, torch.bfloat16), x, w, b, **kw)[2].to(torch.bfloat16)
    dL = _logit_grad64(x, w, b, t, **kw)

    def check(dw):
        assert_matches_reference(dw, ref, base, what="grad_linear_weight", factor=_accum_factor(k))

    check(_emulate_accum(dL, x, chunk, torch.bfloat16))
    for broken in ([*range(k - 1)], [k - 1], [0, *range(k)]):
        with pytest.raises(AssertionError):
            check(_emulate_accum(dL, x, chunk, torch.bfloat16, chunks=broken))


@pytest.mark.parametrize("case", ["float32", "float64", "bf16 input, fp32 weight", "fp32 input, bf16 weight"])
@pytest.mark.parametrize("path", ["forward", "recompute"])
def test_dw_accum_leaves_other_dtypes_unchanged(device, knob, case, path):
    """OPFORGE_LCE_DW_ACCUM=1 applies only where input and the parameter share a 16-bit dtype: float32/float64
    (already accumulated in their own dtype) and mixed dtypes give bit-identical results with the knob 1 and 0."""
    xd, wd = {"float32": (torch.float32,) * 2, "float64": (torch.float64,) * 2,
              "bf16 input, fp32 weight": (torch.bfloat16, torch.float32),
              "fp32 input, bf16 weight": (torch.float32, torch.bfloat16)}[case]
    x, w, b, t = _data(40, 16, 50, wd, device, bias=True, ignore_frac=0.2)
    x = x.to(xd)
    knob(_KNOB, 0 if path == "recompute" else 1)
    res = []
    for accum in (1, 0):
        knob(_ACCUM, accum)
        res.append(_grads(_ours(x, w, t), x, w, b, chunk_size=8))
    for name, a, r in zip(["loss", "grad_input", "grad_linear_weight", "grad_linear_bias"], *res):
        assert a.dtype == r.dtype and torch.equal(a, r), name
    assert res[0][2].dtype == wd


@pytest.mark.parametrize("path", ["forward", "recompute"])
def test_dw_accum_off_is_float32_accumulation(knob, path):
    """OPFORGE_LCE_DW_ACCUM=0 keeps today's bf16 weight gradient: float32 accumulation across chunks, one rounding at
    the end. On CPU, where the 16-bit path computes in float32 throughout, that is bit for bit the float32 call's
    gradients rounded to bfloat16 (CPU only: CUDA's dW GEMM reads a bf16 logit gradient, so it has no float32 twin;
    the other knob tests cover its knob 0)."""
    device = "cpu"
    x, w, b, t = _data(64, 16, 50, torch.bfloat16, device, bias=True, ignore_frac=0.2)
    knob(_KNOB, 0 if path == "recompute" else 1)
    knob(_ACCUM, 0)
    low = _grads(_ours(x, w, t), x, w, b, chunk_size=8)
    f32 = _grads(_ours(x, w, t), x.float(), w.float(), b.float(), chunk_size=8)
    assert low[2].dtype == torch.bfloat16 and torch.equal(low[2], f32[2].bfloat16())
    assert torch.equal(low[3], f32[3].bfloat16()) and torch.equal(low[0], f32[0])


def test_dw_accum_knob_from_environment():
    """The knob is read from OPFORGE_LCE_DW_ACCUM once per process: 0 when unset, 1 when set to "1"."""
    import os
    import subprocess
    import sys

    code = "import torch, opforge; print(torch.ops.opforge._set_knob('OPFORGE_LCE_DW_ACCUM', 0))"
    for value, expect in ((None, "0"), ("1", "1")):
        env = {k: v for k, v in os.environ.items() if k != _ACCUM}
        if value is not None:
            env[_ACCUM] = value
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip().splitlines()[-1] == expect, (value, p.stdout)


def _cuda_peak(run):
    """(bytes allocated at the peak of `run()` above what was allocated before it, run()'s result)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA memory counters)")
@pytest.mark.parametrize("path", ["forward", "recompute"])
def test_dw_accum_allocates_no_float32_weight_buffer(knob, path):
    """CUDA, bf16: with OPFORGE_LCE_DW_ACCUM=1 the pass that computes dW (the forward on the gradient-in-forward path,
    the backward on the recompute path) peaks below the knob's 0 by the difference of a float32 and a bf16 V×H buffer
    (V × H × 2 bytes, 8 MiB here, at the chunk loop's peak; asserted: at least half of it, a margin for the caching
    allocator's block rounding); a float32 V×H buffer anywhere in the knob's pass would make its peak the higher."""
    device = "cuda"
    N, H, V = 2048, 512, 8192
    x, w, _, t = _data(N, H, V, torch.bfloat16, device)
    x.requires_grad_()
    w.requires_grad_()
    knob(_KNOB, 0 if path == "recompute" else 1)
    knob(LCE_LEAN, 0)  # the default mode's fp32 accumulator (lean mode has none with either value)
    peaks = {}
    for accum in (0, 1):
        knob(_ACCUM, accum)
        x.grad = w.grad = None
        torch.cuda.synchronize()
        if path == "forward":
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = opforge.linear_cross_entropy(x, w, t, chunk_size=512)
        else:
            loss = opforge.linear_cross_entropy(x, w, t, chunk_size=512)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
        torch.cuda.synchronize()
        peaks[accum] = torch.cuda.max_memory_allocated() - base
        del loss
    assert peaks[0] - peaks[1] >= V * H, peaks


# ---- lean mode (OPFORGE_LCE_LEAN=1): 16-bit logits chunks on CUDA ----------------------------------------------
# Its numerics run through every test above (the "cuda-lean" id); here: where it applies and its memory.

@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU"))])
@pytest.mark.parametrize("case", ["bfloat16", "float16", "float32", "bf16 input, fp32 weight"])
@pytest.mark.parametrize("path", ["forward", "recompute"])
def test_lean_applies_to_16bit_cuda_only(dev, knob, case, path):
    """OPFORGE_LCE_LEAN=1 changes results only on CUDA where input, weight and bias share a 16-bit dtype (there the
    loss differs from the knob's 0: the logits were rounded; the tolerance rule holds in both, test_matches_float64
    and others under "cuda-lean"); on CPU, for float32 and for mixed dtypes every output is bit-identical."""
    xd, wd = {"bfloat16": (torch.bfloat16,) * 2, "float16": (torch.float16,) * 2, "float32": (torch.float32,) * 2,
              "bf16 input, fp32 weight": (torch.bfloat16, torch.float32)}[case]
    x, w, b, t = _data(40, 16, 50, wd, dev, bias=True, ignore_frac=0.2, scale=2.0)
    x = x.to(xd)
    knob(_KNOB, 0 if path == "recompute" else 1)
    res = []
    for lean in (1, 0):
        knob(LCE_LEAN, lean)
        assert lce_lean(x, w, b) == (lean == 1 and dev == "cuda" and xd == wd != torch.float32)
        res.append(_grads(_ours(x, w, t), x, w, b, chunk_size=8))
    applies = dev == "cuda" and xd == wd != torch.float32
    for name, a, r in zip(["loss", "grad_input", "grad_linear_weight", "grad_linear_bias"], *res):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        if not applies:
            assert torch.equal(a, r), name
    if applies:
        assert not torch.equal(res[0][0], res[1][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA memory counters)")
@pytest.mark.parametrize("path", ["forward", "recompute"])
def test_lean_peak_memory_is_one_16bit_chunk(knob, path):
    """CUDA, bf16, V = 128256 (Llama 3's vocabulary), N = 4096 tokens, no chunk_size: lean mode's chunk comes from its
    512 MiB budget (2048 rows of 128256 bf16 logits, 501 MiB), so the pass that computes the gradients (the forward
    on the gradient-in-forward path, the backward on the recompute path) peaks above its inputs by at most that one
    buffer, the gradients' own storage (dX N x H, dW V x H in bf16) and 16 MiB for per-token and per-class vectors and
    cuBLAS's workspace; a second [chunk, V] buffer (an fp32 chunk: 1002 MiB, or a bf16 copy) or a 4096-row chunk
    would exceed it. The default mode's peak is higher (fp32 chunk, bf16 copy and fp32 dW accumulator). A first
    small call allocates what is allocated once (cuBLAS's workspace) outside the measurement."""
    N, H, V = 4096, 256, 128256
    x, w, _, t = _data(N, H, V, torch.bfloat16, "cuda")
    x.requires_grad_()
    w.requires_grad_()
    knob(_KNOB, 0 if path == "recompute" else 1)
    knob(_ACCUM, 0)
    opforge.linear_cross_entropy(x[:64], w, t[:64]).backward()
    peaks = {}
    for lean in (1, 0):
        knob(LCE_LEAN, lean)
        x.grad = w.grad = None
        if path == "forward":
            peaks[lean], loss = _cuda_peak(lambda: opforge.linear_cross_entropy(x, w, t))
        else:
            loss = opforge.linear_cross_entropy(x, w, t)
            peaks[lean], _ = _cuda_peak(loss.backward)
        del loss
    grads = N * H * 2 + V * H * 2
    assert peaks[1] <= 2048 * V * 2 + grads + (16 << 20), peaks
    assert peaks[0] > peaks[1], peaks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA memory counters)")
def test_grad_in_forward_backward_peaks_under_a_weight_gradient(knob):
    """CUDA, bf16, V = 128256, H = 256: on the gradient-in-forward path the backward scales the saved gradients in
    place, so it peaks above the memory held before it by far less than one more V x H bf16 weight gradient (62.6 MiB;
    16 MiB allowed for the scalar's kernels and allocator rounding)."""
    N, H, V = 1024, 256, 128256
    x, w, _, t = _data(N, H, V, torch.bfloat16, "cuda")
    x.requires_grad_()
    w.requires_grad_()
    knob(_KNOB, 1)
    loss = opforge.linear_cross_entropy(x, w, t)
    peak, _ = _cuda_peak(loss.backward)
    assert peak <= (16 << 20)
