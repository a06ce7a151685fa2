"""The benchmark harness shared by every benchmarks/bench_<op>.py and ``python -m opforge bench``.

``benchmarks/common.py`` is this module (a thin re-export), so ``import common`` in a bench script and
``from opforge.bench import harness`` are the same code.

- Timing: on CUDA, CUDA events around each repetition after a warm-up, with the L2 cache flushed
  (a 256 MB buffer written) before every repetition, and the median kept; on CPU, time.perf_counter
  around each repetition, median kept.
- Each measurement is a Row (op, shape, dtype, impl, pass, time_us, metric, unit): GB/s by the
  minimal-bytes rule for memory-bound ops, TFLOP/s for GEMMs.
- Results append to <out>/<name>.csv (one schema for every benchmark: CONTEXT_COLUMNS + ROW_COLUMNS)
  with the date, device name, torch version and git commit; each run draws a PNG (matplotlib, Agg) whose
  name never replaces an earlier run's, and prints a table. <out> is ``--out`` (``python -m opforge bench``:
  ./opforge_bench), else benchmarks/results of the source tree when a bench script runs from it.
- Peers load optionally: torch.compile'd functions (:class:`CompiledPeer`: one compiled function per
  shape, dtype and grad mode, so Dynamo's recompile limit is never reached; a peer that falls back to
  eager says so in the ``fallback`` column), Liger-Kernel when importable (None otherwise, reported as "n/a").

Redraw a plot from a CSV (e.g. on a machine that has matplotlib, after a GPU run):
    python benchmarks/common.py --plot benchmarks/results/elementwise.csv [--device-kind cuda]
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

#: The source tree this package sits in (``<root>/python/opforge/bench``); meaningless for an installed copy.
REPO_ROOT = Path(__file__).resolve().parents[3]
#: Default output folder of the bench scripts: the source tree's benchmarks/results, else ./opforge_bench.
RESULTS_DIR = (REPO_ROOT / "benchmarks" / "results") if (REPO_ROOT / "benchmarks").is_dir() else Path("opforge_bench")


class _State:
    """Module state: the fallback seen by the current timing, and the rows collected by finish()."""

    last_fallback = ""
    collected: list = []
    out_dir: Optional[Path] = None
L2_FLUSH_BYTES = 256 * 1024 * 1024

# ---- records -------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One measurement. `pass_` is "fwd" or "fwd+bwd"; time_us / metric are NaN for an impl that is n/a."""

    op: str
    shape: str
    dtype: str
    impl: str
    pass_: str
    time_us: float
    metric: float
    unit: str  # "GB/s" or "TFLOP/s"
    fallback: Optional[str] = None  # why a torch.compile peer ran eagerly instead ("" when it did not)

    def __post_init__(self):
        if self.fallback is None:  # a compile peer's row takes the fallback seen by the timing just before it
            self.fallback = _State.last_fallback if "compile" in self.impl else ""


CONTEXT_COLUMNS = ["date", "device", "device_name", "torch", "commit"]
ROW_COLUMNS = ["op", "shape", "dtype", "impl", "pass", "time_us", "metric", "unit", "fallback"]


