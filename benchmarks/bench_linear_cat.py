"""opforge.bench.suites.linear_cat from the source tree, as `python -m opforge bench --ops linear_cat`;
its own options: `python benchmarks/bench_linear_cat.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("linear_cat"))
