"""linear_log_probs: log-probabilities and entropies against float64 (each output's gradient alone and together),
every target ignored (zero gradients whatever grad_output is), large logit offsets, chunking, opcheck,
torch.compile, gradcheck, torch.func and the saved tensors. The shared checks (dtypes, views, bad inputs, autocast,
compiled autograd) run from the conformance entry. On CUDA every test runs in both modes of OPFORGE_LCE_LEAN (ids
"cuda" and "cuda-lean", conftest.lce_device_fixture)."""
import math

import pytest
import torch

import opforge
from opforge.testing import assert_matches_reference, linear_log_probs_reference

from conftest import lce_device_fixture, lce_lean, lean_accum_factor, lean_rounding_bound

device = lce_device_fixture()  # "cpu", "cuda" (OPFORGE_LCE_LEAN=0), "cuda-lean" (OPFORGE_LCE_LEAN=1)


def _data(N, H, V, dtype, device, *, ignore_frac=0.0, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, H, generator=g) * scale).to(dtype=dtype, device=device)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(dtype=dtype, device=device)
    b = torch.randn(V, generator=g).to(dtype=dtype, device=device)
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_frac:
        t[torch.rand(N, generator=g) < ignore_frac] = -100
    return x, w, b, t.to(device)


def _run(fn, x, w, b, glp, gent, **kw):
    """(log_probs, entropy, grad_input, grad_linear_weight, grad_linear_bias) of Σ glp·lp + Σ gent·ent."""
    x, w, b = (v.detach().clone().requires_grad_() for v in (x, w, b))
    lp, ent = fn(x, w, b, **kw)
    loss = (0 if glp is None else (lp * glp).sum()) + (0 if gent is None else (ent * gent).sum())
    loss.backward()
    return lp.detach(), ent.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["log_probs", "entropy", "both"])
@pytest.mark.parametrize("V", [101, 104])  # CUDA: 104 rows take the 16-byte row access (V % 8 == 0), 101 do not
def test_gradients_of_each_output(device, dtype, which, V):
    x, w, b, t = _data(45, 32, V, dtype, device, ignore_frac=0.2, scale=2.0)
    glp = torch.randn(45, device=device) if which != "entropy" else None
    gent = torch.randn(45, device=device) if which != "log_probs" else None
    kw = dict(temperature=0.7, return_entropy=True)
    ours = _run(lambda x, w, b, **k: opforge.linear_log_probs(x, w, t, b, chunk_size=16, **k), x, w, b, glp, gent,
                **kw)
    ref = _run(lambda x, w, b, **k: linear_log_probs_reference(x, w, t, b, **k), x, w, b, glp, gent, **kw)
    base = _run(lambda x, w, b, **k: linear_log_probs_reference(x, w, t, b, compute_dtype=dtype, **k), x, w, b, glp,
                gent, **kw)
    factors, bounds = {}, {}
    if lce_lean(x, w, b):
        # lean mode: dW accumulates in bf16 over the 3 chunks (lean_accum_factor), and log_probs / entropy carry the
        # logits' rounding to bf16 (lean_rounding_bound, from the float64 values as functions of the raw logits)
        factors["grad_linear_weight"] = lean_accum_factor(math.ceil(45 / 16))
        L = x.double() @ w.double().t() + b.double()
        eye = torch.eye(V, dtype=torch.float64, device=device)
        for i, name in enumerate(["log_probs", "entropy"]):
            def value(ls, i=i):
                return linear_log_probs_reference(ls[0], eye, t, temperature=0.7, return_entropy=True)[i]
            bounds[name] = lean_rounding_bound(value, [(L, dtype)], ref[i])
    for name, o, r, bl in zip(["log_probs", "entropy", "grad_input", "grad_linear_weight", "grad_linear_bias"],
                              ours, ref, base):
        assert_matches_reference(o, r, bl.to(o.dtype), what=name, factor=factors.get(name, 2.0),
                                 bound=bounds.get(name))


