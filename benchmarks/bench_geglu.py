"""opforge.bench.suites.geglu from the source tree, as `python -m opforge bench --ops geglu`;
its own options: `python benchmarks/bench_geglu.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("geglu"))
