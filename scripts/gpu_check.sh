#!/usr/bin/env bash
# scripts/gpu_check.sh: build opforge on the GPU machine and run everything there in one call, ending
# with a pass/fail table. Exit status 0 only when every step that ran passed.
#
#   bash scripts/gpu_check.sh                          # results under $OUT (default /tmp/gpu_check_out)
#   GPU_CHECK_BENCH="elementwise rms_norm" bash scripts/gpu_check.sh
#   GPU_CHECK_NO_CUDA=1 GPU_CHECK_JOBS=1 bash scripts/gpu_check.sh      # CPU-only dry run of the flow
#   scripts/multi_gpu_check.sh and scripts/llama_report.sh are this script with other settings.
#   The whole CUDA suite in two runs on the same machine when build + suite would pass a 600 s limit (the
#   second reuses build/gpu, about 40 s), each half of the tests (tests/python/conftest.py's --shard K/N):
#     GPU_CHECK_PYTEST_ARGS='-n 16 --cuda-only --shard 1/2 tests/python' bash scripts/gpu_check.sh
#     GPU_CHECK_PYTEST_ARGS='-n 16 --cuda-only --shard 2/2 tests/python' bash scripts/gpu_check.sh   (within 30 s)
#
# Steps (a failing step is recorded and the later steps still run):
#   wheels     .whl/*.whl, if present, installed with pip --no-index --no-deps into /tmp/site (PYTHONPATH)
#   env        nvidia-smi -L, torch / CUDA / nvcc / cmake versions
#   cublas     cuBLAS headers and libraries in the CUDA toolkit; linked in from torch's nvidia wheels
#              when missing (as .ci does), or given to CMake through a shim folder when not writable
#   configure  CMake + Ninja against python3's torch, TORCH_CUDA_ARCH_LIST=9.0, OPFORGE_CUDA=ON, opforge's CUTLASS
#              sm90 GEMM kernels from the nvidia-cutlass wheel (carried in .whl/; OPFORGE_CUTLASS=ON when python3
#              imports cutlass_library, else AUTO, i.e. off: the configure line says which),
#              OPFORGE_BUILD_TESTS=ON when GoogleTest is found (else the C++ tests are skipped, said so)
#   build      ninja -j$GPU_CHECK_JOBS (library first, then the C++ tests)
#   pytest     tests/python with OPFORGE_LIBRARY=<build>/libopforge.so -> $OUT/pytest.log (-v: one line per test as it ends,
#              so a run cut by its time cap still names its failures), $OUT/junit.xml;
#              counts passed / failed / skipped, and the CUDA tests skipped (the goal is none)
#   ctest      when the C++ tests were built
#   run        each command of $GPU_CHECK_RUN, one step each, with the built library selected
#   sanitizer  GPU_CHECK_SANITIZER=1: scripts/sanitize.sh, compute-sanitizer's memcheck, racecheck, initcheck and
#              synccheck over every opforge kernel (GPU_CHECK_SANITIZER_TOOLS picks tools), each must finish with 0 errors
#   bench      each benchmarks/bench_<name>.py of $GPU_CHECK_BENCH (default: all), capped by `timeout`
#   collect    $OUT gets at most 8 files: summary.txt, pytest.log, junit.xml, logs.tar.gz (every log and
#              every benchmark result of this run, subfolders of benchmarks/results included) and up to 4 CSV/PNG files
#
# Environment (all optional):
#   OUT                       where the results go (the device tool provides it)
#   PYTHON                    python3
#   CUDA_HOME                 /usr/local/cuda
#   GPU_CHECK_JOBS            16      ninja parallelism
#   GPU_CHECK_BUILD_DIR       build/gpu (build/gpu-cpu with GPU_CHECK_NO_CUDA=1)
#   GPU_CHECK_NO_CUDA         0       1: CPU-only build and runs (to exercise this script without a GPU)
#   GPU_CHECK_PYTEST_ARGS     tests/python   what pytest runs (e.g. "tests/python/test_rms_norm.py -x"; split as a shell
#                                            command line: "-k 'fp8 or jsd' tests/python" keeps the -k expression whole);
#                                            "none": no pytest step
#   GPU_CHECK_CPP_TESTS       1       0: do not build or run the C++ tests (a quicker build)
#   GPU_CHECK_RUN                     extra steps, one a line: "NAME: COMMAND" (bash), run after ctest with
#                                     OPFORGE_LIBRARY and PYTHONPATH set to this build, each capped by the
#                                     deadline; output in logs.tar.gz run_NAME.log, its last lines printed
#   GPU_CHECK_SANITIZER       0       1: run the compute-sanitizer step; parallel: the coverage pass, then the tools
#                                     side by side in the background from the end of the build, beside pytest
#   GPU_CHECK_SANITIZER_TOOLS memcheck racecheck initcheck synccheck
#   GPU_CHECK_SANITIZER_QUICK_TOOLS   the tools that run the driver's quick mode (e.g. "initcheck", the slow one);
#                                     the others every dtype both ways. Unset: SANITIZE_QUICK=1 makes all quick
#   GPU_CHECK_BENCH           all     benchmark names ("elementwise rms_norm") or "none"
#   GPU_CHECK_BENCH_ARGS              extra arguments for every benchmark (e.g. "--quick")
#   GPU_CHECK_BENCH_TIMEOUT   150     seconds per benchmark
#   GPU_CHECK_PYTEST_TIMEOUT  360     seconds for pytest
#   GPU_CHECK_DEADLINE        570     seconds from the start after which nothing new starts (the device
#                                     tool stops a command at 600 s)
#   GPU_CHECK_ALLOWED_SKIPS   regex of skip reasons that do not count as skipped CUDA tests
#                                     (default: more GPUs, torch >= 2.13's F.linear_cross_entropy, no CUDA)
#   OPFORGE_GIT_COMMIT        the commit recorded in benchmark CSVs; pass it (OPFORGE_GIT_COMMIT=$(git rev-parse --short HEAD)
#                             on this side): the device copy's .git can be an older snapshot than its working tree (2026-12-01:
#                             CSVs of a 990ad74 tree said 9f3cf06)
set -u
set -o pipefail

