"""Where one training step's GPU time goes: torch.profiler of a Hugging Face Llama (HF, Liger, opforge) and of the
demo model.

(a) For each variant (default hf, liger when importable, opforge; ``--variants`` takes any of bench_hf_llama.py's,
e.g. ``hf+compile,opforge+compile``; each in its own process) the model of
benchmarks/bench_hf_llama.py (its ``build_variant``: same configuration options, seed, tokens, AdamW) trains
``--warmup`` steps, then one profiled step; printed: the step's GPU time by category, the top kernels, and (CUDA)
the step's GPU idle time: its longest gaps between kernels, each with the CPU op that issued the kernel ending it
and whether the host issued it late (the GPU starved), idle time summed by that op, and the host syncs (CUDA runtime
calls that wait for the GPU) with the op that made them. Kernels are matched to the runtime calls and CPU ops that
issued them through torch's ``linked_correlation_id`` where its profiler events have one, else (torch 2.11) through
the ``correlation`` ids of the profile's chrome trace (:func:`gpu_idle_from_trace`).
Categories (first match, on the kernel name, lower-cased; :func:`category`):

    opforge kernels   our own kernels (names in namespace ``opforge::``; its GEMMs are cuBLAS's, so GEMM)
    attention         flash / memory-efficient / cuDNN SDPA kernels
    GEMM              cuBLAS / cuBLASLt / CUTLASS matrix multiplies (gemm, nvjet, xmma, cutlass, sm90_...)
    optimizer         AdamW (multi_tensor_apply, fused adam)
    softmax/CE        softmax, log_softmax, nll_loss, cross_entropy (Liger's and Inductor's too)
    norms             RMSNorm / LayerNorm kernels (rms_norm, layer_norm, Inductor's ``rsqrt`` reductions)
    copies/casts      copies, dtype casts, cat, fill, memcpy/memset
    elementwise       everything else elementwise or a reduction (aten's elementwise/reduce kernels, Triton
                      pointwise kernels, SwiGLU, RoPE)
    other             the rest

(b) One training step of the demo model (opforge.models.llama.Llama, backend "opforge") under torch.profiler:
``key_averages()`` sorted by device time (CPU time on the CPU), then only the ``opforge::<op>`` ranges, each
with the time of the kernels under it.

    python benchmarks/profile_step.py                     # CUDA, bench_hf_llama's default configuration
    python benchmarks/profile_step.py --layers 8          # quicker
    python benchmarks/profile_step.py --variants hf+compile,opforge+compile --no-demo --out benchmarks/results/profile_step_compile_cuda.txt
    python benchmarks/profile_step.py --smoke             # CPU, tiny configuration (tests/python/test_profile_step.py)

Output: printed and written to ``--out`` (default benchmarks/results/profile_step_<cuda|cpu>.txt).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_hf_llama  # noqa: E402
import common  # noqa: E402

VARIANTS = ["hf", "liger", "opforge"]  # the default set; any of bench_hf_llama.VARIANTS is accepted (e.g. "opforge+compile")
CATEGORIES = ["GEMM", "attention", "copies/casts", "softmax/CE", "norms", "elementwise", "optimizer",
              "opforge kernels", "other"]
# (category, pattern on the lower-cased kernel or op name), first match wins
_RULES = [
    ("opforge kernels", r"opforge::(?!.*(gemm|cublas))"),
    ("attention", r"flash|fmha|attention|sdpa|sdp_|_efficient_att|cudnn.*(mha|sdp)"),
    ("optimizer", r"adam|multi_tensor_apply|_fused_sgd|optimizer|foreach"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|^sm\d+_|cublas|wgmma|splitk|aten::(mm|addmm|bmm|baddbmm|matmul)$|_mkl|"
             r"mkldnn_matmul|linear$"),
    ("softmax/CE", r"softmax|cross_entropy|nll_loss|logsumexp"),
    ("norms", r"rms_?norm|layer_?norm|rsqrt"),
    ("copies/casts", r"copy|cat_|catarray|aten::cat$|memcpy|memset|fill|aten::to$|_to_copy|clone|contiguous"),
    ("elementwise", r"elementwise|vectorized|reduce|triton_(poi|red|per)|silu|swiglu|rope|rotary|aten::\w+$"),
]


_RANGES = ("ProfilerStep", "Optimizer.", "aten::", "opforge::", "autograd::", "## ")


def category(name: str) -> str:
    """The category (one of CATEGORIES) of a kernel or op name (first matching rule of _RULES)."""
    n = name.lower()
    for cat, pattern in _RULES:
        if re.search(pattern, n):
            return cat
    return "other"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the profiled one")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated variants of bench_hf_llama.py (default {','.join(VARIANTS)})")
    p.add_argument("--top", type=int, default=15, help="kernels listed per variant")
    p.add_argument("--no-demo", action="store_true", help="skip (b), the demo model's table")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny configuration, one warm-up step")
    p.add_argument("--out", type=Path, default=None, help="output file (default benchmarks/results/profile_step_<dev>.txt)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per process")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.smoke:
        a.device, a.warmup = "cpu", 1
    a.variant_list = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variant_list if v not in bench_hf_llama.VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {bad}; choose from {list(bench_hf_llama.VARIANTS)}")
    if a.out is None:
        a.out = common.RESULTS_DIR / f"profile_step_{'cuda' if a.device.startswith('cuda') else 'cpu'}.txt"
    return a


def _bench_args(a: argparse.Namespace) -> argparse.Namespace:
    """bench_hf_llama's options for this profile (its own parser: one definition of the configuration)."""
    argv = ["--device", a.device, "--steps", "1", "--warmup", str(a.warmup)]
    if a.smoke:
        argv.append("--smoke")
    else:
        argv += ["--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch), "--vocab", str(a.vocab)]
    b = bench_hf_llama.parse_args(argv)
    b.steps, b.warmup = 1, a.warmup
    return b


# ---- GPU idle time: where the step's GPU waits ----------------------------------------------------------------

#: CUDA runtime/driver calls that block the host until the GPU catches up (a host sync inside the step)
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpy2D",
              "cudaFree", "cudaMalloc", "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemFree_v2"}
