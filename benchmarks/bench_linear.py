"""Benchmark linear (forward, forward+backward) against torch.nn.functional.linear, gelu(F.linear) eager
and torch.compile, for bf16 / fp16 / fp32.

Metric: TFLOP/s (2·M·N·K per forward, 3x that for forward+backward) for large M; for M ≤ 16 (decode,
weight streaming) GB/s of the weight read once (N·K·elem bytes per forward) — the roofline unit of a
memory-bound GEMV.

    python benchmarks/bench_linear.py                      # CUDA when available
    python benchmarks/bench_linear.py --device cpu --quick
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Row  # noqa: E402

try:
    import opforge
except ImportError:  # running from a source tree: python/ is the package root
    sys.path.insert(0, str(common.REPO_ROOT / "python"))
    import opforge

NAME = "linear"
CUDA_SHAPES = [(1, 4096, 4096), (8, 4096, 4096), (16, 4096, 14336), (64, 4096, 4096), (1024, 4096, 4096),
               (8192, 4096, 14336)]
CPU_SHAPES = [(1, 1024, 1024), (64, 1024, 1024), (1024, 1024, 1024)]


def eager_linear(x, w, b):
    return F.linear(x, w, b)


def eager_linear_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def ours_linear(x, w, b):
    return opforge.linear(x, w, b)


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    dtypes = common.parse_dtypes(args.dtypes, [torch.bfloat16, torch.float16, torch.float32] if cuda else [torch.float32])
    shapes = CUDA_SHAPES if cuda else CPU_SHAPES
    if args.quick:
        shapes = shapes[:1] + shapes[-2:-1]
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    reps = args.reps if args.reps is not None else ((20 if args.quick else 50) if cuda else 10)
    comp = None if args.no_compile else common.compiled(eager_linear_gelu, fullgraph=True, dynamic=False)
    impls = {"opforge": ours_linear, "F.linear": eager_linear, "gelu(F.linear)": eager_linear_gelu,
             "compile gelu(F.linear)": comp}
    if hasattr(opforge.functional, "linear_act") or "activation" in str(torch.ops.opforge.linear.default._schema):
        impls["opforge linear+gelu"] = lambda x, w, b: opforge.linear(x, w, b, activation="gelu")

    rows: list[Row] = []
    for dtype in dtypes:
        for M, K, N in shapes:
            x = torch.randn(M, K, device=device, dtype=dtype)
            w = torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5
            b = torch.randn(N, device=device, dtype=dtype)
            gx, gw, gb = (t.detach().clone().requires_grad_() for t in (x, w, b))
            dy = torch.randn(M, N, device=device, dtype=dtype)
            for pass_ in ("fwd", "fwd+bwd"):
                for impl, fn in impls.items():
                    if fn is None:
                        t = float("nan")
                    elif pass_ == "fwd":
                        t = common.time_fn(lambda fn=fn: fn(x, w, b), device, warmup=warmup, reps=reps)
                    else:
                        t = common.time_fn(common.fwd_bwd(fn, [gx, gw, gb], dy), device, warmup=warmup, reps=reps)
                    if M <= 16 and pass_ == "fwd":
                        metric, unit = common.gbps(N * K * x.element_size(), t), "GB/s"
                    else:
                        flops = 2 * M * N * K * (1 if pass_ == "fwd" else 3)
                        metric, unit = common.tflops(flops, t), "TFLOP/s"
                    rows.append(Row("linear", common.shape_str((M, K, N)), common.dtype_str(dtype), impl, pass_, t,
                                    metric, unit))
                print(f"  linear {pass_} {common.dtype_str(dtype)} {M}x{K}x{N}: " + ", ".join(
                    f"{r.impl} {common._fmt(r.time_us)}us" for r in rows[-len(impls):]), flush=True)
            del x, w, b, gx, gw, gb, dy
            if cuda:
                torch.cuda.empty_cache()
    common.finish(rows, NAME, device, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