START=$(date +%s)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
JOBS=${GPU_CHECK_JOBS:-16}
NO_CUDA=${GPU_CHECK_NO_CUDA:-0}
if [ "$NO_CUDA" = 1 ]; then BUILD=${GPU_CHECK_BUILD_DIR:-$ROOT/build/gpu-cpu}; else BUILD=${GPU_CHECK_BUILD_DIR:-$ROOT/build/gpu}; fi
DEADLINE=${GPU_CHECK_DEADLINE:-570}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-150}
PYTEST_TIMEOUT=${GPU_CHECK_PYTEST_TIMEOUT:-360}
# Skips that say what this machine lacks rather than what a CUDA test could not do: more GPUs, a torch with
# F.linear_cross_entropy (2.13+; the GPU machine has 2.11, CI's 2.13 runs them on the CPU), or no CUDA at all.
ALLOWED_SKIPS=${GPU_CHECK_ALLOWED_SKIPS:-needs (at least )?[0-9]+ CUDA GPUs|torch (< 2\.13 )?has no (F|nn)\.(linear_cross_entropy|LinearCrossEntropyLoss)|machine without CUDA}
LOGS=$(mktemp -d /tmp/gpu_check_logs.XXXXXX)
STAMP=$LOGS/.start_stamp
touch "$STAMP"

# ---- bookkeeping: one line per step, printed as the final table -----------------------------------------
STEPS=()
STATES=()
DETAILS=()
FAILED=0
record() {  # record NAME PASS|FAIL|SKIP DETAIL
  STEPS+=("$1"); STATES+=("$2"); DETAILS+=("$3")
  [ "$2" = FAIL ] && FAILED=1
  printf '== %-22s %-4s %s\n' "$1" "$2" "$3"
  printf '%-22s %-4s %s\n' "$1" "$2" "$3" >> "$LOGS/steps.txt"
}
elapsed() { echo $(( $(date +%s) - START )); }
remaining() { echo $(( DEADLINE - $(elapsed) )); }
section() { echo; echo "######## $* (t=$(elapsed)s)"; }
tail_log() { echo "---- last lines of $1"; tail -n "${2:-25}" "$1"; echo "----"; }

