"""rope and rope_from_positions (and their backward ops): the four RoPE cases (GQA, partial rotary, angle
precision, views), values and gradients against the float64 reference and transformers' apply_rotary_pos_emb,
opcheck, compile, gradcheck (first and second order), torch.func, errors; on CUDA every test that takes ``device``
runs with each kernel (the default per-token kernel, and the rows kernel through the test hook rope_rows_kernel),
and the kernel-path tests at the end cover each branch of both kernels (vector/strided rows and tables, row groups,
pass-through dims, the grid-stride loop, the rows kernel past the token kernel's shared-memory table)."""
import math

import pytest
import torch

import opforge
from opforge.testing import (assert_matches_reference, rope_cos_sin_reference, rope_from_positions_reference,
                             rope_reference)

from conformance import rope_baseline as _baseline  # the same math in q's dtype (the conformance entry's)

DTYPES = [torch.float32, torch.bfloat16]
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
CUDA_KERNELS = [pytest.param("cuda", marks=_NEEDS_CUDA), pytest.param("cuda-rows-kernel", marks=_NEEDS_CUDA)]
# the test hook rope_rows_kernel of each CUDA parametrization: 0 the default (the per-token kernel wherever its table
# fits in shared memory), 1 the rows kernel
KERNEL_KNOB = {"cuda": 0, "cuda-rows-kernel": 1}


@pytest.fixture(params=["cpu"] + CUDA_KERNELS)
def device(request, knob):
    """conftest's devices, with CUDA twice: the default per-token kernel and the rows kernel (rope_rows_kernel = 1)."""
    if request.param in KERNEL_KNOB:
        knob("rope_rows_kernel", KERNEL_KNOB[request.param])
    return "cuda" if request.param.startswith("cuda") else request.param


def _tables(positions, R, dtype, device, base=10000.0, interleaved=False):
    cos, sin = rope_cos_sin_reference(torch.as_tensor(positions, device=device), R, base, interleaved=interleaved)
    return cos.to(dtype), sin.to(dtype)


