"""rms_norm, fused_add_rms_norm and rms_norm_backward: op-specific cases against float64 references (fp16 overflow,
hidden sizes, views, dweight accumulation, mixed dtypes, zero rows, big tensors); the common checks of every op are in
test_conformance.py."""
import pytest
import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import (assert_matches_reference, fused_add_rms_norm_reference, relative_error,
                             rms_norm_reference)

LOWP_AND_FP32 = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN_SIZES = [1, 7, 8, 127, 768, 769, 3584, 4095, 4096, 5120, 8200, 12288, 16384]


def _ns(x, k=1):
    return tuple(x.shape[-k:])


def _check(x_leaf, view, ns, w, g, eps=None):
    """Forward and gradients of opforge.rms_norm(view(x_leaf)) against float64 and torch in x's dtype.

    x_leaf: leaf tensor (any dtype); view: function making the op's input from it; w: weight or None;
    g: grad_output of the output's shape (or None: no backward).
    """
    def run(fn, x0, w0, g0):
        x = x0.detach().clone().requires_grad_(g is not None)
        ww = w0.detach().clone().requires_grad_(g is not None) if w0 is not None else None
        y = fn(view(x), ns, ww, eps)
        if g is not None:
            y.backward(g0)
        return y, x.grad, (ww.grad if ww is not None else None)

    ours = run(opforge.rms_norm, x_leaf, w, g)
    ref = run(rms_norm_reference, x_leaf.double(), w.double() if w is not None else None,
              g.double() if g is not None else None)
    base = run(TF.rms_norm, x_leaf, w, g)
    assert_matches_reference(ours[0], ref[0], base[0], what="output")
    if g is not None:
        assert_matches_reference(ours[1], ref[1], base[1], what="grad_input")
        if w is not None:
            assert ours[2].dtype == w.dtype and ours[2].shape == w.shape
            assert_matches_reference(ours[2], ref[2], base[2], what="grad_weight")


def _ident(x):
    return x


# ---- fp16 overflow of Σx² ------------------------------------------------------------------------


def test_fp16_sum_of_squares_overflow(device):
    x = torch.full((2, 4096), 8.0, dtype=torch.float16, device=device, requires_grad=True)
    y = opforge.rms_norm(x, (4096,))
    assert torch.isfinite(y).all() and torch.allclose(y.float(), torch.ones_like(y, dtype=torch.float32), atol=1e-3)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    x2 = (torch.randn(4, 8192, device=device) * 300).half()
    w = torch.randn(8192, device=device, dtype=torch.float16)
    _check(x2, _ident, (8192,), w, torch.randn_like(x2))


# ---- hidden sizes, unaligned base, row independence -----------------------------------------


@pytest.mark.parametrize("dtype", LOWP_AND_FP32)
@pytest.mark.parametrize("N", HIDDEN_SIZES)
def test_hidden_sizes(device, dtype, N):
    M = 3 if device == "cpu" else 37
    x = torch.randn(M, N, device=device, dtype=dtype)
    w = (1 + 0.5 * torch.randn(N, device=device)).to(dtype)
    _check(x, _ident, (N,), w, torch.randn_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [40000, 65536])
def test_long_rows(device, dtype, N):
    """Rows too long to keep in registers on CUDA (the streaming kernels), vector and scalar widths."""
    x = torch.randn(3, N, device=device, dtype=dtype)
    w = torch.randn(N, device=device, dtype=dtype)
    _check(x, _ident, (N,), w, torch.randn_like(x))
    r = torch.randn_like(x)
    out, res = opforge.fused_add_rms_norm(x, r, (N,), w)
    assert torch.equal(res, x + r) and torch.equal(out, opforge.rms_norm(res, (N,), w))


@pytest.mark.parametrize("dtype", LOWP_AND_FP32)
def test_no_weight(device, dtype):
    x = torch.randn(5, 3, 769, device=device, dtype=dtype)
    _check(x, _ident, (769,), None, torch.randn_like(x))


def test_normalized_shape_of_two_dims(device):
    x = torch.randn(4, 6, 33, device=device)
    w = torch.randn(6, 33, device=device)
    _check(x, _ident, (6, 33), w, torch.randn_like(x))


