"""Per-call host time of opforge's Python functions against their torch counterparts.

On small CPU tensors (input 4×8, weight 8×8, bias 8) the kernels cost next to nothing, so the time per call
is the call overhead: Python, argument parsing, the dispatcher, the autograd node when a gradient is
needed, the checks and the output allocation. Goal: opforge.linear ≤ 1.1× F.linear.

Each variant is a callable and its arguments, called ``--calls`` times back to back by
``itertools.starmap`` (C code, no Python frame of the benchmark's own, as a user's ``y = f(x, w, b)``
line); the loop is repeated ``--repeats`` times, round-robin over the variants (so drift hits all alike),
and the median per-call time is kept. For context, ATen's own linear called through the same
Python-to-dispatcher path as any C++ custom op (``torch.ops.aten.linear.default``) is measured too:
F.linear's generated binding skips that path, which no op library without the Python C API can.

``--callgrind`` counts instructions instead (valgrind's callgrind, deterministic, unlike wall time on a
loaded machine): each variant runs in a child process under ``valgrind --tool=callgrind
--toggle-collect=starmap_next``, so only the timed calls are counted; instructions per call are printed
and recorded (unit "Ir/call"). ``--cpp`` builds benchmarks/cpp_overhead (the C++ API: opforge::linear
against at::linear) against ``--build-dir`` and records its rows.

    python benchmarks/bench_overhead.py                 # wall time, appends benchmarks/results/overhead_cpu.csv
    python benchmarks/bench_overhead.py --callgrind     # instructions per call (needs valgrind)
    python benchmarks/bench_overhead.py --cpp --build-dir build/dev   # + the C++ API's rows
"""
from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (it puts the source tree's python/ on sys.path without an installed opforge)
from common import Row  # noqa: E402
import opforge  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_calls(fn, args: tuple, calls: int) -> None:
    """fn(*args) `calls` times, from C (itertools.starmap), results dropped at once."""
    collections.deque(itertools.starmap(fn, itertools.repeat(args, calls)), maxlen=0)


def per_call_us(fn, args: tuple, calls: int) -> float:
    """Mean wall time of one fn(*args) over `calls` back-to-back calls, in microseconds."""
    t0 = time.perf_counter()
    run_calls(fn, args, calls)
    return (time.perf_counter() - t0) / calls * 1e6


def variants(requires_grad: bool, shape: str = "4x8x8") -> tuple[dict, dict]:
    """{name: (callable, args)} and {name: the name of its torch baseline}, for one grad mode and one linear
    problem ``MxKxN`` (input M×K, weight N×K, bias N)."""
    torch.manual_seed(0)
    M, K, N = (int(d) for d in shape.split("x"))
    x = torch.randn(M, K, requires_grad=requires_grad)
    w = torch.randn(N, K, requires_grad=requires_grad)
    b = torch.randn(N, requires_grad=requires_grad)
    bk = b if K == N else torch.randn(K, requires_grad=requires_grad)  # a (K,) weight for rms_norm, square_add
    ref_mod, our_mod = torch.nn.Linear(K, N), opforge.nn.Linear(K, N)
    our_mod.load_state_dict(ref_mod.state_dict())
    for m in (ref_mod, our_mod):
        m.requires_grad_(requires_grad)
    op = torch.ops.opforge.linear.default
    xwb = (x, w, b)
    v = {
        "F.linear": (F.linear, xwb),
        "opforge.linear": (opforge.linear, xwb),
        "torch.ops.opforge.linear.default": (op, xwb),  # the OpOverload: one Python frame (__call__)
        "torch.ops.opforge.linear": (torch.ops.opforge.linear, xwb),  # the OpOverloadPacket: resolves the overload
        "torch.ops.opforge.linear.default._op": (op._op, xwb),  # the C++ callable itself: the floor from Python
        "torch.ops.aten.linear.default": (torch.ops.aten.linear.default, xwb),
        "torch.ops.aten.linear.default._op": (torch.ops.aten.linear.default._op, xwb),
        "opforge.linear gelu": (opforge.linear, xwb + ("gelu",)),
        "F.gelu(F.linear)": (lambda x, w, b: F.gelu(F.linear(x, w, b)), xwb),
        "torch.nn.Linear": (ref_mod, (x,)),
        "opforge.nn.Linear": (our_mod, (x,)),
        # the floor of the boxed path: a near-empty ATen op (a bool from two sizes) through its generated binding
        # and through torch.ops, as any custom op is called
        "Tensor.is_same_size": (torch.Tensor.is_same_size, (x, x)),
        "torch.ops.aten.is_same_size.default._op": (torch.ops.aten.is_same_size.default._op, (x, x)),
        # the other functional wrappers, each against its torch counterpart (their inputs: x (M, K), bk (K,))
        "torch.sigmoid": (torch.sigmoid, (x,)),
        "opforge.sigmoid": (opforge.sigmoid, (x,)),
        "torch.square": (torch.square, (x,)),
        "opforge.square": (opforge.square, (x,)),
        "F.rms_norm": (F.rms_norm, (x, (K,), bk)),
        "opforge.rms_norm": (opforge.rms_norm, (x, (K,), bk)),
        "F.silu(gate) * up": (lambda g, u: F.silu(g) * u, (x, x)),
        "opforge.swiglu": (opforge.swiglu, (x, x)),
        "torch.square(x) + b": (lambda x, b: torch.square(x) + b, (x, bk)),
        "opforge.square_add": (opforge.square_add, (x, bk)),
    }
    base = {"Tensor.is_same_size": "Tensor.is_same_size",
            "torch.ops.aten.is_same_size.default._op": "Tensor.is_same_size",
            "opforge.linear gelu": "F.gelu(F.linear)", "F.gelu(F.linear)": "F.gelu(F.linear)",
            "torch.nn.Linear": "torch.nn.Linear", "opforge.nn.Linear": "torch.nn.Linear",
            "torch.sigmoid": "torch.sigmoid", "opforge.sigmoid": "torch.sigmoid",
            "torch.square": "torch.square", "opforge.square": "torch.square",
            "F.rms_norm": "F.rms_norm", "opforge.rms_norm": "F.rms_norm",
            "F.silu(gate) * up": "F.silu(gate) * up", "opforge.swiglu": "F.silu(gate) * up",
            "torch.square(x) + b": "torch.square(x) + b", "opforge.square_add": "torch.square(x) + b"}
    return v, {k: base.get(k, "F.linear") for k in v}


# ---- instruction counts (valgrind --tool=callgrind) ------------------------------------------------------

def callgrind_child(names: list[str], calls: int, shape: str) -> int:
    """Runs inside valgrind: for each "mode:name", warm up, then `calls` calls through starmap (the only code
    counted), then os.getppid(), the marker on which callgrind dumps the counts (and zeroes them)."""
    os.getppid()  # dump 1: whatever came before (nothing: collection is on inside starmap_next only)
    for item in names:
        mode, name = item.split(":", 1)
        fn, args = variants(mode == "requires_grad", shape)[0][name]
        for _ in range(200):  # warm-up outside starmap: caches, lazy inits, the dispatcher's first-call paths
            fn(*args)
        run_calls(fn, args, calls)
        os.getppid()
    return 0


def callgrind_ir(names: list[str], calls: int, threads: int, keep: Path | None, shape: str) -> list[float]:
    """Instructions per call of each "mode:name" variant, in one child process under callgrind (collection on
    inside starmap_next only, one dump per variant at the os.getppid() marker)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=starmap_next",
               "--dump-before=os_getppid", f"--callgrind-out-file={out}", sys.executable,
               str(Path(__file__).resolve()), "--_callgrind-child", "|".join(names), "--calls", str(calls),
               "--threads", str(threads), "--shape", shape]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        dumps = sorted(Path(tmp).glob("callgrind.out.*"), key=lambda f: int(f.suffix[1:]))
        if len(dumps) < len(names) + 1:
            raise RuntimeError(f"callgrind wrote {len(dumps)} dumps for {len(names)} variants")
        irs = []
        for name, dump in zip(names, dumps[1:]):
            text = dump.read_text(errors="replace")
            m = re.search(r"^(?:summary|totals):\s*(\d+)", text, re.M)
            irs.append(int(m.group(1)) / calls if m else float("nan"))
            if keep is not None:  # for callgrind_annotate --inclusive=yes
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(dump, keep / f"callgrind.{re.sub(r'[^A-Za-z0-9_.]+', '_', name)}.out")
        return irs


# ---- the C++ API (benchmarks/cpp_overhead) ----------------------------------------------------------------

def cpp_rows(build_dir: Path, calls: int, repeats: int) -> list[Row]:
    """Configure, build and run benchmarks/cpp_overhead against opforge's build tree `build_dir`."""
    out = build_dir.parent / "cpp_overhead"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(HERE / "cpp_overhead"), "-B", str(out), *gen, "-DCMAKE_BUILD_TYPE=Release",
                    f"-DOPFORGE_BUILD_DIR={build_dir.resolve()}", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "-j1"], check=True, stdout=subprocess.DEVNULL)
    text = subprocess.run([str(out / "cpp_overhead"), str(calls), str(repeats), "--csv"], check=True,
                          capture_output=True, text=True).stdout
    rows = []
    for line in text.splitlines():
        impl, mode, t, ratio = line.split(",")
        rows.append(Row("linear_overhead_cpp", "4x8x8", "float32", impl, mode, float(t), float(ratio), "x baseline"))
    return rows


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
    p.add_argument("--shape", default="4x8x8", help="the linear problem MxKxN: input M×K, weight N×K, bias N")
    p.add_argument("--only", default=None, help="comma-separated variant names (and their baselines)")
    p.add_argument("--callgrind", action="store_true", help="instructions per call under valgrind, not wall time")
    p.add_argument("--callgrind-keep", type=Path, default=None,
                   help="folder to keep each variant's callgrind.out in (for callgrind_annotate --inclusive=yes)")
    p.add_argument("--cpp", action="store_true", help="also build and run benchmarks/cpp_overhead (the C++ API)")
    p.add_argument("--build-dir", type=Path, default=common.REPO_ROOT / "build" / "dev",
                   help="opforge's CMake build tree for --cpp (holding libopforge.so)")
    p.add_argument("--_callgrind-child", dest="child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        return callgrind_child(args.child.split("|"), args.calls, args.shape)
    if args.quick:
        args.calls, args.repeats = min(args.calls, 500), min(args.repeats, 5)

    rows: list[Row] = []
    selected = {}
    for requires_grad in (False, True):
        v, base = variants(requires_grad, args.shape)
        if args.only:
            wanted = {s.strip() for s in args.only.split(",")}
            wanted |= {base[k] for k in wanted if k in base}
            v = {k: fv for k, fv in v.items() if k in wanted}
        selected["requires_grad" if requires_grad else "no_grad"] = (v, base)
    if args.callgrind:  # every variant in one valgrind run (torch's import under valgrind takes minutes)
        names = [f"{mode}:{k}" for mode, (v, _) in selected.items() for k in v]
        irs = dict(zip(names, callgrind_ir(names, args.calls, args.threads, args.callgrind_keep, args.shape)))
        for mode, (v, base) in selected.items():
            for k in v:
                ir, ref = irs[f"{mode}:{k}"], irs.get(f"{mode}:{base[k]}", float("nan"))
                print(f"  {mode:13s} {k:40s} {ir:10.0f} Ir/call", flush=True)
                rows.append(Row("linear_overhead_ir", args.shape, "float32", k, mode, float("nan"), ir / ref,
                                f"x baseline ({ir:.0f} Ir/call)"))
    else:
        for mode, (v, base) in selected.items():
            times = {k: [] for k in v}
            for fn, a in v.values():  # warm-up
                per_call_us(fn, a, max(1, args.calls // 4))
            for _ in range(args.repeats):
                for k, (fn, a) in v.items():
                    times[k].append(per_call_us(fn, a, args.calls))
            med = {k: statistics.median(t) for k, t in times.items()}
            for k, t in med.items():
                rows.append(Row("linear_overhead", args.shape, "float32", k, mode, t, t / med[base[k]], "x baseline"))
    if args.cpp:
        rows += cpp_rows(args.build_dir, args.calls * 10, args.repeats)
    what = "instructions per call (callgrind)" if args.callgrind else "call overhead"
    print(f"{what}: {common.device_name('cpu')}, torch {torch.__version__}, commit {common.git_commit()}")
    print("(metric: value / the matching torch call: F.linear, F.gelu(F.linear), torch.nn.Linear, torch.sigmoid, ...)")
    common.print_table(rows)
    if not args.no_save:
        path = common.write_csv(rows, "overhead_cpu", "cpu")
        print(f"\nappended {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
