#!/usr/bin/env bash
# Builds opforge's CUDA kernels on a machine without a GPU, so a CUDA compile or link error fails CI.
#
# A CUDA build needs a CUDA-enabled torch; CI's torch is a CPU build, so this script keeps a second
# torch (CUDA 13.0 wheels, from the local pip mirror) in its own venv, links the CUDA headers and
# libraries that those wheels ship (cuBLAS, ...) into the machine's CUDA toolkit where it lacks them,
# then configures and builds the whole library with nvcc into build/cuda. Nothing built here runs
# (no GPU); scripts/gpu_check.sh runs the CUDA tests on a GPU machine.
#
# opforge's CUTLASS sm90 GEMM kernels (core/gemm_sm90.h) are built when python3 has the nvidia-cutlass wheel (or
# CUTLASS_DIR names a CUTLASS tree); OPFORGE_CUTLASS=OFF skips them, ON makes their absence an error. They are one
# CUTLASS instantiation per file (about a minute each on one core), ccache'd like the rest.
#
# Environment: OPFORGE_CUDA_VENV (default $HOME/.venv-cuda), OPFORGE_CUDA_TORCH (default torch==2.14.1),
# CUDA_HOME (default /usr/local/cuda), TORCH_CUDA_ARCH_LIST (default 9.0: one arch keeps it quick),
# OPFORGE_JOBS (ninja -j, default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${OPFORGE_CUDA_VENV:-$HOME/.venv-cuda}
CUDA_TORCH=${OPFORGE_CUDA_TORCH:-torch==2.14.1}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NVCC=$CUDA_HOME/bin/nvcc
BUILD=build/cuda
JOBS=${OPFORGE_JOBS:-$(nproc)}

if [ ! -x "$NVCC" ]; then
  echo "cuda_compile_check: no nvcc at $NVCC (set CUDA_HOME to a CUDA toolkit)" >&2
  exit 1
fi

# 1. A CUDA-enabled torch in its own venv (about 2 minutes the first time; reused after).
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  echo "cuda_compile_check: installing $CUDA_TORCH (CUDA build) into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "$CUDA_TORCH" numpy
fi
TORCH_PREFIX=$("$VENV/bin/python" -c "import torch; print(torch.utils.cmake_prefix_path)")

# 2. The toolkit here has nvcc and cudart but not every library torch's CMake config asks for: link the
#    headers and shared libraries of the CUDA wheels (nvidia/cu13) into it where they are missing
#    (scripts/cublas_link.sh, shared with gpu_check.sh).
. scripts/cublas_link.sh
opforge_link_cublas "$VENV/bin/python" "$CUDA_HOME" all || { echo "cuda_compile_check: $OPFORGE_CUBLAS_DETAIL" >&2; exit 1; }
echo "cuda_compile_check: cuBLAS $OPFORGE_CUBLAS_STATUS ($OPFORGE_CUBLAS_DETAIL)"

# 3. The CUTLASS headers: CUTLASS_DIR, else the nvidia-cutlass wheel of python3 (the CUDA venv need not have it).
CUTLASS_SRC=${CUTLASS_DIR:-$(python3 -c 'import cutlass_library; print(cutlass_library.source_path)' 2>/dev/null || true)}

# 4. Configure and build with nvcc (OPFORGE_CUDA=ON: a missing compiler is an error, never a silent CPU build).
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" -G Ninja \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" \
  -DOPFORGE_CUDA=ON \
  -DOPFORGE_CUTLASS="${OPFORGE_CUTLASS:-AUTO}" -DCUTLASS_DIR="$CUTLASS_SRC" \
  -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" > "$BUILD/configure.log" 2>&1 \
  || { cat "$BUILD/configure.log"; exit 1; }
grep -q "CUDA kernels: ON" "$BUILD/configure.log" || { cat "$BUILD/configure.log"; echo "cuda_compile_check: CUDA not enabled" >&2; exit 1; }
grep -E "opforge: CUTLASS" "$BUILD/configure.log" || true
ninja -C "$BUILD" -j "$JOBS"
echo "cuda_compile_check: OK ($(ls csrc/core/*.cu csrc/ops/*/*.cu | wc -l) .cu files compiled and linked into $BUILD/libopforge.so)"
