"""Just-in-time build: opforge's C++ (and CUDA) sources compiled by torch.utils.cpp_extension at import.

The third way to build opforge, next to `pip install --no-build-isolation .` and CMake: no install
step, for prototyping an op in a minute from a source checkout. Select it before `import opforge`:

    OPFORGE_LIBRARY=jit OPFORGE_JIT_SOURCES=my_op.cpp PYTHONPATH=python python -c \\
        "import opforge, torch; print(torch.ops.opforge.my_op)"

`import opforge` then calls `load` instead of loading the installed `libopforge.so`: the
JIT library *replaces* the installed one for the whole process (a process holds one opforge library;
a second one would register the `opforge` namespace twice). `my_op.cpp` adds its schema with
`TORCH_LIBRARY_FRAGMENT(opforge, m)` and its kernels with `TORCH_LIBRARY_IMPL(opforge, CPU, m)`,
and may include `opforge/opforge.h` and the `core/*.h` helpers.

Environment (read by `import opforge`):

- `OPFORGE_LIBRARY=jit`: build and load with `load` instead of the installed library.
- `OPFORGE_JIT_SOURCES`: extra `.cpp`/`.cu` files, separated by `os.pathsep` (`:`).
- `OPFORGE_CUTLASS` (`AUTO`, the default, `ON` or `OFF`) and `CUTLASS_DIR`: opforge's CUTLASS sm90 GEMM
  kernels, as in the CMake build. AUTO builds them when the CUTLASS headers are found (`CUTLASS_DIR`, else the
  `nvidia-cutlass` wheel) and every visible GPU is compute capability 9.0 with `TORCH_CUDA_ARCH_LIST` unset or
  9.0; the whole JIT library's CUDA code is then compiled for sm_90a (it runs on H100/H200 only: this build is
  for this machine).
- `OPFORGE_JIT_VERBOSE=1`: show the compiler's commands and output (by default one line before the build
  and one after it, with the seconds it took, go to stderr; `OPFORGE_JIT_VERBOSE=0` silences them).

The build is cached by torch (`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`): an
unchanged source tree loads in about a second; the first build compiles every `csrc` file (minutes
on a small machine).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Iterable

import torch

__all__ = ["load", "source_dir"]

#: Name of the JIT-built library (`<TORCH_EXTENSIONS_DIR>/opforge_jit/opforge_jit.so`).
NAME = "opforge_jit"


def source_dir() -> Path:
    """The opforge source checkout this package sits in (`<root>/python/opforge` -> `<root>`).

    Returns:
        Path of the checkout: `OPFORGE_SOURCE_DIR` if set, else the folder two levels above this package.

    Raises:
        RuntimeError: this copy of the package is installed (no `csrc` beside it); set
            `OPFORGE_SOURCE_DIR` to a checkout, or run with `PYTHONPATH=<checkout>/python`.
    """
    root = Path(os.environ.get("OPFORGE_SOURCE_DIR") or Path(__file__).resolve().parents[2])
    if not (root / "csrc" / "library.cpp").exists():
        raise RuntimeError(
            f"opforge.jit: no opforge sources at {root} (csrc/library.cpp). The JIT build needs a source "
            "checkout: run with PYTHONPATH=<checkout>/python or set OPFORGE_SOURCE_DIR=<checkout>.")
    return root


def _opforge_loaded() -> bool:
    try:
        return hasattr(torch.ops.opforge, "sigmoid")
    except Exception:  # noqa: BLE001  (namespace absent)
        return False


def _cutlass_include_dirs(with_cuda: bool) -> list[Path]:
    """CUTLASS's include folders when the JIT build compiles the sm90 GEMM kernels (the module's docstring), else [].

    Raises:
        RuntimeError: OPFORGE_CUTLASS=ON where the kernels cannot be built (the reason says why).
    """
    mode = os.environ.get("OPFORGE_CUTLASS", "AUTO").strip().upper() or "AUTO"
    if mode == "OFF":
        return []
    why = ""
    root = os.environ.get("CUTLASS_DIR", "")
    if not root:
        try:
            import cutlass_library  # the nvidia-cutlass wheel: its headers under source_path

            root = cutlass_library.source_path
        except Exception:  # noqa: BLE001  (not installed, or a broken install)
            root = ""
    dirs = [Path(root) / "include", Path(root) / "tools" / "util" / "include"] if root else []
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not with_cuda:
        why = "no CUDA build"
    elif not dirs or not (dirs[0] / "cutlass" / "cutlass.h").exists():
        why = "no CUTLASS headers (pip install nvidia-cutlass, or set CUTLASS_DIR)"
    elif archs not in ("", "9.0", "9.0a"):
        why = f"TORCH_CUDA_ARCH_LIST={archs} is not 9.0"
    elif torch.cuda.device_count() == 0 or any(torch.cuda.get_device_capability(i) != (9, 0)
                                               for i in range(torch.cuda.device_count())):
        why = "the visible GPUs are not all compute capability 9.0"
    if why and mode == "ON":
        raise RuntimeError(f"opforge.jit: OPFORGE_CUTLASS=ON but {why}")
    return [] if why else dirs


def load(extra_sources: Iterable[str | os.PathLike] = (), verbose: bool = False) -> Path:
    """Compile every opforge source (+ `extra_sources`) into one library and load it into `torch.ops`.

    Args:
        extra_sources: iterable of str or os.PathLike. Extra `.cpp` (or `.cu`, with a CUDA torch) files
            compiled into the same library, e.g. a new op's schema (`TORCH_LIBRARY_FRAGMENT(opforge, m)`) and
            kernels. Default: none.
        verbose: bool. Print the build commands and compiler output. Default: False.

    Returns:
        Path of the loaded shared library.

    Raises:
        RuntimeError: an opforge library is already loaded in this process (select the JIT build with
            `OPFORGE_LIBRARY=jit` before `import opforge`); no source checkout; or a compile error
            (the compiler's message follows).

    The CUDA sources (`csrc/ops/*/*.cu`) are included when torch is a CUDA build and a CUDA toolkit
    is found (`CUDA_HOME`). CPU kernels get the same AVX2 flags as the CMake build when the CPU has them.
    """
    if _opforge_loaded():
        raise RuntimeError(
            "opforge.jit.load: an opforge library is already loaded in this process, and a process holds "
            "one. Set OPFORGE_LIBRARY=jit (and OPFORGE_JIT_SOURCES for extra files) before `import opforge`.")
    from torch.utils import cpp_extension

    root = source_dir()
    csrc = root / "csrc"
    sources = sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("core/*.cpp")) + sorted(csrc.glob("ops/*/*.cpp"))
    extra = [Path(s).resolve() for s in extra_sources]
    for s in extra:
        if not s.exists():
            raise RuntimeError(f"opforge.jit.load: extra source {s} does not exist")
    cflags = ["-O3", "-Wno-unused-function"]
    # Same CPU kernel flags as CMakeLists.txt (there per *_cpu.cpp file; here the whole library, since the
    # library is built for this machine only).
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        cflags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    ldflags: list[str] = []
    if torch.backends.openmp.is_available():
        # as CMakeLists.txt: torch's at::parallel_for is an OpenMP loop, serial when compiled without -fopenmp
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    cuda_flags: list[str] = []
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if with_cuda:
        sources += sorted(csrc.glob("core/*.cu")) + sorted(csrc.glob("ops/*/*.cu"))
        cflags.append("-DOPFORGE_WITH_CUDA=1")
        cuda_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DOPFORGE_WITH_CUDA=1"]
        ldflags += ["-lcublas", "-lcublasLt"]
    cutlass = _cutlass_include_dirs(with_cuda)
    if cutlass:  # core/*.cu includes the kernel files core/gemm_sm90_*.cu
        cflags.append("-DOPFORGE_WITH_CUTLASS=1")
        # explicit arch flags replace torch's (cpp_extension adds none when the flags name an arch)
        cuda_flags += ["-DOPFORGE_WITH_CUTLASS=1", "-gencode=arch=compute_90a,code=sm_90a"]
    else:
        sources = [s for s in sources if not s.name.startswith("gemm_sm90_")]
    quiet = os.environ.get("OPFORGE_JIT_VERBOSE", "").strip() == "0"
    if not quiet:
        print(f"opforge.jit: building {len(sources) + len(extra)} source files ({'CPU + CUDA' if with_cuda else 'CPU'}) "
              "with torch.utils.cpp_extension; the first build takes minutes, an unchanged tree loads from "
              "torch's cache in seconds (OPFORGE_JIT_VERBOSE=1 shows the compiler)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    path = cpp_extension.load(
        name=NAME,
        sources=[str(s) for s in sources + extra],
        extra_include_paths=[str(root / "include"), str(csrc)] + [str(d) for d in cutlass],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_flags,
        extra_ldflags=ldflags,
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )
    if not quiet:
        print(f"opforge.jit: loaded {path} after {time.perf_counter() - t0:.1f} s (sources compiled only where changed "
              "since the cached build)", file=sys.stderr, flush=True)
    return Path(path)
