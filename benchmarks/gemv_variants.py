"""Issue 13 probe: small-M linear (decode GEMV) kernels side by side: the warp-per-rows GEMV, the tensor-core
GEMV variants, cuBLASLt and F.linear, in GB/s of weight bytes streamed.

    python benchmarks/gemv_variants.py                 # H200: <= 90 s; CSV to benchmarks/results/gemv_variants.csv
    python benchmarks/gemv_variants.py --dtypes bfloat16 --ms 1,8

Impls (torch.ops.opforge._set_knob, csrc/core/knobs.h): "gemv0" OPFORGE_LINEAR_GEMV=1 with OPFORGE_GEMV_VARIANT=0
(today's kernel), "gemv1".."gemv3" the tensor-core kernels (1: 16 W rows a warp; 2: 32 rows; 3: 16 rows with
split-K over blocks where the grid is small; 16-bit dtypes only), "cublaslt" OPFORGE_LINEAR_GEMV=0, "gemmex" also
OPFORGE_LINEAR_LT=0 (cublasGemmEx), "default"
(the chooser as shipped), "F.linear". Device time per call: CUDA-graph replay of back-to-back calls with the
weight rotated over copies that exceed the L2 twice over (as bench_linear.py). Each impl's output is compared
with F.linear's first; a mismatch prints '!' in the table.
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

NAME = "gemv_variants"
MS = [1, 2, 4, 8, 16]
KN = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1024), (2048, 128256)]
L2_BYTES = 60e6
COPY_CEILING = 4274.0
# impl -> (OPFORGE_LINEAR_GEMV, OPFORGE_GEMV_VARIANT, OPFORGE_LINEAR_LT); None: F.linear. "gemmex": no GEMV and no
# cuBLASLt, the cublasGemmEx fallback (the question of fp32 at M 8..16, where cuBLASLt measured up to 1.9x slower
# than F.linear)
IMPLS = {"gemv0": (1, 0, 1), "gemv1": (1, 1, 1), "gemv2": (1, 2, 1), "gemv3": (1, 3, 1), "cublaslt": (0, -1, 1),
         "gemmex": (0, -1, 0), "default": (-1, -1, 1), "F.linear": None}


def set_knobs(gemv: int, variant: int, lt: int):
    """Sets the three knobs; returns their previous values (the same order) for restoring."""
    return (torch.ops.opforge._set_knob("OPFORGE_LINEAR_GEMV", gemv),
            torch.ops.opforge._set_knob("OPFORGE_GEMV_VARIANT", variant),
            torch.ops.opforge._set_knob("OPFORGE_LINEAR_LT", lt))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    device = "cuda"
    t_start = time.time()
    dtypes = common.parse_dtypes(args.dtypes, [torch.bfloat16, torch.float16, torch.float32])
    ms = [int(m) for m in args.ms.split(",")]
    rows: list[Row] = []
    bad: set = set()
    for dtype in dtypes:
        elem = torch.empty((), dtype=dtype).element_size()
        for K, N in KN:
            wbytes = N * K * elem
            copies = max(1, math.ceil(2.2 * L2_BYTES / wbytes))
            calls = copies * max(1, math.ceil(20 / copies))
            ws = [(torch.randn(N, K, device=device) / K ** 0.5).to(dtype) for _ in range(copies)]
            for M in ms:
                x = torch.randn(M, K, device=device, dtype=dtype)
                with torch.no_grad():
                    ref = F.linear(x, ws[0]).float()
                    scale = ref.abs().max().item() + 1e-6
                    for impl, kn in IMPLS.items():
                        if kn is not None and dtype == torch.float32 and impl in ("gemv1", "gemv2", "gemv3"):
                            continue  # fp32 takes the warp-per-rows kernel for every GEMV variant
                        fn = (lambda w: F.linear(x, w)) if kn is None else (lambda w: opforge.linear(x, w))
                        saved = set_knobs(*kn) if kn is not None else None
                        try:
                            err = (fn(ws[0]).float() - ref).abs().max().item() / scale
                            tol = 2e-2 if dtype != torch.float32 else 2e-3
                            if not err <= tol:
                                bad.add((common.dtype_str(dtype), f"{M}x{K}x{N}", impl))
                            t, _ = common.time_cuda_graph(lambda i: fn(ws[i % copies]), calls, reps=args.reps)
                        except Exception as e:  # one impl failing on one shape must not end the run
                            print(f"  [n/a] {impl} {M}x{K}x{N}: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
                                  file=sys.stderr)
                            t = math.nan
                        finally:
                            if saved is not None:
                                set_knobs(*saved)
                        rows.append(Row("linear", common.shape_str((M, K, N)), common.dtype_str(dtype), impl, "fwd",
                                        t, common.gbps(wbytes, t), "GB/s"))
                del x
            print(f"  {common.dtype_str(dtype)} K={K} N={N} done ({time.time() - t_start:.0f} s)", flush=True)
            del ws
            torch.cuda.empty_cache()
    print_table(rows, bad)
    if not args.no_save:
        print(f"CSV: {common.write_csv(rows, NAME, device)}")
    print(f"total {time.time() - t_start:.0f} s; copy ceiling {COPY_CEILING:.0f} GB/s, goal 0.85x = 3633")
    return 0


def print_table(rows, bad) -> None:
    """Per dtype and (K, N): one line per impl, GB/s of weight bytes per M ('!': output differed from F.linear)."""
    cell = {(r.dtype, r.shape, r.impl): r.metric for r in rows}
    for dtype in dict.fromkeys(r.dtype for r in rows):
        kns = list(dict.fromkeys("x".join(r.shape.split("x")[1:]) for r in rows if r.dtype == dtype))
        mlist = list(dict.fromkeys(r.shape.split("x")[0] for r in rows if r.dtype == dtype))
        for kn in kns:
            common.print_grid(f"linear fwd {dtype} KxN={kn} (GB/s of weight; ceiling {COPY_CEILING:.0f})", IMPLS, mlist,
                              lambda m: "M=" + m, lambda impl, m: cell.get((dtype, f"{m}x{kn}", impl)),
                              lambda impl, m: (dtype, f"{m}x{kn}", impl) in bad, label_width=10, cell_width=9)
    if bad:
        print("\nBAD (output differs from F.linear): " + "; ".join(" ".join(b) for b in sorted(bad)))


if __name__ == "__main__":
    sys.exit(main())
