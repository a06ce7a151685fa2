"""linear_jsd: the divergence and the student's gradients against float64 for β = 0, 1 and between, with a
temperature, biases and ignored tokens; every token ignored (zero gradients for any grad_output); the teacher gets
no gradient; opcheck, torch.compile, gradcheck, torch.func. The shared checks run from the conformance entry. On CUDA
every test runs in both modes of OPFORGE_LCE_LEAN (ids "cuda" and "cuda-lean", conftest.lce_device_fixture)."""
import math

import pytest
import torch

import opforge
from opforge.testing import (assert_matches_reference, linear_jsd_from_logits, linear_jsd_grad_error_bounds,
                             linear_jsd_reference)

from conftest import assert_compile_matches_eager, lce_device_fixture, lce_lean, lean_accum_factor, lean_rounding_bound

device = lce_device_fixture()  # "cpu", "cuda" (OPFORGE_LCE_LEAN=0), "cuda-lean" (OPFORGE_LCE_LEAN=1)


def _data(N, H, Ht, V, dtype, device, *, ignore_frac=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, H, generator=g) * 2).to(dtype=dtype, device=device)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(dtype=dtype, device=device)
    b = torch.randn(V, generator=g).to(dtype=dtype, device=device)
    xt = (torch.randn(N, Ht, generator=g) * 2).to(dtype=dtype, device=device)
    wt = (torch.randn(V, Ht, generator=g) / math.sqrt(Ht)).to(dtype=dtype, device=device)
    bt = torch.randn(V, generator=g).to(dtype=dtype, device=device)
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_frac:
        t[torch.rand(N, generator=g) < ignore_frac] = -100
    return x, w, b, xt, wt, bt, t.to(device)


def _jsd64(zs, zt, t, beta, temperature, ignore_index=-100, reduction="mean"):
    """linear_jsd's value from the raw float64 logits of both heads (zs, zt [N, V], biases included), differentiable
    in both (linear_jsd_reference detaches the teacher)."""
    return linear_jsd_from_logits(zs, zt, t, beta=beta, temperature=temperature, ignore_index=ignore_index,
                                  reduction=reduction)


def _run(fn, x, w, b):
    x, w, b = (v.detach().clone().requires_grad_() for v in (x, w, b))
    loss = fn(x, w, b)
    loss.backward()
    return loss.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("V", [53, 56])  # CUDA: 56 rows take the 16-byte row access (V % 8 == 0), 53 do not
def test_matches_float64(device, dtype, beta, V):
    x, w, b, xt, wt, bt, t = _data(29, 16, 24, V, dtype, device, ignore_frac=0.2)
    kw = dict(beta=beta, temperature=0.8)
    ours = _run(lambda x, w, b: opforge.linear_jsd(x, w, xt, wt, t, linear_bias=b, teacher_linear_bias=bt,
                                                    chunk_size=8, **kw), x, w, b)
    ref = _run(lambda x, w, b: linear_jsd_reference(x, w, xt, wt, t, linear_bias=b, teacher_linear_bias=bt, **kw),
               x, w, b)
    base = _run(lambda x, w, b: linear_jsd_reference(x, w, xt, wt, t, linear_bias=b, teacher_linear_bias=bt,
                                                     compute_dtype=dtype, **kw), x, w, b)
    factors, bounds = {}, {}
    if dtype == torch.float32:
        # the a-priori float32 bounds of the gradients: the row kernel's summation order (16-byte rows or not) may be
        # less lucky than PyTorch's on one shape while within the rounding any order allows
        bounds["grad_input"], bounds["grad_linear_weight"], bounds["grad_linear_bias"] = linear_jsd_grad_error_bounds(
            x, w, xt, wt, torch.ones((), dtype=torch.float64, device=device), t, linear_bias=b,
            teacher_linear_bias=bt, return_bias=True, **kw)
    if lce_lean(x, w, b):
        # lean mode: dW accumulates in bf16 over the 4 chunks (lean_accum_factor), and the loss carries both heads'
        # logits rounded to bf16 (lean_rounding_bound over the student's and the teacher's raw logits)
        factors["grad_linear_weight"] = lean_accum_factor(math.ceil(29 / 8))
        zs = x.double() @ w.double().t() + b.double()
        zt = xt.double() @ wt.double().t() + bt.double()
        bounds["loss"] = lean_rounding_bound(lambda ls: _jsd64(ls[0], ls[1], t, **kw), [(zs, dtype), (zt, dtype)],
                                             ref[0])
    for name, o, r, bl in zip(["loss", "grad_input", "grad_linear_weight", "grad_linear_bias"], ours, ref, base):
        assert_matches_reference(o, r.to(o.dtype) if o.dtype == torch.float64 else r, bl.to(o.dtype), what=name,
                                 factor=factors.get(name, 2.0), bound=bounds.get(name))


