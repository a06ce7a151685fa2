"""opforge.bench.suites.fake_quant_linear from the source tree, as `python -m opforge bench --ops fake_quant_linear`;
its own options: `python benchmarks/bench_fake_quant_linear.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("fake_quant_linear"))
