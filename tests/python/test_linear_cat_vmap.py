"""torch.func.vmap over linear_cat: functorch has no batching fallback for an op with a Tensor[]
argument, so linear_cat and linear_cat_backward carry their own rules (python/opforge/functional.py). Per-sample
gradients (vmap(grad(...))), jacrev, batched weights and batch dims other than 0 equal torch's own cat + linear.
torch.autograd.grad(..., is_grads_batched=True) runs under torch's legacy vmap, whose fallback refuses a Tensor[]
as well: both ops register the list-aware loop of csrc/core/legacy_batched for its `Batched` key."""
import warnings

import pytest
import torch
import torch.func as tf
import torch.nn.functional as TF

import opforge
from opforge.testing import assert_matches_reference, linear_cat_reference


def _f(ours):
    def f(w, b, a, c):
        y = opforge.linear_cat([a, c], w, b) if ours else TF.linear(torch.cat([a, c], -1), w, b)
        return (y.tanh() * y).sum()
    return f


def _params(device, dtype=torch.float64):
    torch.manual_seed(0)
    return torch.randn(6, 7, device=device, dtype=dtype), torch.randn(6, device=device, dtype=dtype)


@pytest.mark.parametrize("in_dims", [(None, None, 0, 0), (None, None, 0, None), (None, None, None, 0)])
def test_per_sample_gradients_equal_torch_cat_linear(device, in_dims):
    """vmap(grad(...)) over the samples (the batched pieces), weight and bias shared: the per-sample weight, bias
    and piece gradients equal those of torch.cat + F.linear."""
    w, b = _params(device)
    a = torch.randn(5, 3, 3, device=device, dtype=torch.float64)
    c = torch.randn(5, 3, 4, device=device, dtype=torch.float64)
    a_, c_ = (a if in_dims[2] == 0 else a[0]), (c if in_dims[3] == 0 else c[0])
    g = lambda ours: tf.vmap(tf.grad(_f(ours), argnums=(0, 1, 2, 3)), in_dims=in_dims)(w, b, a_, c_)  # noqa: E731
    ours, ref = g(True), g(False)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape and o.shape[0] == 5
        torch.testing.assert_close(o, r)


def test_per_sample_gradients_float32(device):
    """The same in float32 against torch's float32 composition, within float32 rounding."""
    w, b = _params(device, torch.float32)
    a, c = torch.randn(8, 2, 3, device=device), torch.randn(8, 2, 4, device=device)
    g = lambda ours: tf.vmap(tf.grad(_f(ours), argnums=(0, 1, 2)), in_dims=(None, None, 0, 0))(w, b, a, c)  # noqa: E731
    for o, r in zip(g(True), g(False)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_batched_weight_and_bias_and_other_batch_dims(device):
    """vmap over an ensemble of weights and biases (a batched weight takes the per-sample path) with the batch dim
    of one piece at dim 1 and of the output at dim 1."""
    torch.manual_seed(1)
    d = torch.float64
    W, B = torch.randn(4, 6, 7, device=device, dtype=d), torch.randn(4, 6, device=device, dtype=d)
    a = torch.randn(3, 4, 3, device=device, dtype=d)  # batch at dim 1
    c = torch.randn(4, 3, 4, device=device, dtype=d)
    ours = tf.vmap(lambda w, b, a, c: opforge.linear_cat([a, c], w, b), in_dims=(0, 0, 1, 0), out_dims=1)(W, B, a, c)
    ref = torch.stack([TF.linear(torch.cat([a[:, i], c[i]], -1), W[i], B[i]) for i in range(4)], 1)
    torch.testing.assert_close(ours, ref)
    # and per-sample gradients with a batched weight (grad of an ensemble member's loss)
    g = lambda ours: tf.vmap(tf.grad(_f(ours), argnums=(0, 1, 2)), in_dims=(0, 0, 0, 0))(W, B, a.movedim(1, 0), c)  # noqa: E731
    for o, r in zip(g(True), g(False)):
        torch.testing.assert_close(o, r)


def test_jacrev_equals_torch(device):
    """jacrev vmaps the vjp over the output's basis: linear_cat_backward's rule (or the differentiable double
    backward) under vmap."""
    w, b = _params(device)
    a, c = torch.randn(2, 3, device=device, dtype=torch.float64), torch.randn(2, 4, device=device, dtype=torch.float64)
    ours = tf.jacrev(lambda a, w: opforge.linear_cat([a, c], w, b), argnums=(0, 1))(a, w)
    ref = tf.jacrev(lambda a, w: TF.linear(torch.cat([a, c], -1), w, b), argnums=(0, 1))(a, w)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)