# ---- wheels carried to the machine (e.g. Liger-Kernel) --------------------------------------------------
section wheels
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$ROOT"/.whl/*.whl > "$LOGS/wheels.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    record wheels PASS "$(cd "$ROOT/.whl" && ls *.whl | tr '\n' ' ')"
  else
    tail_log "$LOGS/wheels.log"
    record wheels FAIL "pip install of .whl/*.whl failed (logs.tar.gz: wheels.log)"
  fi
else
  echo "no .whl/ folder: nothing to install"
fi

# ---- environment ----------------------------------------------------------------------------------------
section env
{
  echo "date: $(date -Is)   host: $(hostname)"
  if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  "$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}  torch {torch.__version__}  torch CUDA {torch.version.cuda}  "
      f"cuda available {torch.cuda.is_available()}  devices {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
try:
    import triton; print(f"triton {triton.__version__}")
except Exception as e:
    print(f"triton: n/a ({type(e).__name__})")
EOF
  # the peer's import (transformers, triton: ~25 s) runs beside the build; its line is printed after the build
  "$PY" - > "$LOGS/env_peers.log" 2>&1 <<'EOF' &
try:
    from importlib.metadata import version
    import liger_kernel.transformers  # noqa: F401  (imports triton)
    print(f"liger-kernel {version('liger-kernel')} imports")
except Exception as e:
    print(f"liger-kernel: n/a ({type(e).__name__}: {str(e)[:120]})")
EOF
  NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
  if [ -x "$NVCC" ]; then "$NVCC" --version | tail -n 2; else echo "nvcc: not found"; fi
  cmake --version | head -n 1
  echo "ninja $(ninja --version 2>/dev/null || echo 'not found')"
  echo "git commit: ${OPFORGE_GIT_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no .git here')}"
} 2>&1 | tee "$LOGS/env.log"
if [ "$NO_CUDA" != 1 ]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    record env PASS "$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>/dev/null)"
  else
    record env FAIL "torch sees no CUDA GPU (every CUDA test will skip)"
  fi
else
  record env PASS "GPU_CHECK_NO_CUDA=1: CPU-only run, torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi

# ---- cuBLAS headers and libraries -----------------------------------------------------------------------
CMAKE_EXTRA=()
if [ "$NO_CUDA" != 1 ]; then
  section cublas
  # shared with cuda_compile_check.sh: link torch's nvidia wheels' cuBLAS into the toolkit, or a shim
  . "$ROOT/scripts/cublas_link.sh"
  if opforge_link_cublas "$PY" "$CUDA_HOME"; then
    if [ -n "$OPFORGE_CUBLAS_SHIM" ]; then
      CMAKE_EXTRA+=("-DCMAKE_LIBRARY_PATH=$OPFORGE_CUBLAS_SHIM/lib" "-DCMAKE_CXX_FLAGS=-isystem $OPFORGE_CUBLAS_SHIM/include"
                    "-DCMAKE_CUDA_FLAGS=-isystem $OPFORGE_CUBLAS_SHIM/include")
      export LD_LIBRARY_PATH=$OPFORGE_CUBLAS_SHIM/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    record cublas PASS "$OPFORGE_CUBLAS_DETAIL"
  else
    record cublas FAIL "$OPFORGE_CUBLAS_DETAIL"
  fi
fi

# ---- configure ------------------------------------------------------------------------------------------
section configure
TORCH_PREFIX=$("$PY" -c "import torch; print(torch.utils.cmake_prefix_path)")
CMAKE_ARGS=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$TORCH_PREFIX")
if [ "$NO_CUDA" = 1 ]; then
  CMAKE_ARGS+=(-DOPFORGE_CUDA=OFF)
else
  NVCC=$(command -v nvcc || echo "$CUDA_HOME/bin/nvcc")
  CMAKE_ARGS+=(-DOPFORGE_CUDA=ON "-DCMAKE_CUDA_COMPILER=$NVCC" -DTORCH_CUDA_ARCH_LIST=9.0)
  # the CUTLASS headers of the nvidia-cutlass wheel (installed from .whl/ above), or CUTLASS_DIR
  CUTLASS_SRC=${CUTLASS_DIR:-$("$PY" -c 'import cutlass_library; print(cutlass_library.source_path)' 2>/dev/null)}
  if [ -n "$CUTLASS_SRC" ]; then
    CMAKE_ARGS+=(-DOPFORGE_CUTLASS=ON "-DCUTLASS_DIR=$CUTLASS_SRC")
  else
    CMAKE_ARGS+=(-DOPFORGE_CUTLASS=AUTO)
  fi
