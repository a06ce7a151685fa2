"""CUDA limits: tensors past 2**31 elements and past 65535 rows for every op, and an out-of-memory
inside an op. CUDA only (they skip cleanly without a GPU); the large cases need ~40 GiB of device memory.

Each large case checks the rows around the boundaries (0, 65535, 65536, the last) of the forward and of the
input gradient against the float64 reference computed on those rows alone.
"""
import gc

import pytest
import torch

import opforge
from opforge import testing

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
BIG = 2**31 + 4096  # elements: past int32 indexing


def _rows(m):
    return sorted({0, 65535, 65536, m - 1})


def _check_rows(got, ref_fn, m, what):
    rows = _rows(m)
    ref = ref_fn(rows)
    sub = got.reshape(m, -1)[rows].double()
    err = (sub - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    assert err <= 2e-2 * scale, f"{what}: max abs error {err} at rows {rows} (scale {scale})"


@cuda
@pytest.mark.parametrize("name", ["sigmoid", "square", "square_add", "swiglu"])
def test_elementwise_past_int32(name):
    n = 8192
    m = BIG // n + 1  # rows > 65535 as well
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if name == "square_add":
        other = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = opforge.square_add(x, other)
        ref = lambda r: testing.square_add_reference(x.detach()[r].double(), other.double())  # noqa: E731
    elif name == "swiglu":
        up = torch.randn(n, device="cuda", dtype=torch.bfloat16).expand(m, n)
        y = opforge.swiglu(x, up)
        ref = lambda r: testing.swiglu_reference(x.detach()[r].double(), up[r].double())  # noqa: E731
    else:
        y = getattr(opforge, name)(x)
        ref = lambda r: getattr(testing, f"{name}_reference")(x.detach()[r].double())  # noqa: E731
    _check_rows(y, ref, m, f"{name} forward")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad.reshape(m, -1)[_rows(m)]).all()
    del x, y
    gc.collect()
    torch.cuda.empty_cache()


@cuda
@pytest.mark.parametrize("fused", [False, True])
def test_rms_norm_past_int32(fused):
    n = 32768
    m = BIG // n + 1  # 65537 rows
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if fused:
        r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        y, z = opforge.fused_add_rms_norm(x, r, [n], w)
        ref = lambda rows: testing.rms_norm_reference(  # noqa: E731
            x.detach()[rows].double() + r[rows].double(), [n], w.detach().double())
    else:
        y = opforge.rms_norm(x, [n], w)
        ref = lambda rows: testing.rms_norm_reference(x.detach()[rows].double(), [n], w.detach().double())  # noqa: E731
    _check_rows(y, ref, m, "rms_norm forward")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad.reshape(m, -1)[_rows(m)]).all() and torch.isfinite(w.grad).all()
    del x, y
    gc.collect()
    torch.cuda.empty_cache()


@cuda
def test_linear_output_past_int32():
    k, n = 64, 4100
    m = BIG // n + 1
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = opforge.linear(x, w, activation="silu")
    _check_rows(y, lambda r: testing.linear_reference(x.detach()[r].double(), w.detach().double(), None, "silu"),
                m, "linear forward")
    y.backward(torch.ones_like(y))
    assert torch.isfinite(x.grad[_rows(m)]).all() and torch.isfinite(w.grad).all()
    del x, y
    gc.collect()
    torch.cuda.empty_cache()


@cuda
def test_out_of_memory_inside_an_op_is_clean():
    """An op whose output cannot be allocated raises torch.OutOfMemoryError, leaks nothing, and the next call works."""
    torch.cuda.empty_cache()
    x = torch.randn(1024, 1024, device="cuda")
    before = torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * 2**20) / total)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            opforge.linear(x[:1].expand(200_000, 1024), x)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    assert torch.cuda.memory_allocated() == before
    torch.testing.assert_close(opforge.sigmoid(x), torch.sigmoid(x))


# ---- the linear variants, linear_cross_entropy and rope past 65535 rows and 2**31 elements ------------
# Each case makes one tensor of just over 2**31 elements (about 4.3 GB in bfloat16, some 10-20 GB per case with the
# outputs and gradients) and checks the first rows, rows 65535 and 65536, the rows holding element 2**31 and the last
# row against float64 references computed on those rows alone; memory is freed after each case.

