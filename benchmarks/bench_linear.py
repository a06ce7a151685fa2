"""opforge.bench.suites.linear from the source tree, as `python -m opforge bench --ops linear`;
its own options: `python benchmarks/bench_linear.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("linear"))