fi
if command -v ccache > /dev/null; then
  CMAKE_ARGS+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
CMAKE_ARGS+=("${CMAKE_EXTRA[@]}")

# GoogleTest: probe with a throw-away project, so a missing GTest never breaks the main configure.
WANT_CPP_TESTS=0
CPP_TESTS_NOTE=""
if [ "${GPU_CHECK_CPP_TESTS:-1}" = 0 ]; then
  CPP_TESTS_NOTE="GPU_CHECK_CPP_TESTS=0"
elif [ ! -f "$ROOT/tests/cpp/CMakeLists.txt" ]; then
  CPP_TESTS_NOTE="no tests/cpp/CMakeLists.txt"
else
  PROBE=$LOGS/gtest_probe
  mkdir -p "$PROBE"
  printf 'cmake_minimum_required(VERSION 3.18)\nproject(p CXX)\nfind_package(GTest)\nif(NOT GTest_FOUND)\n  message(FATAL_ERROR "GTest not found")\nendif()\n' > "$PROBE/CMakeLists.txt"
  if cmake -S "$PROBE" -B "$PROBE/build" > "$LOGS/gtest_probe.log" 2>&1 || [ -d /usr/src/googletest ]; then
    WANT_CPP_TESTS=1
  else
    CPP_TESTS_NOTE="GoogleTest not found on this machine: C++ tests skipped"
  fi
fi
CONFIGURED=0
if [ "$WANT_CPP_TESTS" = 1 ] && cmake "${CMAKE_ARGS[@]}" -DOPFORGE_BUILD_TESTS=ON > "$LOGS/configure.log" 2>&1; then
  CONFIGURED=1
  record configure PASS "$BUILD (C++ tests ON)"
else
  if [ "$WANT_CPP_TESTS" = 1 ]; then
    tail_log "$LOGS/configure.log"
    CPP_TESTS_NOTE="configure with OPFORGE_BUILD_TESTS=ON failed (configure.log); retried without C++ tests"
    WANT_CPP_TESTS=0
    record "configure C++ tests" FAIL "$CPP_TESTS_NOTE"
  fi
  if cmake "${CMAKE_ARGS[@]}" -DOPFORGE_BUILD_TESTS=OFF >> "$LOGS/configure.log" 2>&1; then
    CONFIGURED=1
    record configure PASS "$BUILD (C++ tests OFF${CPP_TESTS_NOTE:+: $CPP_TESTS_NOTE})"
  else
    tail_log "$LOGS/configure.log" 40
    record configure FAIL "cmake failed (logs.tar.gz: configure.log)"
  fi
fi
grep -E "opforge:" "$LOGS/configure.log" | grep -E "CUDA kernels|CUTLASS" | tail -n 2

# ---- build ----------------------------------------------------------------------------------------------
section build
LIB=$BUILD/libopforge.so
BUILT=0
if [ "$CONFIGURED" = 1 ]; then
  if ninja -C "$BUILD" -j "$JOBS" opforge > "$LOGS/build.log" 2>&1; then
    BUILT=1
    record build PASS "libopforge.so in $(elapsed)s since start"
  else
    grep -E "error|FAILED" "$LOGS/build.log" | head -n 30
    tail_log "$LOGS/build.log"
    record build FAIL "ninja failed (logs.tar.gz: build.log)"
  fi
  if [ "$BUILT" = 1 ] && [ "$WANT_CPP_TESTS" = 1 ]; then
    if ninja -C "$BUILD" -j "$JOBS" >> "$LOGS/build.log" 2>&1; then
      record "build C++ tests" PASS ""
    else
      tail_log "$LOGS/build.log"
      WANT_CPP_TESTS=0
      record "build C++ tests" FAIL "(logs.tar.gz: build.log)"
    fi
  fi
else
  record build SKIP "not configured"
fi

for _ in $(seq 60); do grep -q "^liger-kernel" "$LOGS/env_peers.log" 2>/dev/null && break; sleep 1; done  # env's peer import
grep -v Warning "$LOGS/env_peers.log" 2>/dev/null | tail -n 3 | tee -a "$LOGS/env.log"

