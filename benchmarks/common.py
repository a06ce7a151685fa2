"""The benchmark harness, now :mod:`opforge.bench.harness`; this file keeps ``import common`` in the
benchmarks/bench_*.py scripts working (it *is* that module) and ``python benchmarks/common.py --plot <csv>``.
"""
import sys
from pathlib import Path

try:
    from opforge.bench import harness as _harness
except ImportError:  # running from a source tree: python/ is the package root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from opforge.bench import harness as _harness

if __name__ == "__main__":
    sys.exit(_harness.redraw_main())
sys.modules[__name__] = _harness
