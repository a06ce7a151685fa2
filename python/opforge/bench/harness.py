"""The benchmark harness of ``python -m opforge bench``: timing, records, CSV and plots.

Every op family's suite (`opforge.bench.suites`) runs on it; ``benchmarks/bench_<family>.py`` are entry points
over those suites, and ``benchmarks/common.py`` is this module under another name, for the other tools there.

- Timing: on CUDA, CUDA events around each repetition after a warm-up, with the L2 cache flushed (a 256 MB buffer
  written) before every repetition. On the CPU, time.perf_counter around blocks of back-to-back calls, each block
  about `CPU_BLOCK_S` long, enough blocks to span `CPU_SPAN_S` (within `CPU_MAX_SPAN_S`), the
  garbage collector paused. Either way the samples go through `robust_median`: the samples outside Tukey's
  fences (1.5 interquartile ranges beyond the quartiles) are dropped, the median of the others is the time and
  their interquartile range over that median is its spread. While the spread stays above `NOISY_SPREAD`,
  up to `EXTRA_ROUNDS` more rounds of samples are taken; a row whose spread is still above it is printed
  with a warning and marked in the summary (a loaded machine: the ratio is not to be trusted).
- Each measurement is a Row (op, shape, dtype, impl, pass, time_us, metric, unit, spread, fallback): GB/s by the
  minimal-bytes rule for memory-bound ops, TFLOP/s for GEMMs.
- Impls: ``opforge`` is the op under test; other names starting with ``opforge`` are opforge's own variants (another
  kernel, another activation), ``copy`` and names ending in ``(floor)`` are ceilings measured in the same run; every
  other impl is a peer (`impl_role`). The summary compares ``opforge`` with the peers only.
- Results append to ``<out>/<family>.csv``, one schema for every family (`CONTEXT_COLUMNS` +
  `ROW_COLUMNS`: date, commit, device, device name, torch version and the command, then the figures); the plot
  ``<out>/<family>_<cpu|cuda>.png`` (matplotlib, Agg) is then redrawn from that CSV's latest run. ``<out>`` is
  ``--out`` (``python -m opforge bench``: ./opforge_bench), else benchmarks/results of the source tree when a suite
  runs from one.
- Peers load optionally: torch.compile'd functions (`CompiledPeer`: one compiled function per shape, dtype
  and grad mode, so Dynamo's recompile limit is never reached; a peer that falls back to eager says so in the
  ``fallback`` column), Liger-Kernel when importable (None otherwise, reported as "n/a").

Redraw a plot from a CSV (e.g. on a machine that has matplotlib, after a GPU run):
    python -m opforge bench --plot benchmarks/results/elementwise.csv [--device-kind cuda]
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import importlib
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Union

import torch

#: ``<root>/python/opforge/bench`` -> ``<root>``: the source tree this package sits in, when it is one.
_ROOT_CANDIDATE = Path(__file__).resolve().parents[3]
#: The opforge source tree this package was imported from (it holds csrc/library.cpp); None for an installed copy.
SOURCE_TREE: Optional[Path] = _ROOT_CANDIDATE if (_ROOT_CANDIDATE / "csrc" / "library.cpp").is_file() else None
#: The source tree, or where it would be (the benchmarks/ tools build paths from it).
REPO_ROOT = SOURCE_TREE if SOURCE_TREE is not None else _ROOT_CANDIDATE
#: Default output folder of a suite run outside ``python -m opforge bench``: the source tree's benchmarks/results,
#: else ./opforge_bench.
RESULTS_DIR = (SOURCE_TREE / "benchmarks" / "results") if SOURCE_TREE is not None else Path("opforge_bench")

#: A measurement whose spread (interquartile range / median of the samples kept) stays above this is noisy.
NOISY_SPREAD = 0.25
#: Rounds of samples taken after the first while the spread stays above `NOISY_SPREAD`.
EXTRA_ROUNDS = 2
#: CPU timing: the length of one timed block of back-to-back calls (s).
CPU_BLOCK_S = 2e-4
#: CPU timing: the blocks of one round span at least this long (s), within `CPU_MIN_BLOCKS` to
#: `CPU_MAX_BLOCKS` blocks, so that a stall of a loaded machine (8-16 ms) hits a few blocks, not the median.
CPU_SPAN_S = 0.1
#: CPU timing: a round takes no more than this long (s), unless the suite's repetitions ask for more.
CPU_MAX_SPAN_S = 0.5
CPU_MIN_BLOCKS = 11
CPU_MAX_BLOCKS = 500
L2_FLUSH_BYTES = 256 * 1024 * 1024


class _State:
    """Module state: the fallback and spread of the latest timing, the rows collected by finish(), the output folder
    and the command line recorded in the CSV."""

    last_fallback = ""
    last_spread = math.nan
    collected: list = []
    out_dir: Optional[Path] = None
    command: Optional[str] = None


# ---- records -------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One measurement.

    Attributes:
        op, shape, dtype: what was measured (shape as ``4096x4096``, dtype as ``bfloat16``).
        impl: who computed it (see `impl_role`). pass_: ``"fwd"`` or ``"fwd+bwd"`` (or a suite's own).
        time_us: the time in µs (NaN for an impl that is n/a). metric, unit: the roofline figure (``GB/s``,
            ``TFLOP/s``, ...). spread: interquartile range / median of the timing's kept samples (NaN: unknown;
            `BenchRun.add` fills in the latest timing's). fallback: why a torch.compile peer ran eagerly ("" when
            it did not; `BenchRun.add` fills in the latest timing's for a compile peer).
    """

    op: str
    shape: str
    dtype: str
    impl: str
    pass_: str
    time_us: float
    metric: float
    unit: str
    spread: Optional[float] = None
    fallback: Optional[str] = None

    def __post_init__(self):
        if self.fallback is None:
            self.fallback = ""
        if self.spread is None:
            self.spread = math.nan

    @property
    def noisy(self) -> bool:
        """Whether the timing's spread stayed above `NOISY_SPREAD`."""
        return not _isnan(self.spread) and self.spread > NOISY_SPREAD


