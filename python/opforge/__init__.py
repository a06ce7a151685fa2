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
        torch.utils.cpp_extension at import (see `opforge.jit`; OPFORGE_JIT_SOURCES adds files,
        OPFORGE_JIT_VERBOSE=1 shows the compiler's output).
    OPFORGE_NVTX=1: emit NVTX ranges for every op (read once, at import; see `opforge.profiling`).

Warns (``UserWarning``) when this copy of the package, imported from a source tree, shadows an installed
opforge (both paths are named): the code you run is then not the code pip installed.

``opforge.patch`` (Hugging Face model patching) is imported on first use: ``import opforge`` then
``opforge.patch.apply(model)`` works, and a plain ``import opforge`` does not import it.

Loading lives in `opforge._library`, which `opforge.doctor` reads too; under ``python -m opforge doctor``
a library that does not load leaves the package importable without its operators, for the doctor to explain why.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import torch

from . import _library

__version__ = "0.1.0"

#: Prefix for CMake's ``find_package(opforge)``: ``cmake -DCMAKE_PREFIX_PATH=<this> ...``.
cmake_prefix_path = str(_library.PACKAGE_DIR)

_library.warn_if_shadowing()

try:
    #: The path of the loaded ``libopforge.so`` (None only under ``python -m opforge doctor`` when it did not load).
    library_path: Path | None = _library.load_once()
except ImportError:
    if not _library.running_doctor():
        raise
    library_path = None  # python -m opforge doctor (opforge/__main__.py) explains _library.error

if library_path is not None:
    from . import profiling  # noqa: F401  (reads OPFORGE_NVTX once)
    from . import functional, nn
    # Every op of opforge.functional is opforge.<op>: a new op's wrapper, listed in functional.__all__, is exported
    # here without an edit of this file (docs/adding_an_op.md, checklist item 5).
    from .functional import *  # noqa: F401,F403

    # the post-training losses composed on opforge.linear_log_probs: opforge.preference_loss, opforge.grpo_loss, ...
    from . import losses
    from .losses import (grpo_loss, kto_loss, linear_grpo_loss, linear_preference_loss,  # noqa: F401
                         preference_loss, sequence_log_probs)

    __all__ = ["cmake_prefix_path", "functional", "library_path", "losses", "nn"] + [
        name for name in functional.__all__ if name != "LINEAR_ACTIVATIONS"] + [
        name for name in losses.__all__ if not name.endswith("_LOSS_TYPES")]

#: Submodules imported on first use as attributes of the package (``opforge.patch``).
_LAZY_SUBMODULES = ("patch",)


def __getattr__(name: str):
    """``opforge.patch``: the submodule, imported on first access (then an ordinary attribute)."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
