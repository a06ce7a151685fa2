"""The run-time switches of csrc/core/knobs.h: the environment is read there only, once; user-facing modes come from
their environment variable, test hooks from none; torch.ops.opforge._set_knob sets either and returns the previous
value; OPFORGE_LCE_CHUNK_SIZE that is not a positive integer is the error its docs name."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge  # noqa: F401  (loads the library)

ROOT = Path(__file__).resolve().parents[2]
MODES = {"OPFORGE_LCE_GRAD_IN_FORWARD": 1, "OPFORGE_LCE_DW_ACCUM": 0, "OPFORGE_LCE_CHUNK_SIZE": 0, "OPFORGE_LCE_LEAN": 1,
         "OPFORGE_FP8_FAST_ACCUM": 0}
HOOKS = {"linear_lt": 1, "linear_gemv": -1, "rms_norm_forward": -1, "rms_norm_backward": -1, "rope_rows_kernel": 0,
         "indexed_linear_path": 0, "fp8_gemm": -1, "fp8_transpose": -1}


def _code(path: Path) -> str:
    """A C++/CUDA file without its comments and string literals."""
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)
    return re.sub(r"//[^\n]*", "", text)


def test_only_knobs_reads_the_environment():
    readers = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*")
                     if p.suffix in (".cpp", ".cu", ".cuh", ".h") and re.search(r"\bgetenv\s*\(", _code(p)))
    assert readers == ["csrc/core/knobs.cpp"], readers


def _clean_env(**values):
    """This process's environment without the user-facing modes, plus `values`."""
    env = {k: v for k, v in os.environ.items() if k not in MODES}
    env.update(values)
    return env


def test_set_knob_returns_the_previous_value_and_restores():
    for name in [*MODES, *HOOKS]:
        before = torch.ops.opforge._set_knob(name, 5)
        try:
            assert torch.ops.opforge._set_knob(name, 6) == 5
        finally:
            torch.ops.opforge._set_knob(name, before)
        assert torch.ops.opforge._set_knob(name, before) == before


def test_unknown_knob_names_every_knob():
    with pytest.raises(ValueError, match=r"opforge::_set_knob: expected OPFORGE_LCE_GRAD_IN_FORWARD, .*"
                                         r"indexed_linear_path, fp8_gemm or fp8_transpose, but got OPFORGE_ROPE_KERNEL"):
        torch.ops.opforge._set_knob("OPFORGE_ROPE_KERNEL", 1)


def test_environment_sets_modes_not_hooks():
    """In a fresh process: the user-facing modes take their variable's value; the hooks keep their defaults even
    with an environment variable of the hook's name or an OPFORGE_ spelling of it; a chunk size that is not a
    positive integer raises where the chunk size is needed, not where the call gives chunk_size."""
    code = "\n".join([
        "import torch, opforge",
        "names = " + repr([*MODES, *HOOKS]),
        "print(' '.join(str(torch.ops.opforge._set_knob(n, 0)) for n in names if n != 'OPFORGE_LCE_CHUNK_SIZE'))",
        "x, w, t = torch.randn(4, 8), torch.randn(5, 8), torch.tensor([0, 1, 2, 3])",
        "opforge.linear_cross_entropy(x, w, t, chunk_size=2)",
        "try:",
        "    opforge.linear_cross_entropy(x, w, t)",
        "except ValueError as e:",
        "    print(e)",
    ])
    env = _clean_env(OPFORGE_LCE_GRAD_IN_FORWARD="0", OPFORGE_LCE_DW_ACCUM="1", OPFORGE_LCE_CHUNK_SIZE="12x",
                     OPFORGE_LCE_LEAN="0", OPFORGE_FP8_FAST_ACCUM="2",
                     OPFORGE_LINEAR_LT="0", linear_lt="0", OPFORGE_LINEAR_GEMV="1", OPFORGE_ROPE_KERNEL="1",
                     rope_rows_kernel="1", OPFORGE_INDEXED_LINEAR_PATH="gemv", OPFORGE_RMS_FWD="2", fp8_gemm="1")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    # GRAD_IN_FORWARD 0, DW_ACCUM 1, LEAN 0, FP8_FAST_ACCUM 2 from the environment; hooks' defaults
    expect = [0, 1, 0, 2] + list(HOOKS.values())
    assert lines[-2].split() == [str(v) for v in expect], p.stdout
    assert lines[-1].startswith('opforge::linear_cross_entropy: expected OPFORGE_LCE_CHUNK_SIZE to be a positive '
                                'integer, but got "12x"'), p.stdout


def test_chunk_size_from_environment():
    code = "import torch, opforge; print(torch.ops.opforge._set_knob('OPFORGE_LCE_CHUNK_SIZE', 0))"
    for value, expect in (("", "0"), ("7", "7")):
        p = subprocess.run([sys.executable, "-c", code], env=_clean_env(OPFORGE_LCE_CHUNK_SIZE=value),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert p.stdout.strip().splitlines()[-1] == expect, (value, p.stdout)