#: CPU ops that wait for the GPU whatever runtime call they make (.item(), data-dependent shapes)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::masked_select")


def idle_gaps(kernels, launches, min_us: float = 5.0) -> list:
    """GPU idle intervals of a step, each attributed to the kernel that ends it.

    kernels: [(start_us, end_us, name, corr)] of every device activity (kernels, memcpys, memsets), any order;
    launches: {corr: (launch_start_us, op)}: when the host issued activity `corr` and the CPU op that issued it.
    Returns [(gap_us, gap_start_us, next_name, op, host_late)] for every gap of at least `min_us` between the end of
    all earlier activities and the next start, longest first; host_late is True when the host issued the next
    activity after the gap began (the GPU starved: the host was the bottleneck there), False when it was queued
    in time (a dependency or a device-side wait)."""
    out, busy_until = [], None
    for start, end, name, corr in sorted(kernels):
        if busy_until is not None and start - busy_until >= min_us:
            launch, op = launches.get(corr, (None, "?"))
            out.append((start - busy_until, busy_until, name, op, launch is not None and launch > busy_until))
        busy_until = end if busy_until is None else max(busy_until, end)
    return sorted(out, key=lambda g: -g[0])


def _op_path(e) -> str:
    """'outermost > innermost' CPU op names of a profiler event (ProfilerStep ranges left out)."""
    names = []
    while e is not None:
        if not e.name.startswith("ProfilerStep"):
            names.append(e.name)
        e = e.cpu_parent
    if not names:
        return "?"
    return names[-1] if len(names) == 1 else f"{names[-1]} > {names[0]}"


