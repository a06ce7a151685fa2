"""Issue 13 probe: every rms_norm CUDA kernel variant side by side in one process, with F.rms_norm and Liger.

    python benchmarks/rms_norm_variants.py                 # H200: <= 120 s; CSV to benchmarks/results/rms_norm_variants.csv
    python benchmarks/rms_norm_variants.py --shapes 32768x4096 --dtypes bfloat16

Variants are switched at run time through torch.ops.opforge._set_knob (csrc/core/knobs.h):
  OPFORGE_RMS_FWD  0: the register-cached grid-stride kernel (today's); 1: one CTA per row, 2 vectors a thread,
                   weight read after the reduction; 2: one vector a thread; 3: as 1 with the weight loaded with
                   the row; 4: 4 vectors a thread.  (forward and fused_add forward)
  OPFORGE_RMS_BWD  0: today's backward; 1: register-cached rows with shared-memory dweight partials; 2: as 1,
                   next row pipelined.  (forward+backward, forward at the default)
GB/s by bench_rms_norm.py's minimal-bytes rule (forward 2·M·N·e + N·e, fused 4·M·N·e + N·e, forward+backward
5·M·N·e + 2·N·e). Timing: CUDA events with the L2 flushed, median (common.time_cuda); for M·N < 2^20, CUDA-graph
device time of 50 back-to-back calls (common.time_cuda_graph). Each variant's output is compared with F.rms_norm's
first; a mismatch prints BAD in the table (the number is still shown).
"""
from __future__ import annotations

import argparse
import math
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

from bench_rms_norm import EPS, liger_functions  # noqa: E402  (the same peers and eps as bench_rms_norm.py)

NAME = "rms_norm_variants"
SHAPES = [(32768, 4096), (16384, 8192), (4096, 8192), (65536, 1024), (4096, 16384), (8, 4096)]
FWD_VARIANTS = [0, 1, 2, 3, 4]
BWD_VARIANTS = [0, 1, 2]
COPY_CEILING = 4274.0  # GB/s, H200 (issue 13)


def set_knob(name: str, value: int) -> int:
    return torch.ops.opforge._set_knob(name, int(value))


class knobs:
    """with knobs(OPFORGE_RMS_FWD=1): ... sets opforge knobs, restoring them after."""

    def __init__(self, **values):
        self.values, self.saved = values, []

    def __enter__(self):
        self.saved = [(k, set_knob(k, v)) for k, v in self.values.items()]

    def __exit__(self, *exc):
        for k, v in reversed(self.saved):
            set_knob(k, v)


def ours(x, w):
    return opforge.rms_norm(x, (x.shape[-1],), w, EPS)


def ours_fused(x, r, w):
    return opforge.fused_add_rms_norm(x, r, (x.shape[-1],), w, EPS)