@pytest.mark.parametrize("dtype", LOWP_AND_FP32)
def test_unaligned_base_pointer(device, dtype):
    buf = torch.randn(7 * 769 + 1, device=device, dtype=dtype)
    w = torch.randn(769, device=device, dtype=dtype)
    _check(buf, lambda b: b[1:].view(7, 769), (769,), w, torch.randn(7, 769, device=device, dtype=dtype))
    # fused: unaligned input, aligned residual
    x = buf[1:].view(7, 769)
    r = torch.randn(7, 769, device=device, dtype=dtype)
    out, res = opforge.fused_add_rms_norm(x, r, (769,), w)
    ref_out, ref_res = fused_add_rms_norm_reference(x, r, (769,), w)
    assert_matches_reference(res, ref_res, x + r, what="residual_out")
    assert_matches_reference(out, ref_out, TF.rms_norm(x + r, (769,), w), what="output")


@pytest.mark.parametrize("N", [769, 4096])
def test_rows_independent(device, N):
    x = torch.randn(6, N, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, device=device, dtype=torch.bfloat16)
    y = opforge.rms_norm(x, (N,), w)
    for i in range(5):
        x2 = x.clone()
        x2[i + 1] = torch.randn(N, device=device, dtype=torch.bfloat16) * 100
        y2 = opforge.rms_norm(x2, (N,), w)
        assert torch.equal(y[: i + 1], y2[: i + 1]) and torch.equal(y[i + 2:], y2[i + 2:])


# ---- non-contiguous inputs and grad_outputs -------------------------------------------


def test_permuted_input(device):
    x = torch.randn(4, 4096, 3, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, device=device, dtype=torch.bfloat16)
    _check(x, lambda t: t.permute(0, 2, 1), (4096,), w, torch.randn(4, 3, 4096, device=device, dtype=torch.bfloat16))


def test_strided_rows(device):
    x = torch.randn(16, 4096, device=device)
    w = torch.randn(4096, device=device)
    _check(x, lambda t: t[::2], (4096,), w, torch.randn(8, 4096, device=device))


def test_qkv_split_view(device):
    M = 1024 if device == "cuda" else 64
    qkv = torch.randn(M, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(128, device=device, dtype=torch.bfloat16)
    view = lambda t: t.split([2048, 1024, 1024], -1)[0].view(M, 16, 128)  # noqa: E731
    assert not view(qkv).is_contiguous()
    _check(qkv, view, (128,), w, torch.randn(M, 16, 128, device=device, dtype=torch.bfloat16))


def test_expanded_grad_output(device):
    x = torch.randn(8, 4096, device=device, requires_grad=True)
    w = torch.randn(4096, device=device, requires_grad=True)
    opforge.rms_norm(x, (4096,), w).sum().backward()  # grad_output: ones expanded, stride (0, 0)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    rms_norm_reference(x64, (4096,), w64).sum().backward()
    xt = x.detach().clone().requires_grad_()
    wt = w.detach().clone().requires_grad_()
    TF.rms_norm(xt, (4096,), wt).sum().backward()
    assert_matches_reference(x.grad, x64.grad, xt.grad, what="grad_input")
    assert_matches_reference(w.grad, w64.grad, wt.grad, what="grad_weight")


def test_transposed_grad_output(device):
    x = torch.randn(64, 769, device=device, dtype=torch.float16)
    w = torch.randn(769, device=device, dtype=torch.float16)
    g = torch.randn(769, 64, device=device, dtype=torch.float16).t()
    assert not g.is_contiguous()
    _check(x, _ident, (769,), w, g)


def test_grad_output_not_modified_and_weight_grad(device):
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(8, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
    g_res = torch.randn(8, 256, device=device, dtype=torch.bfloat16)
    g0, g_res0 = g.clone(), g_res.clone()
    out, res = opforge.fused_add_rms_norm(x, r, 256, w)
    torch.autograd.backward([out, res], [g, g_res])
    assert torch.equal(g, g0) and torch.equal(g_res, g_res0)
    assert w.grad.shape == (256,) and w.grad.dtype == torch.bfloat16
    # reference: z = x + r; out = rms(z); both inputs get d(out)/dz + g_res
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    o64, z64 = fused_add_rms_norm_reference(x64, r64, 256, w64, eps=torch.finfo(torch.float32).eps)
    torch.autograd.backward([o64, z64], [g.double(), g_res.double()])
    xt, rt, wt = (t.detach().clone().requires_grad_() for t in (x, r, w))
    zt = xt + rt
    torch.autograd.backward([TF.rms_norm(zt, (256,), wt), zt], [g, g_res])
    assert_matches_reference(x.grad, x64.grad, xt.grad, what="grad_input")
    assert_matches_reference(r.grad, r64.grad, rt.grad, what="grad_residual")
    assert_matches_reference(w.grad, w64.grad, wt.grad, what="grad_weight")


# ---- fused_add_rms_norm forward --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOWP_AND_FP32)
@pytest.mark.parametrize("N", [7, 769, 4096])
def test_fused_add_rms_norm(device, dtype, N):
    x = torch.randn(5, N, device=device, dtype=dtype)
    r = torch.randn(5, N, device=device, dtype=dtype)
    w = torch.randn(N, device=device, dtype=dtype)
    out, res = opforge.fused_add_rms_norm(x, r, (N,), w)
    assert torch.equal(res, x + r)  # one rounding of the fp32 sum, like torch's add
    assert torch.equal(out, opforge.rms_norm(res, (N,), w))  # the norm of the stored residual_out
    ref_out, ref_res = fused_add_rms_norm_reference(x, r, (N,), w)
    assert_matches_reference(out, ref_out, TF.rms_norm(x + r, (N,), w))


def test_fused_grad_only_residual_out(device):
    x = torch.randn(4, 64, device=device, requires_grad=True)
    r = torch.randn(4, 64, device=device, requires_grad=True)
    _, res = opforge.fused_add_rms_norm(x, r, 64)
    res.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))