def shape_str(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def linear_flops(M: int, K: int, N: int, pass_: str) -> int:
    """FLOPs of a linear of M rows, K in and N out features: 2·M·K·N for ``"fwd"``, three such GEMMs (the
    forward, dX and dW) for ``"fwd+bwd"``."""
    return 2 * M * N * K * (1 if pass_ == "fwd" else 3)


def method_note(method: str) -> str:
    """`` [loop]`` for a progress line when :func:`time_cuda_graph` fell back to a timed loop, else ``""``."""
    return f" [{method}]" if method == "loop" else ""


def gbps(nbytes: float, time_us: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second) of moving `nbytes` in `time_us` microseconds."""
    return nbytes / (time_us * 1e3) if time_us > 0 else math.nan


def tflops(flops: float, time_us: float) -> float:
    """Throughput in TFLOP/s of `flops` floating-point operations in `time_us` microseconds."""
    return flops / (time_us * 1e6) if time_us > 0 else math.nan


def nbytes(*tensors_or_specs) -> int:
    """Sum of sizes in bytes: tensors, or (numel, dtype) pairs."""
    total = 0
    for t in tensors_or_specs:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        else:
            numel, dtype = t
            total += numel * torch.empty((), dtype=dtype).element_size()
    return total


# ---- context: device, torch, commit ---------------------------------------------------------------------


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return (platform.processor() or platform.machine()) + f" ({torch.get_num_threads()} threads)"


def git_commit(root: Optional[Path] = None) -> str:
    """Short commit of the source tree at ``root`` (default: the tree this file is in) (+"-dirty" with local
    changes); $OPFORGE_GIT_COMMIT or "unknown" where there is no git checkout (e.g. a copied tree on the GPU
    machine, or an installed package: ``python -m opforge bench`` passes the checkout its benchmarks come from)."""
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    where = root if root is not None else REPO_ROOT
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# ---- timing ---------------------------------------------------------------------------------------------

_flush_buffers: dict = {}


def flush_l2(device: str) -> None:
    """Evict the GPU's L2 cache by writing a 256 MB buffer (larger than any current L2)."""
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buf.zero_()


def time_cuda(fn: Callable[[], object], *, warmup: int = 10, reps: int = 50, flush: bool = True) -> float:
    """Median time of fn() in microseconds, measured with CUDA events on the current stream. The L2 is
    flushed before each repetition (outside the timed interval)."""
    _State.last_fallback = ""
    device = f"cuda:{torch.cuda.current_device()}"
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush:
            flush_l2(device)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def _discard_failed_capture(graph: Optional["torch.cuda.CUDAGraph"], pool, stream: "torch.cuda.Stream") -> None:
    """Undo what a CUDA-graph capture that raised leaves behind, so later work in this process is unaffected.

    When the captured code does something illegal during capture (a host synchronization, ``.item()``, a
    cudaMalloc), CUDA invalidates the capture; ``torch.cuda.graph.__exit__`` then calls ``capture_end()``, whose
    ``cudaStreamEndCapture`` fails and raises before PyTorch's epilogue runs. On torch versions where the CUDA
    generator keeps a "capturing" flag (2.11 among them) that flag stays set, and every later random op on the
    device (``torch.randn(..., device="cuda")``) raises "Offset increment outside graph capture encountered
    unexpectedly"; the caching allocator also keeps routing to the graph's private pool. Here, best effort and
    each step on its own: end a capture that is still open, give the default generator of the device a fresh
    copy of its own state (same seed and offset, not capturing), and, when the capture never ended (then the
    graph's destructor does not release its pool), end the allocation to ``pool`` and release it.

    Args:
        graph: the graph whose capture raised (None: nothing was captured). pool: the memory pool handle the
            capture was given. stream: its capture stream.
    """
    dev = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    if graph is not None:
        try:
            with torch.cuda.stream(stream):
                if torch.cuda.is_current_stream_capturing():
                    graph.capture_end()
        except Exception:  # noqa: BLE001  (an invalidated capture cannot end cleanly; it is closed anyway)
            pass
    try:
        gen = torch.cuda.default_generators[dev]
        gen.graphsafe_set_state(gen.clone_state())
    except Exception as e:  # noqa: BLE001
        print(f"  [could not reset the CUDA generator after the failed capture] {type(e).__name__}: {e}",
              file=sys.stderr)
    if graph is None or pool is None:
        return
    try:
        graph.pool()  # raises unless the capture ended: then ~CUDAGraph releases the pool itself
        return
    except Exception:  # noqa: BLE001
        pass
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        try:
            getattr(torch._C, name)(dev, pool)
        except Exception:  # noqa: BLE001  (already ended by capture_end, or absent from this torch)
            pass


def time_cuda_graph(fn: Callable[[int], object], calls: int, *, reps: int = 10, warmup: int = 3) -> tuple[float, str]:
    """Device time per call in microseconds, and the method used.

    ``fn(i)`` for i in 0..calls-1 runs back to back inside one CUDA graph (captured once, after a warm-up
    on the capture stream); the graph is replayed ``reps`` times with CUDA events around each replay, and
    the median replay time divided by ``calls`` is returned with method "graph". Host launch cost is out
    of the measurement, which a single-call timing at small sizes would mostly measure. Where capture
    fails (an op that synchronizes, for example), events around a loop of ``calls`` back-to-back eager
    calls instead, method "loop". Vary the operands with i (e.g. rotate weight copies whose total size
    exceeds the L2) to measure streaming from HBM rather than from the L2."""
    _State.last_fallback = ""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, warmup)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph, pool = None, None
    try:
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            for i in range(calls):
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
        run, method = graph.replay, "graph"
    except Exception as e:  # capture refused: time eager calls instead
        print(f"  [graph capture failed, timing an eager loop] {type(e).__name__}: {str(e).splitlines()[0][:160]}",
              file=sys.stderr)
        _discard_failed_capture(graph, pool, stream)
        graph = None
        torch.cuda.synchronize()

        def run():
            for i in range(calls):
                fn(i)

        run()
        method = "loop"
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times), method


