#!/usr/bin/env bash
# The GPU report of the demo, for the lead, on one H200 (nvidia-h200), in one call from the repository root:
#   OPFORGE_GIT_COMMIT=<commit> bash scripts/llama_report.sh [extra options of python -m opforge demo]
# It is scripts/gpu_check.sh with these settings: builds opforge with CUDA (build/gpu; CMake + Ninja,
# TORCH_CUDA_ARCH_LIST=9.0, cuBLAS header shim when needed; no tests, no benchmarks), then runs
#   python -m opforge demo --report --device cuda --out benchmarks/results
# (bf16, size h200: d_model 2048, 8 layers, sequence 2048, batch 8; opforge and torch.nn, eager and
# torch.compile; 20 steps each, first 3 untimed). The table is printed; benchmarks/results/
# llama_report_cuda.csv (GPU name, torch version, commit; OPFORGE_GIT_COMMIT when the copy has no .git)
# and llama_report_cuda.png come back in $OUT. Ends with gpu_check.sh's pass/fail table.
set -u
cd "$(dirname "$0")/.."
export GPU_CHECK_PYTEST_ARGS=none GPU_CHECK_CPP_TESTS=0 GPU_CHECK_BENCH=none GPU_CHECK_RUN_TAIL=${GPU_CHECK_RUN_TAIL:-25}
export GPU_CHECK_RUN="llama_report: \"\${PYTHON:-python3}\" -m opforge demo --report --device cuda --out \"$PWD/benchmarks/results\" $*"
exec bash scripts/gpu_check.sh