def _check(q, k, cos, sin, dq=None, dk=None, interleaved=False, rotary_dim=None):
    """opforge.rope's values and gradients against float64 and the tolerance rule."""
    q = q.detach().requires_grad_()
    k = k.detach().requires_grad_()
    oq, ok = opforge.rope(q, k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    rq, rk = rope_reference(q, k, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim)
    bq, bk = _baseline(q, k, cos, sin, interleaved, rotary_dim)
    assert_matches_reference(oq, rq, bq, what="q_out")
    assert_matches_reference(ok, rk, bk, what="k_out")
    dq = torch.randn_like(oq) if dq is None else dq
    dk = torch.randn_like(ok) if dk is None else dk
    gq, gk = torch.autograd.grad((oq, ok), (q, k), (dq, dk))
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rgq, rgk = torch.autograd.grad(rope_reference(q64, k64, cos, sin, interleaved=interleaved, rotary_dim=rotary_dim),
                                   (q64, k64), (dq.double(), dk.double()))
    bgq, bgk = torch.autograd.grad((bq, bk), (q, k), (dq, dk))
    assert_matches_reference(gq, rgq, bgq, what="grad_q")
    assert_matches_reference(gk, rgk, bgk, what="grad_k")
    return oq, ok


# ---- case 1: GQA ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [2, 37])
@pytest.mark.parametrize("heads", [(2, 1), (8, 1), (32, 8), (4, 4), (1, 1)])
def test_gqa_forward_backward(device, dtype, seq, heads):
    hq, hk = heads
    q = torch.randn(2, hq, seq, 128, device=device).to(dtype)
    k = torch.randn(2, hk, seq, 128, device=device).to(dtype)
    cos, sin = _tables(torch.arange(seq), 128, dtype, device)
    oq, ok = _check(q, k, cos[None], sin[None])
    # both rotated: position 1 differs from the input in q and in k
    assert not torch.equal(oq[:, :, 1], q[:, :, 1]) and not torch.equal(ok[:, :, 1], k[:, :, 1])
    assert torch.equal(ok[:, :, 0], k[:, :, 0])  # position 0: cos 1, sin 0


# ---- case 2: partial rotary ----------------------------------------------------------------------------------
POSITIONS = [0, 1, 700, 2355, 32767]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dims", [(128, 32), (80, 20), (64, 16), (256, 64)])
def test_partial_rotary(device, dtype, interleaved, dims):
    D, R = dims
    S = len(POSITIONS)
    q = torch.randn(1, 3, S, D, device=device).to(dtype)
    k = torch.randn(1, 2, S, D, device=device).to(dtype)
    pos = torch.tensor(POSITIONS, device=device)
    cos, sin = _tables(pos, R, torch.float32, device, interleaved=interleaved)
    oq, ok = _check(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(oq[..., R:], q[..., R:]) and torch.equal(ok[..., R:], k[..., R:])
    assert oq.shape == q.shape and ok.shape == k.shape
    # rope_from_positions: frequencies base^(−2i/R), i < R/2 (not /D), same pairs
    pq, pk = opforge.rope_from_positions(q, k, pos, interleaved=interleaved, rotary_dim=R)
    rq, rk = rope_from_positions_reference(q, k, pos, interleaved=interleaved, rotary_dim=R)
    bq, bk = _baseline(q, k, *_tables(pos, R, dtype, device, interleaved=interleaved), interleaved, R)
    assert_matches_reference(pq, rq, bq, what="q_out")
    assert_matches_reference(pk, rk, bk, what="k_out")
    assert torch.equal(pq[..., R:], q[..., R:]) and torch.equal(pk[..., R:], k[..., R:])


def test_pairs_of_each_convention(device):
    """One nonzero input dim i: rotate-half moves it to i + R/2, interleaved to i + 1 (position 0 alone would not tell)."""
    D, R, i = 64, 16, 3
    q = torch.zeros(1, 1, 1, D, device=device)
    q[..., i] = 1.0
    pos = torch.tensor([5], device=device)
    for interleaved, partner in ((False, i + R // 2), (True, i - 1)):
        (oq, _) = opforge.rope_from_positions(q, q, pos, 10000.0, interleaved=interleaved, rotary_dim=R)
        nz = set(oq.flatten().nonzero().flatten().tolist())
        assert nz == {i, partner}, (interleaved, nz)
        theta = 5 * 10000.0 ** (-2 * ((i - 1) // 2 if interleaved else i) / R)
        torch.testing.assert_close(oq[0, 0, 0, i].item(), math.cos(theta), rtol=1e-6, atol=1e-6)


# ---- case 3: angle precision ---------------------------------------------------------------------------------
@pytest.mark.parametrize("base", [1e4, 5e5])
@pytest.mark.parametrize("position", [1, 1857, 4095, 32767, 131071, 1048575])
def test_angle_precision_bf16(device, base, position):
    D = 128
    q = torch.randn(1, 4, 1, D, device=device).to(torch.bfloat16)
    k = torch.randn(1, 2, 1, D, device=device).to(torch.bfloat16)
    pos = torch.tensor([position], device=device)
    rq, rk = rope_from_positions_reference(q, k, pos, base)
    bound = 1e-2 if position <= 131071 else 3e-2
    scale = max(q.abs().max().item(), k.abs().max().item())
    pq, pk = opforge.rope_from_positions(q, k, pos, base)
    cos, sin = _tables(pos, D, torch.float32, device, base)  # float32 tables with bf16 q: used as float32
    tq, tk = opforge.rope(q, k, cos, sin)
    for name, (oq, ok) in (("from_positions", (pq, pk)), ("fp32 tables", (tq, tk))):
        err = max((oq.double() - rq).abs().max().item(), (ok.double() - rk).abs().max().item())
        assert err <= bound * scale, f"{name}: error {err:.3e} > {bound} x max|q| {scale:.3e}"
    # the bf16 rounding of each output dominates: as good as rounding the exact result once (x2)
    err_ours = (tq.double() - rq).abs().max().item()
    err_round = (rq.to(torch.bfloat16).double() - rq).abs().max().item()
    assert err_ours <= 2 * err_round + 1e-6


# ---- case 4: views -------------------------------------------------------------------------------------------
def _views(kind, device):
    if kind == "fused_qkv":  # (37, 1536) rows: q 8 heads, k 2 heads, v 2 heads of 128
        qkv = torch.randn(37, 1536, device=device)
        q = qkv[:, :1024].view(37, 8, 128).transpose(0, 1)[None]
        k = qkv[:, 1024:1280].view(37, 2, 128).transpose(0, 1)[None]
        return q, k
    if kind == "mla":  # the rope part (last 64 of 192) of (37, 16, 192) q, and a one-head k
        qf = torch.randn(37, 16, 192, device=device)
        kf = torch.randn(37, 1, 576, device=device)
        return qf[..., 128:].transpose(0, 1)[None], kf[..., 512:].transpose(0, 1)[None]
    q = torch.randn(2, 8, 64, 128, device=device).transpose(1, 2)  # (2, 64, 8, 128)
    k = torch.randn(2, 8, 16, 128, device=device).transpose(1, 2)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["fused_qkv", "mla", "transposed"])
def test_views_and_zero_stride_gradients(device, dtype, kind):
    q, k = _views(kind, device)
    q, k = q.to(dtype), k.to(dtype)
    assert not q.is_contiguous()
    B, _, S, D = q.shape
    cos, sin = _tables(torch.arange(S).expand(B, S), D, dtype, device)
    q = q.requires_grad_()
    k = k.requires_grad_()
    oq, ok = opforge.rope(q, k, cos, sin)
    qc, kc = q.detach().contiguous().requires_grad_(), k.detach().contiguous().requires_grad_()
    cq, ck = opforge.rope(qc, kc, cos, sin)
    torch.testing.assert_close(oq, cq, rtol=0, atol=0)
    torch.testing.assert_close(ok, ck, rtol=0, atol=0)
    rq, rk = rope_reference(q, k, cos, sin)
    bq, bk = _baseline(q, k, cos, sin)
    assert_matches_reference(oq, rq, bq)
    assert_matches_reference(ok, rk, bk)
    (oq.sum() + ok.sum()).backward()  # zero-stride gradients
    (cq.sum() + ck.sum()).backward()
    torch.testing.assert_close(q.grad, qc.grad, rtol=0, atol=0)
    torch.testing.assert_close(k.grad, kc.grad, rtol=0, atol=0)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    r = rope_reference(q64, k64, cos, sin)
    (r[0].sum() + r[1].sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.grad.double(), q64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(k.grad.double(), k64.grad, rtol=tol, atol=tol)


def test_dense_layout_is_kept(device):
    """HF's q (B, S, H, D).transpose(1, 2) comes back in the same memory layout (as HF's elementwise math)."""
    q = torch.randn(2, 5, 4, 16, device=device).transpose(1, 2)
    k = torch.randn(2, 5, 2, 16, device=device).transpose(1, 2)
    cos, sin = _tables(torch.arange(5), 16, torch.float32, device)
    oq, ok = opforge.rope(q, k, cos, sin)
    assert oq.stride() == q.stride() and ok.stride() == k.stride()
    mq, mk = opforge.rope(q.to("meta"), k.to("meta"), cos.to("meta"), sin.to("meta"))
    assert mq.stride() == oq.stride() and mk.stride() == ok.stride() and mq.dtype == oq.dtype


# ---- against transformers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_apply_rotary_pos_emb(device, dtype):
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    rotary = modeling.LlamaRotaryEmbedding(cfg).to(device)
    B, S, D = 2, 19, 64
    x = torch.randn(B, S, 256, device=device, dtype=dtype)
    position_ids = torch.arange(100, 100 + S, device=device).expand(B, S)
    cos, sin = rotary(x, position_ids)  # (B, S, D) in x's dtype
    q = torch.randn(B, S, 4, D, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, S, 2, D, device=device, dtype=dtype).transpose(1, 2)
    hq, hk = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    oq, ok = opforge.rope(q, k, cos, sin)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(oq, hq, **tol)
    torch.testing.assert_close(ok, hk, **tol)
    # the in-kernel angles agree with transformers' float32 ones to float32 rounding of the angle
    pq, pk = opforge.rope_from_positions(q.float(), k.float(), position_ids, cfg.rope_parameters["rope_theta"]
                                         if hasattr(cfg, "rope_parameters") else cfg.rope_theta)
    torch.testing.assert_close(pq, modeling.apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float())[0],
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-4, atol=2e-2 if dtype == torch.bfloat16 else 1e-4)


# ---- autograd, opcheck, compile --------------------------------------------------------------------------------
def _small(device, dtype=torch.float64, interleaved=False):
    q = torch.randn(2, 3, 5, 8, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, device=device, dtype=dtype, requires_grad=True)
    # random (non-duplicated) tables: the backward must be the exact transpose of the forward's map
    cos = torch.randn(2, 5, 6, device=device, dtype=dtype)
    sin = torch.randn(2, 5, 6, device=device, dtype=dtype)
    return q, k, cos, sin


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_and_gradgradcheck_float64(device, interleaved):
    q, k, cos, sin = _small(device)
    fn = lambda q, k: opforge.rope(q, k, cos, sin, interleaved=interleaved)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k))
    assert torch.autograd.gradgradcheck(fn, (q, k))
    pos = torch.tensor([[0, 3, 9, 700, 2], [1, 1, 1, 1, 1]], device=device)
    fp = lambda q, k: opforge.rope_from_positions(q, k, pos, 500.0, interleaved=interleaved, rotary_dim=6)  # noqa: E731
    assert torch.autograd.gradcheck(fp, (q, k))
    assert torch.autograd.gradgradcheck(fp, (q, k))


def test_only_requested_gradient(device):
    q, k, cos, sin = _small(device)
    k = k.detach()
    oq, ok = opforge.rope(q, k, cos, sin)
    oq.sum().backward(retain_graph=True)
    assert q.grad is not None and k.grad is None
    q.grad = None
    ok.sum().backward()  # k_out carries the node too (as any multi-output op), but nothing flows into q
    assert q.grad is None
    gq, gk = torch.ops.opforge.rope_backward(torch.ones_like(q), None, cos, sin)
    assert gk is None and gq.shape == q.shape


@pytest.mark.parametrize("given", ["q", "k"])
def test_backward_ops_with_one_gradient_are_differentiable(device, given):
    """rope_backward and rope_from_positions_backward with one of the two incoming gradients None: the gradient they
    return is differentiable in the one given (gradcheck and gradgradcheck in float64; its backward is rope's)."""
    q, k, cos, sin = _small(device)
    pos = torch.tensor([[0, 3, 9, 700, 2], [1, 1, 1, 1, 1]], device=device)
    i = 0 if given == "q" else 1
    g = (q, k)[i].detach().requires_grad_()

    def pair(g):
        return (g, None) if given == "q" else (None, g)

    ops = [lambda g: torch.ops.opforge.rope_backward(*pair(g), cos, sin)[i],
           lambda g: torch.ops.opforge.rope_from_positions_backward(*pair(g), pos, 500.0, rotary_dim=6)[i]]
    for fn in ops:
        assert torch.autograd.gradcheck(fn, (g,))
        assert torch.autograd.gradgradcheck(fn, (g,))


def test_torch_func_grad(device):
    q, k, cos, sin = _small(device)

    def loss(q, k):
        oq, ok = opforge.rope(q, k, cos, sin)
        return (oq.square().sum() + ok.sin().sum())

    gq, gk = torch.func.grad(loss, argnums=(0, 1))(q.detach(), k.detach())
    q64, k64 = q.detach().requires_grad_(), k.detach().requires_grad_()
    rq, rk = rope_reference(q64, k64, cos, sin)
    rgq, rgk = torch.autograd.grad(rq.square().sum() + rk.sin().sum(), (q64, k64))
    torch.testing.assert_close(gq, rgq)
    torch.testing.assert_close(gk, rgk)


def test_opcheck(device):
    q, k, cos, sin = _small(device, torch.float32)
    torch.library.opcheck(torch.ops.opforge.rope, (q, k, cos, sin), {"interleaved": True})
    torch.library.opcheck(torch.ops.opforge.rope_backward, (q.detach(), k.detach(), cos, sin))
    torch.library.opcheck(torch.ops.opforge.rope_backward, (None, k.detach(), cos, sin))
    pos = torch.arange(5, device=device)
    torch.library.opcheck(torch.ops.opforge.rope_from_positions, (q, k, pos, 10000.0), {"rotary_dim": 4})
    torch.library.opcheck(torch.ops.opforge.rope_from_positions_backward, (q.detach(), k.detach(), pos, 10000.0))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(device, dynamic):
    q, k, cos, sin = _small(device, torch.float32)
    pos = torch.arange(5, device=device)[None]

    def f(q, k):
        oq, ok = opforge.rope(q, k, cos, sin)
        pq, pk = opforge.rope_from_positions(oq, ok, pos, 100.0, interleaved=True)
        return pq.square().sum() + pk.sum()

    fn = torch.compile(f, fullgraph=True, dynamic=dynamic)
    out = fn(q, k)
    out.backward()
    g1 = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    ref = f(q, k)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g1[0], q.grad)
    torch.testing.assert_close(g1[1], k.grad)


def test_zero_size(device):
    q = torch.randn(2, 0, 3, 8, device=device, requires_grad=True)
    k = torch.randn(2, 2, 3, 8, device=device, requires_grad=True)
    cos, sin = torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)
    oq, ok = opforge.rope(q, k, cos, sin)
    (oq.sum() + ok.sum()).backward()
    assert oq.shape == q.shape and q.grad.shape == q.shape
    e = torch.randn(0, 2, 0, 8, device=device)
    assert opforge.rope(e, e, torch.randn(0, 8, device=device), torch.randn(0, 8, device=device))[0].shape == e.shape


def test_dtypes_of_tables(device):
    """bf16 q with float32, float64 or float16 tables: math in float32 on the float32-rounded table."""
    q = torch.randn(1, 2, 4, 16, device=device).bfloat16()
    k = torch.randn(1, 1, 4, 16, device=device).bfloat16()
    cos, sin = _tables(torch.arange(4) * 1000, 16, torch.float64, device)
    a = opforge.rope(q, k, cos.float(), sin.float())
    for dt in (torch.float64, torch.float32):
        b = opforge.rope(q, k, cos.to(dt), sin.to(dt))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and b[0].dtype == torch.bfloat16
    f64 = opforge.rope(q.double(), k.double(), cos, sin)
    assert f64[0].dtype == torch.float64


# ---- errors ----------------------------------------------------------------------------------------------------
def _qkcs(D=8, R=8, S=3, hq=2, hk=1):
    return (torch.randn(1, hq, S, D), torch.randn(1, hk, S, D), torch.randn(S, R), torch.randn(S, R))


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        (_qkcs(D=7, R=6), {}, ValueError, r"opforge::rope: expected an even head_dim, but got 7"),
        (_qkcs(R=5)[:2] + (torch.randn(3, 5), torch.randn(3, 5)), {}, ValueError,
         r"expected rotary_dim to be even, positive and at most head_dim 8, but got 5"),
        (_qkcs(D=8, R=10), {}, ValueError, r"expected rotary_dim to be even, positive and at most head_dim 8, but got 10"),
        (_qkcs(), {"rotary_dim": 4}, ValueError, r"expected rotary_dim of -1 or cos.size\(-1\) 8, but got 4"),
        (_qkcs()[:3] + (torch.randn(3, 6),), {}, ValueError, r"expected cos and sin of the same shape, but got \[3, 8\] and \[3, 6\]"),
        (_qkcs()[:2] + (torch.randn(4, 8), torch.randn(4, 8)), {}, ValueError, r"expected cos and sin of shape \(1, 3, rotary_dim\)"),
        (_qkcs()[:2] + (torch.randn(2, 3, 8), torch.randn(2, 3, 8)), {}, ValueError, r"to match q's \(batch, seq\), but got \[2, 3, 8\]"),
        ((torch.randn(1, 2, 3, 8), torch.randn(2, 1, 3, 8)) + _qkcs()[2:], {}, ValueError,
         r"expected q and k of the same batch, seq and head_dim \(dims 0, 2, 3\), but got \[1, 2, 3, 8\] and \[2, 1, 3, 8\]"),
        ((torch.randn(1, 2, 3, 8), torch.randn(1, 1, 4, 8)) + _qkcs()[2:], {}, ValueError, r"same batch, seq and head_dim"),
        ((torch.randn(2, 3, 8), torch.randn(1, 1, 3, 8)) + _qkcs()[2:], {}, ValueError,
         r"expected q of shape \(batch, heads, seq, head_dim\), but got shape \[2, 3, 8\]"),
        ((torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8).double()) + _qkcs()[2:], {}, TypeError,
         r"expected q and k of the same dtype, but got Float and Double"),
        ((torch.ones(1, 2, 3, 8, dtype=torch.int32), torch.randn(1, 1, 3, 8)) + _qkcs()[2:], {}, TypeError,
         r"expected q to have a floating dtype"),
        (_qkcs()[:2] + (torch.ones(3, 8, dtype=torch.int64), torch.randn(3, 8)), {}, TypeError,
         r"expected cos to have a floating dtype"),
    ],
)
def test_bad_inputs_raise_clear_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        opforge.rope(*args, **kwargs)