def time_cpu(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of fn() in microseconds (time.perf_counter)."""
    _State.last_fallback = ""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def time_fn(fn: Callable[[], object], device: str, *, warmup: int, reps: int) -> float:
    """time_cuda on a CUDA device, time_cpu otherwise; NaN (printed n/a) if fn raises."""
    try:
        if device.startswith("cuda"):
            return time_cuda(fn, warmup=warmup, reps=reps)
        return time_cpu(fn, warmup=warmup, reps=reps)
    except Exception as e:  # a peer failing on one shape must not end the run
        print(f"  [n/a] {getattr(fn, '__name__', fn)}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              file=sys.stderr)
        return math.nan


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            grad_output: Optional[torch.Tensor] = None) -> Callable[[], object]:
    """A closure running fn(*inputs) forward and backward (torch.autograd.grad with respect to the inputs
    that require grad, so nothing accumulates between repetitions)."""
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        out = fn(*inputs)
        g = grad_output if grad_output is not None else torch.ones_like(out)
        return torch.autograd.grad(out, wrt, g)

    return run


# ---- peers ----------------------------------------------------------------------------------------------


class CompiledPeer:
    """``torch.compile(fn)`` as a fair peer: one compiled copy of ``fn`` per (shapes, dtypes, grad mode).

    Dynamo keys its cache on the function's code object and recompiles on every new shape, dtype or
    grad mode; a benchmark that sweeps them hits the recompile limit ("GLOBAL_STATE changed: grad_mode")
    and then silently runs eager code. Here each key gets its own copy of ``fn`` (a new code object), so
    each is compiled once, with ``dynamic=False``, and nothing is shared between keys. If compiling or
    running the compiled copy fails, the call runs ``fn`` eagerly and the reason is recorded: the row of
    that timing gets it in its ``fallback`` column.

    Args:
        fn: a Python function of its own (not a builtin such as torch.sigmoid).
        **kwargs: passed to torch.compile (e.g. ``fullgraph=True``, ``mode="max-autotune"``).
    """

    def __init__(self, fn: Callable, **kwargs):
        self.fn, self.kwargs = fn, {"dynamic": False, **kwargs}
        self.compiled: dict = {}
        self.failed: dict = {}
        self.__name__ = f"torch.compile({getattr(fn, '__name__', 'fn')})"

    @staticmethod
    def _key(args) -> tuple:
        return (torch.is_grad_enabled(),) + tuple(
            (tuple(a.shape), a.dtype, a.device.type, a.requires_grad) if isinstance(a, torch.Tensor) else repr(a)
            for a in args)

    def __call__(self, *args):
        key = self._key(args)
        if key in self.failed:
            _State.last_fallback = self.failed[key]
            return self.fn(*args)
        f = self.compiled.get(key)
        if f is None:
            import types

            copy = types.FunctionType(self.fn.__code__.replace(), self.fn.__globals__, self.fn.__name__,
                                      self.fn.__defaults__, self.fn.__closure__)
            f = self.compiled[key] = torch.compile(copy, **self.kwargs)
        try:
            return f(*args)
        except Exception as e:  # noqa: BLE001  (the peer falls back, and says so)
            reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            self.failed[key] = reason
            print(f"  [fallback to eager] {self.__name__}: {reason}", file=sys.stderr)
            _State.last_fallback = reason
            return self.fn(*args)


def compiled(fn: Callable, **kwargs) -> Optional[Callable]:
    """A :class:`CompiledPeer` of ``fn`` (one compiled copy per shape, dtype and grad mode), or None when
    torch.compile is unavailable here. A recompile-limit hit raises (``fail_on_recompile_limit_hit``)
    instead of silently running eager code, so it shows up as a fallback."""
    try:
        import torch._dynamo

        if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
            torch._dynamo.config.fail_on_recompile_limit_hit = True
        return CompiledPeer(fn, **kwargs)
    except Exception as e:  # e.g. an unsupported Python version
        print(f"  [n/a] torch.compile: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def liger(attr: str, module: str = "liger_kernel.transformers") -> Optional[object]:
    """An attribute of Liger-Kernel (e.g. liger("LigerRMSNorm")), or None when Liger-Kernel (or Triton)
    is not importable here."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:
        return None


def liger_version() -> str:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return "n/a"


# ---- output: table, CSV, plot ---------------------------------------------------------------------------


def _fmt(v: float, digits: int = 1) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def print_grid(title: str, impls: Sequence[str], cols: Sequence[str], header: Callable[[str], str],
               value: Callable[[str, str], Optional[float]], flagged: Callable[[str, str], bool] = lambda i, c: False,
               label_width: int = 16, cell_width: int = 12, file=None) -> None:
    """A probe's pivot table: ``title``, then one line per impl (skipped when it has no value at all) with
    ``value(impl, col)`` per column (0 decimals, "n/a" where None or NaN) and "!" after a flagged cell (its output
    differed from the reference op). Columns are headed ``header(col)``; ``file``: sys.stdout at the call."""
    file = file if file is not None else sys.stdout
    print(f"\n{title}", file=file)
    print(f"{'impl':{label_width}s}" + "".join(f"{header(c):>{cell_width + 1}s}" for c in cols), file=file)
    for impl in impls:
        vals = [value(impl, c) for c in cols]
        if all(v is None for v in vals):
            continue
        line = f"{impl:{label_width}s}"
        for c, v in zip(cols, vals):
            line += f"{_fmt(v if v is not None else math.nan, 0):>{cell_width}s}{'!' if flagged(impl, c) else ' '}"
        print(line, file=file)


def print_table(rows: Iterable[Row], file=sys.stdout) -> None:
    """A compact table: one line per row, with the speed-up of opforge over each peer of its group."""
    rows = list(rows)
    header = ["op", "shape", "dtype", "pass", "impl", "time_us", "metric", "unit"]
    body = [[r.op, r.shape, r.dtype, r.pass_, r.impl + (" (fell back to eager)" if r.fallback else ""), _fmt(r.time_us),
             _fmt(r.metric), r.unit] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line, file=file)
    print("-" * len(line), file=file)
    prev = None
    for b in body:
        key = tuple(b[:4])
        if prev is not None and key != prev:
            print(file=file)
        prev = key
        print("  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(b, widths))), file=file)


def write_csv(rows: Iterable[Row], name: str, device: str, results_dir: Optional[Path] = None) -> Path:
    """Append rows to <results_dir>/<name>.csv (header written when the file is new).

    Args:
        rows: the measurements. name: the benchmark's name (``rms_norm``). device: ``cpu`` or ``cuda[:i]``.
        results_dir: the folder (default: ``--out`` of this run, else :data:`RESULTS_DIR`).
    Returns:
        The CSV's path. A file written with an older schema (other columns) is left alone: the rows go to
        ``<name>-<n>.csv`` instead.
    """
    results_dir = Path(results_dir or _State.out_dir or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.csv"
    n = 2
    while path.exists() and path.stat().st_size and read_header(path) != CONTEXT_COLUMNS + ROW_COLUMNS:
        path, n = results_dir / f"{name}-{n}.csv", n + 1
    context = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "device": "cuda" if device.startswith("cuda") else "cpu",
        "device_name": device_name(device),
        "torch": torch.__version__,
        "commit": git_commit(),
    }
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CONTEXT_COLUMNS + ROW_COLUMNS)
        if new:
            w.writeheader()
        for r in rows:
            d = asdict(r)
            d["pass"] = d.pop("pass_")
            w.writerow({**context, **d})
    return path


def read_header(path: Path) -> list[str]:
    """The column names of a CSV file (its first line)."""
    with Path(path).open(newline="") as f:
        return next(csv.reader(f), [])


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def plot(rows: Sequence[Row], name: str, device: str, results_dir: Optional[Path] = None,
         title: Optional[str] = None) -> Optional[Path]:
    """Draw <results_dir>/<name>_<cpu|cuda>.png (``-2``, ``-3``, ... appended when taken: an earlier run's plot is
    never replaced): one panel per (op, dtype, pass), bars per impl per shape, height = the row's metric.
    Returns None (with a message) when matplotlib is not installed."""
    results_dir = Path(results_dir or _State.out_dir or RESULTS_DIR)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print(f"  (no plot: matplotlib is not installed here; redraw later with "
              f"`python benchmarks/common.py --plot {results_dir / (name + '.csv')}`)", file=sys.stderr)
        return None
    rows = [r for r in rows]
    panels = sorted({(r.op, r.dtype, r.pass_) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.6 * nrows), squeeze=False)
    impls = list(dict.fromkeys(r.impl for r in rows))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    for ax, (op, dtype, pass_) in zip(axes.flat, panels):
        sel = [r for r in rows if (r.op, r.dtype, r.pass_) == (op, dtype, pass_)]
        shapes = list(dict.fromkeys(r.shape for r in sel))
        width = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            vals = []
            for s in shapes:
                m = [r.metric for r in sel if r.impl == impl and r.shape == s]
                vals.append(m[0] if m and not math.isnan(m[0]) else 0.0)
            ax.bar([i + (k - (len(impls) - 1) / 2) * width for i in range(len(shapes))], vals, width,
                   label=impl, color=colors[impl])
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=20, fontsize=8)
        ax.set_title(f"{op} {pass_} {dtype}", fontsize=10)
        ax.set_ylabel(sel[0].unit if sel else "")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or f"{name} on {device_name(device)}, torch {torch.__version__}, {git_commit()}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}_{'cuda' if device.startswith('cuda') else 'cpu'}.png"
    n = 2
    while path.exists():
        path, n = results_dir / f"{name}_{'cuda' if device.startswith('cuda') else 'cpu'}-{n}.png", n + 1
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_csv(csv_path: Path, device_kind: Optional[str] = None) -> Optional[Path]:
    """Redraw the PNG of the latest run (latest date per device kind) recorded in a results CSV."""
    data = read_csv(csv_path)
    if device_kind:
        data = [d for d in data if d["device"] == device_kind]
    if not data:
        print(f"no rows in {csv_path}" + (f" for {device_kind}" if device_kind else ""))
        return None
    kind = data[-1]["device"]
    data = [d for d in data if d["device"] == kind]
    latest = max(d["date"] for d in data)
    run = [d for d in data if d["date"] == latest]
    rows = [Row(d["op"], d["shape"], d["dtype"], d["impl"], d["pass"], float(d["time_us"]), float(d["metric"]),
                d["unit"], d.get("fallback") or "") for d in run]
    first = run[0]
    return plot(rows, Path(csv_path).stem, kind, Path(csv_path).parent,
                title=f"{Path(csv_path).stem} on {first['device_name']}, torch {first['torch']}, "
                      f"{first['commit']}, {latest}")