def _rows_at(m, per_row):
    """Rows to check of an (m, per_row) tensor: the first two, 65535 and 65536, the row holding element 2**31 and
    the next, the last."""
    b = 2**31 // per_row
    return sorted({r for r in (0, 1, 65535, 65536, b, b + 1, m - 1) if 0 <= r < m})


def _close(got, ref, what, rel=2e-2):
    """max |got − ref| ≤ rel · max |ref| (bfloat16 storage, float32 accumulation)."""
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    assert err <= rel * scale, f"{what}: max abs error {err} (scale {scale})"


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _column_sums(x, block=32768):
    """Σ_rows x in float64, block by block (the weight gradient of an all-ones grad_output)."""
    acc = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], block):
        acc += x[i:i + block].double().sum(0)
    return acc


@cuda
def test_linear_cross_entropy_past_int32():
    h, v = 8192, 256
    t = 2**31 // h + 2  # 262146 tokens: past 65535 rows, the input past 2**31 elements
    try:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        b = torch.randn(v, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(0, v, (t,), device="cuda")
        ignored = min(65536, t - 1)
        target[ignored] = -100  # an ignored token at a boundary row
        loss = opforge.linear_cross_entropy(x, w, target, linear_bias=b, reduction="none")
        rows = _rows_at(t, h)
        xr = x.detach()[rows].cpu().double().requires_grad_()
        ref = testing.linear_cross_entropy_reference(xr, w.detach().cpu(), target[rows].cpu(),
                                                     linear_bias=b.cpu(), reduction="none")
        _close(loss[rows], ref, "linear_cross_entropy loss")
        loss.backward(torch.ones_like(loss))
        ref.backward(torch.ones_like(ref))
        _close(x.grad[rows], xr.grad, "linear_cross_entropy input gradient")
        assert torch.isfinite(w.grad).all()
        assert (x.grad[ignored] == 0).all()  # the ignored token
    finally:
        x = w = loss = None
        _free()


@cuda
def test_rope_past_int32():
    bsz, hq, hk, d = 1, 128, 2, 128
    s = 2**31 // (hq * d) + 2  # 131074 positions: q has 128 × 131074 rows of 128, past 2**31 elements
    try:
        q = torch.randn(bsz, hq, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(bsz, hk, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
        ang = torch.rand(s, d // 2, device="cuda") * 100
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        qo, ko = opforge.rope(q, k, cos, sin)
        torch.autograd.backward((qo, ko), (torch.ones_like(qo), torch.ones_like(ko)))
        flat = 2**31 // d  # the (head · s + position) row holding element 2**31
        pairs = [(0, 0), (0, 65535), (0, 65536), (flat // s, flat % s), ((flat + 1) // s, (flat + 1) % s),
                 (hq - 1, s - 1)]
        for h, p in [(h, p) for h, p in pairs if p < s]:
            qr = q.detach()[:, h:h + 1, p:p + 1].cpu().double().requires_grad_()
            kr = k.detach()[:, min(h, hk - 1):min(h, hk - 1) + 1, p:p + 1].cpu().double().requires_grad_()
            rq, rk = testing.rope_reference(qr, kr, cos[p:p + 1].cpu(), sin[p:p + 1].cpu())
            _close(qo[:, h, p], rq[:, 0, 0], f"rope q at head {h}, position {p}")
            _close(ko[:, min(h, hk - 1), p], rk[:, 0, 0], f"rope k at position {p}")
            torch.autograd.backward((rq, rk), (torch.ones_like(rq), torch.ones_like(rk)))
            _close(q.grad[:, h, p], qr.grad[:, 0, 0], f"rope q gradient at head {h}, position {p}")
            _close(k.grad[:, min(h, hk - 1), p], kr.grad[:, 0, 0], f"rope k gradient at position {p}")
    finally:
        q = k = qo = ko = None
        _free()


@cuda
@pytest.mark.parametrize("group_size", [-1, 128])
def test_fake_quant_weight_past_int32(group_size):
    """A weight of 262146 output channels × 8192: fake_quantize_weight bit-identical to torch's fake_quantize on the
    checked rows; fake_quant_linear's output and weight gradient there against float64."""
    k = 8192
    n = 2**31 // k + 2
    try:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
        out, mask, scale, zp = opforge.fake_quantize_weight(w.detach(), 4, group_size, True)
        rows = _rows_at(n, k)
        ref = testing.fake_quantize_weight_reference(w.detach()[rows].cpu(), 4, group_size, True)
        assert torch.equal(out[rows].cpu().view(torch.int16), ref[0].view(torch.int16)), "fq_w not torch's bits"
        assert torch.equal(mask[rows].cpu(), ref[1])
        assert torch.equal(scale[rows].cpu(), ref[2]) and torch.equal(zp[rows].cpu(), ref[3])
        out = mask = None
        x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
        y = opforge.fake_quant_linear(x, w, None, weight_bits=4, group_size=group_size)
        yr = x.detach().cpu().double() @ ref[0].double().T
        _close(y[:, rows], yr, "fake_quant_linear output columns")
        y.backward(torch.ones_like(y))
        dw_ref = x.detach().cpu().double().sum(0).expand(len(rows), k) * ref[1]
        _close(w.grad[rows], dw_ref, "fake_quant_linear weight gradient rows")
    finally:
        w = x = y = out = mask = None
        _free()


@cuda
def test_fake_quant_linear_activation_quant_past_int32():
    """act_quant over 262146 tokens × 8192 (per-token int8, row-local): output and input gradient rows."""
    k = 8192
    m = 2**31 // k + 2
    try:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
        w = torch.randn(16, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
        y = opforge.fake_quant_linear(x, w, None, act_quant=True)
        rows = _rows_at(m, k)
        xr, wc = x.detach()[rows].cpu(), w.detach().cpu()
        _close(y[rows], testing.fake_quant_linear_reference(xr, wc, None, act_quant=True), "act_quant output")
        y.backward(torch.ones_like(y))
        wq = testing.fake_quantize_weight_reference(wc, 4, -1, True)[0].double()
        dx_ref = torch.ones(len(rows), 16, dtype=torch.float64) @ wq * testing.fake_quantize_per_token_reference(xr)[1]
        _close(x.grad[rows], dx_ref, "act_quant input gradient")
        assert torch.isfinite(w.grad).all()
    finally:
        x = w = y = None
        _free()


@cuda
def test_linear_cat_past_int32():
    """Pieces (262146, 8192) and (262146, 64): output and piece gradients on the checked rows, the weight gradient
    (all rows summed) against float64 column sums."""
    k0, k1, n = 8192, 64, 64
    m = 2**31 // k0 + 2
    try:
        x0 = torch.randn(m, k0, device="cuda", dtype=torch.bfloat16).requires_grad_()
        x1 = torch.randn(m, k1, device="cuda", dtype=torch.bfloat16).requires_grad_()
        w = (torch.randn(n, k0 + k1, device="cuda") * 0.05).to(torch.bfloat16).requires_grad_()
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16).requires_grad_()
        y = opforge.linear_cat([x0, x1], w, b)
        rows = _rows_at(m, k0)
        ref = testing.linear_cat_reference([x0.detach()[rows].cpu(), x1.detach()[rows].cpu()], w.detach().cpu(),
                                           b.detach().cpu())
        _close(y[rows], ref, "linear_cat output")
        y.backward(torch.ones_like(y))
        ones = torch.ones(len(rows), n, dtype=torch.float64)
        wd = w.detach().cpu().double()
        _close(x0.grad[rows], ones @ wd[:, :k0], "linear_cat grad of piece 0")
        _close(x1.grad[rows], ones @ wd[:, k0:], "linear_cat grad of piece 1")
        col = torch.cat([_column_sums(x0.detach()), _column_sums(x1.detach())])
        _close(w.grad, col.expand(n, -1), "linear_cat weight gradient")
        _close(b.grad, torch.full((n,), float(m), dtype=torch.float64), "linear_cat bias gradient")
    finally:
        x0 = x1 = w = b = y = None
        _free()
