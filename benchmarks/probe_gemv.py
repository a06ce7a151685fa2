"""Device time of small-M linear (the GEMV path) by CUDA-graph replay, rotating weight copies so the
weights stream from HBM (rotation set > 2x L2). Prints µs per call and weight-streaming GB/s for opforge
and F.linear. A probe for tuning; bench_linear.py is the recorded benchmark.

    python benchmarks/probe_gemv.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
import opforge  # noqa: E402


def graph_time_us(fn, calls):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:3]:
            fn(*c)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            fn(*c)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def main():
    print(f"{'shape':>18} {'dtype':>9} {'bias':>5} {'opforge us':>11} {'GB/s':>7} {'F.linear us':>12} {'GB/s':>7}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for (M, K, N) in [(1, 4096, 4096), (8, 4096, 4096), (16, 4096, 4096), (16, 4096, 14336), (4, 8192, 28672)]:
            wbytes = N * K * torch.finfo(dtype).bits // 8
            copies = max(2, int(2 * 2.2 * 60e6 // wbytes) + 1)
            ws = [torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5 for _ in range(copies)]
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            b = torch.randn(N, device="cuda", dtype=dtype)
            for bias in (False, True):
                calls = [(x, w, b if bias else None) for w in ws] * max(1, 24 // copies)
                t_ours = graph_time_us(opforge.linear, calls)
                t_ref = graph_time_us(F.linear, calls)
                err = (opforge.linear(x, ws[0], b if bias else None).float()
                       - F.linear(x, ws[0], b if bias else None).float()).abs().max().item()
                print(f"{str((M, K, N)):>18} {str(dtype)[6:]:>9} {str(bias):>5} {t_ours:11.2f} {wbytes / t_ours / 1e3:7.0f}"
                      f" {t_ref:12.2f} {wbytes / t_ref / 1e3:7.0f}   maxdiff {err:.2e}", flush=True)
            del ws
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
