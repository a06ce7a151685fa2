"""scripts/kernel_resources.py: its reading of ptxas -v output (registers, spills, stack per kernel) and its message
without a configured CUDA build."""
import sys
from pathlib import Path

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
    assert kernel_resources.parse_ptxas(PTXAS) == [(40, 0, 0, 0, "_Z7kernelAv"), (64, 24, 20, 24, "_Z7kernelBv")]


def test_demangle():
    names = kernel_resources.demangle(["_Z7kernelAv"])
    assert names in (["kernelA()"], ["_Z7kernelAv"])  # the latter where c++filt is not installed


def test_without_a_cuda_build(tmp_path, capsys):
    assert kernel_resources.main(["csrc/ops/rope/rope_cuda.cu", "--build", str(tmp_path)]) == 2
    assert "scripts/cuda_compile_check.sh" in capsys.readouterr().err
