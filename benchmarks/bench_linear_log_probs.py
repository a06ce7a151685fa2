"""opforge.bench.suites.linear_log_probs (linear_log_probs and linear_jsd) from the source tree, as
`python -m opforge bench --ops linear_log_probs`; its own options: `python benchmarks/bench_linear_log_probs.py --help`."""
import common  # noqa: F401  (opforge importable from the source tree)
from opforge.bench import suites

if __name__ == "__main__":
    raise SystemExit(suites.main("linear_log_probs"))