# ---- compute-sanitizer beside the tests (GPU_CHECK_SANITIZER=parallel) --------------------------------------
# The coverage pass, then the tools side by side, in the background while pytest (and the later steps) run: the
# sanitized processes are slow but small, so one call fits the build, the whole suite and the four tools. The
# sanitizer section below waits for them and records each tool's verdict.
SAN_TOOLS=${GPU_CHECK_SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}
# san_quick TOOL: 1 when TOOL runs the driver's quick mode: listed in GPU_CHECK_SANITIZER_QUICK_TOOLS when that is
# set (the others then run every dtype both ways), else $SANITIZE_QUICK for every tool
san_quick() {
  if [ -n "${GPU_CHECK_SANITIZER_QUICK_TOOLS+x}" ]; then
    case " $GPU_CHECK_SANITIZER_QUICK_TOOLS " in *" $1 "*) echo 1 ;; *) echo 0 ;; esac
  else echo "${SANITIZE_QUICK:-0}"; fi
}
SAN_PIDS=()
SAN_SKIP="no CUDA build"; [ "$BUILT" = 1 ] || SAN_SKIP="no library"
# Every cap has a floor: `timeout 0` would never stop its command and a negative one is an invalid option (rc 125).
SAN_MIN_CAP=30
san_cap=$(( $(remaining) - 20 ))
if [ "${GPU_CHECK_SANITIZER:-0}" = parallel ] && [ "$BUILT" = 1 ] && [ "$NO_CUDA" != 1 ] && [ "$san_cap" -lt "$SAN_MIN_CAP" ]; then
  SAN_SKIP="no time left after the build (GPU_CHECK_DEADLINE=${DEADLINE}s)"
elif [ "${GPU_CHECK_SANITIZER:-0}" = parallel ] && [ "$BUILT" = 1 ] && [ "$NO_CUDA" != 1 ]; then
  echo "sanitizer: $SAN_TOOLS in the background (cap ${san_cap}s each, logs.tar.gz: sanitizer_<tool>.txt)"
  # the coverage pass once per mode the tools use (side by side: each mode has its own cached log)
  san_modes=$(for tool in $SAN_TOOLS; do san_quick "$tool"; done | sort -u)
  (
    for q in $san_modes; do
      OPFORGE_LIBRARY=$LIB PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} OUT=$LOGS SANITIZE_COVERAGE_ONLY=1 \
        SANITIZE_QUICK=$q timeout --kill-after=10 "$san_cap" bash scripts/sanitize.sh > "$LOGS/sanitizer_coverage_$q.txt" 2>&1 &
    done
    wait
  ) &
  cov_pid=$!
  for tool in $SAN_TOOLS; do
    (
      while kill -0 "$cov_pid" 2>/dev/null; do sleep 1; done
      cap=$(( DEADLINE - ( $(date +%s) - START ) - 20 ))
      if [ "$cap" -lt "$SAN_MIN_CAP" ]; then echo "skip $cap" > "$LOGS/sanitizer_$tool.rc"; exit 0; fi
      OPFORGE_LIBRARY=$LIB PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} OUT=$LOGS SANITIZE_QUICK=$(san_quick "$tool") \
        timeout --kill-after=10 "$cap" bash scripts/sanitize.sh "$tool" > "$LOGS/sanitizer_$tool.txt" 2>&1
      echo "$? $cap" > "$LOGS/sanitizer_$tool.rc"
    ) &
    SAN_PIDS+=($!)
  done
fi

# ---- pytest ---------------------------------------------------------------------------------------------
section pytest
junit_counts() {  # prints: total failed errors skipped cuda_skipped, and lists the CUDA skips in the log
  "$PY" - "$OUT/junit.xml" "$ALLOWED_SKIPS" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
path, allowed = sys.argv[1], re.compile(sys.argv[2]) if sys.argv[2] else None
total = failed = errors = skipped = 0
cuda_skips = []
for case in ET.parse(path).getroot().iter("testcase"):
    total += 1
    if case.find("failure") is not None: failed += 1
    if case.find("error") is not None: errors += 1
    sk = case.find("skipped")
    if sk is not None:
        skipped += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        msg = sk.get("message", "")
        if ("cuda" in name.lower() or "CUDA" in msg or "GPU" in msg) and not (allowed and allowed.search(msg)):
            cuda_skips.append(f"{name} ({msg})")
with open(path + ".cuda_skips.txt", "w") as f:
    f.write("\n".join(cuda_skips) + "\n")
print(total, failed, errors, skipped, len(cuda_skips))
EOF
}
if [ "${GPU_CHECK_PYTEST_ARGS:-}" = none ]; then
  echo "GPU_CHECK_PYTEST_ARGS=none: no pytest step"
