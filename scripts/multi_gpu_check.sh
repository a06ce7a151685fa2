#!/usr/bin/env bash
# Multi-GPU checks for the lead, on the 2-GPU machine (nvidia-h200-x2), in one call from the repository root
# (about 6-8 minutes; nothing new starts after GPU_CHECK_DEADLINE, default 450 s; pytest gets at most
# GPU_CHECK_PYTEST_TIMEOUT, default 300 s: the tensor-parallel tests add about a minute):
#   bash scripts/multi_gpu_check.sh
# It is scripts/gpu_check.sh with these settings (same CUDA build: CMake + Ninja, TORCH_CUDA_ARCH_LIST=9.0,
# cuBLAS header shim when the toolkit lacks them; results and logs.tar.gz under $OUT):
# 1. builds opforge with CUDA (build/gpu; no C++ tests, no benchmarks);
# 2. pytest tests/python/test_multi_gpu.py tests/python/test_distributed.py tests/python/test_tensor_parallel.py:
#    ops on cuda:1 while the current
#    device is 0 (kernels on cuda:1, outputs and gradients equal to cuda:0's, current device unchanged),
#    inputs on two GPUs raise an error naming both; the demo under torchrun --nproc_per_node=2 with DDP and
#    FSDP2, gloo on CPU and nccl on the 2 GPUs, losses equal to the single-process run on the same global
#    batch; tensor parallelism (opforge.parallel) under torchrun on 2 GPUs: every op under each placement its
#    DTensor rules support against one GPU, the vocabulary-parallel loss (and its per-rank peak memory against
#    the op on one GPU, printed as "CUDA loss memory ... ratio", at most 0.55), odd shapes and options, the same
#    ops, loss and edge suites on bf16 inputs, and a tiny patched Llama under TP + SP (training losses within 1e-5
#    of one GPU, the collectives of a step counted). Any skipped CUDA test counts as a
#    failure here (GPU_CHECK_ALLOWED_SKIPS matches nothing);
# 3. gpus: torch sees at least 2 GPUs;
# 4. demo_ddp, demo_fsdp: python -m opforge.demo under torchrun on both GPUs (size medium, 100 steps, both
#    models; exit status 1 if the opforge and torch.nn loss curves disagree);
# 5. tp_example: examples/tensor_parallel_llama.py under torchrun on both GPUs (a 4-layer patched Llama, TP + SP,
#    20 steps; exit status 1 if its losses differ from one GPU's by more than 1e-4 relative).
# Ends with the pass/fail table of gpu_check.sh; exit status non-zero if anything failed.
# NVLink multicast stays off: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GPU_CHECK_PYTEST_ARGS=${GPU_CHECK_PYTEST_ARGS:-tests/python/test_multi_gpu.py tests/python/test_distributed.py tests/python/test_tensor_parallel.py}
export GPU_CHECK_CPP_TESTS=${GPU_CHECK_CPP_TESTS:-0}
export GPU_CHECK_BENCH=${GPU_CHECK_BENCH:-none}
export GPU_CHECK_ALLOWED_SKIPS=${GPU_CHECK_ALLOWED_SKIPS:-(?!)}
export GPU_CHECK_DEADLINE=${GPU_CHECK_DEADLINE:-450}
export GPU_CHECK_PYTEST_TIMEOUT=${GPU_CHECK_PYTEST_TIMEOUT:-300}
export GPU_CHECK_RUN_TAIL=${GPU_CHECK_RUN_TAIL:-12}
demo='"${PYTHON:-python3}" -m torch.distributed.run --nproc_per_node=2 --standalone -m opforge.demo --device cuda --size medium --steps 100 --plot "" --csv "" --sample-bytes 100 --parallel'
export GPU_CHECK_RUN="gpus: \"\${PYTHON:-python3}\" -c 'import torch, sys; n = torch.cuda.device_count(); print(n, \"GPUs\"); sys.exit(0 if n >= 2 else 1)'
demo_ddp: $demo ddp
demo_fsdp: $demo fsdp
tp_example: \"\${PYTHON:-python3}\" -m torch.distributed.run --nproc_per_node=2 --standalone examples/tensor_parallel_llama.py --device cuda --steps 20 --check"
exec bash scripts/gpu_check.sh
