"""``python -m opforge doctor``: a diagnosis of the installation, not a listing.

Two steps, kept apart so that tests can simulate every failure:

1. `gather_facts` asks the machine: torch and its CUDA / cuDNN, the driver, nvcc (on ``PATH`` and in
   ``CUDA_HOME``), torch's C++11 ABI flag, the opforge library (path, build stamp ``opforge_build.txt``,
   loaded or not and why), the visible devices and their compute capability. It returns a plain dict.
2. `diagnose` is a pure function of that dict: it returns a list of `Diagnosis`, each with
   what it means and the command that fixes it. ``severity`` is ``"error"`` (opforge cannot work as
   installed: exit status 1) or ``"warning"`` (works, with a cost or a risk: exit status 0).

Every diagnosis has an ``id`` (e.g. ``torch-mismatch``); the documentation's troubleshooting page lists them.

The library's state comes from `opforge._library` (this module imports no other part of opforge): the
package's own import has already tried to load it, and under ``python -m opforge doctor`` a failure leaves the
package importable, so that this report can say why.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional

from . import _library

__all__ = ["Diagnosis", "gather_facts", "diagnose", "render", "main", "CHECKS", "parse_archs", "arch_support"]


@dataclass
class Diagnosis:
    """One problem found.

    Attributes:
        id: stable name of the diagnosis (``torch-mismatch``, ``no-kernel-image``, ...).
        severity: ``"error"`` (opforge cannot work as installed) or ``"warning"``.
        title: one line: what was found.
        meaning: what it means for the user.
        fix: the command (or step) that fixes it.
    """

    id: str
    severity: str
    title: str
    meaning: str
    fix: str


# ------------------------------------------------------------------------------------------------- facts


def _run(cmd: List[str], timeout: float = 20) -> Optional[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def _nvcc_version(nvcc: Optional[str]) -> Optional[str]:
    """``"12.4"`` from ``nvcc --version`` ("Cuda compilation tools, release 12.4, V12.4.131"), else None."""
    if not nvcc:
        return None
    out = _run([nvcc, "--version"])
    m = re.search(r"release (\d+\.\d+)", out or "")
    return m.group(1) if m else None


def gather_facts() -> dict:
    """Everything `diagnose` needs, read from this machine (imports torch; loads opforge if it can).

    Returns:
        A JSON-serializable dict: ``python``, ``torch`` (version, cuda, cudnn, cxx11_abi, openmp, arch_list,
        cuda_available, device_count), ``driver`` (version, cuda: the newest CUDA the driver supports),
        ``devices`` (name, capability "9.0"), ``nvcc`` (path_on_path, cuda_home, cuda_home_nvcc, version,
        cuda_home_version), ``library`` (path, exists, stamp, loaded, error, ops, cpu_kernels_missing,
        has_cuda_kernels), ``cpu_capability``.
    """
    import torch

    facts: dict = {"python": sys.version.split()[0]}
    cudnn = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.version.cuda else None
    except Exception:  # noqa: BLE001  (no cuDNN in this build)
        pass
    cuda_available = False
    count = 0
    try:
        cuda_available = torch.cuda.is_available()
        count = torch.cuda.device_count() if cuda_available else 0
    except Exception:  # noqa: BLE001
        pass
    facts["torch"] = dict(version=torch.__version__, cuda=torch.version.cuda, cudnn=cudnn,
                          cxx11_abi=bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)),
                          openmp=bool(torch.backends.openmp.is_available()), threads=torch.get_num_threads(),
                          arch_list=torch.cuda.get_arch_list() if cuda_available else [],
                          cuda_available=cuda_available, device_count=count)
    facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    facts["devices"] = [dict(name=torch.cuda.get_device_name(i),
                             capability="{}.{}".format(*torch.cuda.get_device_capability(i))) for i in range(count)]
    smi = shutil.which("nvidia-smi")
    driver: dict = {"nvidia_smi": smi, "version": None, "cuda": None, "gpus": 0}
    if smi:
        out = _run([smi]) or ""
        m = re.search(r"Driver Version:\s*([\d.]+)", out)
        c = re.search(r"CUDA Version:\s*([\d.]+)", out)
        driver.update(version=m.group(1) if m else None, cuda=c.group(1) if c else None,
                      gpus=len(re.findall(r"^GPU \d+:", _run([smi, "-L"]) or "", flags=re.M)))
    facts["driver"] = driver
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not cuda_home and Path("/usr/local/cuda/bin/nvcc").exists():
        cuda_home = "/usr/local/cuda"
    on_path = shutil.which("nvcc")
    home_nvcc = str(Path(cuda_home) / "bin" / "nvcc") if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists() else None
    facts["nvcc"] = dict(path_on_path=on_path, version=_nvcc_version(on_path), cuda_home=cuda_home,
                         cuda_home_nvcc=home_nvcc,
                         cuda_home_version=_nvcc_version(home_nvcc) if home_nvcc and home_nvcc != on_path else
                         _nvcc_version(on_path) if home_nvcc else None)
    facts["library"] = _library_facts(torch)
    return facts


def _library_facts(torch) -> dict:
    """The library's facts, from `opforge._library` (the package's loading, already attempted by the import of
    ``opforge`` that runs before any of its submodules) and torch's dispatcher."""
    lib: dict = dict(path=None, exists=False, stamp={}, loaded=False, error=None, ops=0, cpu_kernels_missing=[],
                     has_cuda_kernels=False, has_cutlass=None, jit=os.environ.get("OPFORGE_LIBRARY") == "jit")
    try:
        _library.load_once()
    except ImportError:
        pass
    path = _library.path or _library.expected_path()
    if path is not None:
        path = Path(path)
        lib.update(path=str(path), exists=path.exists(), stamp=_library.read_build_info(path))
    lib["error"] = _library.error
    lib["loaded"] = _library.path is not None and _library.error is None
    if lib["loaded"]:
        names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("opforge::"))
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        lib["ops"] = len(names)
        cpu_keys = ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
        lib["cpu_kernels_missing"] = [n for n in names if not any(has(n, k) for k in cpu_keys)]
        lib["has_cuda_kernels"] = any(has(n, "CUDA") for n in names)
        try:  # the build's compile-time flag (csrc/core/knobs.cpp); absent from libraries built before it
            lib["has_cutlass"] = bool(torch.ops.opforge._has_cutlass())
        except (AttributeError, RuntimeError):
            lib["has_cutlass"] = None
    return lib