elif [ "$BUILT" = 1 ]; then
  cap=$(( $(remaining) - 60 )); [ "$cap" -gt "$PYTEST_TIMEOUT" ] && cap=$PYTEST_TIMEOUT
  [ "$cap" -lt 30 ] && cap=30
  echo "pytest (cap ${cap}s) -> $OUT/pytest.log"
  # the arguments split as the shell splits a command line, so quoted ones stay whole (-k 'fp8 or jsd')
  eval "pytest_args=(${GPU_CHECK_PYTEST_ARGS:-tests/python})"
  OPFORGE_LIBRARY=$LIB PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} \
    timeout --kill-after=10 "$cap" "$PY" -m pytest -v -rs -p no:cacheprovider --durations=15 \
      --junitxml="$OUT/junit.xml" "${pytest_args[@]}" > "$OUT/pytest.log" 2>&1
  rc=$?
  tail -n 5 "$OUT/pytest.log"
  if [ -s "$OUT/junit.xml" ] && read -r total failed errors skipped cuda_skipped < <(junit_counts); then
    passed=$(( total - failed - errors - skipped ))
    detail="$passed passed, $failed failed, $errors errors, $skipped skipped (rc $rc)"
    if [ "$rc" = 0 ] && [ "$failed" = 0 ] && [ "$errors" = 0 ]; then record pytest PASS "$detail"
    else record pytest FAIL "$detail$([ "$rc" = 124 ] && echo ', TIMED OUT')"; fi
    if [ "$NO_CUDA" = 1 ]; then
      record "CUDA tests skipped" SKIP "$cuda_skipped (expected: GPU_CHECK_NO_CUDA=1)"
    elif [ "$cuda_skipped" = 0 ]; then
      record "CUDA tests skipped" PASS "0"
    else
      echo "CUDA tests skipped:"; head -n 20 "$OUT/junit.xml.cuda_skips.txt"
      record "CUDA tests skipped" FAIL "$cuda_skipped (list: logs.tar.gz cuda_skips.txt)"
    fi
    mv "$OUT/junit.xml.cuda_skips.txt" "$LOGS/cuda_skips.txt"
  else
    tail_log "$OUT/pytest.log" 40
    record pytest FAIL "no junit.xml (rc $rc$([ "$rc" = 124 ] && echo ', TIMED OUT'))"
  fi
else
  record pytest SKIP "no library"
fi

# ---- ctest ----------------------------------------------------------------------------------------------
section ctest
if [ "$BUILT" = 1 ] && [ "$WANT_CPP_TESTS" = 1 ]; then
  cap=$(( $(remaining) - 30 )); [ "$cap" -gt 300 ] && cap=300; [ "$cap" -lt 20 ] && cap=20
  timeout --kill-after=10 "$cap" ctest --test-dir "$BUILD" --output-on-failure -j 8 > "$LOGS/ctest.log" 2>&1
  rc=$?
  summary=$(grep -E "tests passed|No tests were found" "$LOGS/ctest.log" | tail -n 1)
  tail -n 3 "$LOGS/ctest.log"
  if [ "$rc" = 0 ] && ! grep -q "No tests were found" "$LOGS/ctest.log"; then record ctest PASS "$summary"
  else record ctest FAIL "${summary:-rc $rc} (logs.tar.gz: ctest.log)"; fi
else
  record ctest SKIP "${CPP_TESTS_NOTE:-C++ tests not built}"
fi

