"""Benchmark rms_norm and fused_add_rms_norm against PyTorch eager, torch.compile and Liger-Kernel.

    python benchmarks/bench_rms_norm.py                  # CUDA: issue 3's shapes, bf16 and fp32
    python benchmarks/bench_rms_norm.py --device cpu     # CPU goal: (4096, 4096) fp32 and bf16

Each row: median time over repetitions (CUDA: CUDA events, warm-up, L2 flushed before each repetition;
CPU: perf_counter) and GB/s by the minimal-bytes rule:
  forward:           read x, weight; write y                              = 2·M·N·e + N·e_w
  forward+backward:  forward + read x, dy; write dx, dweight               = 5·M·N·e + 2·N·e_w
  fused forward:     read x, residual, weight; write y, residual_out       = 4·M·N·e + N·e_w
Peers: F.rms_norm (eager), torch.compile of the composed formula, Liger-Kernel's LigerRMSNormFunction /
LigerFusedAddRMSNormFunction when importable (else "missing"). Results append to
benchmarks/results/rms_norm_<device>.csv with the device name, torch version and git commit.

Timing, device name and commit come from the shared harness, benchmarks/common.py.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import common  # noqa: E402
import opforge  # noqa: E402

CUDA_SHAPES = [(32768, 4096), (16384, 8192), (4096, 8192), (65536, 1024), (4096, 16384), (8, 4096)]
CPU_SHAPES = [(4096, 4096)]
EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}

# ---- implementations -----------------------------------------------------------------------------------


def composed_rms_norm(x, w, eps: float = EPS):
    """The formula as a model writes it (Llama's RMSNorm): fp32 math, cast back, scale."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def composed_add_rms_norm(x, r, w, eps: float = EPS):
    z = x + r
    return composed_rms_norm(z, w, eps), z


def liger_functions():
    rms = fused = None
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        rms = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)  # noqa: E731
    except Exception:
        pass
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        fused = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS)  # noqa: E731
    except Exception:
        pass
    return rms, fused


def rms_impls(device: str, use_compile: bool):
    impls = {
        "opforge": lambda x, w: opforge.rms_norm(x, (x.shape[-1],), w, EPS),
        "eager": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
    }
    impls["compile"] = torch.compile(composed_rms_norm) if use_compile else None
    impls["liger"] = liger_functions()[0] if device == "cuda" else None
    return impls


def fused_impls(device: str, use_compile: bool):
    impls = {
        "opforge": lambda x, r, w: opforge.fused_add_rms_norm(x, r, (x.shape[-1],), w, EPS),
        "eager": lambda x, r, w: (lambda z: (F.rms_norm(z, (z.shape[-1],), w, EPS), z))(x + r),
    }
    impls["compile"] = torch.compile(composed_add_rms_norm) if use_compile else None
    impls["liger"] = liger_functions()[1] if device == "cuda" else None
    return impls


# ---- runs ---------------------------------------------------------------------------------------------------


def bench_shape(device, dtype, M, N, reps, use_compile):
    """Rows (op, mode, impl, ms, GB/s) for one (dtype, M, N)."""
    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(M, N, device=device, dtype=dtype)
    r = torch.randn(M, N, device=device, dtype=dtype)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    fwd_bytes = 2 * M * N * e + N * e
    fb_bytes = fwd_bytes + 3 * M * N * e + 2 * N * e
    fused_bytes = 4 * M * N * e + N * e
    rows = []

    def add(op, mode, impl, fn, nbytes):
        if fn is None:
            rows.append((op, mode, impl, float("nan"), float("nan")))
            return
        try:
            ms = common.time_fn(fn, device, warmup=5, reps=reps) / 1e3  # µs -> ms; NaN if fn raised
            rows.append((op, mode, impl, ms, nbytes / (ms * 1e-3) / 1e9))
        except Exception as err:  # a peer that fails on this shape/dtype is reported, not fatal
            print(f"  {impl} {op} {mode} failed: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
            rows.append((op, mode, impl, float("nan"), float("nan")))

    with torch.no_grad():
        for name, f in rms_impls(device, use_compile).items():
            add("rms_norm", "fwd", name, (lambda f=f: f(x, w)) if f else None, fwd_bytes)
    for name, f in rms_impls(device, use_compile).items():
        fn = None
        if f is not None:
            def fn(f=f):
                torch.autograd.grad(f(xg, wg), (xg, wg), dy)
        add("rms_norm", "fwd+bwd", name, fn, fb_bytes)
    with torch.no_grad():
        for name, f in fused_impls(device, use_compile).items():
            add("fused_add_rms_norm", "fwd", name, (lambda f=f: f(x, r, w)) if f else None, fused_bytes)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32, fp16")
    p.add_argument("--shapes", default=None, help="e.g. 32768x4096,8x4096 (default: issue 3's list for the device)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default 50 CUDA, 20 CPU)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (slow to compile on CPU)")
    p.add_argument("--csv", default=None, help="output CSV (default benchmarks/results/rms_norm_<device>.csv)")
    args = p.parse_args(argv)

    device = args.device
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else (CUDA_SHAPES if device == "cuda" else CPU_SHAPES))
    reps = args.reps or (50 if device == "cuda" else 20)
    csv_path = Path(args.csv or Path(__file__).parent / "results" / f"rms_norm_{device}.csv")
    meta = {"device": common.device_name(device), "torch": torch.__version__, "commit": common.git_commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(f"# {meta['device']} | torch {meta['torch']} | opforge {meta['commit']} | {meta['date']}")
    print(f"# command: python {' '.join([os.path.relpath(__file__)] + (argv or sys.argv[1:]))}")

    results = []
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for M, N in shapes:
            for row in bench_shape(device, dtype, M, N, reps, not args.no_compile):
                results.append((dname, M, N) + row)

    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as fh:
        wr = csv.writer(fh)
        if new:
            wr.writerow(["date", "device", "torch", "commit", "op", "mode", "dtype", "M", "N", "impl", "time_ms", "gbps"])
        for dname, M, N, op, mode, impl, ms, gbps in results:
            wr.writerow([meta["date"], meta["device"], meta["torch"], meta["commit"], op, mode, dname, M, N, impl,
                         f"{ms:.5f}", f"{gbps:.1f}"])

    # table: one line per (op, mode, dtype, shape), GB/s per implementation, opforge / best peer
    impls = ["opforge", "eager", "compile", "liger"]
    head = f"{'op':<19}{'mode':<8}{'dtype':<6}{'M x N':>13} " + "".join(f"{i + ' GB/s':>14}" for i in impls)
    print(head + f"{'vs best peer':>14}")
    keyed = {}
    for dname, M, N, op, mode, impl, ms, gbps in results:
        keyed.setdefault((op, mode, dname, M, N), {})[impl] = gbps
    for (op, mode, dname, M, N), g in keyed.items():
        cells = "".join((f"{g[i]:>14.0f}" if g[i] >= 100 else f"{g[i]:>14.2f}") if g.get(i) == g.get(i)
                        else f"{'missing':>14}" for i in impls)
        peers = [g[i] for i in impls[1:] if i in g and g[i] == g[i]]
        ratio = g["opforge"] / max(peers) if peers and g["opforge"] == g["opforge"] else float("nan")
        print(f"{op:<19}{mode:<8}{dname:<6}{f'{M}x{N}':>13} {cells}{ratio:>13.2f}x")
    print(f"# wrote {csv_path}")


if __name__ == "__main__":
    main()