def eager(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def eager_fused(x, r, w):
    z = x + r
    return F.rms_norm(z, (z.shape[-1],), w, EPS), z


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def close(a, b, dtype) -> bool:
    tol = 0.1 if dtype in (torch.bfloat16, torch.float16) else 2e-3
    return bool(torch.isfinite(a).all()) and (a.float() - b.float()).abs().max().item() <= tol


def timer(tiny: bool, warmup: int, reps: int):
    """A function timing fn() in µs: CUDA-graph device time for tiny shapes, else events with an L2 flush."""
    def t(fn):
        try:
            if tiny:
                return common.time_cuda_graph(lambda i: fn(), 50, reps=reps, warmup=3)[0]
            return common.time_cuda(fn, warmup=warmup, reps=reps)
        except Exception as e:  # one impl failing on one shape must not end the run
            print(f"  [n/a] {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
            return math.nan
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=None, help="e.g. 32768x4096,8x4096 (default: issue 13's six)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--no-liger", action="store_true")
    args = p.parse_args(argv)
    device = "cuda"
    t_start = time.time()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    dtypes = common.parse_dtypes(args.dtypes, [torch.bfloat16, torch.float32])
    liger_rms, liger_fused = (None, None) if args.no_liger else liger_functions()
    rows: list[Row] = []
    bad: set = set()

    def add(op, shape, dtype, impl, pass_, t, nb, ok=True):
        rows.append(Row(op, common.shape_str(shape), common.dtype_str(dtype), impl, pass_, t, common.gbps(nb, t), "GB/s"))
        if not ok:
            bad.add((op, pass_, common.shape_str(shape), common.dtype_str(dtype), impl))

    for dtype in dtypes:
        for M, N in shapes:
            e = torch.empty((), dtype=dtype).element_size()
            tiny = M * N < (1 << 20)
            t = timer(tiny, args.warmup, args.reps)
            x = torch.randn(M, N, device=device, dtype=dtype)
            r = torch.randn(M, N, device=device, dtype=dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            w = (1 + 0.1 * torch.randn(N, device=device)).to(dtype)
            nb_fwd, nb_fused, nb_bwd = 2 * M * N * e + N * e, 4 * M * N * e + N * e, 5 * M * N * e + 2 * N * e
            with torch.no_grad():
                ref = eager(x, w)
                ref_f = eager_fused(x, r, w)[0]
                for v in FWD_VARIANTS:
                    with knobs(OPFORGE_RMS_FWD=v):
                        ok = close(ours(x, w), ref, dtype)
                        add("rms_norm", (M, N), dtype, f"opforge fwd{v}", "fwd", t(lambda: ours(x, w)), nb_fwd, ok)
                        okf = close(ours_fused(x, r, w)[0], ref_f, dtype)
                        add("fused_add_rms_norm", (M, N), dtype, f"opforge fwd{v}", "fwd",
                            t(lambda: ours_fused(x, r, w)), nb_fused, okf)
                add("rms_norm", (M, N), dtype, "eager", "fwd", t(lambda: eager(x, w)), nb_fwd)
                add("fused_add_rms_norm", (M, N), dtype, "eager", "fwd", t(lambda: eager_fused(x, r, w)), nb_fused)
                if liger_rms is not None:
                    add("rms_norm", (M, N), dtype, "liger", "fwd", t(lambda: liger_rms(x, w)), nb_fwd)
                if liger_fused is not None:
                    add("fused_add_rms_norm", (M, N), dtype, "liger", "fwd", t(lambda: liger_fused(x, r, w)), nb_fused)
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            gx_ref, gw_ref = common.fwd_bwd(eager, (xg, wg), dy)()
            for v in BWD_VARIANTS:
                with knobs(OPFORGE_RMS_BWD=v):
                    step = common.fwd_bwd(ours, (xg, wg), dy)
                    gx, gw = step()
                    ok = close(gx, gx_ref, dtype) and bool(
                        ((gw.float() - gw_ref.float()).abs().max() <= 0.02 * gw_ref.float().abs().max() + 1e-3).item())
                    add("rms_norm", (M, N), dtype, f"opforge bwd{v}", "fwd+bwd", t(step), nb_bwd, ok)
            add("rms_norm", (M, N), dtype, "eager", "fwd+bwd", t(common.fwd_bwd(eager, (xg, wg), dy)), nb_bwd)
            if liger_rms is not None:
                add("rms_norm", (M, N), dtype, "liger", "fwd+bwd", t(common.fwd_bwd(liger_rms, (xg, wg), dy)), nb_bwd)
            print(f"  {common.dtype_str(dtype)} {M}x{N} done ({time.time() - t_start:.0f} s)", flush=True)
            del x, r, dy, w, xg, wg, ref, ref_f, gx_ref, gw_ref
            torch.cuda.empty_cache()

    print_table(rows, bad)
    if not args.no_save:
        path = common.write_csv(rows, NAME, device)
        print(f"CSV: {path}")
    print(f"total {time.time() - t_start:.0f} s; copy ceiling {COPY_CEILING:.0f} GB/s")
    return 0


def print_table(rows, bad) -> None:
    """Per (dtype, op, pass): one line per impl, GB/s per shape (BAD: output differed from F.rms_norm)."""
    shapes = list(dict.fromkeys(r.shape for r in rows))
    groups = list(dict.fromkeys((r.dtype, r.op, r.pass_) for r in rows))
    cell = {(r.dtype, r.op, r.pass_, r.impl, r.shape): r.metric for r in rows}
    for dtype, op, pass_ in groups:
        impls = list(dict.fromkeys(r.impl for r in rows if (r.dtype, r.op, r.pass_) == (dtype, op, pass_)))
        common.print_grid(f"{op} {pass_} {dtype} (GB/s, minimal bytes; copy ceiling {COPY_CEILING:.0f})", impls, shapes,
                          lambda s: s, lambda impl, s: cell.get((dtype, op, pass_, impl, s), math.nan),
                          lambda impl, s: (op, pass_, s, dtype, impl) in bad)
    if bad:
        print("\nBAD (output differs from F.rms_norm; '!' above): " + "; ".join(" ".join(b) for b in sorted(bad)))


if __name__ == "__main__":
    sys.exit(main())
