"""The op families' benchmark suites: one module a family (``rms_norm``, ``linear``, ...), each with
``main(argv) -> int`` on `opforge.bench.harness`, run by ``python -m opforge bench`` (one process a family) and
by the entry points ``benchmarks/bench_<family>.py`` of the source tree.

A new family is a new module here: `families` finds it by its name (modules whose name starts with ``_`` are
not families).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import List, Optional


def families(package: str = __name__) -> List[str]:
    """The families of ``package`` (default: this one), sorted: its modules whose name does not start with ``_``.

    Raises:
        ModuleNotFoundError: when ``package`` does not import.
    """
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_"))


def main(family: str, argv: Optional[List[str]] = None, package: str = __name__) -> int:
    """Run ``family``'s suite: ``<package>.<family>.main(argv)`` (argv default: sys.argv[1:]); its exit status."""
    return importlib.import_module(f"{package}.{family}").main(argv)