def test_chunk_sizes_agree_and_ignored_tokens_are_zero(device):
    x, w, b, t = _data(37, 16, 29, torch.float64, device, ignore_frac=0.3)
    outs = [opforge.linear_log_probs(x, w, t, b, return_entropy=True, chunk_size=c) for c in (1, 7, 64)]
    for lp, ent in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, outs[0][1], rtol=0, atol=1e-12)
    lp, ent = outs[0]
    ignored = t == -100
    assert ignored.any() and (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert not torch.signbit(lp[ignored]).any()  # +0, not −0
    assert (lp[~ignored] < 0).all() and (ent[~ignored] > 0).all()
    assert ent.dtype == lp.dtype == torch.float64


def test_every_target_ignored_gives_zero_gradients(device):
    """Every target ignored and a loss normalised by the number of valid tokens (0): TRL's masked mean divides by
    mask.sum() = 0, so grad_output is inf or NaN; the unfused math's gradient is zero for each ignored token (the
    masked-out branch), and so is ours."""
    x, w, b, t = _data(9, 8, 13, torch.float32, device)
    t.fill_(-100)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    lp, ent = opforge.linear_log_probs(x, w, t, b, return_entropy=True)
    mask = (t != -100).float()
    loss = (lp * mask).sum() / mask.sum() + (ent * mask).sum() / mask.sum()  # 0/0
    assert torch.isnan(loss)
    loss.backward()
    for g in (x.grad, w.grad, b.grad):
        assert torch.equal(g, torch.zeros_like(g))
    # a non-finite grad_output straight into the ignored tokens
    x.grad = w.grad = b.grad = None
    lp = opforge.linear_log_probs(x, w, t, b)
    lp.backward(torch.full_like(lp, math.inf))
    for g in (x.grad, w.grad, b.grad):
        assert torch.equal(g, torch.zeros_like(g))


def test_large_logit_offset_and_peaked_entropy(device):
    """A common logit offset of 1e4 (float32) changes nothing (the row max is kept apart from log Σ exp); a peaked
    distribution's entropy (1e-30 scale) keeps its relative accuracy (no cancellation of lse − E[z])."""
    x, w, _, t = _data(8, 4, 10, torch.float32, device)
    # logits that are multiples of 1/8 (exact in float32 also after the offset: the offset itself rounds nothing)
    x, w = (x * 2).round(), (w * 16).round() / 8
    b = torch.full((10,), 1e4, device=device)
    lp, ent = opforge.linear_log_probs(x, w, t, b, return_entropy=True)
    rlp, rent = linear_log_probs_reference(x, w, t, None, return_entropy=True)
    torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-6)
    bp = torch.zeros(10, device=device)
    bp[3] = 80.0  # p_3 ≈ 1 − 9e-35
    lp, ent = opforge.linear_log_probs(x * 0, w, t.clamp(min=0), bp, return_entropy=True)
    _, rent = linear_log_probs_reference(x * 0, w, t.clamp(min=0), bp, return_entropy=True)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-4, atol=0)


def test_matches_cross_entropy_without_options(device):
    """−log p is the cross-entropy row: equal to linear_cross_entropy(reduction="none") of the scaled input."""
    x, w, b, t = _data(21, 12, 17, torch.float64, device, ignore_frac=0.2)
    lp = opforge.linear_log_probs(x, w, t, b, temperature=2.0)
    ce = opforge.linear_cross_entropy(x / 2, w, t, linear_bias=b / 2, reduction="none")
    torch.testing.assert_close(-lp, ce, rtol=0, atol=1e-12)


def test_opcheck(device):
    x, w, b, t = _data(11, 6, 9, torch.float32, device, ignore_frac=0.2)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    for ent in (False, True):
        args = (x, w, t, b, 0.8, -100, None, ent, 4)
        torch.library.opcheck(torch.ops.opforge.linear_log_probs.default, args)
        torch.library.opcheck(torch.ops.opforge._linear_log_probs_forward.default, args)
    lp, entropy, stats = torch.ops.opforge._linear_log_probs_forward(x.detach(), w.detach(), t, b.detach(), 0.8, -100,
                                                                     None, True, 4)
    g = torch.randn_like(lp)
    for gl, ge in ((g, None), (None, g), (g, g)):
        for mask in ([True, True, True], [False, True, False]):
            torch.library.opcheck(torch.ops.opforge.linear_log_probs_backward.default,
                                  (gl, ge, x.detach(), w.detach(), t, stats, entropy, b.detach(), 0.8, -100, None,
                                   mask, 4))


