"""rms_norm and fused_add_rms_norm against PyTorch eager, torch.compile and Liger-Kernel.

    python -m opforge bench --ops rms_norm [--quick]      # through the CLI
    python benchmarks/bench_rms_norm.py                   # CUDA: the shapes below, bf16 and fp32
    python benchmarks/bench_rms_norm.py --device cpu      # CPU: (4096, 4096) fp32 and bf16

Each row: the harness's timing (CUDA: CUDA events, warm-up, L2 flushed before each repetition; CPU: blocks of
perf_counter; outliers dropped, median) and GB/s by the minimal-bytes rule:
  forward:           read x, weight; write y                              = 2·M·N·e + N·e_w
  forward+backward:  forward + read x, dy; write dx, dweight               = 5·M·N·e + 2·N·e_w
  fused forward:     read x, residual, weight; write y, residual_out       = 4·M·N·e + N·e_w
Peers: F.rms_norm (eager), torch.compile of the composed formula (one compiled copy per shape and grad mode),
Liger-Kernel's LigerRMSNormFunction / LigerFusedAddRMSNormFunction when importable (else n/a). Before
timing, opforge's outputs are checked against opforge.testing's float64 references.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import opforge
from opforge.testing import fused_add_rms_norm_reference, rms_norm_reference

from .. import harness

NAME = "rms_norm"
CUDA_SHAPES = [(32768, 4096), (16384, 8192), (4096, 8192), (65536, 1024), (4096, 16384), (8, 4096)]
CPU_SHAPES = [(4096, 4096)]
QUICK_SHAPES = {"cuda": [(32768, 4096), (8, 4096)], "cpu": [(512, 1024)]}
EPS = 1e-6


def composed_rms_norm(x, w):
    """The formula as a model writes it (Llama's RMSNorm): fp32 math, cast back, scale."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def composed_add_rms_norm(x, r, w):
    """x + r, then `composed_rms_norm`: (normalized, the sum)."""
    z = x + r
    return composed_rms_norm(z, w), z


def liger_functions():
    """Liger-Kernel's rms_norm and fused add + rms_norm as functions of (x, w) and (x, r, w), or None each."""
    rms = fused = None
    f = harness.liger("LigerRMSNormFunction", "liger_kernel.ops.rms_norm")
    if f is not None:
        rms = lambda x, w: f.apply(x, w, EPS)  # noqa: E731
    g = harness.liger("LigerFusedAddRMSNormFunction", "liger_kernel.ops.fused_add_rms_norm")
    if g is not None:
        fused = lambda x, r, w: g.apply(x, r, w, EPS)  # noqa: E731
    return rms, fused


def check_against_reference(x, r, w) -> None:
    """opforge's outputs against opforge.testing's float64 references (`harness.check_reference`), with the
    composed formula in x's dtype as the baseline."""
    shape = (x.shape[-1],)
    case = f"{harness.dtype_str(x.dtype)} {harness.shape_str(x.shape)}"
    harness.check_reference(f"rms_norm {case}", opforge.rms_norm(x, shape, w, EPS),
                            rms_norm_reference(x.double(), shape, w.double(), EPS), composed_rms_norm(x, w))
    harness.check_reference(f"fused_add_rms_norm {case}", opforge.fused_add_rms_norm(x, r, shape, w, EPS)[0],
                            fused_add_rms_norm_reference(x.double(), r.double(), shape, w.double(), EPS)[0],
                            composed_add_rms_norm(x, r, w)[0])


def main(argv=None) -> int:
    """Run the suite (the harness's command line, and ``--shapes``); 0 when it ran."""
    p = harness.parser(__doc__)
    p.add_argument("--shapes", default=None, help="e.g. 32768x4096,8x4096 (default: the device's list above)")
    run = harness.start(NAME, __doc__, argv, dtypes=[torch.bfloat16, torch.float32], warmup=(5, 2),
                       reps=((20, 50), (5, 20)), arg_parser=p)
    args, device, cuda = run.args, run.device, run.cuda
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, QUICK_SHAPES["cuda"], QUICK_SHAPES["cpu"])
    liger_rms, liger_fused = liger_functions() if cuda else (None, None)
    comp_rms = None if args.no_compile else harness.compiled(composed_rms_norm, fullgraph=True)
    comp_fused = None if args.no_compile else harness.compiled(composed_add_rms_norm, fullgraph=True)
    rms = {"opforge": lambda x, w: opforge.rms_norm(x, (x.shape[-1],), w, EPS),
           "eager": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
           "torch.compile": comp_rms, "liger": liger_rms}
    fused = {"opforge": lambda x, r, w: opforge.fused_add_rms_norm(x, r, (x.shape[-1],), w, EPS),
             "eager": lambda x, r, w: (lambda z: (F.rms_norm(z, (z.shape[-1],), w, EPS), z))(x + r),
             "torch.compile": comp_fused, "liger": liger_fused}

    for dtype in run.dtypes:
        for M, N in shapes:
            e = torch.empty((), dtype=dtype).element_size()
            x = torch.randn(M, N, device=device, dtype=dtype)
            r = torch.randn(M, N, device=device, dtype=dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype)
            check_against_reference(x, r, w)
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            cases = [("rms_norm", "fwd", rms, (x, w), 2 * M * N * e + N * e, False),
                     ("rms_norm", "fwd+bwd", rms, (xg, wg), 5 * M * N * e + 2 * N * e, True),
                     ("fused_add_rms_norm", "fwd", fused, (x, r, w), 4 * M * N * e + N * e, False)]
            for op, pass_, impls, inputs, nb, backward in cases:
                group = []
                for impl, fn in impls.items():
                    if fn is None:
                        t = float("nan")
                    elif backward:
                        t = run.time(harness.fwd_bwd(fn, inputs, dy))
                    else:
                        t = run.time(lambda fn=fn: fn(*inputs), no_grad=True)
                    row = run.add(op, (M, N), dtype, impl, pass_, t, harness.gbps(nb, t), "GB/s")
                    group.append(f"{impl} {harness._fmt(row.metric)}")
                run.say_case(op, pass_, dtype, (M, N), group, ", ")
            del x, r, dy, w, xg, wg
            run.release()
    return run.finish()

