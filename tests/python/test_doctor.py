"""`python -m opforge doctor`: each failure story, simulated through the facts dict, gets its diagnosis (meaning
and fix); a healthy install passes; the command's exit status and --json follow the diagnosis."""
import copy
import json
import os
import subprocess
import sys

import pytest

from opforge import doctor

HEALTHY_GPU = {
    "python": "3.12.0",
    "torch": dict(version="2.11.0+cu128", cuda="12.8", cudnn=91002, cxx11_abi=True, openmp=True, arch_list=["sm_90"],
                  cuda_available=True, device_count=1),
    "driver": dict(nvidia_smi="/usr/bin/nvidia-smi", version="570.86", cuda="12.8", gpus=1),
    "devices": [dict(name="NVIDIA H200", capability="9.0")],
    "nvcc": dict(path_on_path="/usr/local/cuda/bin/nvcc", version="12.8", cuda_home="/usr/local/cuda",
                 cuda_home_nvcc="/usr/local/cuda/bin/nvcc", cuda_home_version="12.8"),
    "library": dict(path="/site/opforge/lib/libopforge.so", exists=True, loaded=True, error=None, ops=16,
                    cpu_kernels_missing=[], has_cuda_kernels=True,
                    stamp=dict(torch="2.11.0", cuda="ON", avx2="ON", openmp="ON", torch_cxx_flags="-D_GLIBCXX_USE_CXX11_ABI=1",
                               cuda_archs="8.0;9.0+PTX")),
    "cpu_capability": "AVX2",
}
HEALTHY_CPU = {
    "python": "3.11.7",
    "torch": dict(version="2.13.0+cpu", cuda=None, cudnn=None, cxx11_abi=True, openmp=True, arch_list=[],
                  cuda_available=False,
                  device_count=0),
    "driver": dict(nvidia_smi=None, version=None, cuda=None, gpus=0),
    "devices": [],
    "nvcc": dict(path_on_path=None, version=None, cuda_home=None, cuda_home_nvcc=None, cuda_home_version=None),
    "library": dict(path="/x/libopforge.so", exists=True, loaded=True, error=None, ops=16, cpu_kernels_missing=[],
                    has_cuda_kernels=False, stamp=dict(torch="2.13.0", cuda="OFF", avx2="ON", openmp="ON")),
    "cpu_capability": "AVX2",
}


def facts(base, **changes):
    f = copy.deepcopy(base)
    for path, value in changes.items():
        *keys, last = path.split("__")
        d = f
        for k in keys:
            d = d[k]
        d[last] = value
    return f


def ids(f):
    return [d.id for d in doctor.diagnose(f)]


def only(f, id_, severity="error"):
    found = doctor.diagnose(f)
    assert [d.id for d in found] == [id_], [(d.id, d.title) for d in found]
    d = found[0]
    assert d.severity == severity and d.meaning and d.fix
    return d


@pytest.mark.parametrize("base", [HEALTHY_GPU, HEALTHY_CPU], ids=["gpu", "cpu"])
def test_healthy_install_has_no_problem(base):
    assert doctor.diagnose(base) == []
    assert "no problems found" in doctor.render(base, [])


def test_library_stamped_for_another_torch():
    d = only(facts(HEALTHY_GPU, library__stamp__torch="2.10.0"), "torch-mismatch")
    assert "2.10.0" in d.title and "2.11.0+cu128" in d.title and "pip install --no-build-isolation" in d.fix


@pytest.mark.parametrize("stamp_openmp", ["OFF", None])
def test_library_without_openmp_runs_cpu_kernels_on_one_thread(stamp_openmp):
    """A library compiled without -fopenmp (or stamped before the 'openmp=' line existed) under an OpenMP torch: its
    at::parallel_for loops run serially; a torch without OpenMP (another threading backend) is not flagged."""
    f = facts(HEALTHY_CPU)
    if stamp_openmp is None:
        del f["library"]["stamp"]["openmp"]
    else:
        f["library"]["stamp"]["openmp"] = stamp_openmp
    assert "cpu-kernels-one-thread" in ids(f)
    assert [d.severity for d in doctor.diagnose(f) if d.id == "cpu-kernels-one-thread"] == ["warning"]
    assert "cpu-kernels-one-thread" not in ids(facts(f, torch__openmp=False))


def test_abi_mismatch():
    d = only(facts(HEALTHY_GPU, library__stamp__torch_cxx_flags="-D_GLIBCXX_USE_CXX11_ABI=0"), "abi-mismatch")
    assert "_GLIBCXX_USE_CXX11_ABI=0" in d.title and "std::__cxx11" in d.meaning


