"""fp8_linear (FP8 GEMMs with current scaling, tensorwise and rowwise) forward and forward+backward (and with the weight's
FP8 operands precomputed, as opforge's layers cache them: "cached") against
F.linear in bfloat16 and torchao's float8 training (`convert_to_float8_training`, tensorwise and rowwise recipes)
when torchao imports, at the Hugging Face Llama 1.5B layer shapes (8192 tokens; fused q/k/v 2048→3072, o 2048→2048,
fused gate/up 2048→16384, down 8192→2048).

Goal (H200, bf16): each fp8_linear row at least as fast as torchao's same recipe, and the tensorwise forward+backward
at ≥ 1.5× F.linear's (the scaled GEMM alone runs 1.6-2.0× the bf16 GEMM at these shapes).

Timing (CUDA): device time per call, back-to-back calls in one CUDA graph (harness.time_cuda_graph; eager loop
where capture fails). CPU: blocks of wall time (torch's CPU `_scaled_mm`: the numerics, not a speed target).
Metric: TFLOP/s of the GEMMs (2·M·N·K per forward, 3x for forward+backward), the quantization passes counted as
overhead. The quantizer alone (quantize_fp8, both granularities) against its torch composition: GB/s of its minimal
bytes. Before timing, opforge's output on the first rows is checked against the float64 product of the same
quantized operands (opforge.testing.fp8_linear_reference) within the scaled GEMM's rounding bound.

    python -m opforge bench --ops fp8_linear [--quick]
    python benchmarks/bench_fp8_linear.py --device cpu --quick
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import opforge
from opforge import _fp8_cache
from opforge import testing

from .. import harness

NAME = "fp8_linear"
CUDA_SHAPES = [(8192, 2048, 3072), (8192, 2048, 2048), (8192, 2048, 16384), (8192, 8192, 2048)]
CUDA_QUICK_SHAPES = [(8192, 2048, 16384), (8192, 8192, 2048)]
CPU_SHAPES = [(256, 512, 768), (512, 1024, 512)]
CPU_QUICK_SHAPES = [(128, 256, 384)]
CHECK_ROWS = 64  # the reference check runs on the first rows only
GRANULARITIES = ("tensorwise", "rowwise")


def ours(granularity: str):
    """opforge.fp8_linear with the granularity's default gradient format."""
    return lambda x, w: opforge.fp8_linear(x, w, granularity=granularity)


def cached(granularity: str, w: torch.Tensor):
    """fp8_linear with the weight's FP8 operands precomputed once (what opforge.nn.Linear(fp8=...) and the patch's
    FP8 projections run between optimizer steps: `_fp8_linear_quantized`, no weight quantization in the call)."""
    ops = _fp8_cache.quantize(w, granularity)
    return lambda x, w: torch.ops.opforge._fp8_linear_quantized(x, w, *ops, granularity=granularity)


def bf16_linear(x, w):
    """torch's linear in the inputs' dtype (no quantization)."""
    return F.linear(x, w)


