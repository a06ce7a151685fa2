"""linear_cat (forward, forward+backward, peak memory) against torch.cat + F.linear.

Goal (H200, bf16): M 8192, pieces (2048, 2048), N 4096, forward+backward time ≤ 1.0× torch.cat + F.linear, and
peak memory lower by the concatenated buffer (forward and saved for backward).

Timing: harness.time_fn (CUDA events, L2 flushed; blocks of wall time on CPU; outliers dropped, median). Metric:
TFLOP/s (2·M·N·K forward, 3× that for forward+backward). Peak memory (CUDA): torch.cuda.max_memory_allocated above
the live inputs during one forward+backward, reported as rows of unit "MiB" (pass "peak fwd+bwd"). Before timing,
opforge's output is checked against opforge.testing's float64 reference.

    python -m opforge bench --ops linear_cat [--quick]
    python benchmarks/bench_linear_cat.py --device cpu --quick
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness

NAME = "linear_cat"
CUDA_SHAPES = [(8192, (2048, 2048), 4096), (8192, (1024, 24, 3072), 4096), (1, (2048, 2048), 4096)]
CUDA_QUICK = CUDA_SHAPES[:1]
CPU_SHAPES = [(256, (256, 256), 256), (512, (1000, 24, 512), 512)]


CHECK_ROWS = 64  # the reference check runs on the first rows only


def ours(a, b_, w, bias):
    """opforge.linear_cat of two pieces."""
    return opforge.linear_cat([a, b_], w, bias)


def ours3(a, b_, c, w, bias):
    """opforge.linear_cat of three pieces."""
    return opforge.linear_cat([a, b_, c], w, bias)


def cat_linear(*args):
    """F.linear(torch.cat(pieces, -1), weight, bias) of (*pieces, weight, bias)."""
    *xs, w, bias = args
    return F.linear(torch.cat(xs, -1), w, bias)


def peak_mib(fn, inputs, dy) -> float:
    """Peak CUDA memory above the live tensors during one forward+backward of fn(*inputs), in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    harness.fwd_bwd(fn, inputs, dy)()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
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
            heads = [t[:CHECK_ROWS] for t in xs]
            harness.check_reference(f"{NAME} {harness.dtype_str(dtype)} {shape}", impls["opforge"](*heads, w, bias),
                                    testing.linear_cat_reference([t.double() for t in heads], w.double(),
                                                                 bias.double()),
                                    cat_linear(*heads, w, bias),
                                    bound=testing.gemm_error_bound(torch.cat(heads, -1), w, dtype))
            for pass_ in ("fwd", "fwd+bwd"):
                group = []
                for impl, fn in impls.items():
                    step = (lambda fn=fn: fn(*xs, w, bias)) if pass_ == "fwd" else harness.fwd_bwd(fn, leaves, dy)
                    t = run.time(step)
                    flops = harness.linear_flops(M, K, N, pass_)
                    run.add(NAME, shape, dtype, impl, pass_, t, harness.tflops(flops, t), "TFLOP/s")
                    group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(harness.tflops(flops, t))}TF")
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

