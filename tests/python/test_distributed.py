"""The demo under torchrun: DDP and FSDP2 (fully_shard) on 2 processes give the loss of the single-process
run on the same global batch.

CPU: gloo, always (CI). CUDA: nccl on 2 GPUs, when this machine has them (scripts/multi_gpu_check.sh).

Tolerance: every logged train/validation loss within 1e-4 relative (fp32). The runs differ only in the
order of floating-point reductions (each rank's mean over half the batch, then the all-reduce/reduce-scatter
average of gradients), a few float32 ulps per step: measured 1.1e-7 on the CPU (gloo) for both; the bound
leaves room for GPU GEMMs that pick other algorithms for the half-size per-rank batch.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from opforge import demo

REL_TOL = 1e-4
STEPS = 8
COMMON = ["--size", "tiny", "--steps", str(STEPS), "--batch", "8", "--seq", "32", "--eval-every", "4",
          "--backends", "opforge", "--quiet", "--plot", "", "--csv", "", "--sample-bytes", "0"]

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs (nccl)"))]


def _single(device, tmp_path):
    path = tmp_path / f"single_{device}.json"
    with demo._threads(1):
        demo.run(demo.parse_args([*COMMON, "--device", device, "--json", str(path)]))
    return json.loads(path.read_text())


def _torchrun(parallel, device, tmp_path):
    path = tmp_path / f"{parallel}_{device}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "opforge.demo",
           *COMMON, "--device", device, "--parallel", parallel, "--json", str(path)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"torchrun {parallel} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(path.read_text())


def _assert_same_losses(dist_out, single_out, what):
    a, b = dist_out["results"]["opforge"], single_out["results"]["opforge"]
    assert dist_out["world"] == 2
    assert len(a["train_loss"]) == len(b["train_loss"]) == STEPS
    rel = [abs(x - y) / abs(y) for x, y in zip(a["train_loss"] + a["val_loss"], b["train_loss"] + b["val_loss"])]
    print(f"{what}: largest relative difference from the single-process run {max(rel):.2e}")
    for i, r in enumerate(rel):
        assert r <= REL_TOL, f"{what}: logged loss {i} differs from the single-process run by {r:.2e} relative"


@pytest.fixture(scope="module")
def single_cache():
    return {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_process_loss_matches_single_process(parallel, device, tmp_path, single_cache):
    if device not in single_cache:
        single_cache[device] = _single(device, tmp_path)
    _assert_same_losses(_torchrun(parallel, device, tmp_path), single_cache[device], f"{parallel} on {device}")


def test_parallel_without_torchrun_is_a_clear_error():
    with pytest.raises(RuntimeError, match="needs torchrun"):
        demo.run(demo.parse_args([*COMMON, "--device", "cpu", "--parallel", "ddp"]))
