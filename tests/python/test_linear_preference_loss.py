"""linear_preference_loss's native op (_linear_preference_loss: the gradient computed in the forward chunk loop over
whole (chosen, rejected) pairs): the loss, the rewards and every gradient against the composed path
(linear_log_probs then preference_loss, autograd's recompute) and a float64 reference on materialised logits, for each
loss type, with a reference head (its own hidden states and bias, or the policy's), given reference log-probabilities,
a policy bias, a temperature, label smoothing, ignored tokens and chunk sizes that do not divide the pairs; float32
and bfloat16 by the tolerance rule; pairs and batches without any counted token; gradcheck, opcheck, Meta shapes,
torch.compile, double backward refused; bad inputs."""
import math

import pytest
import torch

from opforge.losses import PREFERENCE_LOSS_TYPES, _linear_preference_loss_composed, linear_preference_loss
from opforge.testing import assert_matches_reference, linear_log_probs_reference, preference_loss_reference
from conftest import assert_compile_matches_eager, lce_lean, lean_rounding_bound

REFERENCE_TYPES = ("sigmoid", "ipo", "hinge", "robust")
AVERAGED = ("ipo", "simpo", "orpo")
OP = torch.ops.opforge._linear_preference_loss.default
FWD = torch.ops.opforge._linear_preference_forward.default


