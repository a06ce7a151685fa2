"""Determinism: every opforge kernel is deterministic -- no atomics, reductions in a fixed order
over a fixed partition -- so results are bitwise the same from run to run, for any ``torch.set_num_threads`` on CPU,
and under ``torch.use_deterministic_algorithms(True)`` (which opforge honours by having nothing to switch: no op
raises or changes its result there). Compared with torch's own ops in the same setup."""
import pytest
import torch
import torch.nn.functional as TF

import opforge


def _rms_norm_grads(x, w, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    opforge.rms_norm(x, (x.shape[-1],), w).backward(g)
    return x.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("M,N", [(4099, 64), (257, 769), (64, 4096)])
def test_rms_norm_weight_grad_bitwise_stable_across_threads(dtype, M, N):
    """Was: ~7.6e-6 apart between 1 and 2 threads (one dweight partial row per thread)."""
    x = torch.randn(M, N, dtype=dtype)
    w = torch.randn(N, dtype=dtype)
    g = torch.randn(M, N, dtype=dtype)
    n = torch.get_num_threads()
    results, torch_results = [], []
    try:
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            results.append(_rms_norm_grads(x, w, g))
            xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
            TF.rms_norm(xt, (N,), wt).backward(g)
            torch_results.append(wt.grad)
    finally:
        torch.set_num_threads(n)
    for gx, gw in results[1:]:
        assert torch.equal(gx, results[0][0]), "grad_input changed with the thread count"
        assert torch.equal(gw, results[0][1]), "grad_weight changed with the thread count"
    for gw in torch_results[1:]:  # torch's own: stable too (the bar)
        assert torch.equal(gw, torch_results[0])


def test_fused_add_rms_norm_grads_bitwise_stable_across_threads():
    x, r, w = torch.randn(1025, 96), torch.randn(1025, 96), torch.randn(96)
    g, gr = torch.randn(1025, 96), torch.randn(1025, 96)
    n = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            xs, rs, ws = (t.clone().requires_grad_() for t in (x, r, w))
            torch.autograd.backward(opforge.fused_add_rms_norm(xs, rs, 96, ws), [g, gr])
            out.append((xs.grad, rs.grad, ws.grad))
    finally:
        torch.set_num_threads(n)
    for o in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(o, out[0]))


def _every_op(device):
    torch.manual_seed(0)
    x = torch.randn(33, 96, device=device, requires_grad=True)
    r = torch.randn(33, 96, device=device, requires_grad=True)
    w = torch.randn(96, device=device, requires_grad=True)
    W = torch.randn(40, 96, device=device, requires_grad=True)
    b = torch.randn(40, device=device, requires_grad=True)
    h, res = opforge.fused_add_rms_norm(x, r, 96, w)
    h = opforge.rms_norm(h, 96, w)
    y = opforge.linear(h, W, b, "gelu")
    y = opforge.swiglu(y[:, :20], y[:, 20:])
    y = opforge.square_add(opforge.sigmoid(y), opforge.square(b[:20]))
    (y.sum() + res.square().sum()).backward()
    return [y.detach()] + [t.grad for t in (x, r, w, W, b)]


def test_every_op_repeats_bitwise(device):
    first, second = _every_op(device), _every_op(device)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_use_deterministic_algorithms_is_honoured(device):
    """No opforge op raises under deterministic mode (none has a non-deterministic path to refuse), and the results
    are those of the default mode, bitwise."""
    plain = _every_op(device)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        det = _every_op(device)
    finally:
        torch.use_deterministic_algorithms(before)
    for a, b in zip(plain, det):
        assert torch.equal(a, b)