CONTEXT_COLUMNS = ["date", "commit", "device", "device_name", "torch", "command"]
ROW_COLUMNS = ["op", "shape", "dtype", "impl", "pass", "time_us", "metric", "unit", "spread", "fallback"]
#: impls that are ceilings measured beside the op, not peers: ``copy`` (the same bytes through a device copy)
CEILING_IMPLS = ("copy",)


def impl_role(impl: str) -> str:
    """``"opforge"`` (the op under test), ``"variant"`` (opforge's own other kernel or mode: a name starting with
    ``opforge``), ``"ceiling"`` (``copy``, or a name ending in ``(floor)``) or ``"peer"`` (anything else: eager
    PyTorch, torch.compile, Liger-Kernel, ...)."""
    if impl == "opforge":
        return "opforge"
    if impl.startswith("opforge"):
        return "variant"
    if impl in CEILING_IMPLS or impl.endswith("(floor)"):
        return "ceiling"
    return "peer"


def _isnan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def shape_str(shape: Sequence[int]) -> str:
    """``(4096, 4096)`` -> ``"4096x4096"``."""
    return "x".join(str(s) for s in shape)


def dtype_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def linear_flops(M: int, K: int, N: int, pass_: str) -> int:
    """FLOPs of a linear of M rows, K in and N out features: 2·M·K·N for ``"fwd"``, three such GEMMs (the
    forward, dX and dW) for ``"fwd+bwd"``."""
    return 2 * M * N * K * (1 if pass_ == "fwd" else 3)


def method_note(method: str) -> str:
    """`` [loop]`` for a progress line when `time_cuda_graph` fell back to a timed loop, else ``""``."""
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