def _gpu_idle(prof, top: int = 12) -> dict:
    """The profiled step's GPU idle time (from its first to its last device activity), its longest gaps with the CPU
    op that issued the activity after each, idle time summed by that op, and the host syncs of the step."""
    from torch.autograd import DeviceType

    events = prof.events()

    def linked(e):  # FunctionEvent.linked_correlation_id is newer than torch 2.11: without it, no attribution
        return getattr(e, "linked_correlation_id", None)

    frontend = {e.id: e for e in events if e.device_type == DeviceType.CPU and linked(e) == 0}
    runtime = {e.id: e for e in events if e.device_type == DeviceType.CPU and (linked(e) or 0) > 0}
    kernels, launches = [], {}
    for e in events:
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) \
                or "annotation" in str(getattr(e, "activity_type", "")).lower() or e.name.startswith(_RANGES):
            continue
        kernels.append((e.time_range.start, e.time_range.end, e.name, e.id))
        call, op = runtime.get(e.id), frontend.get(linked(e))
        if call is not None:
            launches[e.id] = (call.time_range.start, _op_path(op) if op is not None else call.name)
    if not kernels:
        return {}
    host_start = min((e.time_range.start for e in frontend.values()), default=None)
    calls = []
    for e in runtime.values():
        op = frontend.get(linked(e))
        calls.append((e.name, _op_path(op) if op is not None else "?", op.name if op is not None else "",
                      e.time_range.elapsed_us()))
    # attributed: CPU ops and runtime calls are linked to kernels (torch's linked_correlation_id); without it the
    # host-late, lead and sync figures are unknown, not zero
    return _idle_summary(kernels, launches, host_start, calls, bool(runtime), top)


def _idle_summary(kernels, launches, host_start, calls, attributed: bool, top: int) -> dict:
    """The figures _gpu_idle and gpu_idle_from_trace report, from what each reads out of its profile: kernels and
    launches as idle_gaps takes them; host_start: the step's first CPU op (µs; None: the first kernel's start);
    calls: [(runtime call name, its CPU op path, its innermost CPU op's name, duration µs)] of every runtime call,
    for the host syncs; attributed: whether kernels could be matched to their launches at all."""
    gaps = idle_gaps(kernels, launches)
    first = min(k[0] for k in kernels)
    host_start = first if host_start is None else host_start
    by_op: dict = {}
    for g in gaps:
        t, n = by_op.get(g[3], (0.0, 0))
        by_op[g[3]] = (t + g[0], n + 1)
    syncs: dict = {}
    for name, path, inner, dur in calls:
        if name in SYNC_CALLS or inner.startswith(SYNC_OPS):
            key = f"{name} from {path}"
            t, n = syncs.get(key, (0.0, 0))
            syncs[key] = (t + dur, n + 1)
    return {"span_us": max(k[1] for k in kernels) - first, "idle_us": sum(g[0] for g in gaps), "n_gaps": len(gaps),
            "attributed": attributed, "lead_us": max(0.0, first - host_start),
            "host_late_us": sum(g[0] for g in gaps if g[4]),
            "top": [list(g) for g in gaps[:top]],
            "by_op": sorted(([k, t, n] for k, (t, n) in by_op.items()), key=lambda r: -r[1])[:top],
            "syncs": sorted(([k, t, n] for k, (t, n) in syncs.items()), key=lambda r: -r[1])[:top]}


#: chrome-trace categories (kineto's names, compared lower-case): device activities, CUDA runtime / driver calls,
#: CPU ops (record_function ranges, kineto's user_annotation, included: they are CPU parents in _gpu_idle's events)
_TRACE_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_TRACE_RUNTIME = ("cuda_runtime", "cuda_driver")
_TRACE_OPS = ("cpu_op", "user_annotation", "operator")


