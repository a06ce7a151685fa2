#!/usr/bin/env bash
# Builds examples/cpp_app (a plain C++ program: find_package(opforge), links opforge::opforge) against the
# *installed* opforge package (`pip install --no-build-isolation .`) and runs it: it trains a 2-layer MLP
# through opforge::linear and opforge::sigmoid and exits non-zero unless the loss falls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUILD=build/cpp_app
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}  # cache hits across checkouts
# Run from /tmp so `import opforge` finds the installed package, not ./python.
PREFIX=$(cd /tmp && "$PY" -c "import opforge, torch; print(opforge.cmake_prefix_path + ';' + torch.utils.cmake_prefix_path)")
cmake -S examples/cpp_app -B "$BUILD" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_BUILD_TYPE=Release \
  $(command -v ccache >/dev/null && echo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache) >/dev/null
ninja -C "$BUILD" -j "${OPFORGE_JOBS:-$(nproc)}"
"$BUILD/mlp_train"