# ---- statistics ------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """The summary of one timing's samples (`robust_median`).

    Attributes:
        median: the median of the kept samples (the samples' unit). spread: their interquartile range / median
            (0 for one sample). kept, rejected: how many samples were kept and dropped as outliers.
    """

    median: float
    spread: float
    kept: int
    rejected: int

    @property
    def noisy(self) -> bool:
        """Whether the spread is above `NOISY_SPREAD`."""
        return self.spread > NOISY_SPREAD


def _quartiles(xs: Sequence[float]) -> tuple:
    if len(xs) < 2:
        return xs[0], xs[0]
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q3


def robust_median(samples: Sequence[float]) -> Timing:
    """The median of ``samples`` without their outliers, and how spread out the rest are.

    Samples outside Tukey's fences, [Q1 - 1.5·IQR, Q3 + 1.5·IQR] of all samples, are dropped (a stall of a loaded
    machine makes a few samples many times slower); the median and the spread (interquartile range / median) are
    those of the samples kept.

    Args:
        samples: at least one time (any unit).
    Returns:
        A `Timing`.
    Raises:
        ValueError: when ``samples`` is empty.
    """
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("opforge.bench.harness.robust_median: expected at least one sample, but got none")
    q1, q3 = _quartiles(xs)
    lo, hi = q1 - 1.5 * (q3 - q1), q3 + 1.5 * (q3 - q1)
    kept = [x for x in xs if lo <= x <= hi]
    median = statistics.median(kept)
    k1, k3 = _quartiles(kept)
    spread = (k3 - k1) / median if median > 0 else 0.0
    return Timing(median, spread, len(kept), len(xs) - len(kept))


def measure(take: Callable[[], List[float]], rounds: Optional[int] = None) -> Timing:
    """`robust_median` of the samples of ``take()``, with more rounds of ``take()`` (at most ``rounds``, default
    `EXTRA_ROUNDS`) while the spread stays above `NOISY_SPREAD`; the spread is recorded for the next Row.

    Args:
        take: one round of timing: returns a list of samples.
    Returns:
        The `Timing` of all the rounds' samples together.
    """
    samples = list(take())
    t = robust_median(samples)
    for _ in range(EXTRA_ROUNDS if rounds is None else rounds):
        if not t.noisy:
            break
        samples += take()
        t = robust_median(samples)
    _State.last_spread = t.spread
    return t


def last_spread() -> float:
    """The spread of the latest timing (`measure`)."""
    return _State.last_spread


# ---- context: device, torch, commit ---------------------------------------------------------------------


def device_name(device: str) -> str:
    """The device's name: the GPU's (``NVIDIA H200``), or the CPU's model with torch's thread count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.get_num_threads()} threads)"
    except OSError:
        pass
    return (platform.processor() or platform.machine()) + f" ({torch.get_num_threads()} threads)"


_commits: dict = {}


def git_commit(root: Optional[Path] = None) -> str:
    """Short commit of the source tree at ``root`` (default: `SOURCE_TREE`), with ``-dirty`` after it when
    tracked files have local changes.

    Returns:
        $OPFORGE_GIT_COMMIT when set (a copied tree without its git history, e.g. on a GPU machine), else the
        commit, else ``"unknown"`` (no git, no checkout there, or an installed package: its folder is never taken
        for a source tree, so a virtual environment inside another repository does not report that one's commit).
    """
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    where = root if root is not None else SOURCE_TREE
    if where is None:
        return "unknown"
    if where not in _commits:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True,
                                    text=True, timeout=10, check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            _commits[where] = commit + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            _commits[where] = "unknown"
    return _commits[where]


def cpu_load() -> tuple:
    """(1-minute load average, CPU count); the load is NaN where the system does not report it."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return math.nan, os.cpu_count() or 1


def cpu_load_note() -> str:
    """A warning when other processes compete for this machine's CPUs (the 1-minute load average above the CPU
    count); "" otherwise or where the load average is unknown."""
    load, cpus = cpu_load()
    if not load > cpus:
        return ""
    return (f"note: load average {load:.1f} on {cpus} CPUs: other processes compete for them, so CPU timings include "
            "waiting for a CPU (the spread column says how much they varied).")


def choose_cpu_threads(requested: Optional[int]) -> int:
    """Set torch's intra-op threads for a CPU run and return the count: ``requested`` when given, else torch's own,
    lowered to the CPUs other processes leave free (the CPU count less the 1-minute load average, rounded, at least
    1; said on stderr). A parallel region waits until all its threads get a CPU: with more threads than free CPUs
    most calls stall for a scheduler time slice (several ms), which no statistic separates from the kernel's time."""
    if requested:
        torch.set_num_threads(requested)
        return requested
    load, cpus = cpu_load()
    free = max(1, int(cpus - load + 0.5)) if load == load else cpus
    if torch.get_num_threads() > free:
        print(f"  [threads] load average {load:.1f} on {cpus} CPUs: timing on {free} intra-op thread(s) instead of "
              f"{torch.get_num_threads()} (--threads N to choose)", file=sys.stderr)
        torch.set_num_threads(free)
    return torch.get_num_threads()