@pytest.mark.parametrize("private", [False, True])
@pytest.mark.parametrize("needs", ["w", "x", "r", "xr", "xw", "rw", "xrw"])
def test_fused_residual_out_requires_grad_as_torch_add(device, needs, private):
    """residual_out = input + residual requires grad exactly when torch's input + residual does (not when only the
    weight does); output whenever any input does; every gradient asked for matches float64 (`needs`: the inputs of
    x, r, w that require grad; `private`: the private forward op, which also returns rstd)."""
    torch.manual_seed(0)
    x, r, w = (torch.randn(*s, device=device).requires_grad_(n in needs)
               for s, n in (((4, 64), "x"), ((4, 64), "r"), ((64,), "w")))
    if private:
        out, res, _ = torch.ops.opforge._fused_add_rms_norm_forward(x, r, [64], w, 1e-6)
    else:
        out, res = opforge.fused_add_rms_norm(x, r, (64,), w, 1e-6)
    assert out.requires_grad
    assert res.requires_grad == (x + r).requires_grad == ("x" in needs or "r" in needs)
    g, g_res = torch.randn_like(out), torch.randn_like(res)

    def grads(x0, r0, w0, fn):
        leaves = [t for t in (x0, r0, w0) if t.requires_grad]
        o, z = fn(x0, r0, w0)
        outs, gs = ([o, z], [g, g_res]) if z.requires_grad else ([o], [g])
        return torch.autograd.grad(outs, leaves, [t.to(o.dtype) for t in gs])

    actual = grads(x, r, w, lambda *_: (out, res))
    ref = grads(*(t.detach().double().requires_grad_(t.requires_grad) for t in (x, r, w)),
                lambda a, b, c: fused_add_rms_norm_reference(a, b, 64, c, eps=1e-6))
    base = grads(*(t.detach().clone().requires_grad_(t.requires_grad) for t in (x, r, w)),
                 lambda a, b, c: (TF.rms_norm(a + b, (64,), c, 1e-6), a + b))
    names = [n for t, n in zip((x, r, w), ("grad_input", "grad_residual", "grad_weight")) if t.requires_grad]
    for a, e, b, name in zip(actual, ref, base, names, strict=True):
        assert_matches_reference(a, e, b, what=name)


# ---- dweight accumulation --------------------------------------------------------------------


def _dweight_error(device, M, wdtype):
    x = torch.randn(M, 4096, device=device, dtype=torch.bfloat16)
    g = torch.randn(M, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, device=device, dtype=wdtype, requires_grad=True)
    opforge.rms_norm(x, 4096, w).backward(g)
    w64 = w.detach().double().requires_grad_()
    rms_norm_reference(x, 4096, w64).backward(g.double())
    assert w.grad.dtype == wdtype
    return relative_error(w.grad, w64.grad)


