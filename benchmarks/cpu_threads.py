"""CPU kernels on one thread and on two: does opforge's at::parallel_for run in parallel? (It runs serially in a
library compiled without OpenMP.) The harness's CPU timer, bf16, torch.sigmoid beside opforge.sigmoid.

    python benchmarks/cpu_threads.py            # prints one line per thread count (1 and 2)
    python benchmarks/cpu_threads.py --threads 1 --library build/test/libopforge.so --library build/avx512/libopforge.so
                                                # the same per library (e.g. the AVX2 and the OPFORGE_CPU_AVX512 build)
"""
import argparse
import os
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, action="append", help="thread counts (default 1 and 2)")
    p.add_argument("--library", action="append", help="libopforge.so paths, one process each (default: as installed "
                   "or OPFORGE_LIBRARY)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        print(measure(a.worker), flush=True)
    else:
        for lib in a.library or [None]:
            env = dict(os.environ, **({"OPFORGE_LIBRARY": os.path.abspath(lib)} if lib else {}))
            if lib:
                print(f"library {lib}", flush=True)
            for n in a.threads or (1, 2):  # one process each: torch's thread pool is sized once per process
                subprocess.run([sys.executable, __file__, "--worker", str(n)], check=True, env=env)