def command_line() -> str:
    """The command that runs this benchmark, for the CSV's ``command`` column: the one ``python -m opforge bench``
    recorded (`set_command`), else ``python <script> <args>`` of this process (the script's path relative to
    the source tree when it lies inside it)."""
    if _State.command:
        return _State.command
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("-")
    if SOURCE_TREE is not None:
        try:
            script = script.resolve().relative_to(SOURCE_TREE)
        except ValueError:
            pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def set_command(command: Optional[str]) -> None:
    """Record ``command`` as the command line of this run's CSV rows (None: `command_line`'s default)."""
    _State.command = command


# ---- timing ---------------------------------------------------------------------------------------------

_flush_buffers: dict = {}


def flush_l2(device: str) -> None:
    """Evict the GPU's L2 cache by writing a 256 MB buffer (larger than any current L2)."""
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buf.zero_()


def time_cuda(fn: Callable[[], object], *, warmup: int = 10, reps: int = 50, flush: bool = True) -> float:
    """Time of fn() in microseconds: CUDA events on the current stream around each of ``reps`` repetitions after
    ``warmup`` calls, the L2 flushed before each (outside the timed interval); the `measure` of those samples
    (outliers dropped, more rounds while the spread is large)."""
    _State.last_fallback = ""
    device = f"cuda:{torch.cuda.current_device()}"
    for _ in range(warmup):
        fn()

    def take() -> List[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            if flush:
                flush_l2(device)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    return measure(take).median


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
    on the capture stream); the graph is replayed ``reps`` times with CUDA events around each replay, and the
    `measure` of the replay times divided by ``calls`` is returned with method "graph". Host launch cost is out
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

    def take() -> List[float]:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return times

    t = measure(take)
    del graph
    return t.median, method


def cpu_blocks(call_s: float, reps: int) -> tuple:
    """(calls per block, blocks per round) of `time_cpu` for a call of ``call_s`` seconds.

    A block is about `CPU_BLOCK_S` of back-to-back calls (one call when a call is longer); a round has enough
    blocks to span `CPU_SPAN_S` (at least `CPU_MIN_BLOCKS`, at most `CPU_MAX_BLOCKS`), no more
    than fit in `CPU_MAX_SPAN_S` (but at least 3), and never fewer than ``reps``.
    """
    calls = max(1, min(10_000, round(CPU_BLOCK_S / call_s))) if call_s > 0 else 10_000
    block_s = max(call_s * calls, 1e-9)
    wanted = min(CPU_MAX_BLOCKS, max(CPU_MIN_BLOCKS, math.ceil(CPU_SPAN_S / block_s)))
    affordable = max(3, int(CPU_MAX_SPAN_S / block_s))
    return calls, max(reps, min(wanted, affordable))


def time_cpu(fn: Callable[[], object], *, warmup: int = 3, reps: int = 20) -> float:
    """Wall time of one fn() call in microseconds (time.perf_counter), made robust for a loaded machine.

    After ``warmup`` calls (at least one, which sizes the blocks), rounds of timed blocks of back-to-back calls
    (`cpu_blocks`: at least ``reps`` blocks a round) with the garbage collector paused; the time is the
    `measure` of the per-call times of the blocks: outliers dropped, more rounds while the spread is large.
    """
    _State.last_fallback = ""
    call_s = math.inf
    for _ in range(max(1, warmup)):
        t0 = time.perf_counter()
        fn()
        call_s = min(call_s, time.perf_counter() - t0)
    calls, blocks = cpu_blocks(call_s, reps)

    def take() -> List[float]:
        times = []
        enabled = gc.isenabled()
        gc.disable()
        try:
            for _ in range(blocks):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times.append((time.perf_counter() - t0) / calls * 1e6)
        finally:
            if enabled:
                gc.enable()
        return times

    return measure(take).median