def test_backward_op_errors(device):
    x, w, b, t = _data(5, 4, 6, torch.float32, device)
    lp, ent, stats = torch.ops.opforge._linear_log_probs_forward(x, w, t, b, 1.0, -100, None, True, None)
    pre = "opforge::linear_log_probs_backward: "
    with pytest.raises(ValueError, match=pre + "expected the forward's entropy with grad_entropy, but got None"):
        torch.ops.opforge.linear_log_probs_backward(None, lp, x, w, t, stats, None, b, 1.0, -100, None,
                                                    [True, True, True])
    with pytest.raises(ValueError, match=pre + r"expected grad_log_probs of target's shape \[5\], but got \[4\]"):
        torch.ops.opforge.linear_log_probs_backward(lp[:4], None, x, w, t, stats, None, b, 1.0, -100, None,
                                                    [True, True, True])
    with pytest.raises(ValueError, match=pre + r"expected stats of shape \[5, 2\]"):
        torch.ops.opforge.linear_log_probs_backward(lp, None, x, w, t, stats[:4], None, b, 1.0, -100, None,
                                                    [True, True, True])
    with pytest.raises(RuntimeError, match="linear_log_probs_backward: double backward is not supported"):
        xx = x.clone().requires_grad_()
        lp = opforge.linear_log_probs(xx, w, t, b)
        (g,) = torch.autograd.grad(lp.sum(), xx, create_graph=True)
        g.sum().backward()


def test_compile_fullgraph(device):
    x, w, b, t = _data(13, 8, 11, torch.float32, device, ignore_frac=0.2)

    def f(x, w, b):
        lp, ent = opforge.linear_log_probs(x, w, t, b, temperature=0.9, return_entropy=True, chunk_size=5)
        return lp.sum() + 0.1 * ent.sum()

    eager = _grads_of(f, x, w, b)
    for dynamic in (False, True):
        torch._dynamo.reset()
        comp = _grads_of(torch.compile(f, fullgraph=True, dynamic=dynamic), x, w, b)
        for a, c in zip(eager, comp):
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)


def _grads_of(f, *args):
    args = [a.detach().clone().requires_grad_() for a in args]
    out = f(*args)
    return (out.detach(), *torch.autograd.grad(out, args))


def test_gradcheck_and_torch_func(device):
    x, w, b, t = _data(6, 5, 7, torch.float64, device)
    t[1] = -100

    def f(x, w, b):
        lp, ent = opforge.linear_log_probs(x, w, t, b, temperature=0.8, softcap=2.0, return_entropy=True,
                                           chunk_size=4)
        return lp, ent

    torch.autograd.gradcheck(f, [v.clone().requires_grad_() for v in (x, w, b)])

    def scalar(x, w, b):
        lp, ent = f(x, w, b)
        return (lp * torch.arange(6.0, device=device, dtype=lp.dtype)).sum() + ent.sum()

    def ref_scalar(x, w, b):
        lp, ent = linear_log_probs_reference(x, w, t, b, temperature=0.8, softcap=2.0, return_entropy=True)
        return (lp * torch.arange(6.0, device=device, dtype=lp.dtype)).sum() + ent.sum()

    ours = torch.func.grad(scalar, argnums=(0, 1, 2))(x, w, b)
    ref = torch.func.grad(ref_scalar, argnums=(0, 1, 2))(x, w, b)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, rtol=1e-9, atol=1e-10)


def test_saved_tensors_and_no_graph_without_grad(device):
    x, w, b, t = _data(6, 5, 7, torch.float32, device)
    lp, ent = opforge.linear_log_probs(x, w, t, b, return_entropy=True)
    assert lp.grad_fn is None and ent.grad_fn is None
    w.requires_grad_()
    lp, ent = opforge.linear_log_probs(x, w, t, b, return_entropy=True)
    assert lp.grad_fn is ent.grad_fn and lp.grad_fn.name() == "opforge::LinearLogProbsBackward"
    # no reference cycle through the saved entropy: freeing the outputs frees the node's graph
    import gc
    import weakref
    ref = weakref.ref(ent)
    del lp, ent
    gc.collect()
    assert ref() is None
