"""scripts/kernel_resources.py: its reading of ptxas -v output (registers, spills, stack per kernel and arch), a run on
a stand-in build (a fake nvcc: what it writes, the arch column, a repository-relative path), and its messages without a
configured CUDA build, without ninja, and for a file not in the build."""
import shutil
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import kernel_resources  # noqa: E402

# ptxas -v of two entries (sm_90, CUDA 13.0), the second spilling; an entry without a "Used" line is not reported
PTXAS = """ptxas info    : 172 bytes gmem
ptxas info    : Compiling entry function '_Z7kernelAv' for 'sm_90'
ptxas info    : Function properties for _Z7kernelAv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers
ptxas info    : Compile time = 28.323 ms
ptxas info    : Compiling entry function '_Z7kernelBv' for 'sm_90'
ptxas info    : Function properties for _Z7kernelBv
    24 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers, 8 bytes smem
ptxas info    : Function properties for __internal_trig_reduction_slowpathd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_parse_ptxas():
    assert kernel_resources.parse_ptxas(PTXAS) == [(40, 0, 0, 0, "_Z7kernelAv", "sm_90"),
                                                   (64, 24, 20, 24, "_Z7kernelBv", "sm_90")]


def test_demangle():
    names = kernel_resources.demangle(["_Z7kernelAv"])
    assert names in (["kernelA()"], ["_Z7kernelAv"])  # the latter where c++filt is not installed


def test_without_a_cuda_build(tmp_path, capsys):
    assert kernel_resources.main(["csrc/ops/rope/rope_cuda.cu", "--build", str(tmp_path)]) == 2
    assert "scripts/cuda_compile_check.sh" in capsys.readouterr().err


def test_parse_ptxas_says_the_arch():
    two = PTXAS.replace("'sm_90'", "'sm_100'")
    rows = kernel_resources.parse_ptxas(PTXAS + two)
    assert [r[5] for r in rows] == ["sm_90", "sm_90", "sm_100", "sm_100"] and rows[0][:5] == rows[2][:5]


# a stand-in for the build's nvcc command: writes its -o and -MF files, prints ptxas -v output for sm_90 and sm_100
FAKE_NVCC = """import sys
a = sys.argv
for flag in ("-o", "-MF"):
    open(a[a.index(flag) + 1], "w").write("x")
assert "-Xptxas" in a and a[a.index("-Xptxas") + 1] == "-v", a
sys.stderr.write(open(sys.argv[1]).read())
"""


def _fake_build(tmp_path):
    """A build folder whose ninja knows the object of csrc/ops/rope/rope_cuda.cu, compiled by FAKE_NVCC."""
    build = tmp_path / "build"
    (build / "CMakeFiles/opforge.dir/csrc/ops/rope").mkdir(parents=True)  # the object's folder, as in a real build
    (tmp_path / "nvcc.py").write_text(FAKE_NVCC)
    (tmp_path / "ptxas.txt").write_text(PTXAS + PTXAS.replace("'sm_90'", "'sm_100'"))
    obj = "CMakeFiles/opforge.dir/csrc/ops/rope/rope_cuda.cu.o"
    src = kernel_resources.ROOT / "csrc/ops/rope/rope_cuda.cu"
    (build / "build.ninja").write_text(
        f"rule cu\n  command = {sys.executable} {tmp_path / 'nvcc.py'} {tmp_path / 'ptxas.txt'} -MD -MT $out "
        f"-MF $out.d -x cu -c {src} -o $out\nbuild {obj}: cu {src}\n")
    return build


@pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")
def test_a_run_leaves_the_build_alone_and_says_the_arch(tmp_path, monkeypatch, capsys):
    """The object and its dependency file go to a temporary folder (the build's folder holds what it held); a path
    relative to the repository root works from another folder; two archs: each line says its own."""
    build = _fake_build(tmp_path)
    before = sorted(p.name for p in build.rglob("*"))
    monkeypatch.chdir(tmp_path)
    assert kernel_resources.main(["csrc/ops/rope/rope_cuda.cu", "--build", str(build), "--filter", "kernelB"]) == 0
    assert sorted(p.name for p in build.rglob("*")) == before
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("arch") and "kernel (csrc/ops/rope/rope_cuda.cu)" in out[0]
    assert [line.split()[:5] for line in out[1:]] == [["sm_90", "64", "24", "20", "24"],
                                                       ["sm_100", "64", "24", "20", "24"]]


def test_without_ninja(tmp_path, monkeypatch, capsys):
    build = _fake_build(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert kernel_resources.main(["csrc/ops/rope/rope_cuda.cu", "--build", str(build)]) == 2
    assert "no ninja" in capsys.readouterr().err


def test_a_source_not_in_the_build(tmp_path, capsys):
    build = _fake_build(tmp_path)
    assert kernel_resources.main(["csrc/ops/swiglu/swiglu_cuda.cu", "--build", str(build)]) == 2
    assert "ninja knows no object CMakeFiles/opforge.dir/csrc/ops/swiglu/swiglu_cuda.cu.o" in capsys.readouterr().err