def time_fn(fn: Callable[[], object], device: str, *, warmup: int, reps: int) -> float:
    """time_cuda on a CUDA device, time_cpu otherwise; NaN (printed n/a) if fn raises."""
    try:
        if device.startswith("cuda"):
            return time_cuda(fn, warmup=warmup, reps=reps)
        return time_cpu(fn, warmup=warmup, reps=reps)
    except Exception as e:  # a peer failing on one shape must not end the run
        print(f"  [n/a] {getattr(fn, '__name__', fn)}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              file=sys.stderr)
        _State.last_spread = math.nan
        return math.nan


def fwd_bwd(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            grad_output: Optional[torch.Tensor] = None, params: Sequence[torch.Tensor] = ()) -> Callable[[], object]:
    """A closure running fn(*inputs) forward and backward (torch.autograd.grad with respect to the inputs
    that require grad, so nothing accumulates between repetitions). `params`: more tensors to differentiate (a
    module's parameters, as a training step does); one that the call does not reach (an expert without tokens) gets
    none."""
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    n_inputs = len(wrt)
    wrt += [p for p in params if p.requires_grad]
    unused = len(wrt) > n_inputs

    def run():
        out = fn(*inputs)
        g = grad_output if grad_output is not None else torch.ones_like(out)
        return torch.autograd.grad(out, wrt, g, allow_unused=unused)

    return run


# ---- correctness before speed ---------------------------------------------------------------------------


def check_reference(what: str, actual: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                    bound: Optional[torch.Tensor] = None) -> None:
    """opforge's output against opforge.testing's float64 reference, by the tests' tolerance rule
    (`opforge.testing.assert_matches_reference`: at most 2 × the error of PyTorch's ``baseline`` of the same
    math in the same dtype, or within ``bound`` elementwise): a benchmark of a wrong kernel is void.

    Args:
        what: the case, for the message (``rms_norm bfloat16 512x1024``). actual: opforge's output. reference: the
            float64 reference. baseline: PyTorch's output in actual's dtype. bound: optional elementwise error bound
            (e.g. `opforge.testing.gemm_error_bound` for a GEMM).
    Raises:
        RuntimeError: ``opforge bench: expected <what> to match ...``, when it does not.
    """
    from opforge import testing

    try:
        testing.assert_matches_reference(actual, reference, baseline, what=what, bound=bound)
    except AssertionError as e:
        raise RuntimeError(f"opforge bench: expected {what} to match opforge.testing's float64 reference, but got "
                           f"{e}: fix the kernel before timing it") from None


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
    """A `CompiledPeer` of ``fn`` (one compiled copy per shape, dtype and grad mode), or None when
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


def print_table(rows: Iterable[Row], file=None) -> None:
    """A compact table of ``rows``: one line each (op, shape, dtype, pass, impl, time, metric, unit, spread), a blank
    line between (op, shape, dtype, pass) groups; a noisy row's spread is followed by ``!``."""
    file = file if file is not None else sys.stdout
    rows = list(rows)
    header = ["op", "shape", "dtype", "pass", "impl", "time_us", "metric", "unit", "spread"]
    body = [[r.op, r.shape, r.dtype, r.pass_, r.impl + (" (fell back to eager)" if r.fallback else ""), _fmt(r.time_us),
             _fmt(r.metric), r.unit, ("n/a" if _isnan(r.spread) else f"{r.spread:.0%}") + ("!" if r.noisy else "")]
            for r in rows]
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
    noisy = sum(r.noisy for r in rows)
    if noisy:
        print(f"\n! {noisy} of {len(rows)} timings kept a spread above {NOISY_SPREAD:.0%} (interquartile range / median) "
              "after outliers were dropped and more samples taken: the machine is busy, so their ratios may be off; "
              "rerun on a quiet machine.", file=file)


SCHEMA = CONTEXT_COLUMNS + ROW_COLUMNS


def write_csv(rows: Iterable[Row], name: str, device: str, results_dir: Optional[Path] = None) -> Path:
    """Append ``rows`` to ``<results_dir>/<name>.csv``, the family's one CSV (header written when the file is new).

    Every row gets this run's context: date, commit (`git_commit`), device kind, device name, torch version and
    the command (`command_line`).

    Args:
        rows: the measurements. name: the family (``rms_norm``). device: ``cpu`` or ``cuda[:i]``.
        results_dir: the folder (default: ``--out`` of this run, else `RESULTS_DIR`).
    Returns:
        The CSV's path.
    Raises:
        ValueError: when the file exists with columns that `SCHEMA` lacks (another tool's CSV): nothing is
            written. A file whose columns are all in the schema (an older version of it) is first rewritten with
            the schema's header, its rows keeping their values (the new columns empty).
    """
    results_dir = Path(results_dir or _State.out_dir or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.csv"
    if path.exists() and path.stat().st_size:
        header = read_header(path)
        if header != SCHEMA:
            extra = [c for c in header if c not in SCHEMA]
            if extra:
                raise ValueError(f"opforge bench: expected {path} to have the columns of the harness's schema "
                                 f"({', '.join(SCHEMA)}), but it has {', '.join(extra)} too: move it away")
            _write_rows(path, read_csv(path))
    context = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": "cuda" if device.startswith("cuda") else "cpu",
        "device_name": device_name(device),
        "torch": torch.__version__,
        "command": command_line(),
    }
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SCHEMA)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({**context, **row_dict(r)})
    return path


