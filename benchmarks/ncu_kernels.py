"""One launch of each of opforge's memory-bound kernels, for Nsight Compute (`ncu`) to read its counters.

Each case runs its op once on the shapes of the rms_norm / small-M linear / rope results (README, docs/performance),
so the profile has one record per kernel (ncu replays a kernel to collect its sections;
timing here means nothing):

    ncu --clock-control none --kernel-name regex:opforge --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section MemoryWorkloadAnalysis python benchmarks/ncu_kernels.py [--cases a,b]

Cases: rms_fwd (bf16 32768x4096), rms_fwd_8192 (bf16 16384x8192), fused_fwd (bf16 32768x4096),
rms_bwd_long (bf16 4096x16384 forward+backward), rms_bwd_fp32 (fp32 16384x8192 forward+backward),
gemv (bf16 1x4096x4096, no bias), rope (bf16 4x4096, 32 q / 8 kv heads, head dim 128, forward; q and k as views of
(B, S, H, D) projections, as the rope suite lays them out), rope_copy (q and k of the rope case cloned: the same
bytes through torch's copy kernel, the rope suite's "copy" row; ncu's --kernel-name matches a kernel's base name, so
`regex:"rope|copy"` does not select the copy, which runs as `vectorized_elementwise_kernel`).
`--clock-control none` leaves the GPU's clocks as they are.
"""
from __future__ import annotations

import argparse

import torch

import opforge


def _rms(M, N, dtype, backward=False):
    x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=backward)
    w = torch.randn(N, device="cuda", dtype=dtype, requires_grad=backward)
    y = opforge.rms_norm(x, [N], w, 1e-6)
    if backward:
        y.backward(torch.randn_like(y))


def _fused(M, N, dtype):
    x, r = (torch.randn(M, N, device="cuda", dtype=dtype) for _ in range(2))
    opforge.fused_add_rms_norm(x, r, [N], torch.randn(N, device="cuda", dtype=dtype), 1e-6)


def _gemv():
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    opforge.linear(x, w)


def _rope_inputs():
    B, S, Hq, Hk, D = 4, 4096, 32, 8, 128
    # as the rope suite and a Hugging Face attention layer lay them out: (B, S, H, D) projections viewed (B, H, S, D)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return q, k, S, D


def _rope_copy():
    q, k, _, _ = _rope_inputs()
    q.clone(), k.clone()  # the rope suite's "copy" row: the same bytes as rope's forward, through torch's copy kernel


def _rope():
    q, k, S, D = _rope_inputs()
    pos = torch.arange(S, device="cuda", dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D))
    emb = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], -1)[None]
    opforge.rope(q, k, emb.cos().bfloat16(), emb.sin().bfloat16())


CASES = {
    "rms_fwd": lambda: _rms(32768, 4096, torch.bfloat16),
    "rms_fwd_8192": lambda: _rms(16384, 8192, torch.bfloat16),
    "fused_fwd": lambda: _fused(32768, 4096, torch.bfloat16),
    "rms_bwd_long": lambda: _rms(4096, 16384, torch.bfloat16, backward=True),
    "rms_bwd_fp32": lambda: _rms(16384, 8192, torch.float32, backward=True),
    "gemv": _gemv,
    "rope": _rope,
    "rope_copy": _rope_copy,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    args = p.parse_args(argv)
    for name in args.cases.split(","):
        torch.cuda.nvtx.range_push(name)
        CASES[name]()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"ncu_kernels: {name} done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