def test_float64_sum_without_target_and_chunking(device):
    x, w, b, xt, wt, bt, _ = _data(17, 8, 5, 11, torch.float64, device)
    ref = linear_jsd_reference(x, w, xt, wt, linear_bias=b, teacher_linear_bias=bt, beta=0.3, reduction="sum")
    for chunk in (1, 4, None):
        ours = opforge.linear_jsd(x, w, xt, wt, linear_bias=b, teacher_linear_bias=bt, beta=0.3, reduction="sum",
                                  chunk_size=chunk)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    # the divergence of a head from itself is 0; JSD is symmetric at β = 0.5 up to swapping the heads
    same = opforge.linear_jsd(x, w, x, w, beta=0.5)
    torch.testing.assert_close(same, torch.zeros_like(same), rtol=0, atol=1e-12)
    ab = opforge.linear_jsd(x, w, xt, wt, beta=0.5)
    ba = opforge.linear_jsd(xt, wt, x, w, beta=0.5)
    torch.testing.assert_close(ab, ba, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_token_ignored_gives_zero_gradients(device, reduction):
    """Every target ignored: "mean" is 0/0 = NaN and a "sum" normalised by the number of counted tokens (0) gets an
    inf grad_output; the unfused math's gradient is zero (no token contributes), and so is ours."""
    x, w, b, xt, wt, bt, t = _data(7, 4, 4, 9, torch.float32, device)
    t.fill_(-100)
    x.requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    loss = opforge.linear_jsd(x, w, xt, wt, t, linear_bias=b, teacher_linear_bias=bt, reduction=reduction)
    if reduction == "mean":
        assert torch.isnan(loss)
    else:
        assert loss.item() == 0
        loss = loss / (t != -100).sum()  # 0/0: grad_output inf
    loss.backward()
    for g in (x.grad, w.grad, b.grad):
        assert torch.equal(g, torch.zeros_like(g))


def test_teacher_gets_no_gradient(device):
    x, w, b, xt, wt, bt, t = _data(5, 4, 4, 6, torch.float32, device)
    with pytest.raises(RuntimeError, match="opforge::linear_jsd: expected teacher_linear_weight not to require grad"):
        opforge.linear_jsd(x, w, xt, wt.requires_grad_(), t)
    with pytest.raises(RuntimeError, match="opforge::linear_jsd: expected teacher_input not to require grad"):
        opforge.linear_jsd(x, w.requires_grad_(), xt.requires_grad_(), wt.detach(), t)
    # only the weight requires grad: no input gradient buffer, and the weight's is right
    w2 = w.detach().requires_grad_()
    opforge.linear_jsd(x, w2, xt.detach(), wt.detach(), t).backward()
    w3 = w.detach().double().requires_grad_()
    linear_jsd_reference(x, w3, xt.detach(), wt.detach(), t).backward()
    torch.testing.assert_close(w2.grad.double(), w3.grad, rtol=1e-4, atol=1e-6)


def test_bad_inputs(device):
    x, w, b, xt, wt, bt, t = _data(5, 4, 3, 6, torch.float32, device)
    pre = "opforge::linear_jsd: "
    cases = [
        (dict(beta=1.5), ValueError, r"expected beta in \[0, 1\], but got 1.5"),
        (dict(temperature=0.0), ValueError, "expected temperature > 0 and finite, but got 0"),
        (dict(reduction="none"), ValueError, r"expected reduction to be one of \"mean\", \"sum\", but got \"none\""),
        (dict(chunk_size=0), ValueError, "expected chunk_size >= 1"),
        (dict(teacher_linear_bias=bt[:5]), ValueError, r"expected teacher_linear_bias of shape \[6\]"),
        (dict(linear_bias=b[:5]), ValueError, r"expected linear_bias of shape \[6\]"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=pre + msg):
            opforge.linear_jsd(x, w, xt, wt, t, **kw)
    with pytest.raises(ValueError, match=pre + r"expected teacher_input of input's leading shape \[5\]"):
        opforge.linear_jsd(x, w, xt[:4], wt, t)
    with pytest.raises(ValueError, match=pre + r"expected teacher_linear_weight of shape \[6, 3\]"):
        opforge.linear_jsd(x, w, xt, wt[:5], t)
    with pytest.raises(ValueError, match=pre + "expected target of input's leading shape"):
        opforge.linear_jsd(x, w, xt, wt, t[:4])
    with pytest.raises(TypeError, match=pre + "expected target of dtype int64"):
        opforge.linear_jsd(x, w, xt, wt, t.float())
    with pytest.raises(TypeError, match=pre + "expected teacher_input to have a floating dtype"):
        opforge.linear_jsd(x, w, xt.long(), wt, t)
    with pytest.raises(ValueError, match=pre + "expected input to be a tensor, but got None"):
        opforge.linear_jsd(None, None, None, None)


def test_opcheck_compile_gradcheck_func(device):
    x, w, b, xt, wt, bt, t = _data(6, 4, 3, 7, torch.float64, device)
    t[2] = -100
    for beta in (0.0, 0.4, 1.0):
        args = (x, w, xt, wt, t, b, bt, beta, 0.9, -100, "mean", 4)
        torch.library.opcheck(torch.ops.opforge.linear_jsd.default,
                              (x.clone().requires_grad_(), w.clone().requires_grad_(), *args[2:5],
                               b.clone().requires_grad_(), *args[6:]))
        for mask in ([True, True, True], [False, True, False]):
            torch.library.opcheck(torch.ops.opforge._linear_jsd_forward.default, (*args, mask))

        def f(x, w, b):
            return opforge.linear_jsd(x, w, xt, wt, t, linear_bias=b, teacher_linear_bias=bt, beta=beta,
                                      temperature=0.9, chunk_size=4)

        torch.autograd.gradcheck(f, [v.clone().requires_grad_() for v in (x, w, b)])
        ours = torch.func.grad(f, argnums=(0, 1, 2))(x, w, b)
        ref = torch.func.grad(lambda x, w, b: linear_jsd_reference(x, w, xt, wt, t, linear_bias=b,
                                                                   teacher_linear_bias=bt, beta=beta,
                                                                   temperature=0.9), argnums=(0, 1, 2))(x, w, b)
        for o, r in zip(ours, ref):
            torch.testing.assert_close(o, r, rtol=1e-9, atol=1e-11)
    xf, wf, bf = (v.float() for v in (x, w, b))

    def g(x, w, b):
        return opforge.linear_jsd(x, w, xt.float(), wt.float(), t, linear_bias=b, beta=0.5)

    assert_compile_matches_eager(g, (xf, wf, bf))
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        xx = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(xx, w, b), xx, create_graph=True)
        gx.sum().backward()
