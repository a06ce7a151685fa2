"""opforge.bench.suites.rms_norm from the source tree, as `python -m opforge bench --ops rms_norm`;
its own options: `python benchmarks/bench_rms_norm.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("rms_norm"))
