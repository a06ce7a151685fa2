"""Profiler ranges: torch.profiler shows every opforge op by its dispatcher name (CPU); opforge.profiling.nvtx()
is a context manager around torch.autograd.profiler.emit_nvtx; OPFORGE_NVTX is read once at import."""
import os
import subprocess
import sys

import pytest
import torch

import opforge
from opforge import profiling


def _event_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_rms_norm_and_linear_ranges_forward_and_backward():
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    lw = torch.randn(16, 32, requires_grad=True)

    def step():
        y = opforge.rms_norm(x, (32,), w, 1e-6)
        z = opforge.linear(y, lw)
        z.sum().backward()

    names = _event_names(step)
    for op in ("opforge::rms_norm", "opforge::linear"):
        assert op in names, sorted(n for n in names if "opforge" in n)
    assert any(n.startswith("opforge::") and n.endswith("_backward") for n in names), sorted(names)


def test_nvtx_context_manager():
    with profiling.nvtx(enabled=False):
        opforge.sigmoid(torch.randn(4))
    if not torch.cuda.is_available():
        pytest.skip("NVTX ranges need a CUDA build of torch")
    with profiling.nvtx():
        opforge.sigmoid(torch.randn(4, device="cuda"))


def test_opforge_nvtx_env_is_read_at_import():
    code = "import opforge.profiling as p; print(p.NVTX_FROM_ENV)"
    for value, expected in (("1", "True"), ("0", "False")):
        env = dict(os.environ, OPFORGE_NVTX=value)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip().endswith(expected)