def row_dict(r: Row) -> dict:
    """A row as the CSV's columns (``pass`` for ``pass_``; the spread with 4 digits, "" when NaN)."""
    d = asdict(r)
    d["pass"] = d.pop("pass_")
    d["spread"] = "" if _isnan(r.spread) else f"{r.spread:.4f}"
    return d


def _write_rows(path: Path, records: Sequence[dict]) -> None:
    """Rewrite ``path`` with `SCHEMA`'s header and ``records`` (missing columns empty)."""
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SCHEMA)
        w.writeheader()
        for d in records:
            w.writerow({c: d.get(c, "") for c in SCHEMA})
    tmp.replace(path)


def read_header(path: Path) -> list[str]:
    """The column names of a CSV file (its first line)."""
    with Path(path).open(newline="") as f:
        return next(csv.reader(f), [])


def read_csv(path: Path) -> list[dict]:
    """The records of a CSV file, as dicts of its columns."""
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def _float(text: Optional[str]) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def rows_of(records: Iterable[dict]) -> List[Row]:
    """CSV records (`read_csv`) back as `Row` objects."""
    return [Row(d["op"], d["shape"], d["dtype"], d["impl"], d["pass"], _float(d["time_us"]), _float(d["metric"]),
                d["unit"], _float(d.get("spread")), d.get("fallback") or "") for d in records]


def latest_run(records: Sequence[dict], device_kind: Optional[str] = None) -> List[dict]:
    """The records of the latest run in ``records``: those of the latest date (one run writes one date) of
    ``device_kind`` (``cpu`` or ``cuda``; default: the kind of the last record). [] when there are none."""
    if device_kind:
        records = [d for d in records if d["device"] == device_kind]
    if not records:
        return []
    kind = records[-1]["device"]
    records = [d for d in records if d["device"] == kind]
    latest = max(d["date"] for d in records)
    return [d for d in records if d["date"] == latest]


def plot(rows: Sequence[Row], name: str, device: str, results_dir: Optional[Path] = None,
         title: Optional[str] = None) -> Optional[Path]:
    """Draw ``<results_dir>/<name>_<cpu|cuda>.png``, replacing the plot of an earlier run: one panel per (op, dtype,
    pass), bars per impl per shape, height = the row's metric.

    Returns:
        The PNG's path; None (with a message) when matplotlib is not installed or there is nothing to draw.
    """
    results_dir = Path(results_dir or _State.out_dir or RESULTS_DIR)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        print(f"  (no plot: matplotlib is not installed here; redraw later with "
              f"`python -m opforge bench --plot {results_dir / (name + '.csv')}`)", file=sys.stderr)
        return None
    rows = list(rows)
    panels = sorted({(r.op, r.dtype, r.pass_) for r in rows}, key=lambda k: (k[0], k[2], k[1]))
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 3.6 * nrows), squeeze=False)
    impls = list(dict.fromkeys(r.impl for r in rows))
    colors = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    for ax, (op, dtype, pass_) in zip(axes.flat, panels):
        sel = [r for r in rows if (r.op, r.dtype, r.pass_) == (op, dtype, pass_)]
        shapes = list(dict.fromkeys(r.shape for r in sel))
        here = [i for i in impls if any(r.impl == i for r in sel)]
        width = 0.8 / max(1, len(here))
        for k, impl in enumerate(here):
            vals = []
            for s in shapes:
                m = [r.metric for r in sel if r.impl == impl and r.shape == s]
                vals.append(m[0] if m and not math.isnan(m[0]) else 0.0)
            ax.bar([i + (k - (len(here) - 1) / 2) * width for i in range(len(shapes))], vals, width,
                   label=impl, color=colors[impl])
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, rotation=20, fontsize=8)
        ax.set_title(f"{op} {pass_} {dtype}", fontsize=10)
        ax.set_ylabel(sel[0].unit if sel else "")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title or f"{name} on {device_name(device)}, torch {torch.__version__}, {git_commit()}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}_{'cuda' if device.startswith('cuda') else 'cpu'}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_csv(csv_path: Path, device_kind: Optional[str] = None) -> Optional[Path]:
    """Redraw ``<name>_<kind>.png`` beside a family's CSV from its latest run (`latest_run`).

    Returns:
        The PNG's path, or None (with a message) when the CSV has no such run or matplotlib is not installed.
    """
    run = latest_run(read_csv(csv_path), device_kind)
    if not run:
        print(f"no rows in {csv_path}" + (f" for {device_kind}" if device_kind else ""), file=sys.stderr)
        return None
    first = run[0]
    name = Path(csv_path).stem
    return plot(rows_of(run), name, first["device"], Path(csv_path).parent,
                title=f"{name} on {first['device_name']}, torch {first['torch']}, {first['commit']}, {first['date']}")


