"""indexed_linear against a Python loop over experts and torch._grouped_mm (sort included).

Goals (H200, bf16):
  - training/prefill: T 4096, E 8, K = N = 4096, forward+backward ≥ 3× a Python loop over experts and ≥ 1.0×
    torch._grouped_mm with the sort (argsort, gather, offsets, scatter back) included;
  - decode: T 8, E 64, shrink (K 4096, N 16) and expand (K 16, N 4096) forward ≥ 0.8 of the copy ceiling in bytes
    touched (the selected experts' weights + input + output), the "copy" row being a device copy of that many
    bytes.

Metric: TFLOP/s (2·T·N·K forward, 3× for forward+backward) for the prefill shapes, GB/s of bytes touched for
decode. CUDA: harness.time_fn (events, L2 flushed, outliers dropped, median); decode rows by
harness.time_cuda_graph (device time). Before timing, opforge's output is checked against opforge.testing's
float64 reference.

    python -m opforge bench --ops indexed_linear [--quick]
    python benchmarks/bench_indexed_linear.py --device cpu --quick
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness

NAME = "indexed_linear"
CUDA_PREFILL = [(4096, 8, 4096, 4096), (16384, 8, 2048, 1024)]
CUDA_DECODE = [(8, 64, 16, 4096), (8, 64, 4096, 16)]  # (T, E, N, K): shrink K 4096 -> N 16, expand K 16 -> N 4096
CPU_PREFILL = [(512, 4, 256, 256)]
CPU_DECODE = [(8, 16, 16, 1024)]


def ours(x, w, index, b):
    """opforge.indexed_linear."""
    return opforge.indexed_linear(x, w, index, b)


def expert_loop(x, w, index, b):
    """A Python loop over experts (the common eager MoE implementation; one host sync per expert)."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    for e in range(w.shape[0]):
        rows = (index == e).nonzero().flatten()
        if rows.numel():
            out = out.index_copy(0, rows, F.linear(x[rows], w[e], b[e]))
    return out


def grouped_mm(x, w, index, b):
    """torch._grouped_mm with the sort included: argsort, gather, int32 offsets, GEMM, bias, scatter back."""
    order = torch.argsort(index, stable=True)
    counts = torch.bincount(index, minlength=w.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    ys = torch._grouped_mm(x[order], w.transpose(1, 2), offs) + b[index[order]]
    return torch.empty_like(ys).index_copy(0, order, ys)


def check_against_reference(x, w, index, b, what: str) -> None:
    """opforge.indexed_linear against opforge.testing.indexed_linear_reference, the expert loop as the baseline, within
    the GEMM rounding bound K·u·(|x|·|w[index]|ᵀ) (opforge.testing.gemm_error_bound's rule, row by row)."""
    magnitudes = testing.indexed_linear_reference(x.double().abs(), w.double().abs(), index)
    bound = x.shape[-1] * torch.finfo(x.dtype).eps / 2 * magnitudes
    harness.check_reference(what, ours(x, w, index, b),
                            testing.indexed_linear_reference(x.double(), w.double(), index, b.double()),
                            expert_loop(x, w, index, b), bound=bound)


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(5, 1), reps=((10, 30), (3, 3)))
    device, cuda = run.device, run.cuda
    prefill = run.shapes(CUDA_PREFILL, CPU_PREFILL, CUDA_PREFILL[:1], CPU_PREFILL)
    decode = CUDA_DECODE if cuda else CPU_DECODE
    for dtype in run.dtypes:
        for T, E, N, K in prefill:
            x = torch.randn(T, K, device=device, dtype=dtype)
            w = (torch.randn(E, N, K, device=device) / K ** 0.5).to(dtype)
            b = torch.randn(E, N, device=device, dtype=dtype)
            index = torch.randint(0, E, (T,), device=device)
            dy = torch.randn(T, N, device=device, dtype=dtype)
            check_against_reference(x, w, index, b, f"{NAME} {harness.dtype_str(dtype)} T{T} E{E} {K}->{N}")
            leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
            bl = b.detach().clone().requires_grad_()
            impls = {"opforge": ours, "expert loop": expert_loop}
            if cuda and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
                impls["torch._grouped_mm+sort"] = grouped_mm
            shape = f"T{T} E{E} {K}->{N}"
            for pass_ in ("fwd", "fwd+bwd"):
                group = []
                for impl, fn in impls.items():
                    if pass_ == "fwd":
                        step = lambda fn=fn: fn(x, w, index, b)  # noqa: E731
                    else:
                        step = harness.fwd_bwd(lambda x_, w_, b_, fn=fn: fn(x_, w_, index, b_), [*leaves, bl], dy)
                    t = run.time(step)
                    flops = harness.linear_flops(T, K, N, pass_)
                    run.add(NAME, shape, dtype, impl, pass_, t, harness.tflops(flops, t), "TFLOP/s")
                    group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(harness.tflops(flops, t))}TF")
                run.say_case(NAME, pass_, dtype, shape, group)
            del x, w, b, dy, leaves, bl
        for T, E, N, K in decode:
            elem = torch.empty((), dtype=dtype).element_size()
            x = torch.randn(T, K, device=device, dtype=dtype)
            w = (torch.randn(E, N, K, device=device) / K ** 0.5).to(dtype)
            b = torch.randn(E, N, device=device, dtype=dtype)
            index = torch.randperm(E, device=device)[:T]  # distinct experts: every token streams its own weight
            check_against_reference(x, w, index, b, f"{NAME} {harness.dtype_str(dtype)} T{T} E{E} {K}->{N}")
            touched = (T * N * K + T * K + T * N + T * N) * elem
            src = torch.empty(touched // 2, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            impls = {"opforge": lambda: ours(x, w, index, b), "expert loop": lambda: expert_loop(x, w, index, b),
                     "copy": lambda: dst.copy_(src)}
            shape = f"T{T} E{E} {K}->{N}"
            group = []
            for impl, fn in impls.items():
                if impl != "expert loop":
                    t, _ = run.time_graphed(impl, lambda i, fn=fn: fn(), 50)
                else:
                    t = run.time(fn)
                run.add(NAME, shape, dtype, impl, "fwd", t, harness.gbps(touched, t), "GB/s")
                group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(harness.gbps(touched, t), 0)}GB/s")
            run.say(f"{NAME} decode fwd {harness.dtype_str(dtype)} {shape} ({touched} bytes)", group)
    return run.finish()

