#!/usr/bin/env bash
# Multi-GPU checks for the lead, on the 2-GPU machine (nvidia-h200-x2), from the repository root:
#   bash scripts/multi_gpu_check.sh
# 1. builds opforge with CUDA (build/gpu),
# 2. tests/python/test_multi_gpu.py: ops on cuda:1 while the current device is 0 (outputs, gradients,
#    current device unchanged), inputs on two GPUs raise an error naming both;
# 3. tests/python/test_distributed.py: the demo under torchrun --nproc_per_node=2 with DDP and FSDP2,
#    gloo on CPU and nccl on the 2 GPUs, loss equal to the single-process run on the same global batch;
# 4. the demo itself with DDP and FSDP2 on both GPUs (short run, printed table).
# Ends with a pass/fail table; exit status non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
declare -a NAMES RESULTS

step() {  # step NAME COMMAND...
  local name=$1; shift
  echo "=== $name: $*"
  if "$@"; then RESULTS+=("PASS"); else RESULTS+=("FAIL"); fi
  NAMES+=("$name")
}

nvidia-smi -L
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
step build bash -c "cmake -S . -B build/gpu -G Ninja -DCMAKE_PREFIX_PATH=\$($PY -c 'import torch;print(torch.utils.cmake_prefix_path)') -DTORCH_CUDA_ARCH_LIST=9.0 >/dev/null && ninja -C build/gpu >/dev/null"
export OPFORGE_LIBRARY=$PWD/build/gpu/libopforge.so PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
step gpus bash -c "$PY -c 'import torch,sys; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)'"
step test_multi_gpu $PY -m pytest -q -rs tests/python/test_multi_gpu.py
step test_distributed $PY -m pytest -q -rs tests/python/test_distributed.py
for par in ddp fsdp; do
  step "demo_$par" $PY -m torch.distributed.run --nproc_per_node=2 --standalone -m opforge.demo \
    --parallel $par --device cuda --size medium --steps 100 --plot "" --csv "" --sample-bytes 100
done

echo
printf '%-20s %s\n' check result
fail=0
for i in "${!NAMES[@]}"; do
  printf '%-20s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
  [[ ${RESULTS[$i]} == PASS ]] || fail=1
done
exit $fail