def test_dweight_error_does_not_grow_with_rows(device):
    small, large = (128, 8192) if device == "cpu" else (128, 65536)
    e_small, e_large = _dweight_error(device, small, torch.bfloat16), _dweight_error(device, large, torch.bfloat16)
    assert e_small < 1e-2 and e_large < 1e-2
    assert e_large <= 2 * e_small + 1e-4, (e_small, e_large)
    # fp32 weight with bf16 input: dweight is fp32, accumulated in fp32 (no bf16 rounding at all)
    assert _dweight_error(device, large, torch.float32) < 1e-4


# ---- mixed dtypes ------------------------------------------------------------------------------


@pytest.mark.parametrize("xdtype,wdtype", [(torch.float16, torch.float32), (torch.float32, torch.float16),
                                           (torch.bfloat16, torch.float32)])
def test_mixed_dtypes(device, xdtype, wdtype):
    x = torch.randn(6, 384, device=device, dtype=xdtype, requires_grad=True)
    w = torch.randn(384, device=device, dtype=wdtype, requires_grad=True)
    y = opforge.rms_norm(x, (384,), w)
    # policy: output in input's dtype, weight converted to input's dtype on entry
    assert y.dtype == xdtype
    assert torch.equal(y, opforge.rms_norm(x.detach(), (384,), w.detach().to(xdtype)))
    y.backward(torch.randn_like(y))
    assert x.grad.dtype == xdtype and w.grad.dtype == wdtype
    # Meta: same shapes and dtypes
    xm, wm = x.detach().to("meta"), w.detach().to("meta")
    ym, rstd = torch.ops.opforge._rms_norm_forward(xm, [384], wm, None)
    assert ym.dtype == y.dtype and ym.shape == y.shape and rstd.dtype == torch.float32 and rstd.shape == (6,)
    gx, gw = torch.ops.opforge.rms_norm_backward(ym, xm, rstd, wm, [True, True])
    assert gx.dtype == xdtype and gw.dtype == wdtype and gw.shape == (384,)
    o, res = torch.ops.opforge.fused_add_rms_norm(xm, wm.expand(6, 384).to(torch.float64), [384], wm)
    assert o.dtype == xdtype and res.dtype == xdtype


# ---- zero rows ---------------------------------------------------------------------------------


def test_zero_rows(device):
    x = torch.randn(0, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device=device, dtype=torch.bfloat16, requires_grad=True)
    y = opforge.rms_norm(x, (4096,), w)
    assert y.shape == (0, 4096)
    y.sum().backward()
    assert x.grad.shape == (0, 4096)
    assert torch.equal(w.grad, torch.zeros_like(w))
    r = torch.randn(2, 0, 4096, device=device, requires_grad=True)
    out, res = opforge.fused_add_rms_norm(r, r.detach(), 4096)
    assert out.shape == res.shape == (2, 0, 4096)
    if device == "cuda":
        torch.cuda.synchronize()


# ---- past 2^31 elements (H200) ----------------------------------------------------------------


def _enough_cuda_memory(nbytes):
    if not torch.cuda.is_available():
        return False
    free, _ = torch.cuda.mem_get_info()
    return free > nbytes


@pytest.mark.skipif(not _enough_cuda_memory(20 * 2**30), reason="needs a CUDA GPU with 20 GiB free")
def test_more_than_2_31_elements():
    M, N = 524289, 4096
    x = torch.randn(M, N, device="cuda", dtype=torch.float16)
    w = torch.randn(N, device="cuda", dtype=torch.float16)
    y = opforge.rms_norm(x, (N,), w)
    tail = opforge.rms_norm(x[-3:].clone(), (N,), w)
    assert torch.equal(y[-3:], tail)
    x.requires_grad_()
    y = opforge.rms_norm(x, (N,), w)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    xt = x[-3:].detach().clone().requires_grad_()
    (gt,) = torch.autograd.grad(opforge.rms_norm(xt, (N,), w), xt, g[-3:])
    assert torch.equal(gx[-3:], gt)


# ---- nn modules -------------------------------------------------------------------------------------