# ---- extra steps: GPU_CHECK_RUN ("NAME: COMMAND" lines) ---------------------------------------------------
if [ -n "${GPU_CHECK_RUN:-}" ]; then
  section run
  while IFS= read -r line; do
    [ -z "${line//[[:space:]]/}" ] && continue
    name=${line%%:*}; name=${name//[[:space:]]/}; cmd=${line#*:}
    if [ "$BUILT" != 1 ]; then record "$name" SKIP "no library"; continue; fi
    cap=$(( $(remaining) - 15 ))
    if [ "$cap" -lt 20 ]; then record "$name" SKIP "no time left (GPU_CHECK_DEADLINE=${DEADLINE}s)"; continue; fi
    echo "$name (cap ${cap}s):$cmd"
    t0=$(date +%s)
    OPFORGE_LIBRARY=$LIB PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} \
      timeout --kill-after=10 "$cap" bash -c "$cmd" > "$LOGS/run_$name.log" 2>&1 < /dev/null
    rc=$?
    tail -n "${GPU_CHECK_RUN_TAIL:-30}" "$LOGS/run_$name.log"
    if [ "$rc" = 0 ]; then record "$name" PASS "$(( $(date +%s) - t0 ))s"
    else record "$name" FAIL "rc $rc$([ "$rc" = 124 ] && echo " (timed out after ${cap}s)") (logs.tar.gz: run_$name.log)"; fi
  done <<< "$GPU_CHECK_RUN"
fi

