"""Benchmark linear_cat (forward, forward+backward, peak memory) against torch.cat + F.linear (issue 11).

Goal (H200, bf16): M 8192, pieces (2048, 2048), N 4096, forward+backward time ≤ 1.0× torch.cat + F.linear, and
peak memory lower by the concatenated buffer (forward and saved for backward).

Timing: common.time_fn (CUDA events, L2 flushed, median; wall time on CPU). Metric: TFLOP/s (2·M·N·K forward,
3× that for forward+backward). Peak memory (CUDA): torch.cuda.max_memory_allocated above the live inputs during
one forward+backward, reported as rows of unit "MiB" (pass "peak fwd+bwd").

    python benchmarks/bench_linear_cat.py                 # CUDA when available
    python benchmarks/bench_linear_cat.py --device cpu --quick
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Row  # noqa: E402

try:
    import opforge
except ImportError:
    sys.path.insert(0, str(common.REPO_ROOT / "python"))
    import opforge

NAME = "linear_cat"
CUDA_SHAPES = [(8192, (2048, 2048), 4096), (8192, (1024, 24, 3072), 4096), (1, (2048, 2048), 4096)]
CUDA_QUICK = CUDA_SHAPES[:1]
CPU_SHAPES = [(256, (256, 256), 256), (512, (1000, 24, 512), 512)]


def ours(a, b_, w, bias):
    return opforge.linear_cat([a, b_], w, bias)


def ours3(a, b_, c, w, bias):
    return opforge.linear_cat([a, b_, c], w, bias)


def cat_linear(*args):
    *xs, w, bias = args
    return F.linear(torch.cat(xs, -1), w, bias)


def peak_mib(fn, inputs, dy) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    common.fwd_bwd(fn, inputs, dy)()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None) -> int:
    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    dtypes = common.parse_dtypes(args.dtypes, [torch.bfloat16] if cuda else [torch.float32])
    shapes = (CUDA_QUICK if args.quick else CUDA_SHAPES) if cuda else (CPU_SHAPES[:1] if args.quick else CPU_SHAPES)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    reps = args.reps if args.reps is not None else ((10 if args.quick else 30) if cuda else 5)
    rows: list[Row] = []
    for dtype in dtypes:
        for M, widths, N in shapes:
            K = sum(widths)
            xs = [torch.randn(M, k, device=device, dtype=dtype) for k in widths]
            w = (torch.randn(N, K, device=device) / K ** 0.5).to(dtype)
            bias = torch.randn(N, device=device, dtype=dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            leaves = [t.detach().clone().requires_grad_() for t in (*xs, w, bias)]
            impls = {"opforge": ours if len(widths) == 2 else ours3, "torch.cat+F.linear": cat_linear}
            shape = f"{M}x({'+'.join(map(str, widths))})x{N}"
            for pass_ in ("fwd", "fwd+bwd"):
                group = []
                for impl, fn in impls.items():
                    step = (lambda fn=fn: fn(*xs, w, bias)) if pass_ == "fwd" else common.fwd_bwd(fn, leaves, dy)
                    t = common.time_fn(step, device, warmup=warmup, reps=reps)
                    flops = 2 * M * N * K * (1 if pass_ == "fwd" else 3)
                    rows.append(Row(NAME, shape, common.dtype_str(dtype), impl, pass_, t, common.tflops(flops, t),
                                    "TFLOP/s"))
                    group.append(f"{impl} {common._fmt(t)}us {common._fmt(common.tflops(flops, t))}TF")
                print(f"  {NAME} {pass_} {common.dtype_str(dtype)} {shape}: " + "; ".join(group), flush=True)
            if cuda:
                group = []
                for impl, fn in impls.items():
                    mib = peak_mib(fn, leaves, dy)
                    rows.append(Row(NAME, shape, common.dtype_str(dtype), impl, "peak fwd+bwd", math.nan, mib, "MiB"))
                    group.append(f"{impl} {mib:.0f} MiB")
                cat_mib = M * K * torch.empty((), dtype=dtype).element_size() / 2**20
                print(f"  {NAME} peak memory above inputs {shape}: " + "; ".join(group)
                      + f" (concatenated buffer: {cat_mib:.0f} MiB)", flush=True)
            del xs, w, bias, dy, leaves
            if cuda:
                torch.cuda.empty_cache()
    common.finish(rows, NAME, device, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
