"""``python -m opforge bench``: every op family's benchmark on this machine, one table, CSV + PNG.

The op families are the scripts ``benchmarks/bench_<family>.py`` of the source tree (``OPFORGE_BENCHMARKS``
names another folder); each runs in a process of its own (:mod:`opforge.bench._run_family`, its output streamed
through) on the shared harness (:mod:`opforge.bench.harness`), with ``--device``, ``--quick`` and ``--out``
passed on, so no CUDA, RNG or torch.compile state of one family reaches the next, and a family that fails, even
by a CUDA error that poisons its context or a crash of its process, is reported and the others still run.
The summary table has one line per (op, shape, dtype, pass): opforge's time and its GB/s or TFLOP/s, then the
speed-up of opforge over eager PyTorch, torch.compile and each installed peer (a ratio > 1 means opforge is
faster; "fallback" marks a compile peer that ran eagerly).

    python -m opforge bench                       # every family, this machine's default device
    python -m opforge bench --quick --ops rms_norm --out /tmp/b
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from . import harness

#: Benchmarks that are not an op family (they measure something else) and are not run by the CLI.
NOT_OP_FAMILIES = ("overhead", "hf_llama")  # host overhead; the model-level train-step table (its own columns: tokens/s, memory, loss)


def benchmarks_dir() -> Optional[Path]:
    """The folder of the bench_<family>.py scripts: $OPFORGE_BENCHMARKS, else the source tree's benchmarks/,
    else ./benchmarks; None when none exists (an installed package without its source tree)."""
    candidates = [os.environ.get("OPFORGE_BENCHMARKS"), harness.REPO_ROOT / "benchmarks", Path.cwd() / "benchmarks"]
    for c in candidates:
        if c and (Path(c) / "common.py").exists():
            return Path(c)
    return None


def discover(folder: Path) -> Dict[str, Path]:
    """``{family: path}`` for every ``bench_<family>.py`` in ``folder`` that is an op family, sorted by name."""
    found = {p.stem[len("bench_"):]: p for p in sorted(folder.glob("bench_*.py"))}
    return {k: v for k, v in found.items() if k not in NOT_OP_FAMILIES}


def _child_env() -> Dict[str, str]:
    """The environment of a family's process: this one's, with the folder of this opforge package first on
    PYTHONPATH (so the child imports the same copy, installed or from a source tree)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _stream_target(stream) -> Optional[int]:
    """None (the child inherits the file descriptor) when ``stream`` is a real file, else subprocess.PIPE."""
    try:
        stream.fileno()
        return None
    except (AttributeError, OSError, ValueError):  # e.g. replaced by io.StringIO
        return subprocess.PIPE


def _forward(pipe, stream) -> None:
    for line in iter(pipe.readline, ""):
        stream.write(line)
        stream.flush()
    pipe.close()


