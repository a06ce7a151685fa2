"""Finding, checking and loading ``libopforge.so``, the native library that registers ``torch.ops.opforge.*``.

A leaf module: it imports torch and the standard library only, never the rest of opforge, so that both
``opforge/__init__.py`` (which loads the library through it) and `opforge.doctor` (which reports what happened)
depend on it and not on each other.

Environment:
    OPFORGE_LIBRARY: path of a ``libopforge.so`` to load instead of the installed one (e.g. a CMake build tree's
        ``build/libopforge.so``), or ``jit`` to compile this source checkout with torch.utils.cpp_extension
        (see `opforge.jit`; OPFORGE_JIT_SOURCES adds files, OPFORGE_JIT_VERBOSE=1 shows the compiler's output).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

PACKAGE_DIR = Path(__file__).resolve().parent

#: Where the library was loaded from, once `load_once` succeeded.
path: Optional[Path] = None
#: Why loading failed (the ImportError's message), once `load_once` failed.
error: Optional[str] = None
_attempted = False


def _base_version(v: str) -> str:
    return v.split("+")[0]


def expected_path() -> Optional[Path]:
    """Where the library is looked for: $OPFORGE_LIBRARY, else ``<package>/lib/libopforge.so``; None for the JIT
    build (``OPFORGE_LIBRARY=jit``)."""
    env = os.environ.get("OPFORGE_LIBRARY")
    if env == "jit":
        return None
    if env:
        return Path(env)
    return PACKAGE_DIR / "lib" / "libopforge.so"


def read_build_info(lib: Path) -> Dict[str, str]:
    """The build stamp ``opforge_build.txt`` beside ``lib`` as a dict (``torch``, ``cuda``, ``avx2``, ``openmp``,
    ``cuda_archs``, ...); {} when there is none."""
    info: Dict[str, str] = {}
    stamp = Path(lib).parent / "opforge_build.txt"
    if stamp.exists():
        for line in stamp.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep:
                info[key.strip()] = value.strip()
    return info


def load() -> Path:
    """Check the library against this torch and CPU, then load it into torch (no state kept: see `load_once`).

    Returns:
        The path loaded (the JIT build's, with ``OPFORGE_LIBRARY=jit``).
    Raises:
        ImportError: when the library cannot be found, was built for another torch version (the message names
            both), for CPU instructions this machine lacks, or does not load (the message says how to rebuild).
    """
    if os.environ.get("OPFORGE_LIBRARY") == "jit":  # build from this source checkout instead (opforge.jit)
        from . import jit

        extra = [s for s in os.environ.get("OPFORGE_JIT_SOURCES", "").split(os.pathsep) if s]
        return jit.load(extra_sources=extra, verbose=os.environ.get("OPFORGE_JIT_VERBOSE", "") not in ("", "0"))
    lib = expected_path()
    if not lib.exists():
        raise ImportError(
            f"opforge: native library not found at {lib}. Build and install it with "
            "`pip install --no-build-isolation .` from the opforge source tree, or point "
            "OPFORGE_LIBRARY at a CMake build's libopforge.so."
        )
    info = read_build_info(lib)
    built_for = info.get("torch")
    if info.get("avx2") == "ON" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        raise ImportError(
            f"opforge: {lib} was built with AVX2/FMA CPU kernels, but this CPU does not report AVX2; rebuild "
            "with `cmake -DOPFORGE_CPU_AVX2=OFF` (pip: `pip install --no-build-isolation -C "
            "cmake.define.OPFORGE_CPU_AVX2=OFF .`)."
        )
    if info.get("avx512") == "ON" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        raise ImportError(
            f"opforge: {lib} was built with AVX-512 CPU kernels (OPFORGE_CPU_AVX512=ON), but torch reports this CPU "
            f"as {torch.backends.cpu.get_cpu_capability()} (no AVX-512, or ATEN_CPU_CAPABILITY lowered it); rebuild "
            "without `-DOPFORGE_CPU_AVX512=ON` (the default AVX2 kernels)."
        )
    if built_for and _base_version(built_for) != _base_version(torch.__version__):
        raise ImportError(
            f"opforge: {lib} was built for torch {built_for}, but torch {torch.__version__} is "
            "installed; rebuild opforge against this torch (`pip install --no-build-isolation .`)."
        )
    try:
        torch.ops.load_library(str(lib))
    except OSError as e:  # e.g. an undefined symbol from a torch that changed its ABI
        raise ImportError(
            f"opforge: could not load {lib} into torch {torch.__version__} (built for torch "
            f"{built_for or 'unknown'}): {e}. Rebuild opforge against the installed torch."
        ) from e
    return lib


def load_once() -> Path:
    """`load` the first time (recording `path` or `error`); later calls return the same path, or
    raise the same ImportError again.

    Raises:
        ImportError: as `load`.
    """
    global path, error, _attempted
    if not _attempted:
        _attempted = True
        try:
            path = load()
        except ImportError as e:
            error = str(e)
    if error is not None:
        raise ImportError(error)
    return path


def running_doctor() -> bool:
    """Whether this process is ``python -m opforge doctor ...``: while runpy imports the package, sys.argv is
    ``["-m", "doctor", ...]``. The package then stays importable when the library does not load, so that the doctor
    can explain why."""
    return sys.argv[:1] == ["-m"] and sys.argv[1:2] == ["doctor"]


def warn_if_shadowing() -> None:
    """Warn (``UserWarning``) when an installed opforge exists at another path than this (source-tree) copy. Silent
    when OPFORGE_LIBRARY is set: whoever points it at a build tree (scripts/test.sh, a CMake user) chose the source
    copy."""
    if os.environ.get("OPFORGE_LIBRARY"):
        return
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        try:
            dist = distribution("opforge")
        except PackageNotFoundError:
            return
        installed = Path(dist.locate_file("opforge/__init__.py")).resolve()
    except Exception:  # noqa: BLE001  (a broken metadata folder must not break the import)
        return
    here = (PACKAGE_DIR / "__init__.py").resolve()
    if installed.exists() and installed != here:
        import warnings

        warnings.warn(
            f"opforge: importing {here.parent} (from the source tree / PYTHONPATH), which shadows the installed "
            f"opforge {dist.version} at {installed.parent}; unset PYTHONPATH (or leave the source folder) to use "
            "the installed one.", UserWarning, stacklevel=3)