def torchao_module(K: int, N: int, w: torch.Tensor, recipe: str):
    """torchao's Float8Linear (convert_to_float8_training, `recipe`) holding w, or None when torchao does not
    import or its float8 training does not run on this device."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        m = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=w.device, dtype=w.dtype))
        with torch.no_grad():
            m[0].weight.copy_(w)
        m = convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
        m(torch.randn(16, K, device=w.device, dtype=w.dtype))  # it runs here (torchao's float8 needs CUDA sm89+)
        return m
    except Exception as e:  # not installed, built for another torch, or no FP8 GEMM on this device
        print(f"  [n/a] torchao float8 {recipe}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
              file=sys.stderr)
        return None


def _deq(t, fp8, granularity):
    q, s = testing.quantize_fp8_reference(t, fp8, granularity)
    return q.double() * s.reciprocal().double()


def check_against_reference(x, w, granularity: str, what: str) -> None:
    """fp8_linear against the float64 product of its quantized operands, within the scaled GEMM's rounding bound
    (fp32 accumulation over K, the product's rounding: bfloat16 rowwise, the output's)."""
    y = opforge.fp8_linear(x, w, granularity=granularity)
    ref = testing.fp8_linear_reference(x.double(), w.double(), granularity=granularity)
    e4 = torch.float8_e4m3fn
    a, b = _deq(x, e4, granularity), _deq(w, e4, granularity)
    u32, ub = torch.finfo(torch.float32).eps / 2, torch.finfo(torch.bfloat16).eps / 2
    bound = (x.shape[1] * u32 + 2 * u32 + 2 * ub) * (a.abs() @ b.abs().t())
    harness.check_reference(what, y, ref, testing.fp8_linear_reference(x, w, granularity=granularity), bound=bound)


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=[torch.bfloat16], warmup=(3, 2), reps=((10, 10), (3, 5)))
    device = run.device
    for dtype in run.dtypes:
        for M, K, N in run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_QUICK_SHAPES):
            x = torch.randn(M, K, device=device, dtype=dtype)
            w = (torch.randn(N, K, device=device) / K ** 0.5).to(dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            for g in GRANULARITIES:
                check_against_reference(x[:CHECK_ROWS], w, g, f"{NAME} {g} {harness.dtype_str(dtype)} "
                                                              f"{harness.shape_str((M, K, N))}")
            impls = {f"opforge {g}": ours(g) for g in GRANULARITIES}
            impls.update({f"opforge {g} cached": cached(g, w) for g in GRANULARITIES})
            impls["F.linear"] = bf16_linear
            for g in GRANULARITIES:
                impls[f"torchao float8 {g}"] = torchao_module(K, N, w, g)
            for pass_ in ("fwd", "fwd+bwd"):
                group, by = [], {}
                for impl, fn in impls.items():
                    t, method = math.nan, ""
                    if fn is not None:
                        xl, wl = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
                        if isinstance(fn, torch.nn.Module):
                            step = ((lambda fn=fn: fn(x)) if pass_ == "fwd" else
                                    harness.fwd_bwd(fn, [xl], dy, params=list(fn.parameters())))
                        else:
                            step = (lambda fn=fn: fn(x, w)) if pass_ == "fwd" else harness.fwd_bwd(fn, [xl, wl], dy)
                        t, method = run.time_graphed(impl, lambda i, step=step: step(), 4)
                    tf = harness.tflops(harness.linear_flops(M, K, N, pass_), t)
                    by[impl] = run.add(NAME, (M, K, N), dtype, impl, pass_, t, tf, "TFLOP/s").time_us
                    group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(tf)}TF" + harness.method_note(method))
                run.say_case(NAME, pass_, dtype, (M, K, N), group)
                print("    F.linear / fp8_linear: " + ", ".join(
                    f"{g} {by['F.linear'] / by[f'opforge {g}']:.3f} (cached weight "
                    f"{by['F.linear'] / by[f'opforge {g} cached']:.3f})" for g in GRANULARITIES), flush=True)
            # the quantizer alone (the cast fp8_linear runs on each operand): GB/s of its minimal bytes (read the
            # input, write the FP8 data)
            nb = M * K * (x.element_size() + 1)
            for g in GRANULARITIES:
                quantizers = {"opforge": lambda g=g: opforge.quantize_fp8(x, None, g),
                              "torch ops": lambda g=g: testing.quantize_fp8_reference(x, None, g)}
                group = []
                for impl, fn in quantizers.items():
                    t, _ = run.time_graphed(impl, lambda i, fn=fn: fn(), 4)
                    run.add(f"quantize_fp8 {g}", (M, K), dtype, impl, "fwd", t, harness.gbps(nb, t), "GB/s")
                    group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(harness.gbps(nb, t), 0)}GB/s")
                run.say_case(f"quantize_fp8 {g}", "fwd", dtype, (M, K), group)
            del x, w, dy, impls
            run.release()
    producers(run)
    return run.finish()


def producers(run) -> None:
    """The kernels that hand their output's amax to the FP8 GEMM reading it (the patch's input_layernorm, residual
    add + post_attention_layernorm and SwiGLU at the Llama shapes): each private `*_amax` op against the same op
    without the amax, the op followed by the separate amax pass it replaces (quantize_fp8's tensorwise cast includes
    it: measured as the op then quantize_fp8, against the `*_amax` op then the same cast reading the given amax,
    `_fp8_linear_quantized`'s path, not separately callable) and a device copy of the same bytes (the ceiling). GB/s
    of the op's minimal bytes: its inputs read once, its outputs written once."""
    device, dtype = run.device, torch.bfloat16
    M, D, I = (8192, 2048, 8192) if device.startswith("cuda") else (512, 256, 1024)
    x = torch.randn(M, D, device=device, dtype=dtype)
    res = torch.randn(M, D, device=device, dtype=dtype)
    nw = torch.rand(D, device=device, dtype=dtype) + 0.5
    gu = torch.randn(M, 2 * I, device=device, dtype=dtype)
    ops = torch.ops.opforge
    cases = {
        "rms_norm": ((M, D), 2 * M * D * 2, {
            "op": lambda: ops._rms_norm_forward(x, [D], nw, 1e-6),
            "op + amax": lambda: ops._rms_norm_forward_amax(x, [D], nw, 1e-6),
            "op, then quantize_fp8": lambda: opforge.quantize_fp8(ops._rms_norm_forward(x, [D], nw, 1e-6)[0]),
        }),
        "fused_add_rms_norm": ((M, D), 4 * M * D * 2, {
            "op": lambda: ops._fused_add_rms_norm_forward(x, res, [D], nw, 1e-6),
            "op + amax": lambda: ops._fused_add_rms_norm_forward_amax(x, res, [D], nw, 1e-6),
            "op, then quantize_fp8": lambda: opforge.quantize_fp8(
                ops._fused_add_rms_norm_forward(x, res, [D], nw, 1e-6)[0]),
        }),
        "swiglu_packed": ((M, 2 * I), 3 * M * I * 2, {
            "op": lambda: ops.swiglu_packed(gu),
            "op + amax": lambda: ops._swiglu_packed_amax(gu),
            "op, then quantize_fp8": lambda: opforge.quantize_fp8(ops.swiglu_packed(gu)),
        }),
    }
    for name, (shape, nbytes, impls) in cases.items():
        if not all(hasattr(ops, n) for n in ("_rms_norm_forward_amax", "_swiglu_packed_amax")):
            print(f"  [n/a] {name}: this build has no amax-producing ops", file=sys.stderr)
            return
        src = torch.empty(nbytes // 2 // 2, device=device, dtype=dtype)
        dst = torch.empty_like(src)
        impls = dict(impls, **{"device copy (same bytes)": lambda src=src, dst=dst: dst.copy_(src)})
        group = []
        with torch.no_grad():
            for impl, fn in impls.items():
                t, _ = run.time_graphed(impl, lambda i, fn=fn: fn(), 4)
                run.add(f"fp8 producer {name}", shape, dtype, impl, "fwd", t, harness.gbps(nbytes, t), "GB/s")
                group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(harness.gbps(nbytes, t), 0)}GB/s")
        run.say_case(f"fp8 producer {name}", "fwd", dtype, shape, group)
        run.release()