def _data(B, T, H, V, dtype, device, *, Hr=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hr = Hr or H
    x = torch.randn(2 * B, T, H, generator=g).to(dtype=dtype, device=device)
    w = (torch.randn(V, H, generator=g) / math.sqrt(H)).to(dtype=dtype, device=device)
    b = (0.3 * torch.randn(V, generator=g)).to(dtype=dtype, device=device)
    xr = torch.randn(2 * B, T, Hr, generator=g).to(dtype=dtype, device=device)
    wr = (torch.randn(V, Hr, generator=g) / math.sqrt(Hr)).to(dtype=dtype, device=device)
    br = (0.3 * torch.randn(V, generator=g)).to(dtype=dtype, device=device)
    t = torch.randint(0, V, (2 * B, T), generator=g)
    t[:, :2] = -100  # the prompt
    t[torch.rand(2 * B, T, generator=g) < 0.15] = -100
    rc = (-torch.rand(B, generator=g, dtype=torch.float64) * 3 * T).to(device)
    rr = (rc.cpu() - torch.randn(B, generator=g, dtype=torch.float64)).to(device)
    return x, w, b, xr, wr, br, t.to(device), rc, rr


def _reference(x, w, t, b, *, loss_type, ref_head=None, ref_logps=None, beta=0.1, label_smoothing=0.0,
               simpo_gamma=0.5, cpo_alpha=1.0, temperature=1.0, compute_dtype=torch.float64):
    """The loss and rewards from materialised logits (linear_log_probs_reference) and the papers' formulas
    (preference_loss_reference), in compute_dtype; the chosen NLL of cpo / orpo over the chosen tokens. The reference
    log-probabilities are differentiable in ref_head's tensors (the tests pass constants; lean mode's bound
    differentiates through its logits): the DPO types get the differences s − s_ref with zero references, the same h
    (preference_loss_reference takes its reference arguments as constants)."""
    lp = linear_log_probs_reference(x, w, t, b, temperature=temperature, compute_dtype=compute_dtype)
    cnt = (t != -100).sum(-1).clamp(min=1).to(lp.dtype)
    avg = loss_type in AVERAGED
    s = lp.sum(-1) / cnt if avg else lp.sum(-1)
    B = t.shape[0] // 2
    rc = rr = None
    if loss_type in REFERENCE_TYPES:
        if ref_logps is not None:
            rc, rr = (r.to(lp.dtype) for r in ref_logps)
        else:
            xr, wr, br = ref_head
            rl = linear_log_probs_reference(xr, wr, t, br, temperature=temperature, compute_dtype=compute_dtype).sum(-1)
            rl = rl / cnt if avg else rl
            rc, rr = rl[:B], rl[B:]
    pc, pr, zc, zr = s[:B], s[B:], None, None
    if rc is not None:
        pc, pr = pc.double() - rc.double(), pr.double() - rr.double()  # h's float64 differences, as it forms them
        zc, zr = torch.zeros_like(pc), torch.zeros_like(pr)
    losses = preference_loss_reference(pc, pr, zc, zr, loss_type=loss_type, beta=beta,
                                       label_smoothing=label_smoothing, simpo_gamma=simpo_gamma)
    loss = losses.mean()
    if loss_type in ("cpo", "orpo"):
        loss = loss - (cpo_alpha if loss_type == "cpo" else 1.0) * lp[:B].sum() / (t[:B] != -100).sum().clamp(min=1)
    base_c = s[:B].detach() - (rc if rc is not None else 0)
    base_r = s[B:].detach() - (rr if rr is not None else 0)
    return loss, beta * base_c, beta * base_r


def _run(fn, x, w, b):
    """(loss, chosen_rewards, rejected_rewards, grad_input, grad_linear_weight, grad_linear_bias) of fn(x, w, b)."""
    x, w, b = (v.detach().clone().requires_grad_() for v in (x, w, b))
    loss, cr, rr = fn(x, w, b)
    loss.backward()
    return loss.detach(), cr.detach(), rr.detach(), x.grad, w.grad, b.grad


NAMES = ["loss", "chosen_rewards", "rejected_rewards", "grad_input", "grad_linear_weight", "grad_linear_bias"]

# (loss_type, the reference: a head on its own hidden states, the policy's hidden states, given log-probabilities,
# or none for the reference-free types; label_smoothing)
CASES = ([(lt, "head", 0.0) for lt in REFERENCE_TYPES] + [("sigmoid", "shared_head", 0.2), ("robust", "given", 0.2),
                                                           ("ipo", "given", 0.0), ("hinge", "shared_head", 0.0)]
         + [(lt, "none", 0.0) for lt in ("simpo", "cpo", "orpo")] + [("simpo", "none", 0.2), ("cpo", "none", 0.2)])


def _kwargs(ref, xr, wr, br, rc, rr):
    if ref == "head":
        return dict(ref_input=xr, ref_linear_weight=wr, ref_linear_bias=br)
    if ref == "shared_head":
        return dict(ref_linear_weight=wr)
    if ref == "given":
        return dict(ref_chosen_logps=rc, ref_rejected_logps=rr)
    return {}


@pytest.mark.parametrize("chunk_size", [5, 14, 42, None], ids=["two_sweeps", "one_pair", "three_of_five_pairs",
                                                             "default"])
@pytest.mark.parametrize("loss_type,ref,label_smoothing", CASES)
def test_float64_matches_composed_and_reference(device, loss_type, ref, label_smoothing, chunk_size):
    """float64: the fused op, the composed path and the materialised-logits reference agree to float64 rounding. 5
    pairs of T = 7 tokens: chunk_size 42 tokens is 3 pairs (chunks of 3 and 2), 14 one pair; 5 tokens, less than a
    pair, takes two sweeps (values, then the logits recomputed) in chunks of 5 rows that split the sequences."""
    x, w, b, xr, wr, br, t, rc, rr = _data(5, 7, 6, 23, torch.float64, device, Hr=6 if ref == "shared_head" else 5)
    if ref == "shared_head":
        xr = x
    kw = dict(loss_type=loss_type, beta=0.7, label_smoothing=label_smoothing, simpo_gamma=0.3, cpo_alpha=0.6,
              temperature=0.8)
    rk = _kwargs(ref, xr, wr, br, rc, rr)
    ours = _run(lambda x, w, b: linear_preference_loss(x, w, t, b, chunk_size=chunk_size, **rk, **kw), x, w, b)
    comp = _run(lambda x, w, b: _linear_preference_loss_composed(x, w, t, b, chunk_size=chunk_size, **rk, **kw),
                x, w, b)
    head = (xr, wr, br if ref == "head" else None) if ref in ("head", "shared_head") else None
    refs = _run(lambda x, w, b: _reference(x, w, t, b, ref_head=head, ref_logps=(rc, rr) if ref == "given" else None,
                                           **kw), x, w, b)
    for name, o, c, r in zip(NAMES, ours, comp, refs):
        assert o.dtype == torch.float64, name
        torch.testing.assert_close(o, c, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name} vs composed: {m}")
        torch.testing.assert_close(o, r, rtol=1e-9, atol=1e-12, msg=lambda m: f"{name} vs float64: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loss_type", PREFERENCE_LOSS_TYPES)
def test_low_precision_matches_reference(device, dtype, loss_type):
    """float32 and bfloat16 inputs against float64 by the tolerance rule (baseline: the same math in the input's
    dtype), and against the composed path within the same rule; in lean mode (conftest.lce_lean) the loss may also
    pass by the a-priori bound of the policy's and the reference head's logits rounded to bfloat16."""
    x, w, b, xr, wr, br, t, rc, rr = _data(3, 9, 16, 53, dtype, device)
    kw = dict(loss_type=loss_type, beta=0.5, temperature=0.9)
    rk = dict(ref_input=xr, ref_linear_weight=wr, ref_linear_bias=br) if loss_type in REFERENCE_TYPES else {}
    head = (xr, wr, br)
    ours = _run(lambda x, w, b: linear_preference_loss(x, w, t, b, chunk_size=20, **rk, **kw), x, w, b)
    comp = _run(lambda x, w, b: _linear_preference_loss_composed(x, w, t, b, chunk_size=20, **rk, **kw), x, w, b)
    ref = _run(lambda x, w, b: _reference(x, w, t, b, ref_head=head, **kw), x, w, b)
    base = _run(lambda x, w, b: _reference(x, w, t, b, ref_head=head, compute_dtype=dtype, **kw), x, w, b)
    # the 0-dim loss: also passes within a few float32 roundings of its terms (the pair losses, the chosen NLL, each of
    # magnitude at most |loss| + the chosen tokens' mean |log p|), where the baseline's one value happens to land
    # closer than an ulp
    lp = linear_log_probs_reference(x, w, t, b, temperature=0.9)
    nll = lp[:3].abs().sum() / (t[:3] != -100).sum()
    loss_bound = 8 * torch.finfo(torch.float32).eps * (1 + ref[0].abs() + nll)
    if lce_lean(x, w, b):
        # lean mode: the loss from the raw logits of both heads (the reference head's too: one chunk loop), each
        # rounded to bfloat16 (lean_rounding_bound through identity heads)
        eye = torch.eye(w.shape[0], dtype=torch.float64, device=device)
        heads = [(x, w, b)] + ([head] if loss_type in REFERENCE_TYPES else [])
        logits = [(hx.double() @ hw.double().t() + hb.double(), dtype) for hx, hw, hb in heads]

        def value(ls):
            return _reference(ls[0], eye, t, None, ref_head=(ls[1], eye, None) if len(ls) > 1 else None, **kw)[0]

        loss_bound = loss_bound + lean_rounding_bound(value, logits, ref[0])
    for name, o, c, r, bl in zip(NAMES, ours, comp, ref, base):
        bl = bl.to(o.dtype)
        bound = loss_bound if name == "loss" else None
        assert_matches_reference(o, r, bl, what=name, bound=bound)
        assert_matches_reference(c.to(o.dtype), r, bl, what=f"{name} (composed)", bound=bound)


def test_every_target_ignored_and_empty_pairs(device):
    """Every target ignored: a finite loss and exactly zero gradients for each type, as the composed path; a pair
    whose two sequences have no counted token: its rows' gradients are exactly zero, the rest as the composed path."""
    x, w, b, xr, wr, br, t, rc, rr = _data(3, 5, 4, 11, torch.float32, device)
    for fill in ("all", "pair"):
        tt = t.clone()
        if fill == "all":
            tt.fill_(-100)
        else:
            tt[1] = -100
            tt[4] = -100
        for lt in PREFERENCE_LOSS_TYPES:
            rk = dict(ref_linear_weight=wr) if lt in REFERENCE_TYPES else {}
            ours = _run(lambda x, w, b: linear_preference_loss(x, w, tt, b, loss_type=lt, **rk), x, w, b)
            comp = _run(lambda x, w, b: _linear_preference_loss_composed(x, w, tt, b, loss_type=lt, **rk), x, w, b)
            assert torch.isfinite(ours[0]), lt
            for name, o, c in zip(NAMES, ours, comp):
                torch.testing.assert_close(o, c, rtol=1e-5, atol=1e-6, msg=lambda m: f"{fill} {lt} {name}: {m}")
            gx = ours[3]
            if fill == "all":
                for g in ours[3:]:
                    assert torch.equal(g, torch.zeros_like(g)), lt
            else:
                assert torch.equal(gx[1], torch.zeros_like(gx[1])) and torch.equal(gx[4], torch.zeros_like(gx[4]))


def test_reference_is_a_constant_and_frozen_parts(device):
    """The reference gets no gradient even when its tensors require grad (TRL computes it without gradients); a
    frozen input or weight gets none and the other's gradient is unchanged."""
    x, w, b, xr, wr, br, t, rc, rr = _data(2, 6, 4, 9, torch.float32, device)
    xr, wr = xr.requires_grad_(), wr.requires_grad_()
    ww = w.clone().requires_grad_()
    loss, _, _ = linear_preference_loss(x, ww, t, ref_input=xr, ref_linear_weight=wr)
    loss.backward()
    assert xr.grad is None and wr.grad is None
    w2 = w.clone().requires_grad_()
    _linear_preference_loss_composed(x, w2, t, ref_input=xr.detach(), ref_linear_weight=wr.detach())[0].backward()
    torch.testing.assert_close(ww.grad, w2.grad, rtol=1e-5, atol=1e-7)
    # a grad_output other than 1 scales the gradients computed in the forward
    w3 = w.clone().requires_grad_()
    (-2.5 * linear_preference_loss(x, w3, t, ref_input=xr, ref_linear_weight=wr)[0]).backward()
    torch.testing.assert_close(w3.grad, -2.5 * ww.grad, rtol=1e-6, atol=1e-8)


def test_gradcheck_opcheck_meta(device):
    x, w, b, xr, wr, br, t, rc, rr = _data(2, 3, 3, 5, torch.float64, device)
    t[0, 2] = 1  # every sequence counts a token
    t[2, 2] = 3
    for lt in PREFERENCE_LOSS_TYPES:
        rk = dict(ref_input=xr, ref_linear_weight=wr, ref_linear_bias=br) if lt in REFERENCE_TYPES else {}

        def f(x, w, b, lt=lt, rk=rk):
            return linear_preference_loss(x, w, t, b, loss_type=lt, beta=0.6, temperature=0.9, chunk_size=6, **rk)[0]

        torch.autograd.gradcheck(f, [v.clone().requires_grad_() for v in (x, w, b)])
    args = (x, w, t, b, xr, wr, br, None, None, "sigmoid", 0.4, 0.1, 0.5, 1.0, 0.9, -100, 6)
    given = (x, w, t, b, None, None, None, rc, rr, "ipo", 0.4, 0.0, 0.5, 1.0, 1.0, -100, None)
    free = (x, w, t, None, None, None, None, None, None, "orpo", 0.4, 0.0, 0.5, 1.0, 1.0, -100, 1)
    for a in (args, given, free):
        req = tuple(v.clone().requires_grad_() if i in (0, 1, 3) and v is not None else v for i, v in enumerate(a))
        torch.library.opcheck(OP, req)
        for mask in ([True, True, True], [False, True, False]):
            torch.library.opcheck(FWD, (*a, mask))
            real = FWD(*a, mask)
            meta = FWD(*[v.to("meta") if isinstance(v, torch.Tensor) else v for v in a], mask)
            for r, m in zip(real, meta):
                assert (r is None) == (m is None)
                if r is not None:
                    assert r.shape == m.shape and r.dtype == m.dtype and r.stride() == m.stride()
    loss, lp, rlp = OP(*args)
    assert loss.shape == () and lp.shape == (4,) and rlp.shape == (4,)
    assert OP(*given)[2].shape == (0,)


def test_compile_and_double_backward(device):
    x, w, b, xr, wr, br, t, rc, rr = _data(2, 5, 4, 9, torch.float32, device)

    def f(x, w, b):
        loss, cr, rj = linear_preference_loss(x, w, t, b, ref_input=xr, ref_linear_weight=wr, loss_type="sigmoid",
                                              beta=0.3, chunk_size=10)
        return loss + 0.0 * (cr.sum() + rj.sum())

    assert_compile_matches_eager(f, (x, w, b))
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        xx = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(f(xx, w, b), xx, create_graph=True)
        gx.sum().backward()


def test_autocast_and_torch_func(device):
    """Under autocast both heads' GEMM operands go to the autocast dtype (as torch's linear) and the loss stays
    float32: the same as the call on bf16 inputs; torch.func.grad gives autograd's gradients."""
    x, w, b, xr, wr, br, t, rc, rr = _data(2, 5, 8, 13, torch.float32, device)
    lowp = torch.bfloat16
    with torch.autocast(device, dtype=lowp):
        auto = linear_preference_loss(x, w, t, b, ref_input=xr, ref_linear_weight=wr, ref_linear_bias=br)[0]
    cast = linear_preference_loss(x.to(lowp), w.to(lowp), t, b.to(lowp), ref_input=xr.to(lowp),
                                  ref_linear_weight=wr.to(lowp), ref_linear_bias=br.to(lowp))[0]
    assert auto.dtype == cast.dtype == torch.float32
    torch.testing.assert_close(auto, cast, rtol=0, atol=0)

    def f(x, w, b):
        return linear_preference_loss(x, w, t, b, loss_type="simpo", beta=0.5, chunk_size=10)[0]

    ours = torch.func.grad(f, argnums=(0, 1, 2))(x, w, b)
    xs = [v.clone().requires_grad_() for v in (x, w, b)]
    f(*xs).backward()
    for o, v in zip(ours, xs):
        torch.testing.assert_close(o, v.grad, rtol=0, atol=0)


def _gemm_calls(fn):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name in ("aten::mm", "aten::addmm", "aten::addmm_"))


