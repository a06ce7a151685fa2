"""Drives every opforge CUDA kernel once per case under compute-sanitizer (scripts/sanitize.sh).

Each case runs forward and backward on small odd sizes, in every floating dtype, with contiguous inputs and
with inputs whose base pointer is one element past an allocation's start (unaligned for 16-byte vector
loads), so that the vectorized and the scalar paths of each kernel both run. Values are not checked here
(the test suite does that); the sanitizer's verdict is the result. Ops that this build lacks are skipped and
listed. Prints one line per op and the number of calls made.

Usage: python tests/cuda/sanitize_driver.py [--quick]
"""
from __future__ import annotations

import argparse
import sys

import torch

import opforge

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def make(shape, dtype, unaligned, requires_grad=True):
    """A random CUDA tensor of `shape`; unaligned: a view starting one element into its storage."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.randn(n + 1, device="cuda", dtype=dtype)
    t = (buf[1:] if unaligned else buf[:n]).view(shape).detach()
    return t.requires_grad_(requires_grad)


def backward(outs, inputs):
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o is not None and o.requires_grad]
    if not outs:
        return
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)


def cases():
    """(op name, callable(dtype, unaligned) -> None) for every op family with CUDA kernels."""
    ops = torch.ops.opforge

    def linear(dt, u):
        for m, k, n in ((1, 64, 24), (7, 33, 5), (70, 256, 96)):
            x, w, b = make((m, k), dt, u), make((n, k), dt, u), make((n,), dt, u)
            for act in ("none", "relu", "gelu", "gelu_tanh", "silu"):
                backward(opforge.linear(x, w, b, activation=act), (x, w, b))

    def elementwise(dt, u):
        for shape in ((7,), (3, 83), (5, 769)):
            x = make(shape, dt, u)
            backward(opforge.sigmoid(x), (x,))
            backward(opforge.square(x), (x,))
            o = make(shape[-1:], dt, u)
            backward(opforge.square_add(x, o), (x, o))
            g, up = make(shape, dt, u), make(shape, dt, u)
            backward(opforge.swiglu(g, up), (g, up))

    def rms_norm(dt, u):
        for rows, n in ((3, 7), (5, 1000), (2, 5120), (1, 8200)):
            x, w, r = make((rows, n), dt, u), make((n,), dt, u), make((rows, n), dt, u)
            backward(opforge.rms_norm(x, [n], w), (x, w))
            backward(opforge.fused_add_rms_norm(x, r, [n], w), (x, r, w))

    out = [("linear", linear), ("elementwise", elementwise), ("rms_norm", rms_norm)]

    if hasattr(ops, "linear_cross_entropy"):
        def lce(dt, u):
            for bt, h, v in ((7, 32, 50), (64, 64, 1000)):
                x, w = make((bt, h), dt, u), make((v, h), dt, u)
                t = torch.randint(0, v, (bt,), device="cuda")
                t[::3] = -100
                backward(opforge.linear_cross_entropy(x, w, t), (x, w))
        out.append(("linear_cross_entropy", lce))
    if hasattr(ops, "rope"):
        def rope(dt, u):
            b, s, d = 2, 5, 64
            q, k = make((b, 4, s, d), dt, u), make((b, 2, s, d), dt, u)
            ang = torch.randn(b, s, d // 2, device="cuda", dtype=torch.float32)
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
            backward(opforge.rope(q, k, cos, sin), (q, k))
        out.append(("rope", rope))
    if hasattr(ops, "linear_cat"):
        def linear_cat(dt, u):
            xs = [make((5, 24), dt, u), make((5, 40), dt, u)]
            w, b = make((16, 64), dt, u), make((16,), dt, u)
            backward(opforge.linear_cat(xs, w, b), (*xs, w, b))
        out.append(("linear_cat", linear_cat))
    if hasattr(ops, "indexed_linear"):
        def indexed_linear(dt, u):
            for t in (3, 300):
                x, w, b = make((t, 32), dt, u), make((4, 24, 32), dt, u), make((4, 24), dt, u)
                idx = torch.randint(-1, 4, (t,), device="cuda")
                backward(opforge.indexed_linear(x, w, idx, b), (x, w, b))
        out.append(("indexed_linear", indexed_linear))
    if hasattr(ops, "fake_quant_linear"):
        def fake_quant_linear(dt, u):
            x, w, b = make((5, 64), dt, u), make((24, 64), dt, u), make((24,), dt, u)
            backward(opforge.fake_quant_linear(x, w, b), (x, w, b))
        out.append(("fake_quant_linear", fake_quant_linear))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="float32 and bfloat16 only, aligned inputs only")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("sanitize_driver: no CUDA device", file=sys.stderr)
        return 2
    dtypes = (torch.float32, torch.bfloat16) if args.quick else DTYPES
    aligned = (False,) if args.quick else (False, True)
    failures = 0
    for name, fn in cases():
        n = 0
        for dt in dtypes:
            for u in aligned:
                try:
                    fn(dt, u)
                except Exception as e:  # a Python-level error is a failure too (reported, others still run)
                    failures += 1
                    print(f"{name} {dt} unaligned={u}: {type(e).__name__}: {str(e).splitlines()[0]}")
                n += 1
        torch.cuda.synchronize()
        print(f"{name}: {n} dtype/alignment cases run")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