def test_no_kernel_image_for_the_device():
    d = only(facts(HEALTHY_GPU, library__stamp__cuda_archs="7.0;8.0"), "no-kernel-image")
    assert "sm_90" in d.title and "no kernel image" in d.meaning and "TORCH_CUDA_ARCH_LIST=9.0" in d.fix


def test_ptx_only_is_a_warning():
    d = only(facts(HEALTHY_GPU, library__stamp__cuda_archs="8.0+PTX"), "ptx-jit", "warning")
    assert "JIT" in d.title


@pytest.mark.parametrize("archs,cap,expected", [
    ("8.0;9.0+PTX", "9.0", "native"), ("8.0", "8.6", "native"), ("8.0+PTX", "9.0", "ptx"), ("9.0", "8.0", "none"),
    ("sm_90", "9.0", "native"), ("9.0a", "9.0", "native"), ("10.0", "9.0", "none"), ("", "9.0", "none")])
def test_arch_support(archs, cap, expected):
    assert doctor.arch_support(doctor.parse_archs(archs), cap) == expected


def test_missing_nvcc():
    f = facts(HEALTHY_GPU, nvcc__path_on_path=None, nvcc__version=None, nvcc__cuda_home=None, nvcc__cuda_home_nvcc=None,
              nvcc__cuda_home_version=None)
    d = only(f, "nvcc-missing", "warning")  # the installed library has CUDA kernels: only rebuilding needs nvcc
    assert "CUDA_HOME" in d.fix
    f["library"]["has_cuda_kernels"] = False
    assert "nvcc-missing" in ids(f) and "library-without-cuda" in ids(f)


def test_missing_nvcc_on_cpu_torch_is_fine():
    assert ids(HEALTHY_CPU) == []


def test_nvcc_major_differs_from_torch_cuda():
    d = only(facts(HEALTHY_GPU, nvcc__version="13.0", nvcc__cuda_home_version="13.0"), "nvcc-major-mismatch")
    assert "13.0" in d.title and "12.8" in d.title


def test_nvcc_on_path_differs_from_cuda_home():
    f = facts(HEALTHY_GPU, nvcc__cuda_home="/opt/cuda-12.4", nvcc__cuda_home_nvcc="/opt/cuda-12.4/bin/nvcc",
              nvcc__cuda_home_version="12.4")
    assert ids(f) == ["nvcc-path-vs-cuda-home"]


def test_cuda_torch_without_driver():
    f = facts(HEALTHY_GPU, torch__cuda_available=False, torch__device_count=0, devices=[],
              driver=dict(nvidia_smi=None, version=None, cuda=None, gpus=0))
    d = only(f, "cuda-torch-no-driver", "warning")
    assert "nvidia-smi" in d.fix


def test_driver_present_but_cuda_unusable():
    f = facts(HEALTHY_GPU, torch__cuda_available=False, devices=[])
    assert ids(f) == ["cuda-unavailable"]


def test_driver_older_than_torch_cuda():
    f = facts(HEALTHY_GPU, driver__cuda="11.8")
    assert ids(f) == ["driver-too-old"]


def test_cpu_torch_on_a_gpu_machine():
    f = facts(HEALTHY_CPU, driver=dict(nvidia_smi="/usr/bin/nvidia-smi", version="570.86", cuda="12.8", gpus=1))
    assert ids(f) == ["cpu-torch-with-gpu"]


def test_library_without_cuda_kernels_on_a_gpu():
    assert ids(facts(HEALTHY_GPU, library__has_cuda_kernels=False)) == ["library-without-cuda"]


@pytest.mark.parametrize("error,id_", [
    ("opforge: could not load x.so: undefined symbol: _ZN3c1010Error", "undefined-symbol"),
    ("opforge: x.so was built with AVX2/FMA CPU kernels, but this CPU does not report AVX2", "cpu-avx2"),
    ("opforge: x.so was built with AVX-512 CPU kernels (OPFORGE_CPU_AVX512=ON), but torch reports this CPU as AVX2",
     "cpu-avx512"),
    ("opforge: something else", "library-not-loadable")])
def test_library_not_loadable_says_why(error, id_):
    f = facts(HEALTHY_CPU, library__loaded=False, library__error=error)
    assert ids(f) == [id_]


def test_library_missing():
    f = facts(HEALTHY_CPU, library__loaded=False, library__exists=False, library__error="not found", library__stamp={})
    assert ids(f) == ["library-missing"]