# ---- compute-sanitizer (optional): the four tools over every opforge kernel (scripts/sanitize.sh) ---------
if [ "${GPU_CHECK_SANITIZER:-0}" = parallel ]; then
  section sanitizer
  if [ ${#SAN_PIDS[@]} = 0 ]; then
    record sanitizer SKIP "$SAN_SKIP"
  else
    wait "${SAN_PIDS[@]}" 2>/dev/null
    for tool in $SAN_TOOLS; do
      read -r rc cap < "$LOGS/sanitizer_$tool.rc" 2>/dev/null || { rc="? (no sanitizer_$tool.rc: the tool's shell died)"; cap=?; }
      if [ "$rc" = skip ]; then record "sanitizer $tool" SKIP "no time left after the coverage pass (cap ${cap}s)"; continue; fi
      tail -n 3 "$LOGS/sanitizer_$tool.txt"
      line=$(grep -E "^sanitize " "$LOGS/sanitizer_$tool.txt" | tail -n 1)
      if [ "$rc" = 0 ]; then record "sanitizer $tool" PASS "${line:-clean} (beside pytest)"
      else record "sanitizer $tool" FAIL "rc $rc$([ "$rc" = 124 ] && echo " (timed out after ${cap}s)") ${line} (logs.tar.gz: sanitize_$tool.log)"; fi
    done
  fi
elif [ "${GPU_CHECK_SANITIZER:-0}" = 1 ]; then
  section sanitizer
  if [ "$BUILT" != 1 ] || [ "$NO_CUDA" = 1 ]; then
    record sanitizer SKIP "no CUDA build"
  else
    for tool in ${GPU_CHECK_SANITIZER_TOOLS:-memcheck racecheck initcheck synccheck}; do
      cap=$(( $(remaining) - 30 )); [ "$cap" -gt 240 ] && cap=240
      if [ "$cap" -lt 30 ]; then record "sanitizer $tool" SKIP "no time left"; continue; fi
      OPFORGE_LIBRARY=$LIB PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} OUT=$LOGS SANITIZE_QUICK=$(san_quick "$tool") \
        timeout --kill-after=10 "$cap" bash scripts/sanitize.sh "$tool" > "$LOGS/sanitizer_$tool.txt" 2>&1
      rc=$?
      tail -n 3 "$LOGS/sanitizer_$tool.txt"
      line=$(grep -E "^sanitize " "$LOGS/sanitizer_$tool.txt" | tail -n 1)
      if [ "$rc" = 0 ]; then record "sanitizer $tool" PASS "${line:-clean}"
      else record "sanitizer $tool" FAIL "rc $rc$([ "$rc" = 124 ] && echo " (timed out after ${cap}s)") ${line} (logs.tar.gz: sanitize_$tool.log)"; fi
    done
  fi
fi

# ---- benchmarks -----------------------------------------------------------------------------------------
section benchmarks
BENCH_LIST=${GPU_CHECK_BENCH:-all}
if [ "$BENCH_LIST" = all ]; then
  BENCH_LIST=$(cd "$ROOT/benchmarks" 2>/dev/null && ls bench_*.py 2>/dev/null | sed 's/^bench_//; s/\.py$//' | tr '\n' ' ')
fi
[ "$BENCH_LIST" = none ] && BENCH_LIST=""
for name in ${BENCH_LIST//,/ }; do
  name=${name#bench_}; name=${name%.py}
  script=$ROOT/benchmarks/bench_$name.py
  if [ ! -f "$script" ]; then record "bench $name" FAIL "no $script"; continue; fi
  if [ "$BUILT" != 1 ]; then record "bench $name" SKIP "no library"; continue; fi
  cap=$(( $(remaining) - 15 )); [ "$cap" -gt "$BENCH_TIMEOUT" ] && cap=$BENCH_TIMEOUT
  if [ "$cap" -lt 20 ]; then record "bench $name" SKIP "no time left (GPU_CHECK_DEADLINE=${DEADLINE}s)"; continue; fi
  if [ "$NO_CUDA" = 1 ]; then dev_args=(--device cpu --quick); else dev_args=(--device cuda); fi
  echo "bench_$name (cap ${cap}s)"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  OPFORGE_LIBRARY=$LIB PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} \
    timeout --kill-after=10 "$cap" "$PY" "$script" "${dev_args[@]}" ${GPU_CHECK_BENCH_ARGS:-} > "$LOGS/bench_$name.log" 2>&1
  rc=$?
  if [ "$rc" = 0 ]; then
    sed -n '/^op  /,$p' "$LOGS/bench_$name.log" | head -n 80
    record "bench $name" PASS "$(( $(date +%s) - t0 ))s"
  else
    tail_log "$LOGS/bench_$name.log" 30
    record "bench $name" FAIL "rc $rc$([ "$rc" = 124 ] && echo " (timed out after ${cap}s)") (logs.tar.gz: bench_$name.log)"
  fi
done

# ---- collect: at most 8 files in $OUT ---------------------------------------------------------------------
section collect
mkdir -p "$LOGS/results"
NEW_RESULTS=()
if [ -d "$ROOT/benchmarks/results" ]; then
  # every CSV / PNG / TXT a step of this run wrote, in subfolders too (python -m opforge bench --out <folder>)
  while IFS= read -r f; do NEW_RESULTS+=("$f"); done < <(find "$ROOT/benchmarks/results" -type f \
      \( -name '*.csv' -o -name '*.png' -o -name '*.txt' \) -newer "$STAMP" | sort)
fi
for f in "${NEW_RESULTS[@]}"; do
  rel=${f#"$ROOT/benchmarks/results/"}
  mkdir -p "$LOGS/results/$(dirname "$rel")" && cp "$f" "$LOGS/results/$rel"
done
# Up to 4 result files straight into $OUT (CSVs first); all of them are in logs.tar.gz too.
n=0
for f in $(printf '%s\n' "${NEW_RESULTS[@]}" | grep '\.csv$') $(printf '%s\n' "${NEW_RESULTS[@]}" | grep '\.png$'); do
  [ "$n" -ge 4 ] && break
  cp "$f" "$OUT/" && n=$((n + 1))
done
echo "results of this run: ${#NEW_RESULTS[@]} file(s), $n copied to \$OUT, all in logs.tar.gz"

# ---- the table --------------------------------------------------------------------------------------------
{
  echo
  echo "opforge gpu_check: $(grep -E '^(GPU 0|python |device 0)' "$LOGS/env.log" | tr '\n' ' ')"
  echo "total time $(elapsed)s"
  printf '%-22s %-4s %s\n' STEP STATE DETAIL
  printf '%-22s %-4s %s\n' ---- ----- ------
  for i in "${!STEPS[@]}"; do printf '%-22s %-4s %s\n' "${STEPS[$i]}" "${STATES[$i]}" "${DETAILS[$i]}"; done
  if [ "$FAILED" = 0 ]; then echo "RESULT: PASS"; else echo "RESULT: FAIL"; fi
} > "$LOGS/summary.txt"
cp "$LOGS/summary.txt" "$OUT/summary.txt"
tar -C "$LOGS" -czf "$OUT/logs.tar.gz" . 2>/dev/null || echo "(could not write logs.tar.gz)"
rm -rf "$LOGS"
echo "\$OUT ($OUT): $(cd "$OUT" && ls | tr '\n' ' ')"
cat "$OUT/summary.txt"
exit "$FAILED"
