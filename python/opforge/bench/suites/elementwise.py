"""sigmoid, square and square_add (forward, forward+backward) against PyTorch eager and torch.compile of the same
math, in float32 and bfloat16.

GB/s by the minimal-bytes rule, for n elements of s bytes (square_add's other is a row of N):
    sigmoid, square   fwd: read x, write y = 2·n·s         fwd+bwd: + read dy and y (or x), write dx = 5·n·s
    square_add        fwd: 2·n·s + N·s                     fwd+bwd: 5·n·s + 2·N·s (+ write d(other))
Before timing, opforge's output is checked against opforge.testing's float64 reference.

    python -m opforge bench --ops elementwise [--quick]
    python benchmarks/bench_elementwise.py --device cpu --quick
"""
from __future__ import annotations

import torch

import opforge
from opforge import testing

from .. import harness

NAME = "elementwise"
CUDA_SHAPES = [(4096, 4096), (8192, 8192), (16384, 16384), (8191, 5120)]
CPU_SHAPES = [(1024, 1024), (4096, 4096), (769, 8200)]


# The PyTorch math, as Python functions of their own (what torch.compile compiles).
def eager_sigmoid(x):
    return torch.sigmoid(x)


def eager_square(x):
    return torch.square(x)


def eager_square_add(x, b):
    return x * x + b


OPS = {
    # name: (opforge fn, eager fn, takes other, float64 reference)
    "sigmoid": (opforge.sigmoid, eager_sigmoid, False, testing.sigmoid_reference),
    "square": (opforge.square, eager_square, False, testing.square_reference),
    "square_add": (opforge.square_add, eager_square_add, True, testing.square_add_reference),
}


def minimal_bytes(op: str, pass_: str, n: int, N: int, elem: int) -> int:
    """The bytes one call must move (the module's docstring) for n elements, a row of N, elem bytes each."""
    row = N * elem if op == "square_add" else 0
    if pass_ == "fwd":
        return 2 * n * elem + row
    return 5 * n * elem + 2 * row


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=[torch.float32, torch.bfloat16], warmup=(10, 2),
                       reps=((20, 50), (5, 15)))
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_SHAPES[:1] + CUDA_SHAPES[-1:], CPU_SHAPES[:1] + CPU_SHAPES[-1:])
    for op, (ours, eager, binary, reference) in OPS.items():
        comp = None if run.args.no_compile else harness.compiled(eager, fullgraph=True, dynamic=False)
        impls = {"opforge": ours, "eager": eager, "torch.compile": comp}
        for dtype in run.dtypes:
            for M, N in shapes:
                x = torch.randn(M, N, device=run.device, dtype=dtype)
                b = torch.randn(N, device=run.device, dtype=dtype)
                inputs = [x, b] if binary else [x]
                harness.check_reference(f"{op} {harness.dtype_str(dtype)} {M}x{N}", ours(*inputs),
                                        reference(*(t.double() for t in inputs)), eager(*inputs))
                grad_inputs = [t.detach().clone().requires_grad_() for t in inputs]
                dy = torch.randn_like(x)
                for pass_ in ("fwd", "fwd+bwd"):
                    nb = minimal_bytes(op, pass_, M * N, N, x.element_size())
                    group = []
                    for impl, fn in impls.items():
                        if fn is None:
                            t = float("nan")
                        elif pass_ == "fwd":
                            t = run.time(lambda fn=fn: fn(*inputs))
                        else:
                            t = run.time(harness.fwd_bwd(fn, grad_inputs, dy))
                        row = run.add(op, (M, N), dtype, impl, pass_, t, harness.gbps(nb, t), "GB/s")
                        group.append(f"{impl} {harness._fmt(row.metric)}")
                    run.say_case(op, pass_, dtype, (M, N), group, ", ")
                del x, b, inputs, grad_inputs, dy
                run.release()
    return run.finish()

