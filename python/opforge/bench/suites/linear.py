"""linear (forward, forward+backward) against torch.nn.functional.linear, and linear with a fused GELU against
gelu(F.linear) eager and torch.compile of it, for bf16 / fp16 / fp32.

Rows: op ``linear`` (opforge.linear; F.linear; on CUDA opforge's small-M GEMV kernel at M ≤ 16 as a variant) and op
``linear_gelu`` (opforge.linear(..., "gelu"); gelu(F.linear) eager and compiled; the tanh approximation as a
variant).

Timing (CUDA): device time per call (harness.time_cuda_graph): many back-to-back calls captured in one CUDA graph
and replayed, so host launch cost stays out of it (single-call timing at small M measures the host). The weight
rotates over enough copies that they exceed the L2 twice over, so a small-M call streams its weight from HBM as it
would in a model. On CPU, wall time of single calls (harness.time_cpu).

Metric: GB/s of the weight read once (N·K·elem bytes per call) for a forward with M ≤ 16 (decode: weight
streaming, a memory-bound GEMV); TFLOP/s otherwise (2·M·N·K per forward, 3x that for forward+backward).
Both figures and the µs are printed for every row. Before timing, opforge's outputs are checked against
opforge.testing's float64 reference (within the GEMM rounding bound of opforge.testing.gemm_error_bound).

    python -m opforge bench --ops linear [--quick]
    python benchmarks/bench_linear.py                      # CUDA when available; ≤ 150 s on an H200
    python benchmarks/bench_linear.py --quick              # bf16, three shapes
    python benchmarks/bench_linear.py --device cpu --quick
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness

NAME = "linear"
CUDA_SHAPES = [(1, 4096, 4096), (8, 4096, 4096), (16, 4096, 14336), (64, 4096, 4096), (1024, 4096, 4096),
               (8192, 4096, 14336)]
CUDA_QUICK_SHAPES = [(1, 4096, 4096), (16, 4096, 14336), (1024, 4096, 4096)]
CPU_SHAPES = [(1, 1024, 1024), (64, 1024, 1024), (1024, 1024, 1024)]
L2_BYTES = 60e6  # at least the L2 of current GPUs (H100/H200: 50 MB)
CHECK_ROWS = 64  # the reference check runs on the first rows only (a float64 GEMM of every shape is slow on a CPU)


def eager_linear(x, w, b):
    """F.linear."""
    return F.linear(x, w, b)


def eager_linear_gelu(x, w, b):
    """F.gelu(F.linear): what torch.compile compiles."""
    return F.gelu(F.linear(x, w, b))


def ours_linear(x, w, b):
    """opforge.linear."""
    return opforge.linear(x, w, b)


def ours_linear_gelu(x, w, b):
    """opforge.linear with the exact GELU in its epilogue."""
    return opforge.linear(x, w, b, "gelu")


def ours_linear_gelu_tanh(x, w, b):
    """opforge.linear with the tanh-approximated GELU in its epilogue."""
    return opforge.linear(x, w, b, "gelu_tanh")


def ours_linear_gemv(x, w, b):
    """opforge.linear through the small-M GEMV kernel at any M <= 16 (the test hook linear_gemv = 1 for this call;
    by default it serves M == 1 only)."""
    old = torch.ops.opforge._set_knob("linear_gemv", 1)
    try:
        return opforge.linear(x, w, b)
    finally:
        torch.ops.opforge._set_knob("linear_gemv", old)


def weight_copies(wbytes: int, cuda: bool) -> int:
    """Copies of the weight to rotate over: together more than twice the L2 (1 on CPU)."""
    return max(1, math.ceil(2.2 * L2_BYTES / wbytes)) if cuda else 1


def check_against_reference(x, w, b) -> None:
    """opforge.linear, without and with GELU, on the first rows of x against opforge.testing.linear_reference."""
    xs = x[:CHECK_ROWS]
    bound = testing.gemm_error_bound(xs, w, x.dtype)
    case = f"{harness.dtype_str(x.dtype)} {harness.shape_str((x.shape[0], w.shape[1], w.shape[0]))}"
    for op, ours, eager, act in (("linear", ours_linear, eager_linear, "none"),
                                 ("linear_gelu", ours_linear_gelu, eager_linear_gelu, "gelu")):
        harness.check_reference(f"{op} {case}", ours(xs, w, b),
                                testing.linear_reference(xs.double(), w.double(), b.double(), act), eager(xs, w, b),
                                bound=bound)


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, warmup=(3, 2), reps=((5, 10), (10, 10)),
                        dtypes=lambda cuda, quick: ([torch.bfloat16] if quick else
                                                    [torch.bfloat16, torch.float16, torch.float32]) if cuda
                        else [torch.float32])
    device, cuda = run.device, run.cuda
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_SHAPES[:1] + CPU_SHAPES[-1:])
    # dynamic=None: static for the first shape, one dynamic-shape recompile after (not one per shape)
    comp = None if run.args.no_compile else harness.compiled(eager_linear_gelu, fullgraph=True)
    ops = {"linear": {"opforge": ours_linear, "F.linear": eager_linear},
           "linear_gelu": {"opforge": ours_linear_gelu, "opforge gelu_tanh": ours_linear_gelu_tanh,
                           "gelu(F.linear)": eager_linear_gelu, "compile gelu(F.linear)": comp}}
    if cuda:
        ops["linear"]["opforge gemv"] = ours_linear_gemv  # M <= 16 only (larger M: cuBLASLt, as "opforge")

    for dtype in run.dtypes:
        for M, K, N in shapes:
            elem = torch.empty((), dtype=dtype).element_size()
            wbytes = N * K * elem
            copies = weight_copies(wbytes, cuda)
            calls = copies * max(1, math.ceil((4 if M >= 1024 else 20) / copies))
            x = torch.randn(M, K, device=device, dtype=dtype)
            ws = [(torch.randn(N, K, device=device) / K ** 0.5).to(dtype) for _ in range(copies)]
            b = torch.randn(N, device=device, dtype=dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            check_against_reference(x, ws[0], b)
            leaves = [[t.detach().clone().requires_grad_() for t in (x, w, b)] for w in ws]
            for op, impls in ops.items():
                for pass_ in ("fwd", "fwd+bwd"):
                    group = []
                    for impl, fn in impls.items():
                        t, method = math.nan, ""
                        if fn is not None and not (impl == "opforge gemv" and M > 16):
                            if pass_ == "fwd":
                                steps = [lambda fn=fn, w=w: fn(x, w, b) for w in ws]
                            else:
                                steps = [harness.fwd_bwd(fn, lv, dy) for lv in leaves]
                            t, method = run.time_graphed(impl, lambda i, steps=steps: steps[i % copies](), calls)
                        flops = harness.linear_flops(M, K, N, pass_)
                        gbps, tflops = harness.gbps(wbytes, t), harness.tflops(flops, t)
                        if M <= 16 and pass_ == "fwd":
                            metric, unit = gbps, "GB/s"
                        else:
                            metric, unit = tflops, "TFLOP/s"
                        run.add(op, (M, K, N), dtype, impl, pass_, t, metric, unit)
                        group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(gbps, 0)}GB/s "
                                     f"{harness._fmt(tflops)}TF" + harness.method_note(method))
                    run.say_case(op, pass_, dtype, (M, K, N), group)
            del x, ws, b, dy, leaves
            run.release()
    return run.finish()