# ------------------------------------------------------------------------------------------------ checks


def _major(version: Optional[str]) -> Optional[int]:
    try:
        return int(str(version).split(".")[0])
    except (TypeError, ValueError):
        return None


def _base(version: str) -> str:
    return str(version).split("+")[0]


def parse_archs(text: str) -> List[tuple]:
    """Parse a CUDA arch list as torch spells it (``"8.0;9.0+PTX"``, ``"8.0 9.0a"``, ``"sm_90"``).

    Args:
        text: the list, separated by ``;``, ``,`` or spaces.
    Returns:
        ``[(major, minor, ptx), ...]``: ``ptx`` True where ``+PTX`` (or ``compute_XY``) keeps PTX for that arch.
    """
    out = []
    for item in re.split(r"[;,\s]+", text or ""):
        if not item:
            continue
        ptx = item.endswith("+PTX") or item.startswith("compute_")
        m = re.search(r"(\d+)\.(\d+)", item) or re.search(r"(?:sm|compute)_(\d)(\d+)", item)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), ptx))
    return out


def arch_support(archs: List[tuple], capability: str) -> str:
    """How a library built for ``archs`` (from `parse_archs`) runs on a device of ``capability`` ("9.0").

    Returns:
        ``"native"`` (a kernel image for this device's major with a minor <= the device's),
        ``"ptx"`` (only PTX of an older arch: the driver JIT-compiles it at first use) or ``"none"`` (no kernel
        image for this device: every CUDA op fails with "no kernel image is available").
    """
    major, minor = (int(v) for v in capability.split(".")[:2])
    if any(a == major and b <= minor for a, b, _ in archs):
        return "native"
    if any(ptx and (a, b) <= (major, minor) for a, b, ptx in archs):
        return "ptx"
    return "none"


