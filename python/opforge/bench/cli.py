"""``python -m opforge bench``: every op family's benchmark on this machine, one table, CSV + PNG.

The op families are the suites of the package (`opforge.bench.suites`, one module a family), so the command
works wherever opforge is installed. Each runs in a process of its own (`opforge.bench._run_family`, its output
streamed through) on the shared harness (`opforge.bench.harness`), with ``--device``, ``--quick`` and ``--out``
passed on, so no CUDA, RNG or torch.compile state of one family reaches the next, and a family that fails, even by a
CUDA error that poisons its context or a crash of its process, is reported and the others still run.

The summary has one table per op and one line per (shape, dtype, pass): opforge's time and its GB/s or TFLOP/s, then
the speed-up of opforge over each peer that ran beside it (eager PyTorch, torch.compile, Liger-Kernel, ...: a ratio
> 1 means opforge is faster; "fallback" marks a compile peer that ran eagerly). opforge's own variants (other
kernels, other activations) and the ceilings (a device copy, a GEMM floor) are in the family's table and CSV, not in
the summary. A ratio whose timings stayed noisy (spread above harness.NOISY_SPREAD) is marked with ``?``.

    python -m opforge bench                       # every family, this machine's default device
    python -m opforge bench --quick --ops rms_norm --out /tmp/b
    python -m opforge bench --plot benchmarks/results/rms_norm.csv   # redraw a family's plot from its CSV
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from . import harness, suites

#: The package whose modules are the families (``--suites`` names another).
SUITES = suites.__name__


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


def run_family(module: str, args: List[str], command: str = "") -> Tuple[List[harness.Row], str, str]:
    """Run one family's ``main(args)`` in a process of its own (`opforge.bench._run_family`).

    Args:
        module: the suite's module (``opforge.bench.suites.rms_norm``). args: the arguments of its ``main()``.
        command: the command line its CSV rows record (default: the child's own).
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
        proc = subprocess.Popen([sys.executable, "-m", "opforge.bench._run_family", module, result, command, *args],
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
    """One line per (op, shape, dtype, pass): opforge's time and metric, and its speed-up over every peer.

    Args:
        rows: the harness rows of one or more benchmarks.
    Returns:
        The table's lines as strings; the first is the header: op, shape, dtype, pass, opforge µs, metric, then
        ``vs <impl>`` for each peer (`harness.impl_role`; never opforge's variants nor the ceilings) that ran
        next to an opforge row: ``t_peer / t_opforge``, "n/a" where that peer did not run, " +fallback" where a
        compile peer ran eagerly, "?" after a ratio when either timing stayed noisy (`harness.Row.noisy`).
    """
    groups: Dict[tuple, Dict[str, harness.Row]] = {}
    for r in rows:
        groups.setdefault((r.op, r.shape, r.dtype, r.pass_), {})[r.impl] = r
    # only the peers that ran next to an opforge row of these rows (one family's peers, not every family's)
    peers = list(dict.fromkeys(r.impl for r in rows if harness.impl_role(r.impl) == "peer"
                               and "opforge" in groups[(r.op, r.shape, r.dtype, r.pass_)]))
    table = [["op", "shape", "dtype", "pass", "opforge us", "opforge metric"] + [f"vs {o}" for o in peers]]
    for (op, shape, dtype, pass_), impls in groups.items():
        ours = impls.get("opforge")
        if ours is None:
            continue
        line = [op, shape, dtype, pass_, harness._fmt(ours.time_us), f"{harness._fmt(ours.metric)} {ours.unit}"]
        for o in peers:
            peer = impls.get(o)
            if peer is None or math.isnan(peer.time_us) or math.isnan(ours.time_us) or ours.time_us <= 0:
                line.append("n/a")
            else:
                line.append(f"{peer.time_us / ours.time_us:.2f}x" + ("?" if peer.noisy or ours.noisy else "")
                            + (" +fallback" if peer.fallback else ""))
        table.append(line)
    return table


def summarize_by_op(rows: List[harness.Row]) -> List[List[List[str]]]:
    """`summarize` per op (rows of one ``op`` value each, in the order they came): one table each, with
    only the peers that op was measured against, so a run of every family stays readable."""
    ops = list(dict.fromkeys(r.op for r in rows))
    tables = [summarize([r for r in rows if r.op == op]) for op in ops]
    return [t for t in tables if len(t) > 1]


def print_summary(table: List[List[str]], file=sys.stdout) -> None:
    """Print `summarize`'s lines as aligned columns."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for k, row in enumerate(table):
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))), file=file)
        if k == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)), file=file)


def redraw(paths: List[Path], device_kind: Optional[str]) -> int:
    """``--plot``: redraw each CSV's PNG from its latest run (`harness.plot_csv`); 0 when every one was drawn."""
    status = 0
    for path in paths:
        png = harness.plot_csv(path, device_kind)
        if png:
            print(png)
        else:
            status = 1
    return status


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m opforge bench [--ops a,b] [--quick] [--device d] [--out DIR] [--plot CSV ...]``.

    Returns:
        0 when every selected family ran, 1 when one failed (the others still run), 2 for a bad argument
        (unknown family, a CUDA device on a machine without one).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m opforge bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None, help="comma-separated op families (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="list the op families and exit")
    p.add_argument("--quick", action="store_true", help="few shapes and repetitions (CPU: a few minutes for every family)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--out", type=Path, default=Path("opforge_bench"),
                   help="folder of the CSV and PNG files (default: ./opforge_bench in the current directory)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch's intra-op threads (default: torch's, at most the CPUs the load average leaves free)")
    p.add_argument("--plot", type=Path, nargs="+", metavar="CSV", default=None,
                   help="redraw the PNG beside each family CSV from its latest run, and exit")
    p.add_argument("--device-kind", choices=["cpu", "cuda"], default=None,
                   help="with --plot: the latest run on this kind of device (default: that of the last row)")
    p.add_argument("--suites", default=SUITES, help=f"the package whose modules are the families (default: {SUITES})")
    args = p.parse_args(argv)
    if args.plot:
        return redraw(args.plot, args.device_kind)
    try:
        families = suites.families(args.suites)
    except ImportError as e:
        print(f"opforge bench: expected --suites to name an importable package, but got {args.suites} ({e})",
              file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(families))
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"opforge bench: --device {args.device}, but torch {torch.__version__} sees no CUDA device: "
              "use --device cpu (`python -m opforge doctor` explains)", file=sys.stderr)
        return 2
    selected = [s.strip() for s in args.ops.split(",") if s.strip()] if args.ops else list(families)
    unknown = [s for s in selected if s not in families]
    if unknown:
        print(f"opforge bench: expected --ops from {', '.join(families)}, but got {', '.join(unknown)}", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "opforge", "bench", *argv])
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
              (["--no-compile"] if args.no_compile else []) + (["--threads", str(args.threads)] if args.threads else [])
        family_rows, failure, name = run_family(f"{args.suites}.{family}", sub, command)
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
        noisy = [r for r in rows if r.noisy]
        if noisy:
            print(f"\n? marks a ratio with a noisy timing: {len(noisy)} of {len(rows)} timings kept a spread above "
                  f"{harness.NOISY_SPREAD:.0%} (interquartile range / median) after outliers were dropped and more "
                  "samples taken. The machine is busy: rerun those on a quiet one.")
    note = "" if args.device.startswith("cuda") else harness.cpu_load_note()
    if note:
        print(f"\n{note}")
    print(f"\nCSV and PNG files: {out}")
    for f in failures:
        print(f"FAILED: {f}")
    return 1 if failures or not rows else 0
