"""Benchmark sigmoid, square and square_add (forward, forward+backward) against PyTorch eager and
torch.compile of the same math, in float32 and bfloat16.

GB/s by the minimal-bytes rule, for n elements of s bytes (square_add's other is a row of N):
    sigmoid, square   fwd: read x, write y = 2·n·s         fwd+bwd: + read dy and y (or x), write dx = 5·n·s
    square_add        fwd: 2·n·s + N·s                     fwd+bwd: 5·n·s + 2·N·s (+ write d(other))

    python benchmarks/bench_elementwise.py                 # CUDA when available
    python benchmarks/bench_elementwise.py --device cpu --quick
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Row  # noqa: E402

try:
    import opforge
except ImportError:  # running from a source tree: python/ is the package root
    sys.path.insert(0, str(common.REPO_ROOT / "python"))
    import opforge

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
    # name: (opforge fn, eager fn, takes other)
    "sigmoid": (opforge.sigmoid, eager_sigmoid, False),
    "square": (opforge.square, eager_square, False),
    "square_add": (opforge.square_add, eager_square_add, True),
}


def minimal_bytes(op: str, pass_: str, n: int, N: int, elem: int) -> int:
    row = N * elem if op == "square_add" else 0
    if pass_ == "fwd":
        return 2 * n * elem + row
    return 5 * n * elem + 2 * row


def main(argv=None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    device = args.device
    cuda = device.startswith("cuda")
    dtypes = common.parse_dtypes(args.dtypes, [torch.float32, torch.bfloat16])
    shapes = CUDA_SHAPES if cuda else CPU_SHAPES
    if args.quick:
        shapes = shapes[:1] + shapes[-1:]
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    reps = args.reps if args.reps is not None else ((20 if args.quick else 50) if cuda else (5 if args.quick else 15))

    rows: list[Row] = []
    for op, (ours, eager, binary) in OPS.items():
        comp = None if args.no_compile else common.compiled(eager, fullgraph=True, dynamic=False)
        impls = {"opforge": ours, "eager": eager, "torch.compile": comp}
        for dtype in dtypes:
            for M, N in shapes:
                x = torch.randn(M, N, device=device, dtype=dtype)
                b = torch.randn(N, device=device, dtype=dtype)
                inputs = [x, b] if binary else [x]
                grad_inputs = [t.detach().clone().requires_grad_() for t in inputs]
                dy = torch.randn_like(x)
                for pass_ in ("fwd", "fwd+bwd"):
                    nb = minimal_bytes(op, pass_, M * N, N, x.element_size())
                    for impl, fn in impls.items():
                        if fn is None:
                            t = float("nan")
                        elif pass_ == "fwd":
                            t = common.time_fn(lambda fn=fn: fn(*inputs), device, warmup=warmup, reps=reps)
                        else:
                            t = common.time_fn(common.fwd_bwd(fn, grad_inputs, dy), device, warmup=warmup, reps=reps)
                        rows.append(Row(op, common.shape_str((M, N)), common.dtype_str(dtype), impl, pass_, t,
                                        common.gbps(nb, t), "GB/s"))
                    print(f"  {op} {pass_} {common.dtype_str(dtype)} {M}x{N}: " + ", ".join(
                        f"{r.impl} {common._fmt(r.metric)}" for r in rows[-len(impls):]), flush=True)
                del x, b, inputs, grad_inputs, dy
                if cuda:
                    torch.cuda.empty_cache()
    common.finish(rows, NAME, device, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