def _check_library(f: dict) -> List[Diagnosis]:
    lib, torch_v = f["library"], f["torch"]["version"]
    out = []
    stamp_torch = lib.get("stamp", {}).get("torch")
    if stamp_torch and _base(stamp_torch) != _base(torch_v):
        out.append(Diagnosis(
            "torch-mismatch", "error", f"the opforge library was built for torch {stamp_torch}, torch {torch_v} is installed",
            "A C++ extension links against one torch's C++ symbols; with another torch it fails to load "
            "(\"undefined symbol\") or misbehaves.",
            "pip install --no-build-isolation --force-reinstall --no-deps .   # from the opforge source tree"))
    if lib.get("error") and not out:
        err = lib["error"]
        if not lib.get("exists") and lib.get("path"):
            out.append(Diagnosis("library-missing", "error", f"no opforge library at {lib['path']}",
                                 "opforge's operators live in a compiled library that was never built or installed here.",
                                 "pip install --no-build-isolation .   # or OPFORGE_LIBRARY=<build>/libopforge.so"))
        elif "undefined symbol" in err:
            out.append(Diagnosis("undefined-symbol", "error", "the opforge library does not load: undefined symbol",
                                 f"The library expects a symbol this torch does not export (another torch version or C++ "
                                 f"ABI): {err.splitlines()[0][:300]}",
                                 "pip install --no-build-isolation --force-reinstall --no-deps .   # rebuild against this torch"))
        elif "AVX-512" in err:
            out.append(Diagnosis("cpu-avx512", "error", "the library has AVX-512 kernels, torch reports no AVX-512 here",
                                 "The CPU kernels would stop with an illegal instruction (or ATEN_CPU_CAPABILITY lowered "
                                 "torch's capability below the library's).",
                                 "pip install --no-build-isolation .   # the default AVX2 kernels"))
        elif "AVX2" in err:
            out.append(Diagnosis("cpu-avx2", "error", "the library has AVX2/FMA kernels, this CPU has no AVX2",
                                 "The CPU kernels would stop with an illegal instruction.",
                                 "pip install --no-build-isolation -C cmake.define.OPFORGE_CPU_AVX2=OFF ."))
        else:
            out.append(Diagnosis("library-not-loadable", "error", "the opforge library does not load",
                                 err.splitlines()[0][:400] if err else "unknown error",
                                 "pip install --no-build-isolation --force-reinstall --no-deps .   # rebuild"))
    stamp_flags = lib.get("stamp", {}).get("torch_cxx_flags")
    m = re.search(r"_GLIBCXX_USE_CXX11_ABI=(\d)", stamp_flags or "")
    if m and bool(int(m.group(1))) != bool(f["torch"].get("cxx11_abi")):
        out.append(Diagnosis(
            "abi-mismatch", "error",
            f"C++11 ABI: library built with _GLIBCXX_USE_CXX11_ABI={m.group(1)}, torch uses "
            f"{int(bool(f['torch'].get('cxx11_abi')))}",
            "std::string and std::list differ between the two ABIs: the library fails to load with an "
            "\"undefined symbol\" naming std::__cxx11, or crashes.",
            "pip install --no-build-isolation --force-reinstall --no-deps .   # the build takes the flag from torch's CMake config"))
    stamp = lib.get("stamp") or {}
    if lib.get("loaded") and stamp and f["torch"].get("openmp") and stamp.get("openmp", "OFF") != "ON":
        out.append(Diagnosis(
            "cpu-kernels-one-thread", "warning", "the library was built without OpenMP; this torch's threads are OpenMP's",
            "torch's at::parallel_for is an OpenMP loop that runs serially in code compiled without -fopenmp, so "
            "opforge's CPU kernels use one thread whatever torch.set_num_threads says (libraries built before "
            "2026-12-01's fix have no 'openmp=' in their stamp).",
            "pip install --no-build-isolation --force-reinstall --no-deps .   # CMake finds OpenMP and uses it"))
    if lib.get("cpu_kernels_missing"):
        out.append(Diagnosis("op-without-cpu-kernel", "warning",
                             f"{len(lib['cpu_kernels_missing'])} op(s) have no CPU kernel: "
                             + ", ".join(lib["cpu_kernels_missing"][:5]),
                             "Calling them on CPU tensors raises NotImplementedError.",
                             "rebuild from a complete source tree: pip install --no-build-isolation ."))
    return out


