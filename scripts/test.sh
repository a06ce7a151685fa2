#!/usr/bin/env bash
# Runs every opforge test: the Python tests (pytest, tests/python) and the C++ tests (GoogleTest through
# ctest, tests/cpp), against a CMake build of this source tree in build/test, so the tests always see the
# code in front of you (not an older installed copy). Exits non-zero if any test fails, or if pytest
# collected no test at all.
#
# The build: where build/test does not exist yet but the pip build of this tree does (scripts/demo.sh leaves
# it in build/<wheel tag>/, pyproject.toml's build-dir) with the same torch and Ninja, build/test becomes a
# link to that build and the C++ tests are added to it: the library is not compiled a second time (later pip
# builds there then compile the C++ tests too, those whose sources changed). Otherwise
# the library and the C++ tests are compiled in build/test (about 5 minutes on 2 cores, seconds to a minute
# with a warm ccache); either way it says which, in one line.
#
#   bash scripts/test.sh                 # everything
#   bash scripts/test.sh -k sigmoid      # extra arguments go to pytest (the C++ tests still run)
#
# Needs a C++ compiler; installs what is missing (scripts/bootstrap.sh) into the current Python -- a virtual
# environment if one is active, else the system's: torch 2.13.0 (when no torch is installed), pytest,
# hypothesis, expecttest, transformers (the Hugging Face patching tests), torchao 0.18.0 (the FP8 tests compare
# opforge's scales and casts with its float8 recipe), tqdm, matplotlib (pip),
# CMake >= 3.26 and ninja (pip; pip's scripts folder goes first on PATH), GoogleTest (Debian's libgtest-dev,
# with apt-get: it needs root, and says so before it installs; without root it names the command and stops).
# Environment: PYTHON (default python3), OPFORGE_JOBS (ninja -j, default: number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
BUILD=build/test
JOBS=${OPFORGE_JOBS:-$(nproc)}

# --- what the tests need, installed only when missing (scripts/bootstrap.sh) -----------------------
. scripts/bootstrap.sh
ob_torch
ob_pip pytest hypothesis expecttest transformers torchao=torchao==0.18.0 tqdm matplotlib
ob_build_tools
ob_gtest || exit 1

# The same C++ compiler as pip's build (scikit-build-core takes Python's sysconfig CXX), so ccache
# serves this build from the `pip install` one.
export CXX=${CXX:-$("$PY" -c "import sysconfig; print((sysconfig.get_config_var('CXX') or 'c++').split()[0])")}
TORCH_PREFIX=$("$PY" -c "import torch; print(torch.utils.cmake_prefix_path)")

# The pip build of this tree (build/<wheel tag>/CMakeCache.txt of this source folder, this torch, Ninja), if any.
pip_build_of_this_tree() {
  local cache dir source_dir torch_dir
  torch_dir=$(readlink -f "$TORCH_PREFIX/Torch")
  for cache in build/*/CMakeCache.txt; do
    [ -f "$cache" ] || continue
    dir=${cache%/CMakeCache.txt}
    [ "$dir" != "$BUILD" ] || continue
    source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$cache")
    [ "$source_dir" = "$PWD" ] || [ "$source_dir" = "$(pwd -P)" ] || continue
    grep -qx "CMAKE_GENERATOR:INTERNAL=Ninja" "$cache" || continue
    [ "$(readlink -f "$(sed -n 's/^Torch_DIR:PATH=//p' "$cache")")" = "$torch_dir" ] || continue
    echo "$dir"
    return 0
  done
  return 1
}

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  [ ! -L "$BUILD" ] || rm "$BUILD"  # a link to a pip build that is gone
  if pip_dir=$(pip_build_of_this_tree); then
    ln -s "${pip_dir#build/}" "$BUILD"
    echo "test.sh: reusing the pip build of this tree in $pip_dir (its library is compiled already): adding the C++ tests to it; $BUILD links to it"
  else
    echo "test.sh: building the library and the C++ tests in $BUILD (no pip build of this tree with this torch in build/): about 5 minutes on 2 cores, seconds to a minute with a warm ccache$(command -v ccache >/dev/null || echo ' (ccache is not installed)')"
  fi
fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DOPFORGE_BUILD_TESTS=ON >/dev/null
ninja -C "$BUILD" -j "$JOBS"

py_status=0
OPFORGE_LIBRARY="$PWD/$BUILD/libopforge.so" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m pytest tests/python -q "$@" || py_status=$?
if [ "$py_status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: counted as a failure" >&2
fi

cpp_status=0
ctest --test-dir "$BUILD" --output-on-failure || cpp_status=$?

echo
echo "test.sh: python tests: $([ $py_status -eq 0 ] && echo PASS || echo "FAIL (pytest exit $py_status)")"
echo "test.sh: C++ tests:    $([ $cpp_status -eq 0 ] && echo PASS || echo "FAIL (ctest exit $cpp_status)")"
[ "$py_status" -eq 0 ] && [ "$cpp_status" -eq 0 ]