def test_bad_positions_raise():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    with pytest.raises(TypeError, match=r"opforge::rope_from_positions: expected position_ids of an integer dtype"):
        opforge.rope_from_positions(q, k, torch.arange(3.0))
    with pytest.raises(ValueError, match=r"expected position_ids of shape \(3,\) or \(1, 3\)"):
        opforge.rope_from_positions(q, k, torch.arange(4))
    with pytest.raises(ValueError, match=r"expected a finite base > 0, but got -1"):
        opforge.rope_from_positions(q, k, torch.arange(3), -1.0)
    with pytest.raises(ValueError, match=r"expected rotary_dim to be even, positive and at most head_dim 8, but got 3"):
        opforge.rope_from_positions(q, k, torch.arange(3), rotary_dim=3)


def test_table_requiring_grad_is_refused():
    q, k, cos, sin = _qkcs()
    with pytest.raises(NotImplementedError, match=r"opforge::rope: gradients with respect to cos and sin"):
        opforge.rope(q, k, cos.requires_grad_(), sin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inputs_on_different_devices_raise():
    q, k, cos, sin = _qkcs()
    with pytest.raises(RuntimeError, match=r"opforge::rope: expected q and k to be on the same device"):
        opforge.rope(q.cuda(), k, cos, sin)
    with pytest.raises(RuntimeError, match=r"opforge::rope: expected q and cos to be on the same device"):
        opforge.rope(q.cuda(), k.cuda(), cos, sin)
    with pytest.raises(RuntimeError, match=r"expected q and position_ids to be on the same device"):
        opforge.rope_from_positions(q.cuda(), k.cuda(), torch.arange(3))


def test_rotary_embedding_module(device):
    m = opforge.nn.RotaryEmbedding(16, base=500.0, rotary_dim=8, interleaved=True)
    assert not list(m.parameters()) and not m.state_dict()
    q, k = torch.randn(2, 3, 4, 16, device=device), torch.randn(2, 1, 4, 16, device=device)
    pos = torch.tensor([[0, 5, 9, 100], [1, 2, 3, 4]], device=device)
    oq, ok = m(q, k, pos)
    rq, rk = rope_from_positions_reference(q, k, pos, 500.0, interleaved=True, rotary_dim=8)
    torch.testing.assert_close(oq.double(), rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok.double(), rk, rtol=1e-5, atol=1e-5)


# ---- kernel paths ----------------------------------------------------------------------------------------------
# (Hq, Hk, S, D, R, interleaved, layout, table): rows of 16 = 2 groups of 8, 42 = 6 groups of 7, 3 = one short group;
# layout "hf" is (B, S, H, D).transpose(1, 2), "strided" a non-contiguous last dim (V = 1 path); table "b" a
# per-batch (B, S, R) table, "1" a shared (1, S, R) one, "offset" a table starting one element past an aligned
# address (no 16-byte table loads), "f32" float32 tables with low-precision q. Head dim 1024: long rows (many units a
# row in both kernels).
PATH_CASES = [
    (13, 3, 9, 128, 128, False, "hf", "b"),
    (37, 5, 7, 128, 128, True, "hf", "1"),
    (2, 1, 11, 64, 32, False, "contiguous", "offset"),
    (2, 1, 11, 64, 32, True, "contiguous", "f32"),
    (4, 2, 5, 80, 48, False, "hf", "f32"),
    (3, 2, 6, 96, 32, True, "strided", "b"),
    (5, 1, 4, 64, 64, False, "strided", "offset"),
    (1, 1, 3, 256, 64, False, "contiguous", "1"),
    (30, 10, 3, 1024, 1024, False, "hf", "b"),
    (9, 3, 2, 1024, 512, True, "contiguous", "1"),
]


def _path_inputs(Hq, Hk, S, D, layout, dtype, device, B=2):
    def one(H):
        if layout == "hf":
            return torch.randn(B, S, H, D, device=device).to(dtype).transpose(1, 2)
        if layout == "strided":
            return torch.randn(B, H, S, 2 * D, device=device).to(dtype)[..., ::2]
        return torch.randn(B, H, S, D, device=device).to(dtype)

    return one(Hq), one(Hk)


def _path_tables(B, S, R, interleaved, table, dtype, device):
    pos = torch.randint(0, 5000, (B, S), device=device)
    cos, sin = _tables(pos, R, torch.float32 if table == "f32" else dtype, device, interleaved=interleaved)
    if table == "1":
        cos, sin = cos[:1], sin[:1]
    if table == "offset":
        pad = lambda t: torch.cat((torch.zeros_like(t[..., :1]), t), -1)[..., 1:]  # noqa: E731
        cos, sin = pad(cos), pad(sin)
        assert cos.data_ptr() % 16 != 0
    return cos, sin


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_paths(device, dtype, case):
    Hq, Hk, S, D, R, interleaved, layout, table = case
    if table == "f32" and dtype in (torch.float32, torch.float64):
        table = "b"
    q, k = _path_inputs(Hq, Hk, S, D, layout, dtype, device)
    cos, sin = _path_tables(2, S, R, interleaved, table, dtype, device)
    oq, ok = _check(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(oq[..., R:], q[..., R:]) and torch.equal(ok[..., R:], k[..., R:])
    # the positions form on the same layout
    pos = torch.randint(0, 70000, (2, S), device=device)
    pq, pk = opforge.rope_from_positions(q, k, pos, 5e5, interleaved=interleaved, rotary_dim=R)
    rq, rk = rope_from_positions_reference(q, k, pos, 5e5, interleaved=interleaved, rotary_dim=R)
    bq, bk = _baseline(q, k, *_tables(pos, R, dtype, device, 5e5, interleaved=interleaved), interleaved, R)
    if dtype == torch.float64:
        # angles reach 7e4 rad (positions < 70000, base^(−2i/R) ≤ 1): sin and cos of an fp64 angle carry
        # |angle|·eps of rounding from the argument alone, so the fixed float64 bound does not apply
        for o, r, x in ((pq, rq, q), (pk, rk, k)):
            atol = 8 * torch.finfo(torch.float64).eps * float(pos.max()) * float(x.abs().max())
            torch.testing.assert_close(o, r, rtol=0, atol=atol)
    else:
        assert_matches_reference(pq, rq, bq, what="q_out (positions)")
        assert_matches_reference(pk, rk, bk, what="k_out (positions)")
    # its backward is the rotation by −θ (the transpose): the reference at −position, on the same input
    gq, gk = torch.ops.opforge.rope_from_positions_backward(pq, pk, pos, 5e5, interleaved=interleaved, rotary_dim=R)
    rq2, rk2 = rope_from_positions_reference(pq.double(), pk.double(), -pos, 5e5, interleaved=interleaved,
                                             rotary_dim=R)
    tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(dtype, 1e-2)
    torch.testing.assert_close(gq.double(), rq2, rtol=tol, atol=tol * max(1.0, rq2.abs().max().item()))
    torch.testing.assert_close(gk.double(), rk2, rtol=tol, atol=tol * max(1.0, rk2.abs().max().item()))


@pytest.mark.parametrize("kernel", CUDA_KERNELS)
def test_many_tokens_grid_stride(knob, kernel):
    """More work items than one grid (132 SMs · 64 blocks · 256 threads on an H200): the grid-stride loop. rope is
    per token, so a few tokens at each end and in the middle are checked against the reference of those tokens."""
    knob("rope_rows_kernel", KERNEL_KNOB[kernel])
    B, S, Hq, Hk, D = 1, 70000, 32, 8, 128
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    pos = torch.arange(S, device="cuda")
    cos, sin = _tables(pos, D, torch.bfloat16, "cuda")
    oq, ok = opforge.rope(q, k, cos, sin)
    gq, gk = torch.ops.opforge.rope_backward(oq, ok, cos, sin)
    for sl in (slice(0, 5), slice(S // 2 - 3, S // 2 + 3), slice(S - 5, S)):
        rq, rk = rope_reference(q[:, :, sl], k[:, :, sl], cos[sl], sin[sl])
        bq, bk = _baseline(q[:, :, sl], k[:, :, sl], cos[sl], sin[sl])
        assert_matches_reference(oq[:, :, sl], rq, bq, what=f"q_out[{sl}]")
        assert_matches_reference(ok[:, :, sl], rk, bk, what=f"k_out[{sl}]")
        # backward of the forward: back to the input, to bf16 rounding twice
        torch.testing.assert_close(gq[:, :, sl].float(), q[:, :, sl].float(), rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(gk[:, :, sl].float(), k[:, :, sl].float(), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_both_cuda_kernels_agree_with_cpu(knob):
    """The two CUDA kernels and the CPU kernel on the benchmark's layout (HF's transposed q, k; (B, S, D) tables)."""
    B, S, Hq, Hk, D = 2, 64, 8, 2, 128
    q = torch.randn(B, S, Hq, D, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, dtype=torch.bfloat16).transpose(1, 2)
    cos, sin = _tables(torch.arange(S).expand(B, S), D, torch.bfloat16, "cpu")
    cpu = opforge.rope(q, k, cos, sin)
    for value in (0, 1):
        knob("rope_rows_kernel", value)
        out = opforge.rope(q.cuda(), k.cuda(), cos.cuda(), sin.cuda())
        for a, b in zip(out, cpu):
            # one bf16 rounding of the same fp32 math: at most one ulp apart (fma contraction may differ)
            torch.testing.assert_close(a.cpu().float(), b.float(), rtol=8e-3, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,R", [(torch.float32, 6160), (torch.bfloat16, 6400), (torch.float64, 3088)])
def test_rows_kernel_past_the_shared_table(dtype, R):
    """A rotary_dim whose per-token table (2·R opmath values) exceeds 48 KiB of shared memory runs the rows kernel by
    default: values and gradients against float64, the dims past R copied."""
    q = torch.randn(1, 3, 2, R + 16, device="cuda").to(dtype)
    k = torch.randn(1, 1, 2, R + 16, device="cuda").to(dtype)
    cos, sin = _tables(torch.arange(2, device="cuda"), R, dtype, "cuda")
    oq, ok = _check(q, k, cos, sin)
    assert torch.equal(oq[..., R:], q[..., R:]) and torch.equal(ok[..., R:], k[..., R:])