def _check_cuda(f: dict) -> List[Diagnosis]:
    t, drv, lib, out = f["torch"], f["driver"], f["library"], []
    gpus_seen = drv.get("gpus", 0) or len(f.get("devices", []))
    if t.get("cuda") and not t.get("cuda_available"):
        if not drv.get("nvidia_smi") or not drv.get("version"):
            out.append(Diagnosis(
                "cuda-torch-no-driver", "warning", f"torch {t['version']} is a CUDA {t['cuda']} build, but no NVIDIA driver answers",
                "No GPU is visible (no driver, no GPU, or a container started without GPUs): everything runs on the CPU.",
                "nvidia-smi   # should list the GPU; in a container: docker run --gpus all ..."))
        else:
            out.append(Diagnosis(
                "cuda-unavailable", "error", f"a driver ({drv['version']}) is present, but torch cannot use CUDA",
                "Often a driver older than torch's CUDA runtime, or CUDA_VISIBLE_DEVICES hiding every GPU.",
                "python -c 'import torch; torch.cuda.init()'   # prints the driver's reason"))
    if not t.get("cuda") and gpus_seen:
        out.append(Diagnosis("cpu-torch-with-gpu", "error", f"a GPU is present but torch {t['version']} is a CPU-only build",
                             "Neither torch nor opforge can use the GPU.",
                             "pip install torch --index-url https://download.pytorch.org/whl/cu128   # a CUDA build, then rebuild opforge"))
    if t.get("cuda") and drv.get("cuda"):
        dm, tm = _major(drv["cuda"]), _major(t["cuda"])
        if dm is not None and tm is not None and (dm, float(drv["cuda"])) < (tm, float(t["cuda"])) and dm < tm:
            out.append(Diagnosis("driver-too-old", "error",
                                 f"the driver supports CUDA up to {drv['cuda']}, torch needs CUDA {t['cuda']}",
                                 "The CUDA runtime cannot be newer than the driver's major version.",
                                 "update the NVIDIA driver, or install a torch built for an older CUDA"))
    if f.get("devices") and lib.get("loaded") and not lib.get("has_cuda_kernels"):
        out.append(Diagnosis("library-without-cuda", "error", "a GPU is present but the opforge library has no CUDA kernels",
                             "It was built without nvcc or with a CPU torch: opforge ops on CUDA tensors raise NotImplementedError.",
                             "CUDA_HOME=/usr/local/cuda pip install --no-build-isolation --force-reinstall --no-deps ."))
    archs = parse_archs(lib.get("stamp", {}).get("cuda_archs", ""))
    if archs and lib.get("has_cuda_kernels", True):
        for i, dev in enumerate(f.get("devices", [])):
            support = arch_support(archs, dev["capability"])
            cap = dev["capability"].replace(".", "")
            if support == "none":
                out.append(Diagnosis(
                    "no-kernel-image", "error",
                    f"cuda:{i} ({dev['name']}, sm_{cap}) has no kernel image in the library "
                    f"(built for {lib['stamp']['cuda_archs']})",
                    "Every opforge CUDA op on this device fails with \"no kernel image is available for execution on the device\".",
                    f"TORCH_CUDA_ARCH_LIST={dev['capability']} pip install --no-build-isolation --force-reinstall --no-deps ."))
            elif support == "ptx":
                out.append(Diagnosis(
                    "ptx-jit", "warning",
                    f"cuda:{i} ({dev['name']}, sm_{cap}) runs the library's PTX, JIT-compiled by the driver",
                    "The first call of each kernel waits for the driver's compiler (seconds), and the code is not tuned "
                    "for this device.",
                    f"TORCH_CUDA_ARCH_LIST={dev['capability']} pip install --no-build-isolation --force-reinstall --no-deps ."))
    return out


