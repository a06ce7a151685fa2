"""linear_cross_entropy (forward, forward+backward) against eager F.linear + F.cross_entropy (fp32 loss),
torch.compile of it, Liger-Kernel's LigerFusedLinearCrossEntropyLoss and cut_cross_entropy's linear_cross_entropy
(when importable), torch's F.linear_cross_entropy chunked path (torch >= 2.13), and the floor: the three GEMMs
(logits, dX, dW; 2·BT·H·V FLOPs each) measured alone with torch.mm (cuBLAS on CUDA). On CUDA also opforge with
float32 logits chunks (the knob OPFORGE_LCE_LEAN=0 around the call: "opforge(fp32 chunks)"), beside "opforge" in the
process's mode (lean mode by default: 16-bit logits chunks).

Rows: for each (shape, pass, impl) the time in µs with metric = time / the GEMM floor of that pass (unit
"xGEMM": forward's floor is one GEMM, forward+backward's three), and a second row (op linear_cross_entropy_mem)
with metric = peak memory above the inputs in MiB (CUDA: torch.cuda.max_memory_allocated; CPU: the process's
peak resident set (VmHWM, reset through /proc/self/clear_refs) above its resident set before the call).
10% of the targets are ignored. Before timing, opforge's loss on the first rows is checked against
opforge.testing's float64 reference.

    python -m opforge bench --ops linear_cross_entropy [--quick]
    python benchmarks/bench_linear_cross_entropy.py                 # CUDA: the shapes below, bf16
    python benchmarks/bench_linear_cross_entropy.py --quick         # CUDA: three shapes
    python benchmarks/bench_linear_cross_entropy.py --device cpu --quick   # CPU: BT 2048, H 512, V 32000, fp32
"""
from __future__ import annotations

import gc
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness

NAME = "linear_cross_entropy"
CUDA_SHAPES = [(bt, h, v) for bt in (4096, 8192, 16384) for h in (2048, 4096) for v in (32000, 128256, 151936)]
CUDA_QUICK_SHAPES = [(8192, 4096, 128256), (8192, 2048, 128256), (16384, 4096, 32000)]
CPU_SHAPES = [(2048, 512, 32000)]


CHECK_ROWS = 256  # the reference check runs on the first rows only (the float64 logits of every row are large)


def eager(x, w, t):
    """F.cross_entropy of the fp32 logits of F.linear."""
    return F.cross_entropy(F.linear(x, w).float(), t)


def ours(x, w, t):
    """opforge.linear_cross_entropy (the default: gradients computed in the forward)."""
    return opforge.linear_cross_entropy(x, w, t)


def ours_recompute(x, w, t):
    """The recompute path (4 GEMMs) for reduction "mean", through the knob, to measure both designs."""
    prev = torch.ops.opforge._set_knob("OPFORGE_LCE_GRAD_IN_FORWARD", 0)
    try:
        return opforge.linear_cross_entropy(x, w, t)
    finally:
        torch.ops.opforge._set_knob("OPFORGE_LCE_GRAD_IN_FORWARD", prev)


def ours_fp32_chunks(x, w, t):
    """Lean mode off (OPFORGE_LCE_LEAN=0 through the knob: float32 logits chunks, a 16-bit copy of the gradient,
    float32 dW accumulation, 1024-row chunks at V = 128256), to measure it beside the process's mode in one run."""
    prev = torch.ops.opforge._set_knob("OPFORGE_LCE_LEAN", 0)
    try:
        return opforge.linear_cross_entropy(x, w, t)
    finally:
        torch.ops.opforge._set_knob("OPFORGE_LCE_LEAN", prev)


def torch_chunked(x, w, t):
    """torch's F.linear_cross_entropy (its chunked path)."""
    opts = torch.nn.LinearCrossEntropyOptions() \
        if hasattr(torch.nn, "LinearCrossEntropyOptions") else None
    return F.linear_cross_entropy(x, w, t, ignore_index=-100, options=opts)


def make_liger():
    """Liger-Kernel's LigerFusedLinearCrossEntropyLoss as fn(x, w, t), or None when it does not import."""
    cls = harness.liger("LigerFusedLinearCrossEntropyLoss")
    if cls is None:
        return None
    loss = cls()
    return lambda x, w, t: loss(w, x, t)


