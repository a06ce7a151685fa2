"""Profiler ranges: every opforge op shows up by name in `torch.profiler`; NVTX on request.

The dispatcher records a range named `opforge::<op>` (`opforge::rms_norm`, `opforge::linear`,
`opforge::rms_norm_backward`, ...) for every call while `torch.profiler` (or
`torch.autograd.profiler`) is active, with the op's kernels under it, on CPU and CUDA. Nothing to switch
on:

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opforge.rms_norm(x, (x.shape[-1],), w)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10))

NVTX ranges (for Nsight Systems, `nsys profile`) on request: the `nvtx` context manager, or
`OPFORGE_NVTX=1` in the environment, read once when opforge is imported, which switches them on for the
whole process (`nsys profile -e OPFORGE_NVTX=1 python train.py`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

__all__ = ["nvtx", "NVTX_FROM_ENV"]

#: `OPFORGE_NVTX` as read at import (`1`/`true`/`yes`/`on`: NVTX ranges for the whole process).
NVTX_FROM_ENV: bool = os.environ.get("OPFORGE_NVTX", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def nvtx(enabled: bool = True, record_shapes: bool = False) -> Iterator[None]:
    """Emit an NVTX range for every op called inside (opforge's `opforge::<op>` and torch's own).

    Wraps `torch.autograd.profiler.emit_nvtx`: the ranges appear in Nsight Systems' timeline when the
    program runs under `nsys profile`; without a profiler attached they cost a little host time per op.

    Args:
        enabled: bool. False makes this a no-op (to keep one code path). Default: True.
        record_shapes: bool. Also put the input shapes into each range's name. Default: False.

    Raises:
        RuntimeError: from torch, where this torch build has no NVTX support (a CPU-only build).
    """
    if not enabled:
        yield
        return
    with torch.autograd.profiler.emit_nvtx(enabled=True, record_shapes=record_shapes):
        yield


_process_nvtx = None
if NVTX_FROM_ENV and torch.cuda.is_available():
    # Entered once for the life of the process (the environment switch).
    _process_nvtx = torch.autograd.profiler.emit_nvtx(enabled=True)
    _process_nvtx.__enter__()