def test_vmap_of_the_backward_op_equals_a_loop(device):
    """linear_cat_backward under vmap directly (grad_output, pieces and weight batched; bias dtype given) equals the
    per-sample calls stacked, undefined gradients staying None."""
    torch.manual_seed(2)
    d = torch.float64
    dy = torch.randn(3, 5, 6, device=device, dtype=d)
    xs = [torch.randn(3, 5, 3, device=device, dtype=d), torch.randn(3, 5, 4, device=device, dtype=d)]
    W = torch.randn(3, 6, 7, device=device, dtype=d)
    op = torch.ops.opforge.linear_cat_backward
    for mask in ([True, True, True], [False, True, False], [True, False, False]):
        out_dims = ([0, 0] if mask[0] else [], 0 if mask[1] else None, 0 if mask[2] else None)
        ours = tf.vmap(lambda g, x0, x1, w: op(g, [x0, x1], w, mask, d), out_dims=out_dims)(dy, *xs, W)
        for i in range(3):
            ref = op(dy[i], [xs[0][i], xs[1][i]], W[i], mask, d)
            assert len(ours[0]) == len(ref[0])
            for o, r in zip(ours[0], ref[0]):
                torch.testing.assert_close(o[i], r)
            for o, r in zip(ours[1:], ref[1:]):
                assert (o is None) == (r is None)
                if r is not None:
                    torch.testing.assert_close(o[i], r)


@pytest.mark.parametrize("weight_batched", [False, True])
def test_no_bias_under_vmap(device, weight_batched):
    """Without a bias (left out or None) the dispatcher passes the rule two arguments and two in_dims: vmap, and
    vmap(grad(...)), of a bias-less linear_cat equal torch's cat + linear (they raised a TypeError, the rule's bias
    argument missing)."""
    torch.manual_seed(3)
    d = torch.float64
    W = torch.randn(4, 6, 7, device=device, dtype=d)
    w_arg, w_dim = (W, 0) if weight_batched else (W[0], None)
    a, c = torch.randn(4, 2, 3, device=device, dtype=d), torch.randn(4, 2, 4, device=device, dtype=d)
    for call in (lambda w, a, c: opforge.linear_cat([a, c], w), lambda w, a, c: opforge.linear_cat([a, c], w, None)):
        ours = tf.vmap(call, in_dims=(w_dim, 0, 0))(w_arg, a, c)
        ref = tf.vmap(lambda w, a, c: TF.linear(torch.cat([a, c], -1), w), in_dims=(w_dim, 0, 0))(w_arg, a, c)
        torch.testing.assert_close(ours, ref)
        assert ours.shape == (4, 2, 6)
    g = lambda f: tf.vmap(tf.grad(lambda w, a, c: f(w, a, c).pow(2).sum(), argnums=(0, 1, 2)), in_dims=(w_dim, 0, 0))  # noqa: E731
    ours = g(lambda w, a, c: opforge.linear_cat([a, c], w))(w_arg, a, c)
    ref = g(lambda w, a, c: TF.linear(torch.cat([a, c], -1), w))(w_arg, a, c)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r)


def test_batched_weight_over_an_empty_batch(device):
    """A batch of size 0 on the per-sample path (batched weight) gives empty results of the right shapes, as torch's
    cat + linear does (torch.stack of no samples raised)."""
    d = torch.float64
    W, B = torch.empty(0, 6, 7, device=device, dtype=d), torch.empty(0, 6, device=device, dtype=d)
    a, c = torch.randn(2, 3, device=device, dtype=d), torch.randn(2, 4, device=device, dtype=d)
    ours = tf.vmap(lambda w, b: opforge.linear_cat([a, c], w, b))(W, B)
    assert ours.shape == (0, 2, 6)
    gw, gb = tf.vmap(tf.grad(lambda w, b: opforge.linear_cat([a, c], w, b).sum(), argnums=(0, 1)))(W, B)
    assert gw.shape == W.shape and gb.shape == B.shape


# ---- torch.autograd.grad(..., is_grads_batched=True): torch's legacy vmap ------------------------------------------


def _pieces(device, dtype):
    """Pieces (3, 2, K_i) with a zero-width one, weight (6, 7) and bias (6,), all requiring grad."""
    torch.manual_seed(4)
    xs = [torch.randn(3, 2, k, device=device).to(dtype).requires_grad_() for k in (3, 0, 4)]
    w = (torch.randn(6, 7, device=device) / 7 ** 0.5).to(dtype).requires_grad_()
    return xs, w, torch.randn(6, device=device).to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("wrt", ["all", "weight_and_bias", "pieces", "no_bias"])