def _check_nvcc(f: dict) -> List[Diagnosis]:
    t, n, out = f["torch"], f["nvcc"], []
    if not t.get("cuda"):
        return out
    nvcc = n.get("path_on_path") or n.get("cuda_home_nvcc")
    if not nvcc:
        out.append(Diagnosis(
            "nvcc-missing", "warning" if f["library"].get("has_cuda_kernels") else "error",
            "no nvcc: not on PATH, and CUDA_HOME is " + (repr(n["cuda_home"]) if n.get("cuda_home") else "not set"),
            "Building opforge's CUDA kernels (pip, CMake or the JIT build) needs the CUDA toolkit's nvcc; without it "
            "the build has CPU kernels only.",
            f"export CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH   # a CUDA {t['cuda']} toolkit"))
        return out
    version = n.get("version") if n.get("path_on_path") else n.get("cuda_home_version")
    if version and _major(version) != _major(t["cuda"]):
        out.append(Diagnosis(
            "nvcc-major-mismatch", "error", f"nvcc {version} ({nvcc}) but torch is built with CUDA {t['cuda']}",
            "torch's CMake config and cpp_extension refuse (or miscompile against) a toolkit of another major version.",
            f"export CUDA_HOME=<a CUDA {_major(t['cuda'])}.x toolkit> PATH=$CUDA_HOME/bin:$PATH"))
    if (n.get("path_on_path") and n.get("cuda_home_nvcc")
            and Path(n["path_on_path"]).resolve() != Path(n["cuda_home_nvcc"]).resolve()
            and n.get("version") != n.get("cuda_home_version")):
        out.append(Diagnosis(
            "nvcc-path-vs-cuda-home", "warning",
            f"nvcc on PATH ({n['path_on_path']}, {n.get('version')}) differs from CUDA_HOME's "
            f"({n['cuda_home_nvcc']}, {n.get('cuda_home_version')})",
            "CMake uses the one on PATH, torch.utils.cpp_extension (the JIT build) CUDA_HOME's: the two builds differ.",
            "export PATH=$CUDA_HOME/bin:$PATH"))
    return out


#: The checks `diagnose` runs, in order; each is a pure function of the facts dict.
CHECKS: List[Callable[[dict], List[Diagnosis]]] = [_check_library, _check_cuda, _check_nvcc]


def diagnose(facts: dict) -> List[Diagnosis]:
    """Every problem found in ``facts`` (the dict of `gather_facts`, or a simulated one).

    Args:
        facts: the machine's facts. Missing keys count as "unknown" and trigger nothing.
    Returns:
        The diagnoses, errors first.
    """
    f = {"torch": {}, "driver": {}, "nvcc": {}, "library": {}, "devices": [], **facts}
    found = [d for check in CHECKS for d in check(f)]
    return sorted(found, key=lambda d: d.severity != "error")


# ------------------------------------------------------------------------------------------------ output


def _cpu_isa(stamp: dict) -> str:
    """The instruction set the library's CPU kernels were compiled for, from its build stamp."""
    if stamp.get("avx512") == "ON":
        return "AVX-512 (OPFORGE_CPU_AVX512=ON)"
    if stamp.get("avx2") == "ON":
        return "AVX2 + FMA"
    if "avx2" in stamp:
        return "baseline x86-64 / non-x86 (no AVX2)"
    return "unknown (no stamp)"


def _cutlass_note(lib: dict) -> str:
    """The sm90 CUTLASS kernels' part of the GEMM line: built or not (the library's flag, else its build stamp)."""
    has = lib.get("has_cutlass")
    if has is None:
        stamp = (lib.get("stamp") or {}).get("cutlass")
        has = None if stamp is None else str(stamp).upper() in ("ON", "1", "TRUE")
    if has is None:
        return "; CUTLASS sm90 kernels: unknown (a library without the _has_cutlass op)"
    if has:
        return " + opforge's CUTLASS sm90 kernels (compute capability 9.0 GPUs; chosen per shape)"
    return ("; CUTLASS sm90 kernels: not built (pip install nvidia-cutlass, then rebuild with CUDA arch 9.0; "
            "cuBLASLt serves every GEMM)")


