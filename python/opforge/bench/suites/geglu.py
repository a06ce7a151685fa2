"""geglu and geglu_packed (forward, forward+backward), both forms of gelu, against PyTorch eager and torch.compile of
the same math and Liger-Kernel's GELU-gated kernel, in float32 and bfloat16, on the output gu (M, 2I) of a fused
gate/up projection.

Rows per (approximate, M, I), the op named `geglu[none]`, `geglu_packed[tanh]`, ...:
    geglu           opforge.geglu(gu[..., :I], gu[..., I:], approximate) (the column views, read in place on CUDA;
                    autograd concatenates its two gradients into grad(gu)), eager
                    F.gelu(gate, approximate=approximate) * up on the views, torch.compile of that, and (tanh form,
                    CUDA, when liger_kernel imports) Liger's LigerGELUMulFunction on the views;
    geglu_packed    opforge.geglu_packed(gu, approximate) (one gradient, grad(gu) written by the kernel), the same
                    peers, and opforge.geglu on the views as opforge's variant.

GB/s by the minimal-bytes rule, for M·I output elements of s bytes:
    fwd: read gu (2·M·I), write y (M·I) = 3·M·I·s;  fwd+bwd: + read dy, read gu, write grad(gu) = 8·M·I·s.
Before timing, opforge's outputs are checked against opforge.testing's float64 references.

    python -m opforge bench --ops geglu [--quick]
    python benchmarks/bench_geglu.py --device cpu --quick
"""
from __future__ import annotations

import torch
import torch.nn.functional as TF

import opforge
from opforge.testing import geglu_packed_reference

from .. import harness

NAME = "geglu"
# (M tokens, I intermediate): Gemma-style MLP widths (Gemma 2 9B: I = 14336; Gemma 3 4B: I = 10240)
CUDA_SHAPES = [(8192, 8192), (8192, 14336), (8191, 10240)]
CPU_SHAPES = [(1024, 1024), (769, 4100)]
APPROXIMATIONS = ("none", "tanh")


# The PyTorch math, as Python functions of their own (what torch.compile compiles).
def eager_geglu_views(gu, approximate="none"):
    """F.gelu(gate, approximate=approximate) * up on the two column halves of gu."""
    I = gu.shape[-1] // 2
    return TF.gelu(gu[..., :I], approximate=approximate) * gu[..., I:]


def opforge_geglu_views(gu, approximate="none"):
    """opforge.geglu on the two column halves of gu."""
    I = gu.shape[-1] // 2
    return opforge.geglu(gu[..., :I], gu[..., I:], approximate)


def liger_geglu_views():
    """Liger-Kernel's GELU-gated function (tanh form) on the column halves of gu, or None when it is not importable."""
    f = harness.liger("LigerGELUMulFunction", "liger_kernel.ops.geglu")
    if f is None:
        return None

    def run(gu, approximate="tanh"):
        I = gu.shape[-1] // 2
        return f.apply(gu[..., :I], gu[..., I:])
    return run


def minimal_bytes(pass_: str, M: int, I: int, elem: int) -> int:
    """The bytes one call must move (the module's docstring)."""
    return (3 if pass_ == "fwd" else 8) * M * I * elem


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=[torch.float32, torch.bfloat16], warmup=(10, 2),
                       reps=((20, 50), (5, 15)))
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_SHAPES[:1] + CUDA_SHAPES[-1:], CPU_SHAPES[:1] + CPU_SHAPES[-1:])
    comp = None if run.args.no_compile else harness.compiled(eager_geglu_views, fullgraph=True, dynamic=False)
    liger = liger_geglu_views() if run.cuda else None
    ops = {
        # name: {impl: fn of (gu, approximate)}; torch.compile (and Liger, tanh form) added below
        "geglu": {"opforge": opforge_geglu_views, "eager": eager_geglu_views},
        "geglu_packed": {"opforge": opforge.geglu_packed, "opforge.geglu (views)": opforge_geglu_views,
                         "eager": eager_geglu_views},
    }
    for approximate in APPROXIMATIONS:
        for op, fns in ops.items():
            name = f"{op}[{approximate}]"
            impls = {**fns, "torch.compile": comp}
            if approximate == "tanh":
                impls["liger"] = liger
            for dtype in run.dtypes:
                for M, I in shapes:
                    gu = (torch.randn(M, 2 * I, device=run.device) * 3).to(dtype)
                    grad_inputs = [gu.detach().clone().requires_grad_()]
                    harness.check_reference(f"{name} {harness.dtype_str(dtype)} {M}x{I}",
                                            fns["opforge"](gu, approximate),
                                            geglu_packed_reference(gu.double(), approximate),
                                            eager_geglu_views(gu, approximate))
                    dy = torch.randn(M, I, device=run.device, dtype=dtype)
                    for pass_ in ("fwd", "fwd+bwd"):
                        nb = minimal_bytes(pass_, M, I, gu.element_size())
                        group = []
                        for impl, fn in impls.items():
                            if fn is None:
                                t = float("nan")
                            elif pass_ == "fwd":
                                t = run.time(lambda fn=fn: fn(gu, approximate), no_grad=True)
                            else:
                                t = run.time(harness.fwd_bwd(lambda x, fn=fn: fn(x, approximate), grad_inputs, dy))
                            row = run.add(name, (M, I), dtype, impl, pass_, t, harness.gbps(nb, t), "GB/s")
                            group.append(f"{impl} {harness._fmt(row.metric)}")
                        run.say_case(name, pass_, dtype, (M, I), group, ", ")
                    del gu, grad_inputs, dy
                    run.release()
    return run.finish()
