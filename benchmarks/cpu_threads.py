"""CPU kernels on one thread and on two: does opforge's at::parallel_for run in parallel? (stop 22: it ran serially
until the library was compiled with OpenMP). Median of 15 calls, bf16, torch.sigmoid beside opforge.sigmoid.

    python benchmarks/cpu_threads.py            # prints one line per thread count (1 and 2)
"""
import subprocess
import sys

import torch


def measure(threads: int) -> str:
    import opforge
    from opforge.bench import harness

    torch.set_num_threads(threads)
    x = torch.randn(4096, 4096, dtype=torch.bfloat16)
    w = torch.randn(4096, dtype=torch.bfloat16)
    g = torch.randn(4096, 8192, dtype=torch.bfloat16)

    def t(f):  # ms: the harness's CPU timer (median wall time)
        return harness.time_cpu(f, warmup=3, reps=15) / 1e3

    return (f"threads {threads}: rms_norm bf16 4096x4096 {t(lambda: opforge.rms_norm(x, 4096, w)):.2f} ms; "
            f"swiglu_packed bf16 4096x8192 {t(lambda: opforge.swiglu_packed(g)):.2f} ms; "
            f"torch.sigmoid {t(lambda: torch.sigmoid(x)):.2f} ms, opforge.sigmoid {t(lambda: opforge.sigmoid(x)):.2f} ms")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(measure(int(sys.argv[1])), flush=True)
    else:
        for n in (1, 2):  # one process each: torch's thread pool is sized once per process
            subprocess.run([sys.executable, __file__, str(n)], check=True)
