"""Benchmark swiglu and swiglu_packed (forward, forward+backward) against PyTorch eager and torch.compile of the
same math, in float32 and bfloat16, on the output gu (M, 2I) of a fused gate/up projection.

Rows per (M, I):
    swiglu          opforge.swiglu(gu[..., :I], gu[..., I:]) (the column views, read in place on CUDA; its two
                    gradients are concatenated into grad(gu) by autograd), eager F.silu(gate) * up on the views,
                    torch.compile of that;
    swiglu_packed   opforge.swiglu_packed(gu) (one gradient, grad(gu) written by the kernel), the same eager and
                    compiled peers (eager: the two halves + autograd's accumulation into grad(gu)).

GB/s by the minimal-bytes rule, for M·I output elements of s bytes:
    fwd: read gu (2·M·I), write y (M·I) = 3·M·I·s;  fwd+bwd: + read dy, read gu, write grad(gu) = 8·M·I·s.

    python benchmarks/bench_swiglu.py                 # CUDA when available
    python benchmarks/bench_swiglu.py --device cpu --quick
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as TF

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (it puts the source tree's python/ on sys.path without an installed opforge)
import opforge  # noqa: E402

NAME = "swiglu"
# (M tokens, I intermediate): the Llama-style MLP widths; 8192 x 8192 is the case the packed op was made for
CUDA_SHAPES = [(8192, 8192), (8192, 14336), (8191, 5120)]
CPU_SHAPES = [(1024, 1024), (769, 4100)]


# The PyTorch math, as Python functions of their own (what torch.compile compiles).
def eager_swiglu_views(gu):
    I = gu.shape[-1] // 2
    return TF.silu(gu[..., :I]) * gu[..., I:]


def opforge_swiglu_views(gu):
    I = gu.shape[-1] // 2
    return opforge.swiglu(gu[..., :I], gu[..., I:])


OPS = {
    # name: {impl: fn of gu}; torch.compile is added below (of the eager fn)
    "swiglu": {"opforge": opforge_swiglu_views, "eager": eager_swiglu_views},
    "swiglu_packed": {"opforge": opforge.swiglu_packed, "opforge.swiglu (views)": opforge_swiglu_views,
                      "eager": eager_swiglu_views},
}


def minimal_bytes(pass_: str, M: int, I: int, elem: int) -> int:
    return (3 if pass_ == "fwd" else 8) * M * I * elem


def main(argv=None) -> int:
    run = common.start(NAME, __doc__, argv, dtypes=[torch.float32, torch.bfloat16], warmup=(10, 2),
                       reps=((20, 50), (5, 15)))
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_SHAPES[:1] + CUDA_SHAPES[-1:], CPU_SHAPES[:1] + CPU_SHAPES[-1:])
    comp = None if run.args.no_compile else common.compiled(eager_swiglu_views, fullgraph=True, dynamic=False)
    for op, fns in OPS.items():
        impls = {**fns, "torch.compile": comp}
        for dtype in run.dtypes:
            for M, I in shapes:
                gu = (torch.randn(M, 2 * I, device=run.device) * 3).to(dtype)
                grad_inputs = [gu.detach().clone().requires_grad_()]
                dy = torch.randn(M, I, device=run.device, dtype=dtype)
                for pass_ in ("fwd", "fwd+bwd"):
                    nb = minimal_bytes(pass_, M, I, gu.element_size())
                    group = []
                    for impl, fn in impls.items():
                        if fn is None:
                            t = float("nan")
                        elif pass_ == "fwd":
                            t = run.time(lambda fn=fn: fn(gu), no_grad=True)
                        else:
                            t = run.time(common.fwd_bwd(fn, grad_inputs, dy))
                        row = run.add(op, (M, I), dtype, impl, pass_, t, common.gbps(nb, t), "GB/s")
                        group.append(f"{impl} {common._fmt(row.metric)}")
                    run.say_case(op, pass_, dtype, (M, I), group, ", ")
                del gu, grad_inputs, dy
                run.release()
    return run.finish()


if __name__ == "__main__":
    sys.exit(main())
