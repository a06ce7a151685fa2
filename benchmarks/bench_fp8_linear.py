"""opforge.bench.suites.fp8_linear from the source tree, as `python -m opforge bench --ops fp8_linear`;
its own options: `python benchmarks/bench_fp8_linear.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("fp8_linear"))