def make_cce():
    """cut_cross_entropy's linear_cross_entropy as fn(x, w, t), or None when it does not import."""
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except Exception:
        return None
    return lambda x, w, t: cce(x, w, t)


def gemm_floor(x, w, dev):
    """The three GEMMs alone: logits = X·Wᵀ, dX = dZ·W, dW = dZᵀ·X (dZ in the input's dtype)."""
    dz = torch.randn(x.shape[0], w.shape[0], device=dev, dtype=x.dtype)

    def fwd():
        return torch.mm(x, w.t())

    def fwd_bwd():
        torch.mm(x, w.t())
        torch.mm(dz, w)
        return torch.mm(dz.t(), x)

    return fwd, fwd_bwd


def peak_cpu(fn) -> float:
    """Peak resident memory above the resident set before fn(), in MiB (Linux)."""
    def rss(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 1024
        return math.nan

    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return math.nan
    before = rss("VmRSS:")
    fn()
    return rss("VmHWM:") - before


def peak_cuda(fn) -> float:
    """Peak CUDA memory above the live tensors during fn(), in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(3, 1), reps=((10, 10), (3, 3)))
    dev, cuda = run.device, run.cuda
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_SHAPES)
    impls = {"opforge": ours, "opforge(recompute)": ours_recompute, "eager": eager}
    if not run.args.no_compile:
        comp = harness.compiled(eager, fullgraph=True)
        if comp is not None:
            impls["torch.compile"] = comp
    if hasattr(F, "linear_cross_entropy"):
        impls["F.linear_cross_entropy(chunked)"] = torch_chunked
    if cuda:
        impls["opforge(fp32 chunks)"] = ours_fp32_chunks
        for name, make in (("liger", make_liger), ("cut_cross_entropy", make_cce)):
            fn = make()
            if fn is not None:
                impls[name] = fn
    peak = peak_cuda if cuda else peak_cpu
    for dtype in run.dtypes:
        for (BT, H, V) in shapes:
            torch.manual_seed(0)
            x = torch.randn(BT, H, device=dev, dtype=dtype)
            w = (torch.randn(V, H, device=dev, dtype=dtype) / math.sqrt(H))
            t = torch.randint(0, V, (BT,), device=dev)
            t[torch.rand(BT, device=dev) < 0.1] = -100
            shape = harness.shape_str((BT, H, V))
            xs, ts = x[:CHECK_ROWS], t[:CHECK_ROWS]
            harness.check_reference(f"{NAME} {harness.dtype_str(dtype)} {shape}", ours(xs, w, ts),
                                    testing.linear_cross_entropy_reference(xs, w, ts), eager(xs, w, ts))
            floor_f, floor_fb = gemm_floor(x, w, dev)
            floor, floor_spread = {}, {}
            for pass_, step in (("fwd", floor_f), ("fwd+bwd", floor_fb)):
                floor[pass_] = run.time(step)
                floor_spread[pass_] = harness.last_spread()
            for pass_ in ("fwd", "fwd+bwd"):
                run.add(NAME, shape, dtype, "3 GEMMs (floor)" if pass_ == "fwd+bwd" else "1 GEMM (floor)", pass_,
                        floor[pass_], 1.0, "xGEMM", spread=floor_spread[pass_])
                group = [f"floor {harness._fmt(floor[pass_])}us"]
                for impl, fn in impls.items():
                    xi = x.detach().requires_grad_(pass_ == "fwd+bwd")
                    wi = w.detach().requires_grad_(pass_ == "fwd+bwd")
                    step = harness.fwd_bwd(fn, [xi, wi, t]) if pass_ == "fwd+bwd" else (lambda: fn(xi, wi, t))
                    tm = run.time(step)
                    spread = harness.last_spread()
                    try:
                        mem = peak(step) if not math.isnan(tm) else math.nan
                    except Exception:
                        mem = math.nan
                    ratio = tm / floor[pass_] if floor[pass_] > 0 else math.nan
                    run.add(NAME, shape, dtype, impl, pass_, tm, ratio, "xGEMM", spread=spread)
                    run.add(NAME + "_mem", shape, dtype, impl, pass_, tm, mem, "MiB", spread=spread)
                    group.append(f"{impl} {harness._fmt(tm)}us ({harness._fmt(ratio, 2)}x, {harness._fmt(mem, 0)} MiB)")
                    del step
                    gc.collect()
                    run.release()
                run.say_case(NAME, pass_, dtype, shape, group)
    return run.finish()