def test_is_grads_batched_equals_the_per_sample_loop(device, dtype, wrt):
    """torch.autograd.grad with a leading batch of upstream gradients and is_grads_batched=True (it raised "Batching
    rule not implemented for opforge::linear_cat_backward"): each sample's gradients are those of the per-sample
    torch.autograd.grad loop, bit for bit (the same kernels run once per sample), and match the float64 reference
    by the tolerance rule against torch's cat + linear in the same dtype; only the asked-for gradients are
    computed (the backward's output_mask follows `inputs`)."""
    xs, w, b = _pieces(device, dtype)
    bias = None if wrt == "no_bias" else b
    args = {"all": (*xs, w, b), "weight_and_bias": (w, b), "pieces": tuple(xs), "no_bias": (*xs, w)}[wrt]
    y = opforge.linear_cat(xs, w, bias)
    gos = torch.randn(5, *y.shape, device=device).to(dtype)
    batched = torch.autograd.grad(y, args, gos, retain_graph=True, is_grads_batched=True)
    loop = [torch.autograd.grad(y, args, g, retain_graph=True) for g in gos]

    def grads(fn, cast):
        out = []
        for g in gos:
            a = [t.detach().to(cast).requires_grad_() for t in (*xs, w, b)]
            yy = fn(a[:3], a[3], a[4] if bias is not None else None)
            gg = torch.autograd.grad(yy, a, g.to(cast), allow_unused=True)
            out.append({id(t): gi for t, gi in zip((*xs, w, b), gg)})
        return out

    ref = grads(linear_cat_reference, torch.float64)
    base = grads(lambda xs_, w_, b_: TF.linear(torch.cat(xs_, -1), w_, b_), dtype)
    assert len(batched) == len(args)
    for j, (t, got) in enumerate(zip(args, batched)):
        assert got.shape == (5, *t.shape) and got.dtype == t.dtype, f"gradient {j}: {got.shape} {got.dtype}"
        torch.testing.assert_close(got, torch.stack([lp[j] for lp in loop]), rtol=0, atol=0)
        assert_matches_reference(got, torch.stack([r[id(t)] for r in ref]), torch.stack([r[id(t)] for r in base]),
                                 what=f"is_grads_batched gradient {j}")


def test_is_grads_batched_with_create_graph(device):
    """is_grads_batched=True with create_graph=True (the differentiable double backward, ATen ops under the legacy
    vmap): the gradients and a second derivative through them equal those of the per-sample loop."""
    xs, w, b = _pieces(device, torch.float64)
    args = (*xs, w, b)
    y = opforge.linear_cat(xs, w, b)
    gos = torch.randn(4, *y.shape, device=device, dtype=torch.float64)
    batched = torch.autograd.grad(y, args, gos, create_graph=True, is_grads_batched=True)
    loop = [torch.autograd.grad(y, args, g, create_graph=True) for g in gos]
    stacked = [torch.stack([lp[j] for lp in loop]) for j in range(len(args))]
    for got, want in zip(batched, stacked):
        torch.testing.assert_close(got, want)
    second = [torch.autograd.grad(sum((g * g.tanh()).sum() for g in gs), args, allow_unused=True)
              for gs in (batched, stacked)]
    for got, want in zip(*second):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)


def test_legacy_vmap_nested_levels(device):
    """The legacy `Batched` kernel aligns the batch dims of two nested levels (torch._vmap_internals.vmap, which
    is_grads_batched uses): a piece batched at the outer level only, a weight and a piece at the inner one; the
    forward and linear_cat_backward (a Tensor[] argument and return) equal the per-sample results."""
    from torch._vmap_internals import vmap as legacy_vmap

    torch.manual_seed(5)
    d = torch.float64
    a = torch.randn(2, 3, 2, device=device, dtype=d)     # outer level, dim 0
    C = torch.randn(4, 3, 5, device=device, dtype=d)     # inner level, dim 0
    W = torch.randn(6, 4, 7, device=device, dtype=d)     # inner level, dim 1
    b = torch.randn(6, device=device, dtype=d)
    dY = torch.randn(3, 2, 4, 6, device=device, dtype=d)  # outer level at dim 1, inner at dim 2
    mask = [True, True, True]

    def backward(a, c, w, g):
        gx, gw, gb = torch.ops.opforge.linear_cat_backward(g, [a, c], w, mask, d)
        return (*gx, gw, gb)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the legacy vmap's notice that torch.vmap replaces it
        out = legacy_vmap(legacy_vmap(lambda a, c, w: opforge.linear_cat([a, c], w, b), in_dims=(None, 0, 1)),
                          in_dims=(0, None, None))(a, C, W)
        grads = legacy_vmap(legacy_vmap(backward, in_dims=(None, 0, 1, 1)), in_dims=(0, None, None, 1))(a, C, W, dY)
    assert out.shape == (2, 4, 3, 6)
    for i in range(2):
        for j in range(4):
            torch.testing.assert_close(out[i, j], TF.linear(torch.cat([a[i], C[j]], -1), W[:, j], b))
            want = backward(a[i], C[j], W[:, j], dY[:, i, j])
            for got, r in zip(grads, want):
                torch.testing.assert_close(got[i, j], r, rtol=0, atol=0)
