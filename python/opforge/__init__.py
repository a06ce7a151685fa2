"""opforge: differentiable PyTorch operators written in C++ and CUDA.

Importing this package imports torch, then loads ``libopforge.so``, which registers the operators
``torch.ops.opforge.*`` (linear, rms_norm, sigmoid, square, square_add, ... and their ``*_backward`` ops) with
their CPU, CUDA, Meta and Autograd kernels. The library has no Python C API inside, so one build
serves every Python version of the same torch.

Raises:
    ImportError: when the library was built for another torch version (the message names both),
        or when it cannot be found or loaded (the message says how to build it).

Environment:
    OPFORGE_LIBRARY: path of a ``libopforge.so`` to load instead of the installed one (e.g. a CMake
        build tree's ``build/libopforge.so``), or ``jit`` to compile this source checkout with
        torch.utils.cpp_extension at import (see :mod:`opforge.jit`; OPFORGE_JIT_SOURCES adds files,
        OPFORGE_JIT_VERBOSE=1 shows the compiler's output).
    OPFORGE_NVTX=1: emit NVTX ranges for every op (read once, at import; see :mod:`opforge.profiling`).

Warns (``UserWarning``) when this copy of the package, imported from a source tree, shadows an installed
opforge (both paths are named): the code you run is then not the code pip installed.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

__version__ = "0.1.0"

_PACKAGE_DIR = Path(__file__).resolve().parent

#: Prefix for CMake's ``find_package(opforge)``: ``cmake -DCMAKE_PREFIX_PATH=<this> ...``.
cmake_prefix_path = str(_PACKAGE_DIR)


def _base_version(v: str) -> str:
    return v.split("+")[0]


def _library_path() -> Path:
    env = os.environ.get("OPFORGE_LIBRARY")
    if env:
        return Path(env)
    return _PACKAGE_DIR / "lib" / "libopforge.so"


def _read_build_info(lib: Path) -> dict[str, str]:
    info: dict[str, str] = {}
    for candidate in (lib.parent / "opforge_build.txt",):
        if candidate.exists():
            for line in candidate.read_text().splitlines():
                key, _, value = line.partition("=")
                info[key.strip()] = value.strip()
    return info


def _load() -> Path:
    if os.environ.get("OPFORGE_LIBRARY") == "jit":  # build from this source checkout instead (opforge.jit)
        from . import jit

        extra = [s for s in os.environ.get("OPFORGE_JIT_SOURCES", "").split(os.pathsep) if s]
        return jit.load(extra_sources=extra, verbose=os.environ.get("OPFORGE_JIT_VERBOSE", "") not in ("", "0"))
    lib = _library_path()
    if not lib.exists():
        raise ImportError(
            f"opforge: native library not found at {lib}. Build and install it with "
            "`pip install --no-build-isolation .` from the opforge source tree, or point "
            "OPFORGE_LIBRARY at a CMake build's libopforge.so."
        )
    info = _read_build_info(lib)
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


def _warn_if_shadowing() -> None:
    """Warn when an installed opforge exists at another path than this (source-tree) copy. Silent when
    OPFORGE_LIBRARY is set: whoever points it at a build tree (scripts/test.sh, a CMake user) chose the source copy."""
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
    here = (_PACKAGE_DIR / "__init__.py").resolve()
    if installed.exists() and installed != here:
        import warnings

        warnings.warn(
            f"opforge: importing {here.parent} (from the source tree / PYTHONPATH), which shadows the installed "
            f"opforge {dist.version} at {installed.parent}; unset PYTHONPATH (or leave the source folder) to use "
            "the installed one.", UserWarning, stacklevel=3)


_warn_if_shadowing()

#: The error that kept the library from loading, when the import went on anyway (``python -m opforge doctor``).
load_error: str | None = None
#: Where the library was looked for (also when loading failed).
_expected_library_path = _library_path() if os.environ.get("OPFORGE_LIBRARY") != "jit" else None

try:
    library_path = _load()
except ImportError as _e:
    # `python -m opforge doctor` imports this package first: run the doctor here, to explain the failure.
    import sys as _sys

    if _sys.argv[:1] == ["-m"] and "doctor" in _sys.argv[1:2]:
        library_path, load_error = None, str(_e)
        from . import doctor as _doctor

        _sys.exit(_doctor.main(_sys.argv[2:]))
    raise

from . import profiling  # noqa: E402,F401  (reads OPFORGE_NVTX once)

from . import functional, nn  # noqa: E402
# Every op of opforge.functional is opforge.<op>: a new op's wrapper, listed in functional.__all__, is exported here
# without an edit of this file (docs/adding_an_op.md, checklist item 5).
from .functional import *  # noqa: E402,F401,F403

__all__ = ["cmake_prefix_path", "functional", "library_path", "nn"] + [
    name for name in functional.__all__ if name != "LINEAR_ACTIVATIONS"]
