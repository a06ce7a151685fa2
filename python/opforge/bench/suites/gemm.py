"""opforge's GEMM engine at a Llama model's projection shapes: the sm90 CUTLASS kernels (core/gemm_sm90.h) against
cuBLASLt (opforge's own cuBLASLt path) and cuBLAS (torch.nn.functional.linear), and the SwiGLU epilogue against
the unfused GEMM + swiglu, in bfloat16 (and float16 for the plain GEMM).

Rows per (M, K, N), forward only (every GEMM of a training step is one of these, transposed or not):
    linear          opforge "sm90" (the test hook gemm_sm90 = 2: the CUTLASS kernel), "sm90 pingpong" (gemm_sm90 = 3:
                    bfloat16's ping-pong variant on 128 x 128 tiles), "cuBLASLt" (gemm_sm90 = 0),
                    "opforge" (the default: sm90_choice's table in core/gemm_cuda.cu), F.linear (cuBLAS);
    linear_bias     the same with a bias in the epilogue;
    swiglu_linear   N = 2I, y = silu(z[:, 0::2]) · z[:, 1::2] with z = x · Wᵀ: the training form (the forward
                    autograd runs when a gradient is needed, _swiglu_linear_forward: z kept for backward) and the
                    inference form (opforge.swiglu_linear without gradients: y alone) of
                    "fused pingpong" (gemm_sm90 = 2: one ping-pong kernel, z and y through shared memory and TMA
                    stores; the inference form stores y alone), "unfused" (gemm_sm90 = 0: cuBLASLt GEMM, then
                    opforge.swiglu on z's interleaved columns), "opforge" (the default: kSwiGLUTable's choice in
                    core/gemm_cuda.cu); and the patch's path today (inference form only): F.linear on the [gate | up]
                    weight, then opforge.swiglu_packed. The training-form rows are named "... (z, y)".
Metric: TFLOP/s (2·M·N·K per call); each printed line gives µs, TFLOP/s and the fraction of the H200's dense
bf16/fp16 peak (PEAK_TFLOPS). Timing: harness.time_cuda_graph (back-to-back calls in one CUDA graph). Before
timing, each implementation's output on the first rows is checked against opforge.testing's float64 reference.

    python -m opforge bench --ops gemm [--quick]
    python benchmarks/bench_gemm.py --quick          # bf16, two shapes
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness

NAME = "gemm"
PEAK_TFLOPS = 790.0  # H200 SXM dense bf16/fp16 tensor-core peak (989 at the boost clock; 790 sustained)
TOKENS = 8192  # batch 4 x 2048 tokens
# (M, K, N) of Llama 3.2 1B-style projections (hidden 2048, intermediate 8192, 16/8 heads, vocab 128256)
CUDA_SHAPES = [(TOKENS, 2048, 3072),     # q, k, v fused
               (TOKENS, 2048, 2048),     # o_proj
               (TOKENS, 2048, 16384),    # gate + up fused
               (TOKENS, 8192, 2048),     # down_proj
               (TOKENS, 2048, 128256)]   # lm_head
CUDA_QUICK_SHAPES = [(TOKENS, 2048, 3072), (TOKENS, 2048, 16384)]
CPU_SHAPES = [(256, 256, 512)]
CHECK_ROWS = 64


@contextlib.contextmanager
def _knob(value: int):
    old = torch.ops.opforge._set_knob("gemm_sm90", value)
    try:
        yield
    finally:
        torch.ops.opforge._set_knob("gemm_sm90", old)


def with_knob(fn, value: int):
    """fn under the test hook gemm_sm90 = value (read when the call is made, so also while a graph captures it)."""
    def call(*args):
        with _knob(value):
            return fn(*args)
    return call


def interleave(w_gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows (2I, K) -> interleaved rows (row 2j gate j, row 2j + 1 up j)."""
    gate, up = w_gate_up.chunk(2, 0)
    return torch.stack([gate, up], 1).flatten(0, 1)


def packed_path(x, w_packed, b):
    """The patch's path today: F.linear on [gate | up], then opforge.swiglu_packed."""
    return opforge.swiglu_packed(F.linear(x, w_packed, b))


