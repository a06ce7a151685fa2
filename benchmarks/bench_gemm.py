"""opforge.bench.suites.gemm from the source tree, as `python -m opforge bench --ops gemm`;
its own options: `python benchmarks/bench_gemm.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("gemm"))
