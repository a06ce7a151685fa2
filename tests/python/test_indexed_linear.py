"""indexed_linear and indexed_linear_backward: values and gradients against float64, index −1, out-of-range
indices, empty experts, int32 offsets overflow (CUDA), strided banks, opcheck, compile, gradcheck, torch.func,
errors (cases 1-4: index −1, empty experts, offsets past int32, strided banks). CUDA cases run every kernel path
(the test hook indexed_linear_path of csrc/core/knobs.h)."""
import pytest
import torch

import opforge
from opforge.testing import assert_matches_reference, experts_present, indexed_linear_reference, relative_error

from conftest import FLOAT_DTYPES

CUDA_PATHS = ["auto", "gemv", "grouped", "grouped_mm"]
PATH_HOOK = {"auto": 0, "gemv": 1, "grouped": 2, "grouped_mm": 3}  # the test hook indexed_linear_path's values


@pytest.fixture(params=["cpu"] + [pytest.param(("cuda", p), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU")) for p in CUDA_PATHS], ids=lambda p: p if isinstance(p, str) else f"cuda-{p[1]}")
def dev(request, knob):
    """The device, with the CUDA kernel path forced through the test hook indexed_linear_path."""
    if request.param == "cpu":
        return "cpu"
    _, path = request.param
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    return "cuda"


def _make(device, dtype, T, E, N, K, bias=True, index=None):
    x = torch.randn(T, K, device=device).to(dtype).requires_grad_()
    w = (torch.randn(E, N, K, device=device) / max(K, 1) ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(E, N, device=device).to(dtype).requires_grad_() if bias else None
    if index is None:
        index = torch.randint(-1, E, (T,), device=device)
    return x, w, index.to(device), b


def _torch_baseline(x, w, index, b):
    """The same math in x's dtype with torch ops (the achievable error)."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    out = out + 0 * (x.sum() + w.sum() + (b.sum() if b is not None else 0))  # connected: zero grads, not None
    for e in experts_present(index, w.shape[0]):
        rows = (index == e).nonzero().flatten()
        out[rows] = torch.nn.functional.linear(x[rows], w[e], b[e] if b is not None else None)
    return out


def _grads64(x, w, index, b, dy):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if b is not None else None
    indexed_linear_reference(x64, w64, index, b64).backward(dy.double())
    return x64.grad, w64.grad, (b64.grad if b is not None else None)


def _baseline_grads(x, w, index, b, dy):
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    b2 = b.detach().requires_grad_() if b is not None else None
    _torch_baseline(x2, w2, index, b2).backward(dy)
    return x2.grad, w2.grad, (b2.grad if b is not None else None)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T, E, N, K", [(1, 3, 5, 7), (8, 4, 16, 32), (83, 5, 24, 40), (300, 3, 70, 72)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_float64(dev, dtype, T, E, N, K, bias):
    x, w, index, b = _make(dev, dtype, T, E, N, K, bias)
    y = opforge.indexed_linear(x, w, index, b)
    assert_matches_reference(y, indexed_linear_reference(x, w, index, b), _torch_baseline(x, w, index, b), factor=3.0)
    dy = torch.randn_like(y)
    y.backward(dy)
    gx, gw, gb = _grads64(x, w, index, b, dy)
    bx, bw, bb = _baseline_grads(x, w, index, b, dy)
    assert_matches_reference(x.grad, gx, bx, what="grad_input", factor=3.0)
    assert_matches_reference(w.grad, gw, bw, what="grad_weight", factor=3.0)
    if b is not None:
        assert_matches_reference(b.grad, gb, bb, what="grad_bias", factor=3.0)


def test_case1_minus_one_rows(dev):
    """Case 1: index −1 gives zero rows, and nothing flows to or from them."""
    index = torch.tensor([0, -1, 3, -1, 1, 2, -1, 0])
    x, w, index, b = _make(dev, torch.float64, 8, 4, 6, 5, True, index)
    y = opforge.indexed_linear(x, w, index, b)
    assert torch.equal(y[[1, 3, 6]], torch.zeros(3, 6, dtype=y.dtype, device=y.device))
    torch.testing.assert_close(y, indexed_linear_reference(x, w, index, b))
    dy = torch.randn_like(y)
    y.backward(dy)
    assert torch.equal(x.grad[[1, 3, 6]], torch.zeros(3, 5, dtype=x.dtype, device=x.device))
    torch.testing.assert_close(w.grad[3], torch.outer(dy[2], x[2].detach()))  # bank 3: row 2 only
    torch.testing.assert_close(b.grad[3], dy[2])
    gx, gw, gb = _grads64(x, w, index, b, dy)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(w.grad, gw)
    torch.testing.assert_close(b.grad, gb)


@pytest.mark.parametrize("bad", [4, 10**6, -2])
def test_case1_out_of_range_index_is_an_error_on_cpu(bad):
    x, w, _, b = _make("cpu", torch.float32, 8, 4, 6, 5)
    index = torch.tensor([0, -1, 3, -1, 1, 2, -1, bad])
    with pytest.raises(IndexError, match=rf"opforge::indexed_linear: expected every index in \[-1, 4\).*but got {bad} at position 7"):
        opforge.indexed_linear(x, w, index, b)
    with pytest.raises(IndexError, match=r"opforge::indexed_linear_backward: expected every index in \[-1, 4\)"):
        torch.ops.opforge.indexed_linear_backward(torch.randn(8, 6), x.detach(), w.detach(), index, [True, True, True])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", CUDA_PATHS)
def test_case1_out_of_range_index_is_a_zero_row_on_cuda(path, knob):
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    index = torch.tensor([0, -1, 3, -1, 1, 2, 10**6, -2], device="cuda")
    x, w, _, b = _make("cuda", torch.bfloat16, 8, 4, 16, 32)
    y = opforge.indexed_linear(x, w, index, b)
    y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    assert torch.equal(y[[1, 3, 6, 7]].float(), torch.zeros(4, 16, device="cuda"))
    assert torch.equal(x.grad[[1, 3, 6, 7]].float(), torch.zeros(4, 32, device="cuda"))
    as_minus_one = torch.where((index >= 0) & (index < 4), index, -1)
    torch.testing.assert_close(y.float(), indexed_linear_reference(x, w, as_minus_one, b).float(), rtol=2e-2, atol=2e-2)


def test_case1_length_mismatch_is_an_error(dev):
    x, w, _, b = _make(dev, torch.float32, 8, 4, 6, 5)
    with pytest.raises(ValueError, match=r"opforge::indexed_linear: expected index of length 8 \(input's rows\), but got 7"):
        opforge.indexed_linear(x, w, torch.zeros(7, dtype=torch.int64, device=dev), b)


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_case2_empty_groups(dev, order):
    """Case 2: counts [162, 0, 2577, 446, 0, 83] in bfloat16: experts 1 and 4 get exactly zero gradients."""
    counts = [162, 0, 2577, 446, 0, 83]
    K, N = (2048, 768) if dev == "cuda" else (256, 96)
    index = torch.cat([torch.full((c,), e, dtype=torch.int64) for e, c in enumerate(counts)])
    if order == "shuffled":
        index = index[torch.randperm(index.numel())]
    T = index.numel()
    x, w, index, b = _make(dev, torch.bfloat16, T, len(counts), N, K, True, index)
    y = opforge.indexed_linear(x, w, index, b)
    dy = torch.randn_like(y)
    y.backward(dy)
    gx, gw, gb = _grads64(x, w, index, b, dy)
    for e in (1, 4):
        assert torch.equal(w.grad[e].float(), torch.zeros(N, K, device=dev)), f"expert {e}: nonzero grad_weight"
        assert torch.equal(b.grad[e].float(), torch.zeros(N, device=dev)), f"expert {e}: nonzero grad_bias"
    for e in (0, 2, 3, 5):
        assert relative_error(w.grad[e], gw[e]) <= 1e-2, f"expert {e}: grad_weight"
        assert relative_error(b.grad[e], gb[e]) <= 1e-2, f"expert {e}: grad_bias"
    assert relative_error(y, indexed_linear_reference(x, w, index, b)) <= 1e-2
    # the input gradient on its own, with another random grad_output
    dy2 = torch.randn_like(y)
    gi, _, _ = torch.ops.opforge.indexed_linear_backward(dy2, x.detach(), w.detach(), index, [True, False, False])
    gx2, _, _ = _grads64(x, w, index, None, dy2)
    assert relative_error(gi, gx2) <= 1e-2


def _boundary_rows(T, row_sizes, limit=2**31):
    """Distinct, in-range rows of a [T, ·] tensor around `limit`: 0, T − 1 and, for each row size (bytes or
    elements per row), the rows b − 1, b, b + 1 with b = limit // size (row b straddles or starts at the limit).
    Distinct matters: a row listed twice gets one grad_output row but counts twice in a reference sum."""
    rows = {0, T - 1}
    for size in row_sizes:
        b = limit // size
        rows |= {b - 1, b, b + 1}
    return sorted(r for r in rows if 0 <= r < T)


def _check_probe_rows(device, dtype, T, E, N, K, rows, tol):
    """Forward rows, grad_input rows, grad_weight and grad_bias (grad_output nonzero only on `rows`) against float64."""
    x, w, index, b = _make(device, dtype, T, E, N, K, True, torch.randint(0, E, (T,)))
    y = opforge.indexed_linear(x, w, index, b)
    rows = torch.tensor(rows, device=device)
    assert rows.unique().numel() == rows.numel() and int(rows.max()) < T  # the reference sums below need this
    ref = torch.einsum("tk,tnk->tn", x[rows].double(), w[index[rows]].double()) + b[index[rows]].double()
    torch.testing.assert_close(y[rows].double(), ref, rtol=tol, atol=tol)
    dy = torch.zeros_like(y)
    dy[rows] = torch.randn(rows.numel(), N, device=device).to(dtype)
    y.backward(dy)
    ref_gx = torch.einsum("tn,tnk->tk", dy[rows].double(), w[index[rows]].double())
    torch.testing.assert_close(x.grad[rows].double(), ref_gx, rtol=tol, atol=2.5 * tol)
    for e in range(E):
        sel = rows[index[rows] == e]
        ref_gw = dy[sel].double().t() @ x[sel].double()
        torch.testing.assert_close(w.grad[e].double(), ref_gw, rtol=tol, atol=tol)
        torch.testing.assert_close(b.grad[e].double(), dy[sel].double().sum(0), rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [1, 2, 3, 7, 8, 9, 10, 11, 40])
def test_boundary_rows_are_distinct_and_in_range(T):
    """Regression: case 3 listed row 87382 for T = 87382 (out of range: device-side assert) and twice for T = 87383
    (grad_weight reference counted it twice). Here with a scaled limit (row sizes 8 and 4, limit 64: b = 8, 16)."""
    rows = _boundary_rows(T, [8, 4], limit=64)
    assert rows == sorted(set(rows)) and all(0 <= r < T for r in rows) and 0 in rows and T - 1 in rows


@pytest.mark.parametrize("T", [8, 9, 10, 11])
def test_case3_probe_rows_on_cpu(T):
    """The case-3 check itself on CPU at a scaled limit (row b = 9 of 28 bytes straddles 2⁸ bytes), T − 1 from b − 2 to b + 1."""
    rows = _boundary_rows(T, [7 * 4], limit=2**8)
    _check_probe_rows("cpu", torch.float32, T, 2, 7, 3, rows, tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# 87381 rows of 12288 bf16 (24576 bytes) end 8192 bytes below 2³¹, row 87381 straddles it (T = 87382: the last row),
# row 87382 starts past it; 174763: T × N passes 2³¹ elements (row 174762 straddles)
@pytest.mark.parametrize("T", [87381, 87382, 87383, 100000, 174763])
@pytest.mark.parametrize("path", ["auto", "grouped"])
def test_case3_past_int32_offsets(T, path, knob):
    """Case 3: T × N × 2 bytes (and T × N) around 2³¹; rows 0, T − 1 and the rows at each boundary equal
    the float64 reference, fwd and bwd (grad_weight, grad_bias from those rows only)."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    E, K, N = 2, 16, 12288
    rows = _boundary_rows(T, [N * 2, N])
    _check_probe_rows("cuda", torch.bfloat16, T, E, N, K, rows, tol=2e-2)


@pytest.mark.parametrize("layout", ["transposed_bank", "sliced_bank", "sliced_input"])
def test_case4_strided_banks_and_inputs(dev, layout):
    """Case 4: values and gradients right; the untouched halves' gradients exactly zero."""
    T, E, N, K = 40, 3, 16, 24
    index = torch.randint(-1, E, (T,)).to(dev)
    if layout == "transposed_bank":
        leaf = torch.randn(E, K, N, device=dev, requires_grad=True)
        w, x_leaf = leaf.transpose(1, 2), torch.randn(T, K, device=dev, requires_grad=True)
        x = x_leaf
    elif layout == "sliced_bank":
        leaf = torch.randn(E, 2 * N, K, device=dev, requires_grad=True)
        w, x_leaf = leaf[:, :N], torch.randn(T, K, device=dev, requires_grad=True)
        x = x_leaf
    else:
        leaf = torch.randn(E, N, K, device=dev, requires_grad=True)
        w = leaf
        x_leaf = torch.randn(T, 2 * K, device=dev, requires_grad=True)
        x = x_leaf[:, K:]
    y = opforge.indexed_linear(x, w, index)
    torch.testing.assert_close(y, indexed_linear_reference(x, w, index).float(), rtol=1e-4, atol=1e-4)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    indexed_linear_reference(x64, w64, index).backward(dy.double())
    if layout == "transposed_bank":
        torch.testing.assert_close(leaf.grad, w64.grad.transpose(1, 2).float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x_leaf.grad, x64.grad.float(), rtol=1e-4, atol=1e-4)
    elif layout == "sliced_bank":
        torch.testing.assert_close(leaf.grad[:, :N], w64.grad.float(), rtol=1e-4, atol=1e-4)
        assert torch.equal(leaf.grad[:, N:], torch.zeros(E, N, K, device=dev))
    else:
        torch.testing.assert_close(x_leaf.grad[:, K:], x64.grad.float(), rtol=1e-4, atol=1e-4)
        assert torch.equal(x_leaf.grad[:, :K], torch.zeros(T, K, device=dev))
        torch.testing.assert_close(leaf.grad, w64.grad.float(), rtol=1e-4, atol=1e-4)


def test_zero_sizes(dev):
    for T, E, N, K in [(0, 3, 4, 5), (6, 3, 0, 5), (6, 3, 4, 0), (6, 0, 4, 5)]:
        index = torch.full((T,), -1, dtype=torch.int64) if E == 0 else torch.randint(-1, E, (T,))
        x, w, index, b = _make(dev, torch.float32, T, E, N, K, True, index)
        y = opforge.indexed_linear(x, w, index, b)
        assert y.shape == (T, N)
        torch.testing.assert_close(y, indexed_linear_reference(x, w, index, b).float())
        y.sum().backward()
        assert x.grad.shape == x.shape and w.grad.shape == w.shape and b.grad.shape == b.shape
        none = index.eq(-1)  # rows without an expert (every row when E = 0): exactly zero input gradient
        assert torch.equal(x.grad[none], torch.zeros_like(x.grad[none]))


def test_module(dev):
    m = opforge.nn.IndexedLinear(8, 6, num_experts=3).to(dev)
    assert m.weight.shape == (3, 6, 8) and m.bias.shape == (3, 6)
    x = torch.randn(10, 8, device=dev)
    index = torch.randint(-1, 3, (10,), device=dev)
    torch.testing.assert_close(m(x, index), indexed_linear_reference(x, m.weight, index, m.bias).float())


def test_gradcheck_and_gradgradcheck_float64(dev):
    x, w, index, b = _make(dev, torch.float64, 9, 3, 4, 5, True, torch.tensor([0, -1, 2, 2, 1, -1, 0, 2, 2]))
    fn = lambda x, w, b: opforge.indexed_linear(x, w, index, b)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))
    assert torch.autograd.gradgradcheck(fn, (x, w, b))


def test_torch_func_grad(dev):
    x, w, index, b = _make(dev, torch.float64, 9, 3, 4, 5, True)
    g = torch.func.grad(lambda w: opforge.indexed_linear(x.detach(), w, index, b.detach()).square().sum())(w.detach())
    w2 = w.detach().requires_grad_()
    indexed_linear_reference(x.detach(), w2, index, b.detach()).square().sum().backward()
    torch.testing.assert_close(g, w2.grad)


def test_opcheck(dev):
    x, w, index, b = _make(dev, torch.float32, 12, 3, 8, 16, True)
    torch.library.opcheck(torch.ops.opforge.indexed_linear, (x, w, index, b))
    torch.library.opcheck(torch.ops.opforge.indexed_linear, (x, w, index, None))
    dy = torch.randn(12, 8, device=dev)
    torch.library.opcheck(torch.ops.opforge.indexed_linear_backward,
                          (dy, x.detach(), w.detach(), index, [True, True, True], torch.float32))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(dev, dynamic):
    x, w, index, b = _make(dev, torch.float32, 12, 3, 8, 16, True)
    fn = torch.compile(lambda x, w, i, b: opforge.indexed_linear(x, w, i, b).square().sum(), fullgraph=True,
                       dynamic=dynamic)
    out = fn(x, w, index, b)
    out.backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = opforge.indexed_linear(x, w, index, b).square().sum()
    ref.backward()
    torch.testing.assert_close(out, ref)
    for g, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(g, t.grad)


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.zeros(4, dtype=torch.int32), None), TypeError,
         r"opforge::indexed_linear: expected index to have dtype int64, but got Int"),
        (lambda: (torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.int64), None), ValueError,
         r"opforge::indexed_linear: expected weight to be 3-D"),
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 4), torch.zeros(4, dtype=torch.int64), None), ValueError,
         r"opforge::indexed_linear: expected input's last dimension to equal weight's in_features 4, but got 3"),
        (lambda: (torch.randn(4, 3), torch.randn(2, 5, 3), torch.zeros(4, dtype=torch.int64), torch.randn(5)), ValueError,
         r"opforge::indexed_linear: expected bias of shape \[2, 5\]"),
        (lambda: (torch.randn(2, 4, 3), torch.randn(2, 5, 3), torch.zeros(4, dtype=torch.int64), None), ValueError,
         r"opforge::indexed_linear: expected input to be 2-D"),
        (lambda: (torch.ones(4, 3, dtype=torch.int64), torch.randn(2, 5, 3), torch.zeros(4, dtype=torch.int64), None),
         TypeError, r"opforge::indexed_linear: expected input to have a floating dtype"),
    ],
)
def test_bad_inputs_raise_clear_errors(make, exc, match):
    x, w, i, b = make()
    with pytest.raises(exc, match=match):
        opforge.indexed_linear(x, w, i, b)
    with pytest.raises(exc, match=match):  # Meta runs the same checker
        opforge.indexed_linear(x.to("meta"), w.to("meta"), i.to("meta"), None if b is None else b.to("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", CUDA_PATHS)
def test_cuda_graph_capture_no_host_sync(path, knob):
    """Forward and backward ops never synchronise with the host: they capture in a CUDA graph and replay right."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    T = 8 if path in ("auto", "gemv") else 256
    x, w, index, b = _make("cuda", torch.bfloat16, T, 4, 64, 128)
    x, w, b = x.detach(), w.detach(), b.detach()
    dy = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opforge.indexed_linear(x, w, index, b)
        torch.ops.opforge.indexed_linear_backward(dy, x, w, index, [True, True, True], torch.bfloat16)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = opforge.indexed_linear(x, w, index, b)
        gi, gw, gb = torch.ops.opforge.indexed_linear_backward(dy, x, w, index, [True, True, True], torch.bfloat16)
    index.copy_(torch.randint(-1, 4, (T,), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, opforge.indexed_linear(x, w, index, b))
    ref = torch.ops.opforge.indexed_linear_backward(dy, x, w, index, [True, True, True], torch.bfloat16)
    for got, want in zip((gi, gw, gb), ref):
        torch.testing.assert_close(got, want)


# ---- CUDA gather-GEMV: decode shapes (multi-LoRA shrink K 4096 -> N 16, expand K 16 -> N 4096) ------------------

GEMV_K = [16, 24, 4095, 4096, 4097]  # 16-byte loads where K·sizeof divides by 16, element loads for odd K
GEMV_N = [1, 16, 17, 4096]
GEMV_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _decode_index(T, E):
    """Experts in [0, E) with −1 at positions 1, 4, 7, ..., E + 5 at 5, 12, ... and −7 at 6, 15, ... (out of range:
    a −1 row on CUDA); position 0 always valid."""
    index = torch.randint(0, E, (T,))
    index[1::3] = -1
    index[5::7] = E + 5
    index[6::9] = -7
    return index.cuda()


def _as_minus_one(index, E):
    return torch.where((index >= 0) & (index < E), index, -1)


def _fp32_accumulation_bound(x, w, index, b, dtype):
    """Elementwise a-priori bound of y = round_dtype(Σ_k x·w + b) accumulated in fp32 (float64 for float64):
    (K + 1)·u_acc·(|x|·|W_e|ᵀ + |b_e|) + u_dtype·|y| (Higham's γ_K, first order), 0 on the −1 rows. Float64 (T, N).
    A wrong expert, a missing chunk or a wrong row breaks it on most elements."""
    u_acc = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps / 2
    u = torch.finfo(dtype).eps / 2
    K = x.shape[1]
    absb = b.detach().abs() if b is not None else None
    mag = indexed_linear_reference(x.detach().abs(), w.detach().abs(), index, absb)
    ref = indexed_linear_reference(x, w, index, b)
    return (K + 1) * u_acc * mag + u * ref.abs()


def _check_decode(x, w, index, b, dtype):
    """y against the float64 reference with the file's rule (3× PyTorch's error, or the fp32-accumulation bound),
    the invalid rows exactly zero."""
    E = w.shape[0]
    valid_index = _as_minus_one(index, E)
    y = opforge.indexed_linear(x, w, index, b)
    assert y.dtype == dtype and y.shape == (x.shape[0], w.shape[1])
    invalid = valid_index < 0
    assert torch.equal(y[invalid].double(), torch.zeros(int(invalid.sum()), w.shape[1], dtype=torch.float64,
                                                        device="cuda")), "−1 / out-of-range rows not exactly zero"
    ref = indexed_linear_reference(x, w, valid_index, b)
    bound = _fp32_accumulation_bound(x, w, valid_index, b, dtype)
    assert_matches_reference(y, ref, _torch_baseline(x, w, valid_index, b), factor=3.0, bound=bound)
    return y


@needs_cuda
@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("K", GEMV_K)
@pytest.mark.parametrize("N", GEMV_N)
@pytest.mark.parametrize("T", [1, 5, 16, 33])
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_gemv_decode_shapes_match_float64(dtype, K, N, T, bias, knob):
    """The gather-GEMV (forced for T 33) on shrink / expand shapes incl. odd K and N, with −1 and out-of-range
    indices: values against float64, invalid rows exactly zero."""
    knob("indexed_linear_path", PATH_HOOK["gemv"])
    E = 4
    index = _decode_index(T, E)
    x, w, _, b = _make("cuda", dtype, T, E, N, K, bias, index)
    _check_decode(x.detach(), w.detach(), index, None if b is None else b.detach(), dtype)


@needs_cuda
@pytest.mark.parametrize("path", ["auto", "gemv"])
@pytest.mark.parametrize("K, N", [(4096, 16), (16, 4096), (4097, 17)])
def test_cuda_decode_every_token_count(path, K, N, knob):
    """T = 1 .. 33 in bfloat16 with bias (auto: the GEMV up to 16 tokens, the grouped regime after)."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    E = 64
    w = (torch.randn(E, N, K, device="cuda") / K ** 0.5).bfloat16()
    b = torch.randn(E, N, device="cuda").bfloat16()
    for T in range(1, 34):
        x = torch.randn(T, K, device="cuda").bfloat16()
        _check_decode(x, w, _decode_index(T, E), b, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K, N", [(16, 4096), (24, 1), (4096, 16), (4097, 17), (4096, 4096)])
def test_cuda_gemv_unaligned_views(dtype, K, N, knob):
    """Input and bank at an odd storage offset (not 16-byte aligned: element loads) give the right values and the
    same values as aligned copies within the rule."""
    knob("indexed_linear_path", PATH_HOOK["gemv"])
    T, E = 8, 3
    x = torch.randn(T * K + 1, device="cuda").to(dtype)[1:].view(T, K)
    w = (torch.randn(E * N * K + 1, device="cuda") / K ** 0.5).to(dtype)[1:].view(E, N, K)
    b = torch.randn(E * N + 1, device="cuda").to(dtype)[1:].view(E, N)
    assert x.is_contiguous() and w.is_contiguous() and x.data_ptr() % 16 != 0 and w.data_ptr() % 16 != 0
    index = _decode_index(T, E)
    _check_decode(x, w, index, b, dtype)
    _check_decode(x.clone(), w.clone(), index, b.clone(), dtype)


@needs_cuda
@pytest.mark.parametrize("path", ["auto", "gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, K, N", [(8, 64, 4096, 16), (8, 64, 16, 4096), (3, 5, 4097, 1), (16, 4, 8192, 64)])
def test_cuda_gemv_deterministic(path, dtype, T, E, K, N, knob):
    """Two calls give the same bits (fixed summation order: no atomics), and so does a third after other work."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    x = torch.randn(T, K, device="cuda").to(dtype)
    w = (torch.randn(E, N, K, device="cuda") / K ** 0.5).to(dtype)
    b = torch.randn(E, N, device="cuda").to(dtype)
    index = _decode_index(T, E)
    y1 = opforge.indexed_linear(x, w, index, b)
    y2 = opforge.indexed_linear(x, w, index, b)
    torch.randn(1 << 20, device="cuda").sum()  # other work in between
    y3 = opforge.indexed_linear(x, w, index, b)
    assert torch.equal(y1, y2) and torch.equal(y1, y3)
    ref = indexed_linear_reference(x, w, _as_minus_one(index, E), b)
    assert relative_error(y1, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)  # and the bits are right ones


@needs_cuda
@pytest.mark.parametrize("K, N", [(4096, 16), (16, 4096), (4097, 17)])
def test_cuda_gemv_decode_graph_capture(K, N):
    """The decode shapes capture in a CUDA graph (no host sync, no workspace) and a replay after the index changed
    gives the eager result bit for bit."""
    T, E = 8, 64
    x = torch.randn(T, K, device="cuda").bfloat16()
    w = (torch.randn(E, N, K, device="cuda") / K ** 0.5).bfloat16()
    b = torch.randn(E, N, device="cuda").bfloat16()
    index = _decode_index(T, E)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opforge.indexed_linear(x, w, index, b)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = opforge.indexed_linear(x, w, index, b)
    index.copy_(torch.randperm(E, device="cuda")[:T])
    index[3] = -1
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, opforge.indexed_linear(x, w, index, b))
    assert torch.equal(y[3].float(), torch.zeros(N, device="cuda"))
    _check_decode(x, w, index, b, torch.bfloat16)


def _at_odd_offset(t):
    """A copy of `t` one element into a fresh storage (contiguous, base address not 16-byte aligned), a leaf that
    requires grad when `t` does."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t.detach())
    assert out.is_contiguous() and out.storage_offset() == 1 and out.data_ptr() % 16 != 0
    return out.requires_grad_(t.requires_grad)


@needs_cuda
@pytest.mark.parametrize("path", CUDA_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [5, 33, 300])  # auto: the gather-GEMV, the grouped regime (few and many tokens)
@pytest.mark.parametrize("unaligned", ["input", "weight", "bias", "grad_output", "all"])
def test_cuda_unaligned_operands_every_path(path, dtype, T, unaligned, knob):
    """An operand at an odd storage offset (a valid contiguous view, not 16-byte aligned) on every path: forward and
    backward against float64 (bfloat16 with K, N multiples of 8 reaches torch's _grouped_mm on sm_90, which needs
    16-byte aligned operands: the sanitizer run's "expected data_ptr to be aligned to 16 bytes")."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    E, N, K = 4, 24, 32
    index = _decode_index(T, E)
    x, w, _, b = _make("cuda", dtype, T, E, N, K, True, index)
    moved = {"input", "weight", "bias"} if unaligned == "all" else {unaligned}
    x = _at_odd_offset(x) if "input" in moved else x.detach().requires_grad_()
    w = _at_odd_offset(w) if "weight" in moved else w.detach().requires_grad_()
    b = _at_odd_offset(b) if "bias" in moved else b.detach().requires_grad_()
    y = _check_decode(x, w, index, b, dtype)
    dy = torch.randn(T, N, device="cuda").to(dtype)
    if unaligned in ("grad_output", "all"):
        dy = _at_odd_offset(dy)
    y.backward(dy)
    valid_index = _as_minus_one(index, E)
    gx, gw, gb = _grads64(x, w, valid_index, b, dy)
    bx, bw, bb = _baseline_grads(x, w, valid_index, b, dy)
    assert_matches_reference(x.grad, gx, bx, what="grad_input", factor=3.0)
    assert_matches_reference(w.grad, gw, bw, what="grad_weight", factor=3.0)
    assert_matches_reference(b.grad, gb, bb, what="grad_bias", factor=3.0)


# ---- index_sorted: the caller's rows already in expert order --------------------------------------------------

def _sorted_index(T, E, device, invalid=True):
    """A random index sorted by expert with rows of −1 last (some experts empty when T is small)."""
    index = torch.randint(0, E, (T,)).sort().values
    if invalid and T > 2:
        index[-(T // 5 + 1):] = -1
    return index.to(device)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T, E, N, K", [(5, 3, 16, 24), (83, 5, 24, 40), (300, 4, 64, 72), (300, 64, 16, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_index_sorted_matches_float64_and_the_unsorted_call(dev, dtype, T, E, N, K, bias):
    """index_sorted=True: values and gradients within the rounding rule of float64 and, rounding aside, the
    unsorted call's (the same grouped GEMMs over the same rows, without the gather and scatter)."""
    x, w, index, b = _make(dev, dtype, T, E, N, K, bias, _sorted_index(T, E, "cpu"))
    y = opforge.indexed_linear(x, w, index, b, index_sorted=True)
    assert_matches_reference(y, indexed_linear_reference(x, w, index, b), _torch_baseline(x, w, index, b), factor=3.0)
    dy = torch.randn_like(y)
    y.backward(dy)
    got = [v.grad for v in (x, w, b) if v is not None]
    gx, gw, gb = _grads64(x, w, index, b, dy)
    bx, bw, bb = _baseline_grads(x, w, index, b, dy)
    assert_matches_reference(got[0], gx, bx, what="grad_input", factor=3.0)
    assert_matches_reference(got[1], gw, bw, what="grad_weight", factor=3.0)
    if b is not None:
        assert_matches_reference(got[2], gb, bb, what="grad_bias", factor=3.0)
    assert torch.equal(y[index.eq(-1)], torch.zeros_like(y[index.eq(-1)]))
    for v in (x, w, b):
        if v is not None:
            v.grad = None
    y2 = opforge.indexed_linear(x, w, index, b)
    y2.backward(dy)
    if dev == "cpu":  # one code path: the same bits
        assert torch.equal(y, y2)
        for g, v in zip(got, (x, w, b)):
            assert torch.equal(g, v.grad)


@pytest.mark.parametrize("index, pos", [([0, 1, 1, 0], 3), ([2, 2, -1, 1], 3), ([-1, 0], 1)])
def test_index_sorted_out_of_order_is_an_error_on_cpu(index, pos):
    x, w, index, b = _make("cpu", torch.float32, len(index), 3, 4, 5, True, torch.tensor(index))
    with pytest.raises(ValueError, match=rf"opforge::indexed_linear: expected index sorted by expert .* at position "
                                         rf"{pos} after"):
        opforge.indexed_linear(x, w, index, b, index_sorted=True)
    dy = torch.ones(len(index), 4)
    with pytest.raises(ValueError, match=r"opforge::indexed_linear_backward: expected index sorted by expert"):
        torch.ops.opforge.indexed_linear_backward(dy, x.detach(), w.detach(), index, [True, True, True],
                                                  index_sorted=True)
    opforge.indexed_linear(x, w, index, b)  # the same index unsorted is fine


def test_index_sorted_opcheck_and_compile(dev):
    x, w, index, b = _make(dev, torch.float32, 40, 4, 8, 16, True, _sorted_index(40, 4, "cpu"))
    args = (x.detach(), w.detach(), index, b.detach())
    torch.library.opcheck(torch.ops.opforge.indexed_linear.default, args, {"index_sorted": True})
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: opforge.indexed_linear(*a, index_sorted=True), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(*args), opforge.indexed_linear(*args))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["auto", "grouped", "grouped_mm"])
def test_index_sorted_out_of_order_rows_are_nan_on_cuda(path, knob):
    """CUDA cannot raise without a host synchronisation: the rows that break the promised order (the misplaced row,
    and rows its key moves out of their expert's group) come out NaN, the others keep their values, and the weight
    and bias gradients are NaN (never silently wrong)."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    T, E, N, K = 64, 4, 32, 64
    index = _sorted_index(T, E, "cpu", invalid=False)
    index[10] = E - 1  # out of order: an expert above its neighbours' inside expert 0's rows
    x, w, index, b = _make("cuda", torch.bfloat16, T, E, N, K, True, index)
    y = opforge.indexed_linear(x, w, index, b, index_sorted=True)
    ref = opforge.indexed_linear(x, w, index, b)
    assert y[10].isnan().all().item()
    ok = ~y.isnan().any(1)  # every other row: NaN as a whole, or the unsorted call's value
    assert torch.equal(y.isnan().all(1), ~ok)
    torch.testing.assert_close(y[ok], ref[ok])
    y.backward(torch.ones_like(y))
    assert w.grad.isnan().all().item() and b.grad.isnan().all().item()


@needs_cuda
@pytest.mark.parametrize("path", ["auto", "grouped", "grouped_mm"])
@pytest.mark.parametrize("unaligned", ["input", "grad_output", "all"])
def test_cuda_index_sorted_unaligned_operands(path, unaligned, knob):
    """index_sorted=True with an input or output gradient at an odd storage offset (a valid contiguous view, not
    16-byte aligned): bfloat16 with K, N multiples of 8 runs torch's _grouped_mm on the caller's rows in place on
    sm_90, which needs 16-byte aligned operands; forward and backward against float64."""
    if path != "auto":
        knob("indexed_linear_path", PATH_HOOK[path])
    T, E, N, K = 300, 4, 24, 32
    index = _sorted_index(T, E, "cuda")
    x, w, _, b = _make("cuda", torch.bfloat16, T, E, N, K, True, index)
    if unaligned in ("input", "all"):
        x = _at_odd_offset(x)
    y = opforge.indexed_linear(x, w, index, b, index_sorted=True)
    assert_matches_reference(y, indexed_linear_reference(x, w, index, b), _torch_baseline(x, w, index, b), factor=3.0)
    dy = torch.randn(T, N, device="cuda").to(torch.bfloat16)
    if unaligned in ("grad_output", "all"):
        dy = _at_odd_offset(dy)
    y.backward(dy)
    gx, gw, gb = _grads64(x, w, index, b, dy)
    bx, bw, bb = _baseline_grads(x, w, index, b, dy)
    assert_matches_reference(x.grad, gx, bx, what="grad_input", factor=3.0)
    assert_matches_reference(w.grad, gw, bw, what="grad_weight", factor=3.0)
    assert_matches_reference(b.grad, gb, bb, what="grad_bias", factor=3.0)
