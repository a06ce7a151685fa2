"""The build and the package: loading, the version check, the installed layout, the JIT build."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge

PACKAGE_PARENT = str(Path(opforge.__file__).resolve().parents[1])  # the dir that holds opforge/
REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPFORGE_LIBRARY", "PYTHONPATH", "OPFORGE_JIT_SOURCES")}
    env.update(extra)
    return env


def test_library_loaded_and_ops_registered():
    assert opforge.library_path.exists()
    for op in ("linear", "linear_backward", "sigmoid", "sigmoid_backward", "square", "square_backward",
               "square_add", "square_add_backward"):
        assert hasattr(torch.ops.opforge, op), op


def test_library_has_no_python_c_api():
    """One library for every Python version: it must not reference the Python C API or libtorch_python."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed")
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(opforge.library_path)], capture_output=True,
                               text=True, check=True).stdout
    py_symbols = [line for line in undefined.splitlines() if line.split()[-1].startswith(("Py", "_Py"))]
    assert not py_symbols, f"Python C API symbols in {opforge.library_path}: {py_symbols[:5]}"
    readelf = shutil.which("readelf")
    if readelf:
        needed = subprocess.run([readelf, "-d", str(opforge.library_path)], capture_output=True, text=True).stdout
        assert "libtorch_python" not in needed and "libpython" not in needed


def test_version_mismatch_raises_import_error_naming_both(tmp_path):
    """A library built for another torch raises ImportError naming both versions, never 'undefined symbol'."""
    shutil.copy(opforge.library_path, tmp_path / "libopforge.so")
    (tmp_path / "opforge_build.txt").write_text("torch=1.99.0+cu999\ncuda=ON\n")
    r = _python("import opforge", env=_env(OPFORGE_LIBRARY=str(tmp_path / "libopforge.so"), PYTHONPATH=PACKAGE_PARENT),
                cwd=tmp_path)
    assert r.returncode != 0
    assert "ImportError" in r.stderr, r.stderr
    assert "1.99.0+cu999" in r.stderr and torch.__version__ in r.stderr, r.stderr
    assert "undefined symbol" not in r.stderr


def test_missing_library_raises_import_error(tmp_path):
    r = _python("import opforge", env=_env(OPFORGE_LIBRARY=str(tmp_path / "nowhere.so"), PYTHONPATH=PACKAGE_PARENT),
                cwd=tmp_path)
    assert r.returncode != 0 and "ImportError" in r.stderr and "not found" in r.stderr, r.stderr


def test_installed_package_in_fresh_interpreter(tmp_path):
    """`pip install --no-build-isolation .` put the library, headers and CMake config inside the package."""
    env = _env()
    probe = _python("import importlib.util as u; s = u.find_spec('opforge'); print(s.origin if s else '')",
                    env=env, cwd=tmp_path)
    origin = probe.stdout.strip()
    if not origin or Path(origin).resolve().is_relative_to(REPO):
        pytest.skip("opforge is not pip-installed here (pip install --no-build-isolation .)")
    r = _python("import opforge, torch; print(torch.ops.opforge.linear); print(opforge.library_path); "
                "print(opforge.cmake_prefix_path)", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    op, lib, prefix = r.stdout.split()
    assert op == "opforge.linear"
    prefix = Path(prefix)
    assert Path(lib) == prefix / "lib" / "libopforge.so"
    assert (prefix / "lib" / "cmake" / "opforge" / "opforgeConfig.cmake").exists()
    assert (prefix / "include" / "opforge" / "opforge.h").exists()
    assert (prefix / "lib" / "opforge_build.txt").read_text().startswith(f"torch={torch.__version__.split('+')[0]}")


@pytest.mark.slow
def test_jit_build_with_an_extra_op(tmp_path):
    """OPFORGE_LIBRARY=jit compiles the source tree plus a user's file and loads it instead of the installed lib."""
    extra = tmp_path / "cube.cpp"
    extra.write_text(
        '#include <ATen/ATen.h>\n#include <torch/library.h>\n'
        'TORCH_LIBRARY_FRAGMENT(opforge, m) { m.def("example_cube(Tensor input) -> Tensor"); }\n'
        'TORCH_LIBRARY_IMPL(opforge, CPU, m) { m.impl("example_cube", [](const at::Tensor& x) { return x * x * x; }); }\n')
    code = ("import opforge, torch; x = torch.arange(4.0); "
            "assert torch.equal(torch.ops.opforge.example_cube(x), x ** 3); "
            "assert torch.allclose(opforge.sigmoid(x), torch.sigmoid(x)); print(opforge.library_path)")
    r = _python(code, env=_env(OPFORGE_LIBRARY="jit", OPFORGE_JIT_SOURCES=str(extra), PYTHONPATH=str(REPO / "python"),
                               TORCH_EXTENSIONS_DIR=str(REPO / "build" / "jit")), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "opforge_jit" in r.stdout


def test_doctor_lists_ops(tmp_path):
    env = _env(PYTHONPATH=PACKAGE_PARENT)
    if os.environ.get("OPFORGE_LIBRARY"):
        env["OPFORGE_LIBRARY"] = os.environ["OPFORGE_LIBRARY"]
    r = _python("import sys, opforge.__main__ as m; sys.exit(m.main(['doctor', '--ops']))", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert str(opforge.library_path) in r.stdout
    assert "opforge::sigmoid" in r.stdout and "CPU" in r.stdout
    assert torch.__version__ in r.stdout


def test_library_is_compiled_with_openmp_when_torch_is():
    """torch's at::parallel_for is an OpenMP loop (ATen/ParallelOpenMP.h) that runs serially in code compiled
    without -fopenmp: the loaded library's stamp must say openmp=ON and the library must call into OpenMP's runtime
    (GOMP_parallel among its dynamic symbols) whenever this torch uses OpenMP."""
    if not torch.backends.openmp.is_available():
        pytest.skip("this torch does not use OpenMP for its intra-op threads")
    lib = Path(opforge.library_path)
    stamp = lib.parent / "opforge_build.txt"
    if not stamp.exists():
        pytest.skip(f"no build stamp beside {lib} (a JIT build)")
    assert "openmp=ON" in stamp.read_text().splitlines(), stamp.read_text()
    assert b"GOMP_parallel" in lib.read_bytes(), f"{lib} makes no OpenMP call: its CPU kernels run on one thread"


def test_patch_is_an_attribute_after_import_opforge(tmp_path):
    """`import opforge` then `opforge.patch.apply` works in a fresh interpreter, and the plain import does not import
    the patching module (nor transformers) until it is used."""
    code = ("import sys, opforge; assert 'opforge.patch' not in sys.modules and 'transformers' not in sys.modules; "
            "apply = opforge.patch.apply; assert callable(apply) and callable(opforge.patch.revert); "
            "assert 'patch' in dir(opforge); import opforge.patch as p; assert p is opforge.patch; print('ok')")
    env = _env(PYTHONPATH=PACKAGE_PARENT)
    if os.environ.get("OPFORGE_LIBRARY"):
        env["OPFORGE_LIBRARY"] = os.environ["OPFORGE_LIBRARY"]
    r = _python(code, env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r = _python("import opforge; opforge.no_such_thing", env=env, cwd=tmp_path)
    assert r.returncode != 0 and "AttributeError" in r.stderr and "no_such_thing" in r.stderr, r.stderr
