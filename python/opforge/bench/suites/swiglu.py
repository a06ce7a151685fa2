"""swiglu and swiglu_packed (forward, forward+backward) against PyTorch eager and torch.compile of the same math, in
float32 and bfloat16, on the output gu (M, 2I) of a fused gate/up projection.

Rows per (M, I):
    swiglu          opforge.swiglu(gu[..., :I], gu[..., I:]) (the column views, read in place on CUDA; its two
                    gradients are concatenated into grad(gu) by autograd), eager F.silu(gate) * up on the views,
                    torch.compile of that;
    swiglu_packed   opforge.swiglu_packed(gu) (one gradient, grad(gu) written by the kernel), the same eager and
                    compiled peers (eager: the two halves + autograd's accumulation into grad(gu)), and
                    opforge.swiglu on the views as opforge's variant.

GB/s by the minimal-bytes rule, for M·I output elements of s bytes:
    fwd: read gu (2·M·I), write y (M·I) = 3·M·I·s;  fwd+bwd: + read dy, read gu, write grad(gu) = 8·M·I·s.
Before timing, opforge's outputs are checked against opforge.testing's float64 references.

    python -m opforge bench --ops swiglu [--quick]
    python benchmarks/bench_swiglu.py --device cpu --quick
"""
from __future__ import annotations

import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import swiglu_packed_reference

from .. import harness

NAME = "swiglu"
# (M tokens, I intermediate): the Llama-style MLP widths; 8192 x 8192 is the case the packed op was made for
CUDA_SHAPES = [(8192, 8192), (8192, 14336), (8191, 5120)]
CPU_SHAPES = [(1024, 1024), (769, 4100)]


# The PyTorch math, as Python functions of their own (what torch.compile compiles).
def eager_swiglu_views(gu):
    """F.silu(gate) * up on the two column halves of gu."""
    I = gu.shape[-1] // 2
    return TF.silu(gu[..., :I]) * gu[..., I:]


def opforge_swiglu_views(gu):
    """opforge.swiglu on the two column halves of gu."""
    I = gu.shape[-1] // 2
    return opforge.swiglu(gu[..., :I], gu[..., I:])


OPS = {
    # name: {impl: fn of gu}; torch.compile is added below (of the eager fn)
    "swiglu": {"opforge": opforge_swiglu_views, "eager": eager_swiglu_views},
    "swiglu_packed": {"opforge": opforge.swiglu_packed, "opforge.swiglu (views)": opforge_swiglu_views,
                      "eager": eager_swiglu_views},
}


def minimal_bytes(pass_: str, M: int, I: int, elem: int) -> int:
    """The bytes one call must move (the module's docstring)."""
    return (3 if pass_ == "fwd" else 8) * M * I * elem


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=[torch.float32, torch.bfloat16], warmup=(10, 2),
                       reps=((20, 50), (5, 15)))
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_SHAPES[:1] + CUDA_SHAPES[-1:], CPU_SHAPES[:1] + CPU_SHAPES[-1:])
    comp = None if run.args.no_compile else harness.compiled(eager_swiglu_views, fullgraph=True, dynamic=False)
    for op, fns in OPS.items():
        impls = {**fns, "torch.compile": comp}
        for dtype in run.dtypes:
            for M, I in shapes:
                gu = (torch.randn(M, 2 * I, device=run.device) * 3).to(dtype)
                grad_inputs = [gu.detach().clone().requires_grad_()]
                harness.check_reference(f"{op} {harness.dtype_str(dtype)} {M}x{I}", fns["opforge"](gu),
                                        swiglu_packed_reference(gu.double()), eager_swiglu_views(gu))
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
                            t = run.time(harness.fwd_bwd(fn, grad_inputs, dy))
                        row = run.add(op, (M, I), dtype, impl, pass_, t, harness.gbps(nb, t), "GB/s")
                        group.append(f"{impl} {harness._fmt(row.metric)}")
                    run.say_case(op, pass_, dtype, (M, I), group, ", ")
                del gu, grad_inputs, dy
                run.release()
    return run.finish()