def test_render_prints_meaning_and_fix():
    f = facts(HEALTHY_GPU, library__stamp__torch="2.10.0")
    text = doctor.render(f, doctor.diagnose(f))
    assert "ERROR [torch-mismatch]" in text and "means:" in text and "fix:" in text and "NVIDIA H200 sm_90" in text


@pytest.mark.parametrize("stamp,isa", [(dict(avx2="ON"), "AVX2 + FMA"), (dict(avx2="OFF", avx512="ON"), "AVX-512"),
                                       (dict(avx2="OFF"), "no AVX2")])
def test_render_names_the_cpu_kernels_instruction_set(stamp, isa):
    f = facts(HEALTHY_CPU, **{f"library__stamp__{k}": v for k, v in stamp.items()})
    line = [ln for ln in doctor.render(f, doctor.diagnose(f)).splitlines() if ln.startswith("CPU kernels")]
    assert len(line) == 1 and isa in line[0] and "AVX2" in line[0].split("capability")[1], line


def _doctor_cmd(*argv, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "opforge", "doctor", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_command_on_this_machine_is_healthy_and_json():
    p = _doctor_cmd("--json")
    out = json.loads(p.stdout)
    assert p.returncode == (0 if out["ok"] else 1)
    assert out["facts"]["library"]["loaded"] and out["facts"]["torch"]["version"]
    assert [d for d in out["diagnoses"] if d["severity"] == "error"] == [], out["diagnoses"]


def test_command_explains_a_library_that_is_missing(tmp_path):
    p = _doctor_cmd(env_extra={"OPFORGE_LIBRARY": str(tmp_path / "libopforge.so")})
    assert p.returncode == 1, p.stdout + p.stderr
    assert "[library-missing]" in p.stdout and "fix:" in p.stdout and "Traceback" not in p.stderr


def test_command_explains_a_library_built_for_another_torch(tmp_path):
    lib = tmp_path / "libopforge.so"
    lib.write_bytes(b"not a library")
    (tmp_path / "opforge_build.txt").write_text("torch=1.0.0\ncuda=OFF\navx2=OFF\n")
    p = _doctor_cmd("--json", env_extra={"OPFORGE_LIBRARY": str(lib)})
    assert p.returncode == 1
    assert [d["id"] for d in json.loads(p.stdout)["diagnoses"]] == ["torch-mismatch"]


def test_command_explains_an_avx512_library_on_a_cpu_torch_reports_below_avx512(tmp_path):
    """A library stamped avx512=ON, with torch's capability lowered to AVX2 (ATEN_CPU_CAPABILITY): import refuses
    it before loading (no illegal instruction), and doctor names the cause."""
    import torch

    lib = tmp_path / "libopforge.so"
    lib.write_bytes(b"not a library")
    (tmp_path / "opforge_build.txt").write_text(f"torch={torch.__version__}\ncuda=OFF\navx2=OFF\navx512=ON\n")
    p = _doctor_cmd("--json", env_extra={"OPFORGE_LIBRARY": str(lib), "ATEN_CPU_CAPABILITY": "avx2"})
    assert p.returncode == 1
    assert [d["id"] for d in json.loads(p.stdout)["diagnoses"]] == ["cpu-avx512"]


def _fresh(code, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("first", ["opforge.doctor", "opforge"])
def test_import_order_does_not_matter(first):
    """opforge and opforge.doctor import in either order in a fresh process, and the doctor sees the library the
    package loaded."""
    second = "opforge" if first == "opforge.doctor" else "opforge.doctor"
    p = _fresh(f"import {first}, {second}, opforge.doctor as d, opforge; f = d._library_facts(__import__('torch')); "
               "assert f['loaded'] and f['ops'] > 0 and f['error'] is None, f; "
               "assert str(opforge.library_path) == f['path'], (opforge.library_path, f['path']); print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


def _imports_of_opforge(path):
    """The opforge modules a file imports: ``from . import x`` and ``from .x import y`` as ``x``, ``import opforge``
    / ``from opforge[.x] import ...`` as ``opforge[.x]``."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "opforge":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "opforge"}
    return found


def test_the_dependency_goes_one_way():
    """doctor reads the library's state from opforge._library only, and _library imports no part of opforge but the
    JIT build: the package's __init__ depends on _library, the doctor on _library, never one on the other."""
    from pathlib import Path

    package = Path(doctor.__file__).parent
    assert _imports_of_opforge(package / "doctor.py") == {"_library"}
    assert _imports_of_opforge(package / "_library.py") <= {"jit"}
    assert "doctor" not in _imports_of_opforge(package / "__init__.py")
    assert _imports_of_opforge(package / "jit.py") == set()