def gpu_idle_from_trace(trace: dict, top: int = 12) -> dict:
    """_gpu_idle's figures from a chrome trace (the dict of torch.profiler's export_chrome_trace JSON), for a torch
    whose profiler events carry no linked_correlation_id (2.11): a device activity and the runtime call that issued it
    share ``args.correlation``; the call's CPU op path is that of the CPU ops (record_function ranges included,
    ProfilerStep left out) on the same thread (pid, tid) whose span [ts, ts + dur) contains the call's start: an op
    ending where the call or a sibling starts, or of zero duration, holds neither. Times in microseconds. Returns {}
    when the trace has no device activity."""
    corr = lambda e: (e.get("args") or {}).get("correlation")  # noqa: E731
    # one pass over the events: device activities; per thread (pid, tid), its CPU ops and runtime calls
    kernels, by_thread, host_start = [], {}, None
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        c, ts = str(e.get("cat", "")).lower(), float(e["ts"])
        if c in _TRACE_DEVICE:
            kernels.append((ts, ts + float(e.get("dur", 0)), e.get("name", "?"), corr(e)))
            continue
        if c in _TRACE_OPS:
            host_start = ts if host_start is None else min(host_start, ts)  # ProfilerStep too
            if str(e.get("name", "")).startswith("ProfilerStep"):
                continue
            kind = 0
        elif c in _TRACE_RUNTIME:
            kind = 1
        else:
            continue
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append((ts, kind, ts + float(e.get("dur", 0)), e))
    if not kernels:
        return {}
    # each runtime call's enclosing CPU ops: one sweep per thread in start order (ops before calls at one instant,
    # longer ops first), keeping the ops not yet ended
    calls = []  # (call event, its op path, innermost op name)
    for items in by_thread.values():
        stack: list = []  # (end, name) of the ops open at the sweep's time, outermost first
        for ts, kind, end, e in sorted(items, key=lambda i: (i[0], i[1], -i[2])):
            if stack and (stack[-1][0] <= ts or stack[0][0] <= ts):
                stack = [o for o in stack if o[0] > ts]  # ended ones (any level: spans may nest imperfectly)
            if kind == 0:
                stack.append((end, e.get("name", "?")))
                continue
            names = [o[1] for o in stack]
            path = "?" if not names else names[0] if len(names) == 1 else f"{names[0]} > {names[-1]}"
            calls.append((e, path, names[-1] if names else ""))
    launches = {corr(e): (float(e["ts"]), path if path != "?" else e.get("name", "?")) for e, path, _ in calls
                if corr(e) is not None}
    return _idle_summary(kernels, launches, host_start,
                         [(e.get("name"), path, inner, float(e.get("dur", 0))) for e, path, inner in calls],
                         bool(launches), top)


def _chrome_trace(prof) -> dict:
    """The profile as chrome-trace JSON (through a temporary file: export_chrome_trace writes one)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def format_idle(idle: dict) -> str:
    """The GPU idle section of a variant's table (empty without device activities)."""
    if not idle:
        return ""
    attributed = idle.get("attributed", True)
    head = f"  GPU idle: {idle['idle_us'] / 1e3:.2f} ms of the {idle['span_us'] / 1e3:.2f} ms from the step's first to " \
           f"its last kernel, in {idle['n_gaps']} gaps of >= 5 us"
    if attributed:
        head += (f" ({idle['host_late_us'] / 1e3:.2f} ms where the host issued the next kernel after the GPU went idle); "
                 f"the first kernel started {idle['lead_us'] / 1e3:.2f} ms after the step's first CPU op")
    else:
        head += (" (this torch's profiler events carry no linked_correlation_id: which CPU op issued each kernel, "
                 "whether the host was late, and the host syncs are unknown, shown as ?/n/a)")
    lines = [head,
             f"  longest gaps: {'us':>9s}  host late  next kernel / its CPU op"]
    for us, _, name, op, late in idle["top"]:
        short = name if len(name) <= 60 else name[:57] + "..."
        lines.append(f"  {us:22.1f}  {('yes' if late else 'no ') if attributed else 'n/a':9s}  {short} / {op}")
    lines.append(f"  idle by the CPU op that ended it: {'us':>9s} {'gaps':>5s}")
    for op, us, n in idle["by_op"]:
        lines.append(f"  {us:42.1f} {n:5d}  {op}")
    if idle["syncs"]:
        lines.append("  host syncs in the step (CUDA runtime calls that wait for the GPU): us, calls")
        for key, us, n in idle["syncs"]:
            lines.append(f"  {us:12.1f} {n:5d}  {key}")
    else:
        lines.append("  host syncs in the step: " + ("none" if attributed else "n/a"))
    return "\n".join(lines)