def test_rmsnorm_module_is_drop_in(device):
    ref = torch.nn.RMSNorm(64, eps=1e-6, device=device)
    torch.nn.init.normal_(ref.weight)
    ours = opforge.nn.RMSNorm(64, eps=1e-6, device=device)
    assert isinstance(ours, torch.nn.RMSNorm)
    ours.load_state_dict(ref.state_dict())
    assert ours.state_dict().keys() == ref.state_dict().keys()
    x = torch.randn(3, 64, device=device)
    torch.testing.assert_close(ours(x), ref(x))
    fused = opforge.nn.FusedAddRMSNorm(64, eps=1e-6, device=device)
    fused.load_state_dict(ref.state_dict())
    r = torch.randn(3, 64, device=device)
    out, res = fused(x, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, ref(x + r))
    assert opforge.nn.RMSNorm(8, elementwise_affine=False).weight is None


# ---- bad inputs (the table: conformance.py), here Meta's eps check ------------------------------------
# Also: gradcheck, gradgradcheck, opcheck, torch.compile, Meta, bad inputs, compiled autograd, torch.func and autocast of
# every op: test_conformance.py (the table: conformance.py).

@pytest.mark.parametrize("eps", [-1.0, float("nan")])
def test_meta_rejects_bad_eps_like_the_real_kernels(eps):
    for dev in ("cpu", "meta"):
        with pytest.raises(ValueError, match="opforge::rms_norm: expected eps >= 0"):
            opforge.rms_norm(torch.empty(2, 4, device=dev), (4,), None, eps)
        with pytest.raises(ValueError, match="opforge::fused_add_rms_norm: expected eps >= 0"):
            opforge.fused_add_rms_norm(torch.empty(2, 4, device=dev), torch.empty(2, 4, device=dev), (4,), None, eps)


# ---- every CUDA kernel variant a chooser picks (test hooks rms_norm_forward / rms_norm_backward), against float64 --

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
VARIANT_SIZES = [1, 7, 83, 769, 3584, 5120, 8200, 16384]
FWD_VARIANTS = [0, 1, 2, 3, 4]
BWD_VARIANTS = [0, 1, 2]


@CUDA_ONLY
@pytest.mark.parametrize("variant", FWD_VARIANTS)
@pytest.mark.parametrize("dtype", LOWP_AND_FP32)
@pytest.mark.parametrize("N", VARIANT_SIZES)
def test_forward_variants(knob, variant, dtype, N):
    """Forward and fused forward of each variant: vector widths (N % 8 == 0) and the scalar fallback, warp- and
    block-per-row mappings, enough rows for several waves of blocks."""
    knob("rms_norm_forward", variant)
    M = 300 if N <= 8200 else 40
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.5 * torch.randn(N, device="cuda")).to(dtype)
    _check(x, _ident, (N,), w, None)
    r = torch.randn_like(x)
    out, res = opforge.fused_add_rms_norm(x, r, (N,), w)
    assert torch.equal(res, x + r)
    ref_out, _ = fused_add_rms_norm_reference(x.double(), r.double(), (N,), w.double())
    assert_matches_reference(out, ref_out, TF.rms_norm(x + r, (N,), w), what="fused output")
    # the rstd the forward saves (used by the backward) is the reference's 1 / rms
    y, rstd = torch.ops.opforge._rms_norm_forward(x, [N], w, 1e-6)
    ref_rstd = (x.double().pow(2).mean(-1) + 1e-6).rsqrt()
    assert torch.allclose(rstd.double(), ref_rstd, rtol=1e-4, atol=0)


@CUDA_ONLY
@pytest.mark.parametrize("variant", FWD_VARIANTS)
def test_forward_variants_views_and_no_weight(knob, variant):
    """Strided rows, an unaligned base pointer (scalar path) and no weight, per forward variant."""
    knob("rms_norm_forward", variant)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    _check(x, lambda t: t[::2], (4096,), torch.randn(4096, device="cuda", dtype=torch.bfloat16), None)
    flat = torch.randn(33 * 4096 + 1, device="cuda", dtype=torch.bfloat16)
    _check(flat, lambda t: t[1:].view(33, 4096), (4096,), torch.randn(4096, device="cuda", dtype=torch.bfloat16), None)
    _check(torch.randn(9, 769, device="cuda", dtype=torch.float16), _ident, (769,), None, None)
    _check(torch.randn(9, 8192, device="cuda"), _ident, (8192,), None, None)


