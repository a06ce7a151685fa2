"""Profiler ranges: torch.profiler shows every opforge op by its dispatcher name (CPU); opforge.profiling.nvtx()
is a context manager around torch.autograd.profiler.emit_nvtx; OPFORGE_NVTX is read once at import."""
import os
import subprocess
import sys

import pytest
import torch

import opforge
from opforge import profiling


def _profile(fn, device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return prof


def test_rms_norm_and_linear_ranges_forward_and_backward(device):
    """Every op's dispatcher range is in the profiler table, forward and backward; on CUDA the ranges carry
    device time (their kernels ran under them)."""
    x = torch.randn(8, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    lw = torch.randn(16, 32, device=device, requires_grad=True)

    def step():
        y = opforge.rms_norm(x, (32,), w, 1e-6)
        z = opforge.linear(y, lw)
        z.sum().backward()

    prof = _profile(step, device)
    events = {e.key: e for e in prof.key_averages()}
    names = set(events)
    for op in ("opforge::rms_norm", "opforge::linear"):
        assert op in names, sorted(n for n in names if "opforge" in n)
    assert any(n.startswith("opforge::") and n.endswith("_backward") for n in names), sorted(names)
    if device == "cuda":
        attr = "device_time_total" if hasattr(events["opforge::rms_norm"], "device_time_total") else "cuda_time_total"
        for op in ("opforge::rms_norm", "opforge::linear"):
            assert getattr(events[op], attr) > 0, f"{op}: no device time under its range"


def test_nvtx_disabled_is_a_no_op():
    with profiling.nvtx(enabled=False):
        opforge.sigmoid(torch.randn(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVTX ranges need a CUDA GPU")
def test_nvtx_context_manager_cuda():
    with profiling.nvtx():
        opforge.sigmoid(torch.randn(4, device="cuda"))


def test_opforge_nvtx_env_is_read_at_import():
    code = "import opforge.profiling as p; print(p.NVTX_FROM_ENV)"
    for value, expected in (("1", "True"), ("0", "False")):
        env = dict(os.environ, OPFORGE_NVTX=value)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip().endswith(expected)