# ---- workers (one process each) ------------------------------------------------------------------------------

def _profile(fn, cuda: bool):
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return prof


def _kernel_times(prof, cuda: bool) -> dict:
    """{name: (microseconds, calls)}: CUDA kernels, memcpys and memsets on CUDA; ops' self CPU time on the CPU."""
    from torch.autograd import DeviceType

    out: dict = {}
    if cuda:
        for e in prof.events():
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False) \
                    or "annotation" in str(getattr(e, "activity_type", "")).lower() or e.name.startswith(_RANGES):
                continue  # record_function ranges mirrored on the GPU timeline, not kernels
            us = e.time_range.elapsed_us()
            t, n = out.get(e.name, (0.0, 0))
            out[e.name] = (t + us, n + 1)
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep"):
                out[e.key] = (float(e.self_cpu_time_total), int(e.count))
    return out


def _variant_worker(a: argparse.Namespace) -> dict:
    import torch

    b = _bench_args(a)
    model, _, _, report, step, sync = bench_hf_llama.build_variant(b, a.worker)
    for i in range(a.warmup):
        step(i)
    sync()
    t0 = time.perf_counter()
    step(a.warmup)
    sync()
    wall = time.perf_counter() - t0
    cuda = a.device.startswith("cuda")
    prof = _profile(lambda: step(a.warmup), cuda)
    config = (f"layers={b.layers} hidden={b.hidden} heads={b.heads}/{b.kv_heads} vocab={b.vocab} seq={b.seq} "
              f"batch={b.batch} {b.dtype}")
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    idle = _gpu_idle(prof) if cuda else {}
    if idle and not idle.get("attributed", True):  # torch 2.11: no linked_correlation_id; the trace's correlation ids
        idle = gpu_idle_from_trace(_chrome_trace(prof)) or idle
    return {"variant": a.worker, "kernels": _kernel_times(prof, cuda), "idle": idle,
            "wall_ms": wall * 1e3, "config": config,
            "peak_gib": peak, "report": report}


def _demo_worker(a: argparse.Namespace) -> dict:
    import torch

    try:
        import opforge  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(common.REPO_ROOT / "python"))
    from opforge.models.llama import Llama, LlamaConfig

    cuda = a.device.startswith("cuda")
    size = dict(d_model=64, layers=2, heads=4, seq=64, batch=4) if a.smoke else \
        dict(d_model=1024, layers=4, heads=8, seq=1024, batch=8)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, d_model=size["d_model"], n_layers=size["layers"], n_heads=size["heads"],
                      max_seq_len=size["seq"])
    dtype = torch.bfloat16 if cuda else torch.float32
    model = Llama(cfg, backend="opforge", device=a.device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    x = torch.randint(0, 256, (size["batch"], size["seq"]), device=a.device)
    y = torch.roll(x, -1, 1)

    def step():
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    prof = _profile(step, cuda)
    key = "device_time_total" if cuda else "cpu_time_total"
    avg = prof.key_averages()
    table = avg.table(sort_by=key, row_limit=30)
    ranges = [e for e in avg if e.key.startswith("opforge::")]
    dev = (lambda e: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))) if cuda else \
        (lambda e: e.cpu_time_total)
    ranges.sort(key=dev, reverse=True)
    lines = [f"{'opforge range':40s} {'calls':>6s} {'CPU total us':>13s} " + (f"{'device total us':>16s}" if cuda else "")]
    for e in ranges:
        lines.append(f"{e.key:40s} {e.count:6d} {e.cpu_time_total:13.0f} " + (f"{dev(e):16.0f}" if cuda else ""))
    desc = (f"demo model (opforge.models.llama.Llama, backend opforge): d_model={size['d_model']} layers={size['layers']} "
            f"heads={size['heads']} seq={size['seq']} batch={size['batch']} {str(dtype).replace('torch.', '')}, AdamW")
    return {"variant": "demo", "table": table, "ranges": "\n".join(lines), "n_ranges": len(ranges), "config": desc}


