"""The benchmark harness, :mod:`opforge.bench.harness`, under the name the tools of this folder import: ``import
common`` puts the source tree's python/ on sys.path when opforge is not importable otherwise, and *is* that module.
"""
import sys
from pathlib import Path

try:
    from opforge.bench import harness as _harness
except ImportError:  # running from a source tree: python/ is the package root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from opforge.bench import harness as _harness

sys.modules[__name__] = _harness