def run_family(path: Path, args: List[str]) -> Tuple[List[harness.Row], str, str]:
    """Run one family's ``main(args)`` in a process of its own (:mod:`opforge.bench._run_family`).

    Args:
        path: its ``bench_<family>.py``. args: the arguments of its ``main()``.
    Returns:
        (the rows it measured, also those before a failure; "" when it ran, else why it failed as one line;
        the device's name as the child saw it, "" when unknown).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    fd, result = tempfile.mkstemp(prefix="opforge_bench_", suffix=".json")
    os.close(fd)
    try:
        out_t, err_t = _stream_target(sys.stdout), _stream_target(sys.stderr)
        proc = subprocess.Popen([sys.executable, "-m", "opforge.bench._run_family", str(path), result, *args],
                                env=_child_env(), stdout=out_t, stderr=err_t, text=True)
        threads = [threading.Thread(target=_forward, args=(pipe, stream), daemon=True)
                   for pipe, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)) if pipe is not None]
        for t in threads:
            t.start()
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C: stop the child too
            proc.kill()
            proc.wait()
            raise
        for t in threads:
            t.join()
        try:
            payload = json.loads(Path(result).read_text() or "null")
        except (OSError, ValueError):
            payload = None
    finally:
        try:
            os.unlink(result)
        except OSError:
            pass
    if payload is None:  # no result: the process died (a signal, os._exit, a fatal CUDA error)
        try:
            why = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        except ValueError:
            why = f"exit status {code}"
        return [], f"its process ended without a result ({why})", ""
    rows = [harness.Row(**r) for r in payload.get("rows", [])]
    status = payload.get("status", code)
    if payload.get("error"):
        failure = payload["error"]
    elif status:
        failure = f"exit status {status}"
    else:
        failure = ""
    return rows, failure, payload.get("device_name", "")


def summarize(rows: List[harness.Row]) -> List[List[str]]:
    """One line per (op, shape, dtype, pass): opforge's time and metric, and its speed-up over every other impl.

    Args:
        rows: the harness rows of one or more benchmarks.
    Returns:
        The table's lines as strings; the first is the header: op, shape, dtype, pass, opforge µs, metric,
        then ``vs <impl>`` per other impl (``t_impl / t_opforge``; "n/a" where that impl did not run,
        "+fallback" where a compile peer ran eagerly).
    """
    groups: Dict[tuple, Dict[str, harness.Row]] = {}
    for r in rows:
        groups.setdefault((r.op, r.shape, r.dtype, r.pass_), {})[r.impl] = r
    # only the impls that ran next to an opforge row of these rows (one family's peers, not every family's)
    others = list(dict.fromkeys(r.impl for r in rows if r.impl != "opforge"
                                and "opforge" in groups[(r.op, r.shape, r.dtype, r.pass_)]))
    table = [["op", "shape", "dtype", "pass", "opforge us", "opforge metric"] + [f"vs {o}" for o in others]]
    for (op, shape, dtype, pass_), impls in groups.items():
        ours = impls.get("opforge")
        if ours is None:
            continue
        line = [op, shape, dtype, pass_, harness._fmt(ours.time_us), f"{harness._fmt(ours.metric)} {ours.unit}"]
        for o in others:
            peer = impls.get(o)
            if peer is None or math.isnan(peer.time_us) or math.isnan(ours.time_us) or ours.time_us <= 0:
                line.append("n/a")
            else:
                line.append(f"{peer.time_us / ours.time_us:.2f}x" + (" +fallback" if peer.fallback else ""))
        table.append(line)
    return table


def summarize_by_op(rows: List[harness.Row]) -> List[List[List[str]]]:
    """:func:`summarize` per op (rows of one ``op`` value each, in the order they came): one table each, with
    only the peers that op was measured against, so a run of every family stays readable."""
    ops = list(dict.fromkeys(r.op for r in rows))
    tables = [summarize([r for r in rows if r.op == op]) for op in ops]
    return [t for t in tables if len(t) > 1]


def print_summary(table: List[List[str]], file=sys.stdout) -> None:
    """Print :func:`summarize`'s lines as aligned columns."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for k, row in enumerate(table):
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))), file=file)
        if k == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)), file=file)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m opforge bench [--ops a,b] [--quick] [--device d] [--out DIR]``.

    Returns:
        0 when every selected family ran, 1 when one failed (the others still run), 2 for a bad argument
        (unknown family, no benchmarks folder, a CUDA device on a machine without one).
    """
    p = argparse.ArgumentParser(prog="python -m opforge bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None, help="comma-separated op families (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="list the op families and exit")
    p.add_argument("--quick", action="store_true", help="few shapes and repetitions (CPU: a few minutes for every family)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--out", type=Path, default=Path("opforge_bench"),
                   help="folder of the CSV and PNG files (default: ./opforge_bench in the current directory)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"opforge bench: --device {args.device}, but torch {torch.__version__} sees no CUDA device: "
              "use --device cpu (`python -m opforge doctor` explains)", file=sys.stderr)
        return 2
    folder = benchmarks_dir()
    if folder is None:
        print("opforge bench: no benchmarks/ folder (the bench_<family>.py scripts live in the source tree): run "
              "from an opforge checkout or set OPFORGE_BENCHMARKS=<checkout>/benchmarks", file=sys.stderr)
        return 2
    families = discover(folder)
    # the commit of the checkout the benchmarks come from (an installed package knows none), for every family's
    # CSV rows and the summary line
    commit = harness.git_commit(folder.resolve().parent)
    if commit != "unknown":
        os.environ.setdefault("OPFORGE_GIT_COMMIT", commit)
    if args.list:
        print("\n".join(families))
        return 0
    selected = [s.strip() for s in args.ops.split(",") if s.strip()] if args.ops else list(families)
    unknown = [s for s in selected if s not in families]
    if unknown:
        print(f"opforge bench: expected --ops from {', '.join(families)}, but got {', '.join(unknown)}", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        tqdm = None
    # a bar on a terminal; in a log (stderr and stdout to one file) a bar's redraws would be glued onto the result
    # lines, so there one line per family, flushed
    bar = (tqdm(total=len(selected), desc="opforge bench", unit="family", file=sys.stderr)
           if tqdm and sys.stderr.isatty() else None)
    rows: List[harness.Row] = []
    failures, names, t0 = [], [], time.perf_counter()
    for i, family in enumerate(selected, 1):
        if bar is not None:
            bar.set_postfix_str(family)
        else:
            print(f"opforge bench: [{i}/{len(selected)}] {family} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
        sub = ["--device", args.device, "--out", str(out)] + (["--quick"] if args.quick else []) + \
              (["--no-compile"] if args.no_compile else [])
        family_rows, failure, name = run_family(families[family], sub)
        rows.extend(family_rows)
        names.append(name)
        if failure:  # one family failing must not lose the others
            failures.append(f"{family}: {failure}")
            print(f"opforge bench: {failures[-1]}", file=sys.stderr)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    device = next((n for n in names if n), None) or harness.device_name(args.device)
    print(f"\nopforge bench: {device}, torch {torch.__version__}, commit {harness.git_commit()}, "
          f"{time.perf_counter() - t0:.0f}s; ratios are peer time / opforge time (> 1: opforge faster)")
    if rows:
        for k, table in enumerate(summarize_by_op(rows)):
            if k:
                print(file=sys.stdout)
            print_summary(table)
    print(f"\nCSV and PNG files: {out}")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures or not rows else 0