# ---- the driver ----------------------------------------------------------------------------------------------

def _spawn(a: argparse.Namespace, worker: str) -> dict:
    argv = ["--layers", str(a.layers), "--seq", str(a.seq), "--batch", str(a.batch), "--vocab", str(a.vocab),
            "--warmup", str(a.warmup), "--device", a.device, "--out", str(a.out)] + (["--smoke"] if a.smoke else [])
    r = bench_hf_llama.spawn_worker(Path(__file__).resolve(), worker, argv, a.timeout)
    if "status" in r:
        r["error"] = r.pop("status")
    return r


def format_variant(r: dict, top: int, cuda: bool) -> str:
    """A variant's table: time by category (ms, share) and the top kernels."""
    kernels = r["kernels"]
    total = sum(t for t, _ in kernels.values())
    by_cat = {c: 0.0 for c in CATEGORIES}
    for name, (t, _) in kernels.items():
        by_cat[category(name)] += t
    what = "GPU time (kernels)" if cuda else "self CPU time (ops)"
    peak = f", peak memory {r['peak_gib']:.2f} GiB" if cuda else ""
    lines = [f"== {r['variant']}: {what} of one training step {total / 1e3:.1f} ms (step wall time "
             f"{r['wall_ms']:.1f} ms{peak}); {r['config']}",
             f"  {'category':18s} {'ms':>9s} {'share':>7s}"]
    for c in CATEGORIES:
        if by_cat[c] > 0:
            lines.append(f"  {c:18s} {by_cat[c] / 1e3:9.2f} {100 * by_cat[c] / max(total, 1e-9):6.1f}%")
    lines.append(f"  top {top}: {'ms':>8s} {'calls':>6s}  category         name")
    for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        short = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"  {t / 1e3:14.3f} {n:6d}  {category(name):16s} {short}")
    idle = format_idle(r.get("idle") or {})
    return "\n".join(lines + ([idle] if idle else []))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        out = _demo_worker(a) if a.worker == "demo" else _variant_worker(a)
        Path(a.json).write_text(json.dumps(out))
        return 0
    import torch

    cuda = a.device.startswith("cuda")
    head = (f"profile_step: {common.device_name(a.device)}, torch {torch.__version__}, commit {common.git_commit()}, "
            f"{a.warmup} warm-up step(s) then one profiled step per variant, each in its own process")
    print(head, flush=True)
    sections = [head]
    t_all = time.perf_counter()
    for v in a.variant_list + ([] if a.no_demo else ["demo"]):
        t0 = time.perf_counter()
        r = _spawn(a, v)
        took = time.perf_counter() - t0
        if "error" in r:
            text = f"== {v}: {r['error']}"
        elif v == "demo":
            text = (f"== {r['config']}: torch.profiler key_averages() of one training step, sorted by "
                    f"{'device' if cuda else 'CPU'} time total\n{r['table']}\n"
                    f"opforge's ranges ({r['n_ranges']} ops; each includes the kernels it launched):\n{r['ranges']}")
        else:
            text = format_variant(r, a.top, cuda)
        text += f"\n  ({took:.0f} s)"
        print("\n" + text, flush=True)
        sections.append(text)
    tail = f"total {time.perf_counter() - t_all:.0f} s"
    print("\n" + tail)
    sections.append(tail)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n\n".join(sections) + "\n")
    print(f"written: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