# ---- command line ---------------------------------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every bench script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes, e.g. float32,bfloat16")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median kept)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--no-save", action="store_true", help="print only: no CSV and no PNG")
    p.add_argument("--out", type=_out_dir, default=None,
                   help=f"folder of the CSV and PNG (default: {RESULTS_DIR})")
    return p


def _out_dir(text: str) -> Path:
    """argparse type of ``--out``: also makes it the folder of every later write_csv / plot."""
    _State.out_dir = Path(text)
    return _State.out_dir


def parse_dtypes(text: Optional[str], default: Sequence[torch.dtype]) -> list[torch.dtype]:
    if not text:
        return list(default)
    return [getattr(torch, t.strip()) for t in text.split(",") if t.strip()]


def finish(rows: list[Row], name: str, device: str, save: bool = True, out: Optional[Path] = None) -> None:
    """Print the table; unless save is False, append the CSV and draw the PNG, and say where they are.

    Args:
        rows: the benchmark's measurements. name: its name (CSV ``<name>.csv``). device: ``cpu``/``cuda``.
        save: write the CSV and PNG. out: their folder (default: the ``--out`` of ``python -m opforge bench``,
            else :data:`RESULTS_DIR`).
    """
    _State.collected.extend(rows)
    if out is not None:
        _State.out_dir = Path(out)
    print()
    print(f"{name}: {device_name(device)}, torch {torch.__version__}, commit {git_commit()}, "
          f"liger-kernel {liger_version()}")
    print_table(rows)
    if save:
        path = write_csv(rows, name, device)
        print(f"\nappended {len(rows)} rows to {path}")
        png = plot(rows, name, device)
        if png:
            print(f"plot: {png}")


