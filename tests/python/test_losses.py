"""opforge.losses: the preference losses (DPO sigmoid/IPO/hinge/robust, SimPO, CPO, ORPO), KTO and GRPO (grpo,
bnpo, dr_grpo, dapo; token and sequence importance sampling, clipping, the KL penalty) against float64 references
written from the papers' formulas, the fused front ends (linear_preference_loss, linear_grpo_loss) against the same
math on materialised logits, sequences and batches without any valid token (zero gradients), and the defects peers
have reported (ORPO's log(1 − p) at p → 1, robust DPO's sign, IPO on summed log-probabilities, KTO's mean over no
example)."""
import math

import pytest
import torch

import opforge
from opforge.losses import (GRPO_LOSS_TYPES, PREFERENCE_LOSS_TYPES, grpo_loss, kto_loss, linear_grpo_loss,
                            linear_preference_loss, preference_loss, sequence_log_probs)
from opforge.testing import (grpo_loss_reference, kto_loss_reference, linear_log_probs_reference,
                             preference_loss_reference)

REFERENCE_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def _logps(B, device, *, average=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 if average else 20.0
    return [(-torch.rand(B, generator=g, dtype=torch.float64) * scale - 0.01).to(device) for _ in range(4)]


# label_smoothing is a parameter of the losses that take it (sigmoid's conservative DPO, robust's noise rate,
# SimPO's and CPO's smoothed sigmoid); IPO, hinge and ORPO have none, so they are run at 0 only
SMOOTHED_TYPES = ("sigmoid", "robust", "simpo", "cpo")
PAPER_CASES = [(lt, 0.0) for lt in PREFERENCE_LOSS_TYPES] + [(lt, 0.2) for lt in PREFERENCE_LOSS_TYPES
                                                              if lt in SMOOTHED_TYPES]


@pytest.mark.parametrize("loss_type,label_smoothing", PAPER_CASES)
def test_matches_paper_formulas(device, loss_type, label_smoothing):
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
    c32 = torch.tensor([-1e-6, -1e-9, 0.0], dtype=torch.float32, requires_grad=True)
    l32 = preference_loss(c32, torch.tensor([-2.0, -2.0, -2.0]), loss_type="orpo")[0]
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


def test_every_target_ignored_gives_zero_gradients(device):
    """A whole batch without any counted token (every target ignored): each fused loss is finite and every
    gradient is exactly zero, as the unfused math's (each ignored token's log-probability is a masked-out branch)."""
    x, w, wr, t = _seq_data(2, 6, 4, 13, torch.float32, device)
    t.fill_(-100)
    adv = torch.randn(4, device=device)
    calls = [(f"preference {lt}", lambda xx, ww, lt=lt: linear_preference_loss(xx, ww, t, ref_linear_weight=wr,
                                                                                loss_type=lt)[0])
             for lt in PREFERENCE_LOSS_TYPES]
    calls += [(f"grpo {lt}", lambda xx, ww, lt=lt: linear_grpo_loss(xx, ww, t, adv, ref_linear_weight=wr, beta=0.1,
                                                                    loss_type=lt)[0]) for lt in GRPO_LOSS_TYPES]
    calls.append(("grpo dapo num_items_in_batch=0",
                  lambda xx, ww: linear_grpo_loss(xx, ww, t, adv, num_items_in_batch=torch.tensor(0))[0]))
    for name, fn in calls:
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xx, ww)
        loss.backward()
        assert torch.isfinite(loss), name
        for g in (xx.grad, ww.grad):
            assert torch.equal(g, torch.zeros_like(g)), name


def _grpo_data(B, T, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).to(device)
    old = (lp.cpu() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0).to(device)
    ref = (lp.cpu() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0).to(device)
    adv = torch.randn(B, generator=g, dtype=torch.float64).to(device)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False  # a sequence without any counted token
    return lp, old, ref, adv, mask.to(device)


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("opts", [dict(), dict(beta=0.04, epsilon_high=0.28), dict(beta=0.1, delta=1.5),
                                  dict(max_completion_length=20, num_items_in_batch=37)], ids=str)
