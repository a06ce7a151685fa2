"""Benchmark rms_norm and fused_add_rms_norm against PyTorch eager, torch.compile and Liger-Kernel.

    python benchmarks/bench_rms_norm.py                  # CUDA: issue 3's shapes, bf16 and fp32
    python benchmarks/bench_rms_norm.py --device cpu     # CPU goal: (4096, 4096) fp32 and bf16
    python -m opforge bench --ops rms_norm --quick       # the same through the CLI

Each row (the harness's one schema): median time over repetitions (CUDA: CUDA events, warm-up, L2 flushed
before each repetition; CPU: perf_counter) and GB/s by the minimal-bytes rule:
  forward:           read x, weight; write y                              = 2·M·N·e + N·e_w
  forward+backward:  forward + read x, dy; write dx, dweight               = 5·M·N·e + 2·N·e_w
  fused forward:     read x, residual, weight; write y, residual_out       = 4·M·N·e + N·e_w
Peers: F.rms_norm (eager), torch.compile of the composed formula (one compiled copy per shape and grad mode),
Liger-Kernel's LigerRMSNormFunction / LigerFusedAddRMSNormFunction when importable (else n/a). Before
timing, opforge's output is checked against opforge.testing's float64 reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import opforge  # noqa: E402
from opforge.testing import fused_add_rms_norm_reference, rms_norm_reference  # noqa: E402

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
    z = x + r
    return composed_rms_norm(z, w), z


def liger_functions():
    """Liger-Kernel's rms_norm and fused add + rms_norm as functions of (x, w) and (x, r, w), or None each."""
    rms = fused = None
    f = common.liger("LigerRMSNormFunction", "liger_kernel.ops.rms_norm")
    if f is not None:
        rms = lambda x, w: f.apply(x, w, EPS)  # noqa: E731
    g = common.liger("LigerFusedAddRMSNormFunction", "liger_kernel.ops.fused_add_rms_norm")
    if g is not None:
        fused = lambda x, r, w: g.apply(x, r, w, EPS)  # noqa: E731
    return rms, fused


def check_against_reference(x, r, w) -> None:
    """opforge's outputs vs opforge.testing's float64 references: a benchmark of a wrong kernel is void."""
    shape = (x.shape[-1],)
    ref = rms_norm_reference(x.double(), shape, w.double(), EPS)
    err = (opforge.rms_norm(x, shape, w, EPS).double() - ref).abs().max().item()
    fused_ref = fused_add_rms_norm_reference(x.double(), r.double(), shape, w.double(), EPS)[0]
    ferr = (opforge.fused_add_rms_norm(x, r, shape, w, EPS)[0].double() - fused_ref).abs().max().item()
    tol = 0.1 if x.dtype in (torch.bfloat16, torch.float16) else 1e-3
    if not (err <= tol and ferr <= tol):
        raise RuntimeError(f"bench_rms_norm: opforge differs from the reference by {max(err, ferr):.3g} "
                           f"({x.dtype}, {tuple(x.shape)}): fix the kernel before timing it")


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="e.g. 32768x4096,8x4096 (default: issue 3's list for the device)")
    run = common.start(NAME, __doc__, argv, dtypes=[torch.bfloat16, torch.float32], warmup=(5, 2),
                       reps=((20, 50), (5, 20)), arg_parser=p)
    args, device, cuda = run.args, run.device, run.cuda
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, QUICK_SHAPES["cuda"], QUICK_SHAPES["cpu"])
    liger_rms, liger_fused = liger_functions() if cuda else (None, None)
    comp_rms = None if args.no_compile else common.compiled(composed_rms_norm, fullgraph=True)
    comp_fused = None if args.no_compile else common.compiled(composed_add_rms_norm, fullgraph=True)
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
                        t = run.time(common.fwd_bwd(fn, inputs, dy))
                    else:
                        t = run.time(lambda fn=fn: fn(*inputs), no_grad=True)
                    row = run.add(op, (M, N), dtype, impl, pass_, t, common.gbps(nb, t), "GB/s")
                    group.append(f"{impl} {common._fmt(row.metric)}")
                run.say_case(op, pass_, dtype, (M, N), group, ", ")
            del x, r, dy, w, xg, wg
            run.release()
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
