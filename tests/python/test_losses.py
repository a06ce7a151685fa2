"""opforge.losses: the preference losses (DPO sigmoid/IPO/hinge/robust, SimPO, CPO, ORPO) and KTO against float64
references written from the papers' formulas, the fused front end (linear_preference_loss) against the same math on
materialised logits, sequences without any valid token, and the defects peers have reported (ORPO's log(1 − p) at
p → 1, robust DPO's sign, IPO on summed log-probabilities, KTO's mean over no example)."""
import math

import pytest
import torch

import opforge
from opforge.losses import PREFERENCE_LOSS_TYPES, kto_loss, linear_preference_loss, preference_loss, sequence_log_probs
from opforge.testing import kto_loss_reference, linear_log_probs_reference, preference_loss_reference

REFERENCE_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def _logps(B, device, *, average=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 if average else 20.0
    return [(-torch.rand(B, generator=g, dtype=torch.float64) * scale - 0.01).to(device) for _ in range(4)]


@pytest.mark.parametrize("loss_type", PREFERENCE_LOSS_TYPES)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_matches_paper_formulas(device, loss_type, label_smoothing):
    if label_smoothing and loss_type in ("ipo", "hinge", "orpo"):
        pytest.skip("label_smoothing is not a parameter of this loss")
    c, r, rc, rr = _logps(16, device, average=loss_type in ("ipo", "simpo", "orpo"))
    kw = dict(loss_type=loss_type, beta=0.3, label_smoothing=label_smoothing, simpo_gamma=0.4)
    ref_args = (rc, rr) if loss_type in REFERENCE_TYPES else (None, None)
    c1, r1 = c.clone().requires_grad_(), r.clone().requires_grad_()
    losses, cr, rj = preference_loss(c1, r1, *ref_args, reduction="none", **kw)
    c2, r2 = c.clone().requires_grad_(), r.clone().requires_grad_()
    ref = preference_loss_reference(c2, r2, *ref_args, **kw)
    torch.testing.assert_close(losses, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(16, dtype=torch.float64, device=device)
    (losses * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(c1.grad, c2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r1.grad, r2.grad, rtol=1e-10, atol=1e-12)
    assert not cr.requires_grad and not rj.requires_grad
    if loss_type in REFERENCE_TYPES:
        torch.testing.assert_close(cr, 0.3 * (c - rc))
    mean, _, _ = preference_loss(c, r, *ref_args, **kw)
    torch.testing.assert_close(mean, ref.detach().mean())


def test_robust_dpo_is_unbiased_under_label_noise():
    """Chowdhury et al.: the robust loss's expectation over labels flipped with probability ε equals the clean DPO
    loss (the sign of the ε term is what makes it so; a flipped sign, as once reported against a peer, breaks it)."""
    c, r, rc, rr = _logps(32, "cpu")
    eps = 0.2
    clean = preference_loss(c, r, rc, rr, loss_type="sigmoid", beta=0.5, reduction="none")[0]
    kept = preference_loss(c, r, rc, rr, loss_type="robust", beta=0.5, label_smoothing=eps, reduction="none")[0]
    flipped = preference_loss(r, c, rr, rc, loss_type="robust", beta=0.5, label_smoothing=eps, reduction="none")[0]
    torch.testing.assert_close((1 - eps) * kept + eps * flipped, clean, rtol=1e-12, atol=1e-12)


def test_orpo_near_certain_tokens_is_finite():
    """ORPO's log odds need log(1 − p) at p = exp(mean log-prob); near p = 1 (a well-fit chosen response) the naive
    log1p(−exp(l)) is −inf at l = 0 and loses all digits near it (NaN losses and gradients, reported against a peer's
    ORPO); log(−expm1(l)) keeps them."""
    c = torch.tensor([-1e-9, -1e-4, 0.0], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([-2.0, -3.0, -1.0], dtype=torch.float64)
    loss, _, _ = preference_loss(c[:2], r[:2], loss_type="orpo", beta=0.1, reduction="sum")
    ref = preference_loss_reference(c[:2].detach(), r[:2], loss_type="orpo", beta=0.1).sum()
    torch.testing.assert_close(loss, ref, rtol=1e-9, atol=0)
    loss.backward()
    assert torch.isfinite(c.grad).all()
    c32 = torch.tensor([-1e-6], dtype=torch.float32, requires_grad=True)
    l32 = preference_loss(c32, torch.tensor([-2.0]), loss_type="orpo")[0]
    l32.backward()
    assert torch.isfinite(l32) and torch.isfinite(c32.grad).all()


def test_kto_matches_value_function_and_empty_halves(device):
    c, r, k, rc = _logps(8, device)
    rr, rk = (v.flip(0) for v in (c, k))
    kw = dict(beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)
    c1 = c.clone().requires_grad_()
    loss, cr, rj = kto_loss(c1, r, k, rc, rr, rk, **kw)
    c2 = c.clone().requires_grad_()
    ref = kto_loss_reference(c2, r, k, rc, rr, rk, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(c1.grad, c2.grad, rtol=1e-10, atol=1e-14)
    # a batch of only desirable examples, and one without any: never 0/0 (TRL's nanmean gives NaN there)
    e = c.new_zeros(0)
    only, _, _ = kto_loss(c, e, k, rc, e, rk, **kw)
    torch.testing.assert_close(only, kto_loss_reference(c, e, k, rc, e, rk, **kw))
    none, _, _ = kto_loss(e.requires_grad_(), e, e, e, e, e)
    assert none.item() == 0
    none.backward()


def _seq_data(B, T, H, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * B, T, H, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(dtype=dtype, device=device)
    wr = (w.double().cpu() + 0.05 * torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype=dtype, device=device)
    t = torch.randint(0, V, (2 * B, T), generator=g)
    t[:, :3] = -100  # the prompt
    t[torch.rand(2 * B, T, generator=g) < 0.1] = -100
    return x, w, wr, t.to(device)


def _unfused(x, w, wr, t, loss_type, **kw):
    """The same loss on materialised float64 logits (the reference log-probabilities, the papers' formulas)."""
    avg = loss_type in ("ipo", "simpo", "orpo")
    lp = linear_log_probs_reference(x, w, t)
    valid = t != -100
    cnt = valid.sum(-1).clamp(min=1)
    s = lp.sum(-1) / cnt if avg else lp.sum(-1)
    B = t.shape[0] // 2
    ref = None
    if loss_type in REFERENCE_TYPES:
        with torch.no_grad():
            rl = linear_log_probs_reference(x, wr, t).sum(-1)
            ref = (rl / cnt if avg else rl)
        ref = (ref[:B], ref[B:])
    losses = preference_loss_reference(s[:B], s[B:], *(ref or (None, None)), loss_type=loss_type, **kw)
    loss = losses.mean()
    if loss_type in ("cpo", "orpo"):
        loss = loss - lp[:B].sum() / valid[:B].sum().clamp(min=1)
    return loss


@pytest.mark.parametrize("loss_type", PREFERENCE_LOSS_TYPES)
def test_linear_preference_loss_matches_unfused(device, loss_type):
    x, w, wr, t = _seq_data(3, 11, 8, 37, torch.float64, device)
    kw = dict(beta=0.2)
    w1 = w.clone().requires_grad_()
    x1 = x.clone().requires_grad_()
    loss, cr, rr = linear_preference_loss(x1, w1, t, ref_linear_weight=wr, loss_type=loss_type, chunk_size=7, **kw)
    w2 = w.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    ref = _unfused(x2, w2, wr, t, loss_type, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-8, atol=1e-12)
    assert cr.shape == rr.shape == (3,)


def test_float32_policy_and_given_reference(device):
    x, w, wr, t = _seq_data(2, 9, 8, 29, torch.float32, device)
    with torch.no_grad():
        ref = sequence_log_probs(x, wr, t)
    a, _, _ = linear_preference_loss(x, w, t, ref_chosen_logps=ref[:2], ref_rejected_logps=ref[2:])
    b, _, _ = linear_preference_loss(x, w, t, ref_linear_weight=wr)
    torch.testing.assert_close(a, b)
    u = _unfused(x.double(), w.double(), wr.double(), t, "sigmoid", beta=0.1)
    torch.testing.assert_close(a.double(), u, rtol=1e-5, atol=1e-6)


def test_sequences_without_valid_tokens(device):
    """A pair whose sequences are all prompt (every target ignored): averaged log-probabilities are 0 (not 0/0) and
    every gradient is finite and zero for those rows; a batch where no chosen token counts adds a zero NLL."""
    x, w, wr, t = _seq_data(2, 6, 4, 13, torch.float32, device)
    t[0] = -100
    t[2] = -100
    for loss_type in ("ipo", "simpo", "orpo", "cpo"):
        xx = x.clone().requires_grad_()
        loss, _, _ = linear_preference_loss(xx, w, t, ref_linear_weight=wr, loss_type=loss_type)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(xx.grad).all()
        assert torch.equal(xx.grad[0], torch.zeros_like(xx.grad[0]))
    t[:2] = -100  # no chosen token at all
    xx = x.clone().requires_grad_()
    loss, _, _ = linear_preference_loss(xx, w, t, loss_type="cpo")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(xx.grad).all()


def test_ipo_uses_mean_log_probs():
    """IPO's target margin 1/(2β) is on per-token mean log-ratios (Azar et al.; a peer once applied it to summed
    log-probabilities, which scales the margin with the sequence length): linear_preference_loss averages."""
    x, w, wr, t = _seq_data(2, 10, 4, 11, torch.float64, "cpu")
    loss, _, _ = linear_preference_loss(x, w, t, ref_linear_weight=wr, loss_type="ipo", beta=0.5)
    mean_lp = sequence_log_probs(x, w, t, average_log_prob=True)
    mean_ref = sequence_log_probs(x, wr, t, average_log_prob=True)
    direct = preference_loss(mean_lp[:2], mean_lp[2:], mean_ref[:2], mean_ref[2:], loss_type="ipo", beta=0.5)[0]
    torch.testing.assert_close(loss, direct)


def test_bad_arguments():
    c, r, rc, rr = _logps(4, "cpu")
    pre = "opforge::preference_loss: "
    with pytest.raises(ValueError, match=pre + "expected loss_type to be one of"):
        preference_loss(c, r, rc, rr, loss_type="dpo")
    with pytest.raises(ValueError, match=pre + "expected ref_chosen_logps and ref_rejected_logps"):
        preference_loss(c, r, loss_type="sigmoid")
    with pytest.raises(ValueError, match=pre + "expected beta > 0, but got 0"):
        preference_loss(c, r, rc, rr, beta=0)
    with pytest.raises(ValueError, match=pre + r"expected label_smoothing in \[0, 0.5\), but got 0.5"):
        preference_loss(c, r, rc, rr, label_smoothing=0.5)
    with pytest.raises(ValueError, match=pre + r"expected rejected_logps of chosen_logps's shape \[4\], but got \[3\]"):
        preference_loss(c, r[:3], rc, rr)
    with pytest.raises(ValueError, match=pre + "expected reduction to be one of"):
        preference_loss(c, r, rc, rr, reduction="avg")
    with pytest.raises(ValueError, match="opforge::kto_loss: expected beta > 0"):
        kto_loss(c, r, c, c, r, c, beta=-1)
    x, w, wr, t = _seq_data(1, 4, 4, 7, torch.float32, "cpu")
    with pytest.raises(ValueError, match="opforge::linear_preference_loss: expected a batch of 2B sequences"):
        linear_preference_loss(x[:1], w, t[:1])
    with pytest.raises(ValueError, match="opforge::linear_preference_loss: expected ref_chosen_logps"):
        linear_preference_loss(x, w, t, loss_type="sigmoid")
    assert opforge.preference_loss is preference_loss and "linear_preference_loss" in opforge.__all__