@CUDA_ONLY
@pytest.mark.parametrize("variant", BWD_VARIANTS)
@pytest.mark.parametrize("dtype", LOWP_AND_FP32)
@pytest.mark.parametrize("N", VARIANT_SIZES)
def test_backward_variants(knob, variant, dtype, N):
    """grad_input and grad_weight of each backward variant; M large enough that each block of the
    grid-stride grid visits several rows (the dweight partial accumulates over them)."""
    knob("rms_norm_backward", variant)
    M = 1500 if N <= 1024 else (400 if N <= 8200 else 200)
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    w = (1 + 0.5 * torch.randn(N, device="cuda")).to(dtype)
    _check(x, _ident, (N,), w, torch.randn_like(x))


@CUDA_ONLY
@pytest.mark.parametrize("variant", BWD_VARIANTS)
@pytest.mark.parametrize("dtype,N", [(torch.bfloat16, 32768), (torch.float32, 16384), (torch.float32, 12288)])
def test_backward_variants_long_rows(knob, variant, dtype, N):
    """The rows the backward variants are for (4 vectors a thread, 64 KiB of dweight partial in shared memory)."""
    knob("rms_norm_backward", variant)
    x = torch.randn(300, N, device="cuda", dtype=dtype)
    w = (1 + 0.5 * torch.randn(N, device="cuda")).to(dtype)
    _check(x, _ident, (N,), w, torch.randn_like(x))


@CUDA_ONLY
@pytest.mark.parametrize("variant", BWD_VARIANTS)
def test_backward_variants_views_masks_and_no_weight(knob, variant):
    """Strided rows, unaligned base (scalar path), no weight, and grad of x or of the weight alone."""
    knob("rms_norm_backward", variant)
    x = torch.randn(600, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    _check(x, lambda t: t[::2], (4096,), torch.randn(4096, device="cuda", dtype=torch.bfloat16), g)
    flat = torch.randn(333 * 769 + 1, device="cuda")
    _check(flat, lambda t: t[1:].view(333, 769), (769,), torch.randn(769, device="cuda"), torch.randn(333, 769, device="cuda"))
    _check(torch.randn(500, 16384, device="cuda", dtype=torch.bfloat16), _ident, (16384,), None,
           torch.randn(500, 16384, device="cuda", dtype=torch.bfloat16))
    xs = torch.randn(700, 5120, device="cuda", dtype=torch.float16)
    ws = torch.randn(5120, device="cuda", dtype=torch.float16)
    gs = torch.randn_like(xs)
    y, rstd = torch.ops.opforge._rms_norm_forward(xs, [5120], ws, None)
    gx_full, gw_full = torch.ops.opforge.rms_norm_backward(gs, xs, rstd, ws, [True, True])
    gx_only, none_w = torch.ops.opforge.rms_norm_backward(gs, xs, rstd, ws, [True, False])
    none_x, gw_only = torch.ops.opforge.rms_norm_backward(gs, xs, rstd, ws, [False, True])
    assert none_w is None and none_x is None
    assert torch.equal(gx_only, gx_full) and torch.equal(gw_only, gw_full)


@CUDA_ONLY
@pytest.mark.parametrize("variant", [1, 2])
def test_backward_variant_is_deterministic(knob, variant):
    knob("rms_norm_backward", variant)
    x = torch.randn(3000, 8192, device="cuda", dtype=torch.float32)
    w = torch.randn(8192, device="cuda")
    g = torch.randn_like(x)
    y, rstd = torch.ops.opforge._rms_norm_forward(x, [8192], w, None)
    a = torch.ops.opforge.rms_norm_backward(g, x, rstd, w, [True, True])
    b = torch.ops.opforge.rms_norm_backward(g, x, rstd, w, [True, True])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.skipif(not _enough_cuda_memory(12 * 2**30), reason="needs a CUDA GPU with 12 GiB free")
@pytest.mark.parametrize("variant", [1, 2])
def test_forward_variant_past_2_31_elements(knob, variant):
    """64-bit offsets of the one-CTA-per-row kernels where M · N >= 2^31."""
    knob("rms_norm_forward", variant)
    M, N = 524289, 4096
    x = torch.randn(M, N, device="cuda", dtype=torch.float16)
    w = torch.randn(N, device="cuda", dtype=torch.float16)
    y = opforge.rms_norm(x, (N,), w)
    tail = opforge.rms_norm(x[-3:].clone(), (N,), w)  # the same variant with 32-bit offsets
    assert torch.equal(y[-3:], tail)
