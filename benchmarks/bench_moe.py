"""opforge.bench.suites.moe from the source tree, as `python -m opforge bench --ops moe`;
its own options: `python benchmarks/bench_moe.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("moe"))