def test_grpo_matches_reference(device, loss_type, level, opts):
    lp, old, ref, adv, mask = _grpo_data(6, 9, device)
    kw = dict(loss_type=loss_type, importance_sampling_level=level, **opts)
    a = lp.clone().requires_grad_()
    loss, stats = grpo_loss(a, adv, mask, old, ref, **kw)
    b = lp.clone().requires_grad_()
    expected = grpo_loss_reference(b, adv, mask, old, ref, **kw)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-14)
    assert torch.equal(a.grad[~mask], torch.zeros_like(a.grad[~mask]))
    assert all(not v.requires_grad for v in stats.values()) and ("kl" in stats) == bool(opts.get("beta"))
    assert 0 <= stats["clip_ratio_low"] <= stats["clip_ratio"] <= 1


def test_grpo_on_policy_and_clip_statistics():
    """Without old_log_probs the ratio is 1 (one step per generation): the loss is −mean(A) over the tokens for
    "bnpo" and its gradient A / count per token; a ratio past the clip range with an advantage of that sign gets
    no gradient and is counted as clipped."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, stats = grpo_loss(lp, adv, mask, loss_type="bnpo")
    torch.testing.assert_close(loss, torch.tensor((-2 * 1.0 + 3 * 2.0) / 5, dtype=torch.float64))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.2, -0.2, 0.0], [0.4, 0.4, 0.4]], dtype=torch.float64))
    assert stats["clip_ratio"] == 0
    old = lp.detach() - torch.tensor([[0.5, 0.0, 0.0], [0.0, -0.5, 0.0]], dtype=torch.float64)  # ratios e^0.5, e^-0.5
    lp.grad = None
    loss, stats = grpo_loss(lp, adv, mask, old, loss_type="bnpo")
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[1, 1] == 0 and lp.grad[0, 1] != 0
    torch.testing.assert_close(stats["clip_ratio_high"], torch.tensor(0.2, dtype=torch.float64))
    torch.testing.assert_close(stats["clip_ratio_low"], torch.tensor(0.2, dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_linear_grpo_loss_matches_unfused(device, loss_type):
    x, w, wr, t = _seq_data(2, 7, 8, 31, torch.float64, device)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(4, generator=g, dtype=torch.float64).to(device)
    old = (linear_log_probs_reference(x, w, t, temperature=0.9) + 0.1 * torch.randn(4, 7, generator=g,
                                                                                     dtype=torch.float64).to(device))
    kw = dict(loss_type=loss_type, beta=0.05, epsilon_high=0.3)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = linear_grpo_loss(x1, w1, t, adv, old_log_probs=old, ref_linear_weight=wr, temperature=0.9,
                               chunk_size=5, **kw)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp = linear_log_probs_reference(x2, w2, t, temperature=0.9)
    with torch.no_grad():
        ref = linear_log_probs_reference(x, wr, t, temperature=0.9)
    expected = grpo_loss_reference(lp, adv, t != -100, old, ref, **kw)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-8, atol=1e-12)


def test_grpo_bad_arguments():
    lp, old, ref, adv, mask = _grpo_data(3, 4, "cpu")
    pre = "opforge::grpo_loss: "
    with pytest.raises(ValueError, match=pre + "expected loss_type to be one of"):
        grpo_loss(lp, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match=pre + "expected importance_sampling_level"):
        grpo_loss(lp, adv, mask, importance_sampling_level="batch")
    with pytest.raises(ValueError, match=pre + r"expected advantages of shape \[3\]"):
        grpo_loss(lp, adv[:2], mask)
    with pytest.raises(ValueError, match=pre + r"expected mask of log_probs's shape"):
        grpo_loss(lp, adv, mask[:, :2])
    with pytest.raises(ValueError, match=pre + "expected ref_log_probs with beta"):
        grpo_loss(lp, adv, mask, beta=0.1)
    with pytest.raises(ValueError, match=pre + "expected delta > 1"):
        grpo_loss(lp, adv, mask, delta=0.5)
    with pytest.raises(ValueError, match=pre + "expected log_probs of shape"):
        grpo_loss(lp[0], adv, mask)
    x, w, wr, t = _seq_data(1, 4, 4, 7, torch.float32, "cpu")
    with pytest.raises(ValueError, match="opforge::linear_grpo_loss: expected ref_log_probs or ref_linear_weight"):
        linear_grpo_loss(x, w, t, torch.zeros(2), beta=0.1)
    assert opforge.grpo_loss is grpo_loss and "linear_grpo_loss" in opforge.__all__
