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
import common  # noqa: E402  (it puts the source tree's python/ on sys.path without an installed opforge)
import opforge  # noqa: E402

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
    run = common.start(NAME, __doc__, argv, dtypes=common.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(5, 2), reps=((10, 30), (5, 5)))
    device = run.device
    for dtype in run.dtypes:
        for M, widths, N in run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK):
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
                    t = run.time(step)
                    flops = common.linear_flops(M, K, N, pass_)
                    run.add(NAME, shape, dtype, impl, pass_, t, common.tflops(flops, t), "TFLOP/s")
                    group.append(f"{impl} {common._fmt(t)}us {common._fmt(common.tflops(flops, t))}TF")
                run.say_case(NAME, pass_, dtype, shape, group)
            if run.cuda:
                group = []
                for impl, fn in impls.items():
                    mib = peak_mib(fn, leaves, dy)
                    run.add(NAME, shape, dtype, impl, "peak fwd+bwd", math.nan, mib, "MiB")
                    group.append(f"{impl} {mib:.0f} MiB")
                cat_mib = M * K * torch.empty((), dtype=dtype).element_size() / 2**20
                run.say(f"{NAME} peak memory above inputs {shape}",
                        group + [f"(concatenated buffer: {cat_mib:.0f} MiB)"])
            del xs, w, bias, dy, leaves
            run.release()
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
