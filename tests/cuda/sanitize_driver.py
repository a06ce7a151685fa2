"""Drives every opforge CUDA kernel, forward and backward, under compute-sanitizer (scripts/sanitize.sh).

Each case is one op family in one dtype with either contiguous inputs or inputs whose base pointer is one element
past an allocation's start (unaligned for 16-byte vector loads), so that the vectorized and the scalar paths of each
kernel both run. Every input and gradient is made on the host and copied to the device (a cudaMemcpy, which
initcheck tracks; initcheck runs without the kernel filter, so the writes of torch's and cuBLAS's kernels, e.g. a
GEMM output that an activation pass reads, are tracked too: scripts/sanitize.sh). Each family also runs its
kernel paths through the test hooks of core/knobs.h, so that every kernel is launched. Values are not checked here
(the test suite does that); the sanitizer's verdict is the result.

Each case prints ``case <id>: begin`` before and ``case <id>: ok`` after it (flushed), so a log cut short by a
sanitizer failure names the case it died in, and ``--start-after <id>`` resumes after it. ``--coverage`` runs the
same cases without a sanitizer under torch.profiler and checks that every ``__global__`` kernel of csrc/ was launched
under a name containing "opforge" (the sanitizer's kernel-name filter), printing ``coverage: K kernels, M launches``.

``--only <id>[,<id>|<prefix/>...]`` runs those cases (to localize a failure, e.g. with CUDA_LAUNCH_BLOCKING=1).
``--vendor-safe``: see VENDOR_SAFE.

Usage: python tests/cuda/sanitize_driver.py [--quick] [--vendor-safe] [--tool T] [--coverage] [--start-after ID]
       [--only IDS] [--list]
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

import torch

import opforge
from opforge import _fp8_cache

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ROOT = Path(__file__).resolve().parents[2]
FILTER = "opforge"  # scripts/sanitize.sh: --kernel-name kns=opforge
# --vendor-safe (scripts/sanitize.sh sets it for racecheck): the float32 / float64 cases launch no 16-bit vendor GEMM
# of their own (the bfloat16 GEMV kernel of linear's float32 cases runs forward only: its backward is cuBLAS;
# indexed_linear's extra bfloat16 _grouped_mm call is left to the bfloat16 cases). Racecheck's process dies inside
# 16-bit aligned cuBLAS / CUTLASS GEMMs on the H200 (the control cases show it with torch's own ops), which would
# otherwise take the float32 cases' opforge kernels down with it. The same opforge kernels are launched (the coverage
# pass runs in the same mode).
VENDOR_SAFE = False
LOW = (torch.float16, torch.bfloat16)
# families whose 16-bit cases run vendor GEMMs on aligned operands of their own making (skipped in vendor-safe mode
# when the case's inputs are aligned too; their unaligned cases run, and the float32 ones)
VENDOR_GEMM_FAMILIES = {"control_torch", "linear", "linear_cross_entropy", "linear_cat", "indexed_linear",
                        "fake_quant_linear", "grouped_mm_epilogue", "gemm_sm90", "post_training"}
# families that vendor-safe mode leaves out altogether (racecheck dies in their vendor GEMM unaligned too)
VENDOR_SAFE_SKIP = {"grouped_mm_epilogue"}
# families run in some dtypes only
FAMILY_DTYPES = {"grouped_mm_epilogue": (torch.bfloat16,)}
# kernels that vendor-safe mode cannot launch: {name: why}
VENDOR_SAFE_EXEMPT = {
    "scatter_rows_kernel": "runs only on torch._grouped_mm's output (CUTLASS, bfloat16), in which racecheck dies; "
                           "it uses no shared memory, so racecheck has nothing to check in it"}


def make(shape, dtype, unaligned, requires_grad=True, scale=1.0):
    """A random CUDA tensor of `shape`, made on the host and copied over; unaligned: a view starting one element
    into its storage."""
    n = 1
    for s in shape:
        n *= s
    buf = (torch.randn(n + 1, dtype=torch.float32) * scale).to(dtype).to("cuda")
    t = (buf[1:] if unaligned else buf[:n]).view(shape).detach()
    return t.requires_grad_(requires_grad)


@contextlib.contextmanager
def knobs(**values):
    """Sets opforge's run-time knobs (core/knobs.h: test hooks such as linear_gemv=1, user-facing modes such as
    OPFORGE_LCE_GRAD_IN_FORWARD=0) through _set_knob for the block, restoring the previous values after; a knob set
    to None is left as it is."""
    saved = []
    try:
        for name, value in values.items():
            if value is not None:
                saved.append((name, torch.ops.opforge._set_knob(name, int(value))))
        yield
    finally:
        for name, old in reversed(saved):
            torch.ops.opforge._set_knob(name, old)


# the test hook indexed_linear_path's values (core/knobs.h)
INDEXED_LINEAR_PATH = {None: 0, "gemv": 1, "grouped": 2, "grouped_mm": 3}


def host_randint(lo, hi, shape):
    return torch.randint(lo, hi, shape).to("cuda")


def backward(outs):
    """Backward of every output that requires grad, with host-made random gradients."""
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o is not None and o.requires_grad]
    if not outs:
        return
    grads = [torch.randn(o.shape, dtype=torch.float32).to(o.dtype).to("cuda") for o in outs]
    # in this thread (no autograd device thread): the sanitizer then sees one host thread, with its CUDA context
    # current, for forward and backward alike (racecheck died in an autograd thread's first cuBLAS call on the H200)
    with torch.autograd.set_multithreading_enabled(False):
        torch.autograd.backward(outs, grads)


def families(quick: bool):
    """(family, callable(dtype, unaligned)) for every op family with CUDA kernels; quick: fewer shapes and
    activations, every kernel (and each kernel's shared-memory path) still launched. Each family also forces its
    kernel paths (the test hooks of core/knobs.h) on small shapes, so kernels that a chooser picks only for large
    shapes are launched (and sanitized) too."""
    ops = torch.ops.opforge

    def control_torch(dt, u):
        # torch's own ops only, the same calls the opforge families make (F.linear + GELU, small-M GEMMs, a gradient
        # accumulated over two uses of one input; for bfloat16 also torch._grouped_mm and a torch kernel reading its
        # output, as indexed_linear's scatter_rows_kernel does): what a sanitizer reports here is not opforge's
        # (cuBLAS's, CUTLASS's or torch's kernels, or the sanitizer itself); scripts/sanitize.sh reports these cases
        # apart. Each case uses GEMMs of its own dtype only, so a crash names the dtype and alignment it needs.
        for m, k, n in ((1, 64, 24), (7, 33, 5), (3, 2048, 40)):
            x, w, b = make((m, k), dt, u), make((n, k), dt, u), make((n,), dt, u)
            backward(torch.nn.functional.linear(x, w, b))  # x.grad, w.grad, b.grad then accumulated
            backward(torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b)))
        x = make((5, 769), dt, u)
        backward([torch.sigmoid(x), x * x])
        if dt == torch.bfloat16 and not u and hasattr(torch, "_grouped_mm") \
                and torch.cuda.get_device_capability()[0] == 9:
            xs, ws = make((40, 32), dt, False, False), make((4, 24, 32), dt, False, False).transpose(1, 2)
            offs = torch.tensor([10, 20, 30, 40], dtype=torch.int32).to("cuda")
            ys = torch._grouped_mm(xs, ws, offs)  # [40, 24] (ws as indexed_linear passes it), CUTLASS on sm_90
            (ys + 1).sum().item()                 # a torch kernel reading it (what initcheck says of that read)

    def linear(dt, u):
        shapes = ((1, 64, 24), (7, 33, 5)) if quick else ((1, 64, 24), (7, 33, 5), (70, 256, 96))
        acts = ("none", "gelu") if quick else opforge.functional.LINEAR_ACTIVATIONS
        for m, k, n in shapes:
            x, w, b = make((m, k), dt, u), make((n, k), dt, u), make((n,), dt, u)
            for act in acts:
                backward(opforge.linear(x, w, b, activation=act))
        with knobs(linear_lt=0):  # cublasGemmEx plus separate bias / activation passes
            x, w, b = make((7, 33), dt, u), make((5, 33), dt, u), make((5,), dt, u)
            backward(opforge.linear(x, w, b, activation="gelu"))
        # the GEMV kernel (linear_gemv.cuh) at every M <= 16: 16-bit (float32 cases run it in bfloat16), K a multiple
        # of 8; aligned cases launch it, unaligned ones the cuBLAS fallback
        gdt = dt if dt in (torch.float16, torch.bfloat16) else torch.bfloat16
        with knobs(linear_gemv=1):
            for m, k, n in ((1, 64, 24), (3, 2048, 40)):
                x, w, b = make((m, k), gdt, u), make((n, k), gdt, u), make((n,), gdt, u)
                for act in ("none", "gelu"):
                    if VENDOR_SAFE and gdt != dt:
                        with torch.no_grad():
                            opforge.linear(x, w, b, activation=act)
                    else:
                        backward(opforge.linear(x, w, b, activation=act))
        if dt == torch.float32:  # the float32 GEMV too
            with knobs(linear_gemv=1):
                x, w, b = make((2, 64), dt, u), make((24, 64), dt, u), make((24,), dt, u)
                backward(opforge.linear(x, w, b, activation="gelu"))

    def elementwise(dt, u):
        for shape in (((7,), (5, 769)) if quick else ((7,), (3, 83), (5, 769))):
            x = make(shape, dt, u)
            backward(opforge.sigmoid(x))
            backward(opforge.square(x))
            o = make(shape[-1:], dt, u)
            backward(opforge.square_add(x, o))
            g, up = make(shape, dt, u), make(shape, dt, u)
            backward(opforge.swiglu(g, up))
            # gate/up as column views of one fused [gate | up] projection (row stride 2·I): the *_rows kernels
            gu = make(shape[:-1] + (2 * shape[-1],), dt, u)
            backward(opforge.swiglu(gu[..., : shape[-1]], gu[..., shape[-1]:]))
            # the same packed: swiglu_packed's backward writes both halves of grad(gu) through output row strides;
            # I = 64 too, for the vector path (aligned cases)
            backward(opforge.swiglu_packed(gu))
            backward(opforge.swiglu_packed(make(shape[:-1] + (128,), dt, u)))
            # geglu: the same kernel templates with gelu (both forms), contiguous, views and packed
            backward(opforge.geglu(g, up))
            backward(opforge.geglu(gu[..., : shape[-1]], gu[..., shape[-1]:], "tanh"))
            backward(opforge.geglu_packed(gu, "tanh"))
            backward(opforge.geglu_packed(make(shape[:-1] + (128,), dt, u)))

    def rms_norm(dt, u):
        for rows, n in ((3, 7), (5, 1000), (2, 5120), (1, 8200)):
            x, w, r = make((rows, n), dt, u), make((n,), dt, u), make((rows, n), dt, u)
            backward(opforge.rms_norm(x, [n], w))
            backward(opforge.fused_add_rms_norm(x, r, [n], w))
            # _rms_norm_apply (the patch's norm recompute) from the fused forward's rstd
            with torch.no_grad():
                _, z, rstd = torch.ops.opforge._fused_add_rms_norm_forward(x, r, [n], w)
                torch.ops.opforge._rms_norm_apply(z, rstd, w)
        # the forced forward (0 grid-stride, 1..4 one CTA per row) and backward (0, 1, 2) kernels
        for name, variants in (("rms_norm_forward", range(5)), ("rms_norm_backward", range(3))):
            for v in variants:
                with knobs(**{name: v}):
                    for rows, n in ((3, 7), (5, 1000)):
                        x, w, r = make((rows, n), dt, u), make((n,), dt, u), make((rows, n), dt, u)
                        backward(opforge.rms_norm(x, [n], w))
                        backward(opforge.fused_add_rms_norm(x, r, [n], w))

    out = [("control_torch", control_torch), ("linear", linear), ("elementwise", elementwise), ("rms_norm", rms_norm)]

    if hasattr(ops, "linear_cross_entropy"):
        def linear_cross_entropy(dt, u):
            for bt, h, v in ((7, 32, 50), (64, 64, 1000)):
                x, w, b = make((bt, h), dt, u), make((v, h), dt, u), make((v,), dt, u)
                t = host_randint(0, v, (bt,))
                t[::3] = -100
                backward(opforge.linear_cross_entropy(x, w, t, linear_bias=b))
                if dt in LOW:  # lean mode: the 16-bit logits chunk (row kernels on 16-bit logits, in place)
                    with knobs(OPFORGE_LCE_LEAN=1):
                        backward(opforge.linear_cross_entropy(x, w, t, linear_bias=b))
                        backward(opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none"))
            # the separate backward (lce_backward_rows): reduction "none", and "mean" with the gradients not
            # computed in the forward (OPFORGE_LCE_GRAD_IN_FORWARD=0); smoothing, z-loss and softcap once
            x, w, b = make((7, 32), dt, u), make((50, 32), dt, u), make((50,), dt, u)
            t = host_randint(0, 50, (7,))
            t[::3] = -100
            backward(opforge.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none"))
            with knobs(OPFORGE_LCE_GRAD_IN_FORWARD=0):
                backward(opforge.linear_cross_entropy(x, w, t, linear_bias=b))
                backward(opforge.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, z_loss=1e-4,
                                                      softcap=30.0))
        out.append(("linear_cross_entropy", linear_cross_entropy))
    if hasattr(ops, "linear_log_probs"):
        def post_training(dt, u):
            # linear_log_probs (lce_forward_rows / lce_backward_rows with the log-probability row function, entropy
            # too) and linear_jsd's jsd_rows (student and teacher chunks, both ends of beta and the middle)
            x, w, b = make((7, 32), dt, u), make((50, 32), dt, u), make((50,), dt, u)
            t = host_randint(0, 50, (7,))
            t[::3] = -100
            backward(opforge.linear_log_probs(x, w, t, b, return_entropy=True))
            backward(opforge.linear_log_probs(x, w, t, temperature=0.7))
            xt, wt = make((7, 32), dt, u, requires_grad=False), make((50, 32), dt, u, requires_grad=False)
            for beta in (0.0, 0.5, 1.0):
                backward(opforge.linear_jsd(x, w, xt, wt, t, linear_bias=b, beta=beta, temperature=2.0))
            if dt in LOW:  # lean mode, V a multiple of 8 (the 16-byte row access) and not
                for v in (50, 104):
                    w, b = make((v, 32), dt, u), make((v,), dt, u)
                    wt = make((v, 32), dt, u, requires_grad=False)
                    t = host_randint(0, v, (7,))
                    with knobs(OPFORGE_LCE_LEAN=1):
                        backward(opforge.linear_log_probs(x, w, t, b, return_entropy=True))
                        backward(opforge.linear_jsd(x, w, xt, wt, t, linear_bias=b, beta=0.5))
        out.append(("post_training", post_training))
    if hasattr(ops, "quantize_fp8"):
        def fp8(dt, u):
            # the amax reductions and the casts of quantize_fp8 (tensorwise, rowwise; e4m3, e5m2) on ragged sizes;
            # fp8_linear forward and backward (its GEMMs are torch._scaled_mm, sm_89+, 16-byte multiples) except in
            # vendor-safe mode: racecheck dies inside cuBLAS's FP8 GEMMs for every input dtype and alignment, and
            # quantize_fp8 with the GEMM-free backward calls below launches every fp8 kernel of opforge
            for shape in ((7,), (5, 769), (3, 64)):
                x = make(shape, dt, u, requires_grad=False)
                for fdt in (torch.float8_e4m3fn, torch.float8_e5m2):
                    opforge.quantize_fp8(x, fdt)
                    opforge.quantize_fp8(x, fdt, granularity="rowwise")
            # fp8_linear_backward's transposed quantizers (quantize_cols, quantize_both) with no GEMM, in every mode:
            # with K = 0 or N = 0 the scaled GEMMs are empty and skipped, while dY (K = 0; both ways tensorwise, per
            # column rowwise) or xᵀ (N = 0) is quantized
            for g in ("tensorwise", "rowwise"):
                for k, n in ((0, 72), (72, 0)):
                    gy, x, w = (make(s, dt, u, requires_grad=False) for s in ((33, n), (33, k), (n, k)))
                    torch.ops.opforge.fp8_linear_backward(gy, x, w, [True, True, False], g, None, None)
            # the producers that write their output's amax (the patch's norms and SwiGLU, every rms_norm forward
            # variant's amax instantiation through its test hook), on ragged rows and a row-strided packed input
            if hasattr(ops, "_swiglu_packed_amax"):
                nw = make((72,), dt, u, requires_grad=False)
                for variant in range(5):
                    with knobs(rms_norm_forward=variant):
                        for rows in (1, 33):
                            x, r = (make((rows, 72), dt, u, requires_grad=False) for _ in range(2))
                            ops._rms_norm_forward_amax(x, [72], nw, 1e-6)
                            ops._fused_add_rms_norm_forward_amax(x, r, [72], nw, 1e-6)
                for shape in ((33, 2 * 37), (5, 2 * 64)):
                    ops._swiglu_packed_amax(make(shape, dt, u, requires_grad=False))
                ops._swiglu_packed_amax(make((9, 3 * 64), dt, u, requires_grad=False)[:, : 2 * 64])
            if torch.cuda.get_device_capability() >= (8, 9) and not VENDOR_SAFE:
                # the cast kernels reading a given amax (input_amax: no amax pass), forward and the saved input's
                # backward quantization
                x, w = make((33, 72), dt, u), make((40, 72), dt, u)
                ops_w = _fp8_cache.quantize(w, "tensorwise")
                amax = x.detach().abs().amax().reshape(1).to(torch.float64 if dt == torch.float64 else torch.float32)
                backward(torch.ops.opforge._fp8_linear_quantized(x, w, *ops_w, None, granularity="tensorwise",
                                                                 save_input=True, input_amax=amax))
                x, w, b = make((32, 64), dt, u), make((48, 64), dt, u), make((48,), dt, u)
                for g in ("tensorwise", "rowwise"):
                    backward(opforge.fp8_linear(x, w, b, granularity=g))
                # the tensorwise GEMMs through opforge's cuBLASLt engine (gemm_fp8), with and without fast accumulation
                for fast in (0, 2):
                    with knobs(fp8_gemm=2, OPFORGE_FP8_FAST_ACCUM=fast):
                        backward(opforge.fp8_linear(x, w, b))
                # the layers' cached operands, tensorwise: q(Wᵀ) as the view q(W).t(), made row-major by the FP8
                # transpose kernel (ragged 64 x 64 tiles)
                # (and the 4 x 4 block kernel where both sides are multiples of 16)
                for x_shape, w_shape in (((32, 70), (130, 70)), ((32, 80), (144, 80))):
                    x, w = make(x_shape, dt, u), make(w_shape, dt, u)
                    ops_w = _fp8_cache.quantize(w, "tensorwise")
                    with knobs(fp8_transpose=1):
                        backward(torch.ops.opforge._fp8_linear_quantized(x, w, *ops_w, None,
                                                                         granularity="tensorwise"))
        out.append(("fp8", fp8))
    if hasattr(ops, "rope"):
        def rope(dt, u):
            b, s, d = 2, 5, 64
            q, k = make((b, 4, s, d), dt, u), make((b, 2, s, d), dt, u)
            ang = torch.randn(b, s, d // 2)
            cos, sin = torch.cat([ang.cos()] * 2, -1).to("cuda"), torch.cat([ang.sin()] * 2, -1).to("cuda")
            pos = host_randint(0, 4096, (b, s))
            # rope_rows_kernel: 0 the default (the per-token kernel at this size), 1 the rows kernel
            for kernel in (0, 1):
                with knobs(rope_rows_kernel=kernel):
                    backward(opforge.rope(q, k, cos, sin))
                    backward(opforge.rope(q, k, cos, sin, interleaved=True))
                    if hasattr(ops, "rope_from_positions"):
                        backward(opforge.rope_from_positions(q, k, pos))
        out.append(("rope", rope))
    if hasattr(ops, "linear_cat"):
        def linear_cat(dt, u):
            xs = [make((5, 24), dt, u), make((5, 40), dt, u)]
            w, b = make((16, 64), dt, u), make((16,), dt, u)
            backward(opforge.linear_cat(xs, w, b))
            xs3 = [make((2, 3, 8), dt, u), make((2, 3, 0), dt, u), make((2, 3, 9), dt, u)]
            backward(opforge.linear_cat(xs3, make((7, 17), dt, u)))
            with knobs(linear_lt=0):  # cublasGemmEx plus separate passes
                backward(opforge.linear_cat(xs, w, b))
        out.append(("linear_cat", linear_cat))
    if hasattr(ops, "indexed_linear"):
        def indexed_linear(dt, u):
            # opforge's own kernels: the gather-GEMV (T <= 16) and the tiled grouped GEMM, auto and forced (for
            # bfloat16 the auto path at T = 300 is _grouped_mm: family grouped_mm_epilogue)
            paths = ("gemv", "grouped") + (() if dt == torch.bfloat16 else (None,))
            for path in paths:
                with knobs(indexed_linear_path=INDEXED_LINEAR_PATH[path]):
                    for t in (3, 300):  # the gather-GEMV (T <= 16) and the grouped regime
                        x, w, b = make((t, 32), dt, u), make((4, 24, 32), dt, u), make((4, 24), dt, u)
                        idx = host_randint(-1, 4, (t,))
                        backward(opforge.indexed_linear(x, w, idx, b))
                        sorted_rows(x, w, b, t)

        def sorted_rows(x, w, b, t):
            # index_sorted: rows in expert order with the expert-less rows last (finish_rows_kernel,
            # fix_weight_grad_kernel with no poison), then one row out of order (every row kernel's NaN branch and
            # the poisoned weight gradients)
            idx = torch.sort(host_randint(0, 4, (t,))).values
            idx[t - t // 4:] = -1
            backward(opforge.indexed_linear(x, w, idx, b, index_sorted=True))
            idx[0] = 3
            backward(opforge.indexed_linear(x, w, idx, b, index_sorted=True))

        def grouped_mm_epilogue(dt, u):
            # indexed_linear's _grouped_mm path (bfloat16 on sm_90; bfloat16 cases only): torch._grouped_mm
            # (CUTLASS, TMA stores) then scatter_rows_kernel, auto (T = 300) and forced. initcheck does not see TMA
            # stores (control_torch/bfloat16/aligned: torch's own add reads all 960 elements of a _grouped_mm output
            # as uninitialized), so scripts/sanitize.sh reports this family's initcheck findings apart
            for path in (None, "grouped_mm"):
                with knobs(indexed_linear_path=INDEXED_LINEAR_PATH[path]):
                    x, w, b = make((300, 32), dt, u), make((4, 24, 32), dt, u), make((4, 24), dt, u)
                    backward(opforge.indexed_linear(x, w, host_randint(-1, 4, (300,)), b))
                    sorted_rows(x, w, b, 300)
        out.append(("indexed_linear", indexed_linear))
        out.append(("grouped_mm_epilogue", grouped_mm_epilogue))
    if hasattr(ops, "fake_quant_linear"):
        def fake_quant_linear(dt, u):
            # vendor-safe 16-bit: K odd, so that no operand of cuBLAS's GEMM on the fake-quantized weight (a fresh,
            # aligned allocation) has a 16-byte row stride (no TMA kernel); the grouped quantizer alone below
            odd = VENDOR_SAFE and dt in LOW
            k = 65 if odd else 64
            x, w, b = make((5, k), dt, u), make((24, k), dt, u), make((24,), dt, u)
            backward(opforge.fake_quant_linear(x, w, b))  # per channel, symmetric int4
            if odd:
                backward(opforge.fake_quant_linear(x, w, b, symmetric=False, act_quant=True))
                opforge.fake_quantize_weight(make((24, 64), dt, u, requires_grad=False), 4, 32, False)
            else:
                backward(opforge.fake_quant_linear(x, w, b, group_size=32, symmetric=False, act_quant=True))
            backward(opforge.fake_quant_linear(x, w, None, group_size=0))  # per tensor (device min/max)
            with knobs(linear_lt=0):
                backward(opforge.fake_quant_linear(x, w, b))
            # the quantizer's three team widths: 8 threads (short groups), a warp, the whole block (shared memory)
            for shape, g in (((6, 32), 8), ((3, 640), -1), ((2, 4096), -1)):
                opforge.fake_quantize_weight(make(shape, dt, u, requires_grad=False), 4, g, False)
        out.append(("fake_quant_linear", fake_quant_linear))

    def gemm_sm90(dt, u):
        # opforge's CUTLASS sm90 kernels (core/gemm_sm90*.cu; their kernel names carry opforge's namespace in the
        # template arguments, so the kns=opforge filter instruments them): linear through the engine wherever it takes
        # the problem (gemm_sm90=1), and swiglu_linear's fused SwiGLU epilogue (gemm_sm90=2 makes it run or raise).
        # The engine takes 16-bit operands with 16-byte aligned rows; the other cases run the unfused paths.
        if not ops._has_cutlass() or torch.cuda.get_device_capability() != (9, 0):
            return
        for m, k, n in ((7, 64, 24), (300, 520, 1000)) if not quick else ((300, 520, 1000),):
            x, w, b = make((m, k), dt, u), make((2 * n, k), dt, u, scale=k ** -0.5), make((2 * n,), dt, u)
            with knobs(gemm_sm90=1):
                backward(opforge.linear(x, w, b))
                backward(opforge.swiglu_linear(x, w, b))
            if dt == torch.bfloat16 and not u:
                with knobs(gemm_sm90=2):  # the ping-pong SwiGLU kernel: z and h, h alone without grad
                    y = opforge.swiglu_linear(x, w, b)
                    with torch.no_grad():
                        opforge.swiglu_linear(x, w, b)
                with knobs(gemm_sm90=1):
                    backward(y)
    out.append(("gemm_sm90", gemm_sm90))
    return out


def configs(quick: bool):
    """(dtype, unaligned) per case: quick runs float32 aligned (the vector paths) and bfloat16 unaligned (the
    scalar paths); full runs every dtype both ways."""
    if quick:
        return [(torch.float32, False), (torch.bfloat16, True)]
    return [(dt, u) for dt in DTYPES for u in (False, True)]


def case_list(quick: bool, vendor_safe: bool = False):
    """(id, fn, dtype, unaligned) per case; vendor_safe: without the 16-bit aligned cases of the families in
    VENDOR_GEMM_FAMILIES (the control's included: they are known to kill racecheck) and the VENDOR_SAFE_SKIP ones."""
    out = []
    for name, fn in families(quick):
        for dt, u in configs(quick):
            if dt not in FAMILY_DTYPES.get(name, DTYPES):
                continue
            if vendor_safe and (name in VENDOR_SAFE_SKIP or (name in VENDOR_GEMM_FAMILIES and dt in LOW and not u)):
                continue
            out.append((f"{name}/{str(dt).replace('torch.', '')}/{'unaligned' if u else 'aligned'}", fn, dt, u))
    return out


def expected_kernels():
    """{kernel name: source file} of every __global__ function under csrc/ (comments stripped)."""
    pat = re.compile(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?(?:void\s+)?(\w+)\s*\(")
    found = {}
    for f in sorted((ROOT / "csrc").rglob("*")):
        if f.suffix not in (".cu", ".cuh", ".h"):
            continue
        text = re.sub(r"//[^\n]*", "", f.read_text())
        for m in pat.finditer(text):
            found.setdefault(m.group(1), str(f.relative_to(ROOT)))
    return found


def run_cases(cases, start_after=None):
    """Runs the cases in order (after `start_after` when given); returns the number of Python-level failures."""
    skipping = start_after is not None
    failures = 0
    for cid, fn, dt, u in cases:
        if skipping:
            skipping = cid != start_after
            continue
        print(f"case {cid}: begin", flush=True)
        try:
            fn(dt, u)
            torch.cuda.synchronize()
            print(f"case {cid}: ok", flush=True)
        except Exception as e:  # a Python-level error is a failure too (reported, the others still run)
            failures += 1
            print(f"case {cid}: FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
            if sticky_cuda_error(e):
                # the context is lost (every later case would fail the same way): stop here, so that
                # scripts/sanitize.sh records this case as not checked and resumes after it in a fresh process
                print(f"case {cid}: CUDA context lost, stopping", flush=True)
                sys.exit(4)
    return failures


def sticky_cuda_error(e: BaseException) -> bool:
    """True for a CUDA error after which the process's CUDA context is unusable (illegal address, launch failure,
    a sanitizer's hardware exception), as opposed to a Python-level error of one case."""
    text = f"{type(e).__name__}: {e}"
    return type(e).__name__ == "AcceleratorError" or any(
        k in text for k in ("illegal memory access", "unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED",
                            "misaligned address", "an illegal instruction", "hardware exception"))


def coverage(cases) -> int:
    """Runs the cases under torch.profiler; checks every csrc __global__ kernel launched under a name the
    sanitizer's filter matches. Prints `coverage: K kernels, M launches` (and MISSING / FILTER lines)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        failures = run_cases(cases)
        torch.cuda.synchronize()
    counts = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            counts[e.name] = counts.get(e.name, 0) + 1
    expected = expected_kernels()
    bad = 0
    launched = {}
    for kname, where in expected.items():
        pat = re.compile(r"(?:^|[\s:*&])" + re.escape(kname) + r"\s*[<(]")
        names = [n for n in counts if pat.search(n)]
        launched[kname] = sum(counts[n] for n in names)
        if not names and VENDOR_SAFE and kname in VENDOR_SAFE_EXEMPT:
            print(f"coverage: EXEMPT {kname} ({where}) in vendor-safe mode: {VENDOR_SAFE_EXEMPT[kname]}")
        elif not names:
            print(f"coverage: MISSING {kname} ({where}): never launched by the driver")
            bad += 1
        for n in names:
            if FILTER not in n:
                print(f"coverage: FILTER {kname} launched as '{n[:120]}': no '{FILTER}' in its name, the sanitizer "
                      "would not check it")
                bad += 1
    ours = {n: c for n, c in counts.items() if FILTER in n}
    for kname in sorted(expected):
        print(f"coverage: {launched[kname]:6d} launches  {kname}  ({expected[kname]})")
    print(f"coverage: {sum(1 for k in launched if launched[k])} kernels, {sum(ours.values())} launches "
          f"({len(ours)} instantiations) of {len(expected)} kernels in csrc")
    return (3 if bad else 0) or (1 if failures else 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="float32 aligned and bfloat16 unaligned, fewer shapes")
    p.add_argument("--tool", default="memcheck", help="the sanitizer tool this run is for (recorded in the log)")
    p.add_argument("--coverage", action="store_true", help="no sanitizer: profile the kernels the cases launch")
    p.add_argument("--start-after", default=None, help="resume after this case id (a crashed case)")
    p.add_argument("--only", default=None,
                   help="run only these cases: comma-separated ids, or prefixes ending in '/' (e.g. control_torch/)")
    p.add_argument("--vendor-safe", action="store_true",
                   help="float32/float64 cases launch no 16-bit vendor GEMM of their own (see VENDOR_SAFE)")
    p.add_argument("--list", action="store_true", help="print the case ids and exit")
    args = p.parse_args()
    global VENDOR_SAFE
    VENDOR_SAFE = args.vendor_safe
    cases = case_list(args.quick, VENDOR_SAFE)
    if args.only is not None:
        sel = [w for w in args.only.split(",") if w]
        chosen = [c for c in cases if any(c[0] == w or (w.endswith("/") and c[0].startswith(w)) for w in sel)]
        if not chosen:
            print(f"sanitize_driver: no case matches {args.only}", file=sys.stderr)
            return 2
        cases = chosen
    if args.list:
        for c in cases:
            print(c[0])
        return 0
    if not torch.cuda.is_available():
        print("sanitize_driver: no CUDA device", file=sys.stderr)
        return 2
    if args.start_after is not None and args.start_after not in [c[0] for c in cases]:
        print(f"sanitize_driver: unknown case {args.start_after}", file=sys.stderr)
        return 2
    if VENDOR_SAFE:
        n_left_out = len(case_list(args.quick)) - len(case_list(args.quick, True))
        print(f"sanitize_driver: vendor-safe: {n_left_out} 16-bit cases with vendor GEMMs "
              f"({', '.join(sorted(VENDOR_GEMM_FAMILIES))}) not run", flush=True)
    torch.manual_seed(0)
    if args.coverage:
        rc = coverage(cases)
    else:
        rc = 1 if run_cases(cases, args.start_after) else 0
    print(f"sanitize_driver: done ({args.tool}, {len(cases)} cases, rc {rc})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