# ---- command line ---------------------------------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    """The arguments every bench script takes."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtypes", default=None, help="comma-separated dtypes, e.g. float32,bfloat16")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions a round (CPU: at least this many timed blocks); outliers dropped, median kept")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    p.add_argument("--no-save", action="store_true", help="print only: no CSV and no PNG")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch's intra-op threads (default: torch's, at most the CPUs the load average leaves free)")
    p.add_argument("--out", type=_out_dir, default=None,
                   help=f"folder of the CSV and PNG (default: {RESULTS_DIR})")
    return p


def _out_dir(text: str) -> Path:
    """argparse type of ``--out``: also makes it the folder of every later write_csv / plot."""
    _State.out_dir = Path(text)
    return _State.out_dir


def parse_dtypes(text: Optional[str], default: Sequence[torch.dtype]) -> list[torch.dtype]:
    """``"float32,bfloat16"`` -> [torch.float32, torch.bfloat16]; ``default`` when ``text`` is empty."""
    if not text:
        return list(default)
    return [getattr(torch, t.strip()) for t in text.split(",") if t.strip()]


def finish(rows: list[Row], name: str, device: str, save: bool = True, out: Optional[Path] = None) -> None:
    """Print the table; unless save is False, append the family's CSV, redraw its PNG from it, and say where they are.

    Args:
        rows: the family's measurements. name: the family (CSV ``<name>.csv``). device: ``cpu``/``cuda``.
        save: write the CSV and PNG. out: their folder (default: the ``--out`` of ``python -m opforge bench``,
            else `RESULTS_DIR`).
    """
    _State.collected.extend(rows)
    if out is not None:
        _State.out_dir = Path(out)
    print()
    print(f"{name}: {device_name(device)}, torch {torch.__version__}, commit {git_commit()}, "
          f"liger-kernel {liger_version()}")
    print_table(rows)
    note = "" if device.startswith("cuda") else cpu_load_note()
    if note:
        print(note)
    if save:
        try:
            path = write_csv(rows, name, device)
        except ValueError as e:
            print(f"\n{e}; no CSV written", file=sys.stderr)
            return
        print(f"\nappended {len(rows)} rows to {path}")
        png = plot_csv(path, "cuda" if device.startswith("cuda") else "cpu")
        if png:
            print(f"plot: {png}")


# ---- a suite's run: the main() every opforge.bench.suites module shares -----------------------------------


