"""Per-call host time of opforge.linear against torch.nn.functional.linear from Python (issue 4).

On small CPU tensors (input 4×8, weight 8×8, bias 8) the GEMM costs next to nothing, so the time per call
is the call overhead: Python, argument parsing, the dispatcher, the autograd node when a gradient is
needed, the checks and the output allocation. Each variant runs `--calls` calls in a timed loop; the
loop is repeated `--repeats` times, round-robin over the variants (so drift hits all alike), and the
median per-call time is kept. Goal: opforge.linear ≤ 1.1× F.linear. For context, ATen's own linear called
through the same Python-to-dispatcher path as any C++ custom op (torch.ops.aten.linear.default) is
measured too: F.linear's generated binding skips that path, which no op library without the Python C API
can.

    python benchmarks/bench_overhead.py            # appends benchmarks/results/overhead_cpu.csv
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Row  # noqa: E402

try:
    import opforge
except ImportError:  # running from a source tree: python/ is the package root
    sys.path.insert(0, str(common.REPO_ROOT / "python"))
    import opforge


def per_call_us(fn, calls: int) -> float:
    """Mean wall time of one fn() over `calls` back-to-back calls, in microseconds."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=25, help="timed loops per variant (median kept)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1: no pool wake-ups)")
    p.add_argument("--no-save", action="store_true", help="print only: no CSV")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="accepted for the shared benchmark command line; the tensors are CPU tensors either way "
                        "(the goal is host time per call)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.calls, args.repeats = min(args.calls, 500), min(args.repeats, 5)
    torch.set_num_threads(args.threads)

    rows: list[Row] = []
    op = torch.ops.opforge.linear.default
    aten_op = torch.ops.aten.linear.default  # ATen's own op through the same boxed Python path: the floor
    for requires_grad in (False, True):
        x = torch.randn(4, 8, requires_grad=requires_grad)
        w = torch.randn(8, 8, requires_grad=requires_grad)
        b = torch.randn(8, requires_grad=requires_grad)
        ref_mod, our_mod = torch.nn.Linear(8, 8), opforge.nn.Linear(8, 8)
        our_mod.load_state_dict(ref_mod.state_dict())
        for m in (ref_mod, our_mod):
            m.requires_grad_(requires_grad)
        variants = {
            "F.linear": lambda: F.linear(x, w, b),
            "opforge.linear": lambda: opforge.linear(x, w, b),
            "torch.ops.opforge.linear.default": lambda: op(x, w, b),
            "torch.ops.aten.linear.default": lambda: aten_op(x, w, b),
            "opforge.linear gelu": lambda: opforge.linear(x, w, b, "gelu"),
            "F.gelu(F.linear)": lambda: F.gelu(F.linear(x, w, b)),
            "torch.nn.Linear": lambda: ref_mod(x),
            "opforge.nn.Linear": lambda: our_mod(x),
        }
        times = {k: [] for k in variants}
        for fn in variants.values():  # warm-up
            per_call_us(fn, args.calls // 4)
        for _ in range(args.repeats):
            for k, fn in variants.items():
                times[k].append(per_call_us(fn, args.calls))
        med = {k: statistics.median(v) for k, v in times.items()}
        base = {"opforge.linear gelu": med["F.gelu(F.linear)"], "F.gelu(F.linear)": med["F.gelu(F.linear)"],
                "torch.nn.Linear": med["torch.nn.Linear"], "opforge.nn.Linear": med["torch.nn.Linear"]}
        mode = "requires_grad" if requires_grad else "no_grad"
        for k, t in med.items():
            ratio = t / base.get(k, med["F.linear"])
            rows.append(Row("linear_overhead", "4x8x8", "float32", k, mode, t, ratio, "x baseline"))
    print(f"linear call overhead: {common.device_name('cpu')}, torch {torch.__version__}, commit {common.git_commit()}")
    print("(metric: time / the matching torch call: F.linear, F.gelu(F.linear) or torch.nn.Linear)")
    common.print_table(rows)
    if not args.no_save:
        path = common.write_csv(rows, "overhead_cpu", "cpu")
        print(f"\nappended {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