def render(facts: dict, diagnoses: List[Diagnosis]) -> str:
    """The human-readable report: facts first, then each problem with its meaning and fix."""
    t, d, n, lib = facts["torch"], facts["driver"], facts["nvcc"], facts["library"]
    stamp = lib.get("stamp") or {}
    lines = [
        f"python         {facts.get('python')}",
        f"torch          {t['version']} ({'CUDA ' + t['cuda'] if t.get('cuda') else 'CPU-only build'}"
        f"{', cuDNN ' + str(t['cudnn']) if t.get('cudnn') else ''}; C++11 ABI {int(bool(t.get('cxx11_abi')))})",
        f"driver         {d.get('version') or 'none'}" + (f" (supports CUDA {d['cuda']})" if d.get("cuda") else ""),
        f"nvcc           PATH: {n.get('path_on_path') or 'none'} ({n.get('version') or '-'}); "
        f"CUDA_HOME: {n.get('cuda_home') or 'unset'} ({n.get('cuda_home_version') or '-'})",
        "devices        " + ", ".join(["cpu (" + str(facts.get("cpu_capability")) + ")"]
                                      + [f"cuda:{i} {x['name']} sm_{x['capability'].replace('.', '')}"
                                         for i, x in enumerate(facts.get("devices", []))]),
        f"library        {lib.get('path') or ('JIT build' if lib.get('jit') else 'unknown')}: "
        + ("loaded, " + f"{lib.get('ops')} ops, CUDA kernels {'yes' if lib.get('has_cuda_kernels') else 'no'}"
           if lib.get("loaded") else "NOT loaded"),
        f"built for      torch {stamp.get('torch', 'unknown')}, CUDA {stamp.get('cuda', 'unknown')}"
        # CUDA archs mean something only for a CUDA build; torch's CMake leaves TORCH_CXX_FLAGS empty on some builds
        + (f", archs {stamp.get('cuda_archs') or '-'}" if str(stamp.get("cuda", "")).upper() not in ("OFF", "0", "FALSE", "")
           else " (a CPU-only build: no CUDA archs)")
        + (f", torch C++ flags {stamp.get('torch_cxx_flags')}" if stamp.get("torch_cxx_flags")
           else ", torch C++ flags: none (torch's CMake config set no TORCH_CXX_FLAGS for this build; the ABI is"
                " checked from torch itself)"),
        f"CPU threads    library built with OpenMP: "
        f"{stamp.get('openmp', 'unknown (stamped before the openmp= line: its CPU kernels use one thread)')}; "
        f"torch {'uses OpenMP' if t.get('openmp') else 'does not use OpenMP'}, {t.get('threads', '?')} intra-op threads",
        f"CPU kernels    {_cpu_isa(stamp)}; torch's CPU capability {facts.get('cpu_capability', '?')}",
        "GEMM engines   " + ("cuBLASLt" + _cutlass_note(lib) if lib.get("has_cuda_kernels")
                             else "ATen's on the CPU (no CUDA kernels in this library)"),
    ]
    if not diagnoses:
        lines.append("\nno problems found")
    for x in diagnoses:
        lines += [f"\n{x.severity.upper()} [{x.id}] {x.title}", f"  means: {x.meaning}", f"  fix:   {x.fix}"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m opforge doctor [--json]``.

    Returns:
        0 when no error-level problem was found, 1 otherwise.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m opforge doctor", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print {facts, diagnoses, ok} as JSON")
    p.add_argument("--ops", action="store_true", help="also list the registered opforge ops and their dispatch keys")
    args = p.parse_args(argv)
    facts = gather_facts()
    found = diagnose(facts)
    ok = not any(d.severity == "error" for d in found)
    if args.json:
        print(json.dumps({"facts": facts, "diagnoses": [asdict(d) for d in found], "ok": ok}, indent=1, default=str))
    else:
        print(render(facts, found))
    if args.ops and facts["library"].get("loaded"):
        import torch

        keys = ("CPU", "CUDA", "Meta", "Autograd", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
        print("\nops:")
        for name in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("opforge::")):
            print(f"  {name:<40} " + " ".join(k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)))
    return 0 if ok else 1