def test_gemms_per_chunk():
    """The gradient in the forward: 3 GEMMs per chunk for the policy (logits, dX, dW) and 1 for the reference head,
    against the composition's 4 + 1 (its backward recomputes the logits); a chunk_size below a pair: two sweeps,
    4 + 1. 3 pairs of T = 6 tokens, one pair (12 tokens) a chunk."""
    x, w, b, xr, wr, br, t, rc, rr = _data(3, 6, 4, 9, torch.float32, "cpu")

    def step(f, chunk):
        def run():
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            f(xx, ww, t, ref_input=xr, ref_linear_weight=wr, chunk_size=chunk)[0].backward()
        return run

    assert _gemm_calls(step(linear_preference_loss, 12)) == 3 * (3 + 1)
    assert _gemm_calls(step(_linear_preference_loss_composed, 12)) == 3 * (4 + 1)
    assert _gemm_calls(step(linear_preference_loss, 9)) == 4 * (4 + 1)  # 36 tokens in chunks of 9


def test_bad_inputs(device):
    x, w, b, xr, wr, br, t, rc, rr = _data(2, 4, 4, 7, torch.float32, device)
    pre = "opforge::linear_preference_loss: "
    ref = dict(ref_linear_weight=wr)
    cases = [
        ((x[:3], w, t[:3]), ref, ValueError, r"expected a batch of 2B sequences \(chosen, then rejected\): target of "
                                             r"shape \(2B, T\), but got target of shape \[3, 4\]"),
        ((x[0], w, t[0]), ref, ValueError, r"expected a batch of 2B sequences .* but got target of shape \[4\]"),
        ((x, w, t), dict(loss_type="dpo"), ValueError, "expected loss_type to be one of sigmoid, ipo, hinge"),
        ((x, w, t), {}, ValueError, "expected ref_chosen_logps / ref_rejected_logps or ref_linear_weight for "
                                    "loss_type \"sigmoid\", but got None"),
        ((x, w, t), dict(ref_chosen_logps=rc), ValueError,
         "expected both ref_chosen_logps and ref_rejected_logps, or neither, but got only ref_chosen_logps"),
        ((x, w, t), dict(ref_chosen_logps=rc[:1], ref_rejected_logps=rr), ValueError,
         r"expected ref_chosen_logps of shape \(B,\) = \[2\] \(half of target's 2B\), but got \[1\]"),
        ((x, w, t), dict(ref_linear_weight=wr[:6]), ValueError,
         r"expected ref_linear_weight of shape \[7, 4\] \(linear_weight's V, input's hidden size\), but got \[6, 4\]"),
        ((x, w, t), dict(ref_input=xr[:, :3], ref_linear_weight=wr), ValueError,
         r"expected ref_input of input's leading shape \[4, 4\]"),
        ((x, w, t), dict(ref_linear_weight=wr, ref_linear_bias=br[:3]), ValueError,
         r"expected ref_linear_bias of shape \[7\]"),
        ((x, w, t), dict(ref, beta=0.0), ValueError, "expected beta > 0 and finite, but got 0"),
        ((x, w, t), dict(ref, label_smoothing=0.5), ValueError, r"expected label_smoothing in \[0, 0.5\), but got 0.5"),
        ((x, w, t), dict(ref, temperature=-1.0), ValueError, "expected temperature > 0 and finite, but got -1"),
        ((x, w, t), dict(ref, chunk_size=0), ValueError, "expected chunk_size >= 1"),
        ((x, w[:, :3], t), ref, ValueError, "expected input's last dimension to equal linear_weight's H 3"),
        ((x, w, t[:, :3]), ref, ValueError, r"expected target of input's leading shape \[4, 4\]"),
        ((x, w, t.float()), ref, TypeError, "expected target of dtype int64"),
        ((x.long(), w, t), ref, TypeError, "expected input to have a floating dtype"),
        ((x, w, t), dict(ref_linear_weight=wr.long()), TypeError, "expected ref_linear_weight to have a floating"),
        ((x, w, t), dict(ref_chosen_logps=rc.long(), ref_rejected_logps=rr), TypeError,
         "expected ref_chosen_logps to have a floating dtype"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=pre + msg):
            linear_preference_loss(*args, **kw)
    if device == "cpu":
        with pytest.raises(IndexError, match=pre + r"expected every target in \[0, 7\)"):
            bad = t.clone()
            bad[0, -1] = 99
            linear_preference_loss(x, w, bad, ref_linear_weight=wr)