@dataclass
class BenchRun:
    """One run of a family's suite: its command line (`parser`) resolved once, the rows it measures, and the
    steps every suite repeats (timing with the run's warm-up and repetitions, a row, a printed line, releasing
    CUDA memory between shapes, the final table, CSV and PNG). Made by `start`."""

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
        """`time_fn` of ``step`` with the run's warm-up and repetitions (under torch.no_grad() if asked)."""
        if no_grad:
            with torch.no_grad():
                return time_fn(step, self.device, warmup=self.warmup, reps=self.reps)
        return time_fn(step, self.device, warmup=self.warmup, reps=self.reps)

    def time_graphed(self, impl: str, step: Callable[[int], object], calls: int) -> tuple[float, str]:
        """(µs per call, method): on CUDA `time_cuda_graph` of ``step(i)`` for i < calls, on the CPU
        `time_cpu` of ``step(0)``, with the run's warm-up and repetitions. NaN (and a line on stderr naming
        ``impl``) when it raises: one peer failing on one shape must not end the run."""
        try:
            if self.cuda:
                return time_cuda_graph(step, calls, reps=self.reps, warmup=self.warmup)
            return time_cpu(lambda: step(0), warmup=self.warmup, reps=self.reps), ""
        except Exception as e:  # noqa: BLE001
            print(f"  [n/a] {impl}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  file=sys.stderr)
            _State.last_spread = math.nan
            return math.nan, ""

    def add(self, op: str, shape, dtype: torch.dtype, impl: str, pass_: str, time_us: float, metric: float,
            unit: str, spread: Optional[float] = None) -> Row:
        """Append and return one row (shape: a string, or a sequence of ints for `shape_str`; spread: default
        the latest timing's; a compile peer's fallback: the latest timing's). A noisy row (`Row.noisy`) is
        reported on stderr."""
        if spread is None:
            spread = _State.last_spread if not _isnan(time_us) else math.nan
        fallback = _State.last_fallback if "compile" in impl else ""  # what the timing just before saw
        row = Row(op, shape if isinstance(shape, str) else shape_str(shape), dtype_str(dtype), impl, pass_, time_us,
                  metric, unit, spread, fallback)
        if row.noisy:
            print(f"  [noisy] {op} {pass_} {row.dtype} {row.shape} {impl}: spread {row.spread:.0%} (interquartile "
                  f"range / median) after outliers were dropped and more samples taken", file=sys.stderr)
        self.rows.append(row)
        return row

    @staticmethod
    def say(label: str, parts: Iterable[str], sep: str = "; ") -> None:
        """Print one progress line: ``  <label>: <part><sep><part>...``."""
        print(f"  {label}: " + sep.join(parts), flush=True)

    def say_case(self, op: str, pass_: str, dtype: torch.dtype, shape, parts: Iterable[str], sep: str = "; ") -> None:
        """`say` for one case: the label ``<op> <pass> <dtype> <shape>`` (shape: a string, or a sequence of
        ints for `shape_str`)."""
        self.say(f"{op} {pass_} {dtype_str(dtype)} {shape if isinstance(shape, str) else shape_str(shape)}", parts, sep)

    def release(self) -> None:
        """Return the caching allocator's free blocks between shapes (CUDA)."""
        if self.cuda:
            torch.cuda.empty_cache()

    def finish(self) -> int:
        """`finish` of the rows (table; CSV and PNG unless ``--no-save``); main()'s exit status 0."""
        finish(self.rows, self.name, self.device, save=not self.args.no_save)
        return 0


DtypeDefault = Union[Sequence[torch.dtype], Callable[[bool, bool], Sequence[torch.dtype]]]


def start(name: str, doc: str, argv=None, *, dtypes: DtypeDefault, warmup: tuple, reps: tuple,
          arg_parser: Optional[argparse.ArgumentParser] = None) -> BenchRun:
    """Parse a suite's command line and resolve its defaults.

    Args:
        name: the family (its CSV ``<name>.csv``). doc: the suite's docstring (its first paragraph is the
            description, the rest the epilog of ``--help``). argv: the arguments (default: sys.argv[1:]).
        dtypes: the dtypes without ``--dtypes``: a list, or ``f(cuda, quick)`` returning one.
        warmup: (CUDA, CPU) warm-up calls without ``--warmup``.
        reps: ((CUDA quick, CUDA), (CPU quick, CPU)) repetitions without ``--reps``.
        arg_parser: `parser` with the suite's own arguments added (default: `parser` itself).
    """
    args = (arg_parser or parser(doc)).parse_args(argv)
    cuda = args.device.startswith("cuda")
    if not cuda:
        choose_cpu_threads(args.threads)
    default = dtypes(cuda, args.quick) if callable(dtypes) else dtypes
    w = args.warmup if args.warmup is not None else warmup[0 if cuda else 1]
    r = args.reps if args.reps is not None else reps[0 if cuda else 1][0 if args.quick else 1]
    return BenchRun(name, args, parse_dtypes(args.dtypes, default), w, r)


def cuda_or_cpu(cuda_dtypes: Sequence[torch.dtype], cpu_dtypes: Sequence[torch.dtype]) -> Callable:
    """A ``dtypes`` default of `start`: one list on CUDA, another on the CPU."""
    return lambda cuda, quick: cuda_dtypes if cuda else cpu_dtypes