def forward_z_y(x, w, b):
    """swiglu_linear's training-form forward (z and y, as autograd runs it when a gradient is needed); returns y."""
    return torch.ops.opforge._swiglu_linear_forward(x, w, b)[0]


def line(impl: str, t: float, flops: float, method: str) -> str:
    tf = harness.tflops(flops, t)
    return (f"{impl} {harness._fmt(t)}us {harness._fmt(tf)}TF ({harness._fmt(100 * tf / PEAK_TFLOPS, 0)}% peak)"
            + harness.method_note(method))


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, warmup=(3, 2), reps=((5, 10), (10, 10)),
                        dtypes=lambda cuda, quick: ([torch.bfloat16] if quick else [torch.bfloat16, torch.float16])
                        if cuda else [torch.float32])
    device = run.device
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_SHAPES)
    have_sm90 = run.cuda and torch.ops.opforge._has_cutlass() and torch.cuda.get_device_capability() == (9, 0)
    if run.cuda and not have_sm90:
        print("gemm: no sm90 engine here (a GPU other than compute capability 9.0, or a build without CUTLASS): "
              "its rows are NaN")
    lin = opforge.linear
    impls = {"sm90": with_knob(lin, 2) if have_sm90 else None, "sm90 pingpong": with_knob(lin, 3) if have_sm90 else None,
             "cuBLASLt": with_knob(lin, 0), "opforge": lin, "F.linear": F.linear}
    for dtype in run.dtypes:
        for M, K, N in shapes:
            x = torch.randn(M, K, device=device, dtype=dtype)
            w = (torch.randn(N, K, device=device) / K ** 0.5).to(dtype)
            b = torch.randn(N, device=device, dtype=dtype)
            flops = 2.0 * M * N * K
            xs = x[:CHECK_ROWS]
            bound = testing.gemm_error_bound(xs, w, dtype)
            for op, bias in (("linear", None), ("linear_bias", b)):
                group = []
                ref = testing.linear_reference(xs.double(), w.double(), None if bias is None else bias.double())
                for impl, fn in impls.items():
                    t, method = math.nan, ""
                    if impl == "sm90 pingpong" and dtype != torch.bfloat16:
                        continue  # the variant is built for bfloat16 only
                    if fn is not None:
                        harness.check_reference(f"{op} {impl} {harness.dtype_str(dtype)} {M}x{K}x{N}",
                                                fn(xs, w, bias), ref, F.linear(xs, w, bias), bound=bound)
                        t, method = run.time_graphed(impl, lambda i, fn=fn: fn(x, w, bias), 2)
                    run.add(op, (M, K, N), dtype, impl, "fwd", t, harness.tflops(flops, t), "TFLOP/s")
                    group.append(line(impl, t, flops, method))
                run.say_case(op, "fwd", dtype, (M, K, N), group)
            if dtype == torch.bfloat16 and N % 2 == 0 and N <= 32768:
                wi = interleave(w)
                ys = opforge.swiglu_linear
                sw = {"fused pingpong (z, y)": with_knob(forward_z_y, 2) if have_sm90 else None,
                      "fused pingpong": with_knob(ys, 2) if have_sm90 else None,
                      "unfused (z, y)": with_knob(forward_z_y, 0),
                      "unfused": with_knob(ys, 0),
                      "opforge (z, y)": forward_z_y,
                      "opforge": ys,
                      "F.linear + swiglu_packed": packed_path}
                operands = {impl: (w if impl == "F.linear + swiglu_packed" else wi) for impl in sw}
                ref = testing.swiglu_linear_reference(xs.double(), wi.double())
                base = packed_path(xs, w, None)
                group = []
                for impl, fn in sw.items():
                    t, method = math.nan, ""
                    if fn is not None:
                        wt = operands[impl]
                        harness.check_reference(f"swiglu_linear {impl} {M}x{K}x{N}", fn(xs, wt, None), ref, base)
                        t, method = run.time_graphed(impl, lambda i, fn=fn, wt=wt: fn(x, wt, None), 2)
                    run.add("swiglu_linear", (M, K, N), dtype, impl, "fwd", t, harness.tflops(flops, t), "TFLOP/s")
                    group.append(line(impl, t, flops, method))
                run.say_case("swiglu_linear", "fwd", dtype, (M, K, N), group)
                del wi
            del x, w, b
            run.release()
    return run.finish()