# ---- a bench script's run: the main() every benchmarks/bench_<name>.py shares --------------------------


@dataclass
class BenchRun:
    """One run of a bench script: its command line (:func:`parser`) resolved once, the rows it measures, and the
    steps every script repeats (timing with the run's warm-up and repetitions, a row, a printed line, releasing
    CUDA memory between shapes, the final table, CSV and PNG). Made by :func:`start`."""

    name: str
    args: argparse.Namespace
    dtypes: list
    warmup: int
    reps: int
    rows: list = field(default_factory=list)

    @property
    def device(self) -> str:
        """``--device`` (cuda, cuda:<i> or cpu)."""
        return self.args.device

    @property
    def cuda(self) -> bool:
        """Whether the run is on a CUDA device."""
        return self.device.startswith("cuda")

    def shapes(self, cuda: Sequence, cpu: Sequence, cuda_quick: Optional[Sequence] = None,
               cpu_quick: Optional[Sequence] = None) -> list:
        """The shape list of this device; with ``--quick`` its quick list (default: the first shape)."""
        full, quick = (cuda, cuda_quick) if self.cuda else (cpu, cpu_quick)
        if not self.args.quick:
            return list(full)
        return list(quick) if quick is not None else list(full[:1])

    def time(self, step: Callable[[], object], no_grad: bool = False) -> float:
        """:func:`time_fn` of ``step`` with the run's warm-up and repetitions (under torch.no_grad() if asked)."""
        if no_grad:
            with torch.no_grad():
                return time_fn(step, self.device, warmup=self.warmup, reps=self.reps)
        return time_fn(step, self.device, warmup=self.warmup, reps=self.reps)

    def time_graphed(self, impl: str, step: Callable[[int], object], calls: int) -> tuple[float, str]:
        """(µs per call, method): on CUDA :func:`time_cuda_graph` of ``step(i)`` for i < calls, on the CPU
        :func:`time_cpu` of ``step(0)``, with the run's warm-up and repetitions. NaN (and a line on stderr naming
        ``impl``) when it raises: one peer failing on one shape must not end the run."""
        try:
            if self.cuda:
                return time_cuda_graph(step, calls, reps=self.reps, warmup=self.warmup)
            return time_cpu(lambda: step(0), warmup=self.warmup, reps=self.reps), ""
        except Exception as e:  # noqa: BLE001
            print(f"  [n/a] {impl}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  file=sys.stderr)
            return math.nan, ""

    def add(self, op: str, shape, dtype: torch.dtype, impl: str, pass_: str, time_us: float, metric: float,
            unit: str) -> Row:
        """Append and return one row (shape: a string, or a sequence of ints for :func:`shape_str`)."""
        row = Row(op, shape if isinstance(shape, str) else shape_str(shape), dtype_str(dtype), impl, pass_, time_us,
                  metric, unit)
        self.rows.append(row)
        return row

    @staticmethod
    def say(label: str, parts: Iterable[str], sep: str = "; ") -> None:
        """Print one progress line: ``  <label>: <part><sep><part>...``."""
        print(f"  {label}: " + sep.join(parts), flush=True)

    def say_case(self, op: str, pass_: str, dtype: torch.dtype, shape, parts: Iterable[str], sep: str = "; ") -> None:
        """:meth:`say` for one case: the label ``<op> <pass> <dtype> <shape>`` (shape: a string, or a sequence of
        ints for :func:`shape_str`)."""
        self.say(f"{op} {pass_} {dtype_str(dtype)} {shape if isinstance(shape, str) else shape_str(shape)}", parts, sep)

    def release(self) -> None:
        """Return the caching allocator's free blocks between shapes (CUDA)."""
        if self.cuda:
            torch.cuda.empty_cache()

    def finish(self) -> int:
        """:func:`finish` of the rows (table; CSV and PNG unless ``--no-save``); main()'s exit status 0."""
        finish(self.rows, self.name, self.device, save=not self.args.no_save)
        return 0


DtypeDefault = Union[Sequence[torch.dtype], Callable[[bool, bool], Sequence[torch.dtype]]]


def start(name: str, doc: str, argv=None, *, dtypes: DtypeDefault, warmup: tuple, reps: tuple,
          arg_parser: Optional[argparse.ArgumentParser] = None) -> BenchRun:
    """Parse a bench script's command line and resolve its defaults.

    Args:
        name: the benchmark's name (its CSV ``<name>.csv``). doc: the script's docstring (its first line is the
            description). argv: the arguments (default: sys.argv).
        dtypes: the dtypes without ``--dtypes``: a list, or ``f(cuda, quick)`` returning one.
        warmup: (CUDA, CPU) warm-up calls without ``--warmup``.
        reps: ((CUDA quick, CUDA), (CPU quick, CPU)) repetitions without ``--reps``.
        arg_parser: :func:`parser` with the script's own arguments added (default: :func:`parser` itself).
    """
    args = (arg_parser or parser(doc.splitlines()[0])).parse_args(argv)
    cuda = args.device.startswith("cuda")
    default = dtypes(cuda, args.quick) if callable(dtypes) else dtypes
    w = args.warmup if args.warmup is not None else warmup[0 if cuda else 1]
    r = args.reps if args.reps is not None else reps[0 if cuda else 1][0 if args.quick else 1]
    return BenchRun(name, args, parse_dtypes(args.dtypes, default), w, r)


def cuda_or_cpu(cuda_dtypes: Sequence[torch.dtype], cpu_dtypes: Sequence[torch.dtype]) -> Callable:
    """A ``dtypes`` default of :func:`start`: one list on CUDA, another on the CPU."""
    return lambda cuda, quick: cuda_dtypes if cuda else cpu_dtypes


def redraw_main(argv=None) -> int:
    """``python benchmarks/common.py --plot <csv>``: redraw the latest run's PNG from a results CSV."""
    ap = argparse.ArgumentParser(description="Redraw a benchmark plot from its results CSV.")
    ap.add_argument("--plot", type=Path, required=True, help="benchmarks/results/<name>.csv")
    ap.add_argument("--device-kind", choices=["cpu", "cuda"], default=None)
    a = ap.parse_args(argv)
    out = plot_csv(a.plot, a.device_kind)
    if out:
        print(out)
    return 0 if out else 1
