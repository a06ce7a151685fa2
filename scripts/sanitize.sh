#!/usr/bin/env bash
# Runs compute-sanitizer's four tools (memcheck, racecheck, initcheck, synccheck) over every opforge CUDA
# kernel, forward and backward, every dtype, odd sizes, unaligned base pointers (tests/cuda/sanitize_driver.py),
# checking only opforge's kernels (kernel-name filter "opforge": torch's own kernels run uninstrumented).
# Each tool must run to completion with 0 errors. Needs a GPU and an opforge build (OPFORGE_LIBRARY or installed).
#
#   bash scripts/sanitize.sh [tool ...]        # default: all four;  SANITIZE_QUICK=1: fewer dtypes
# Logs: $OUT/sanitize_<tool>.log (OUT defaults to /tmp). Exit status: number of tools that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
quick=()
[ "${SANITIZE_QUICK:-0}" = 1 ] && quick=(--quick)
help=$("$CS" --help 2>&1 || true)
if grep -q -- "--kernel-name " <<<"$help"; then
  filter=(--kernel-name kns=opforge)
else
  filter=(--filter kns=opforge)
fi
export PYTORCH_NO_CUDA_MEMORY_CACHING=1   # allocations the sanitizer can see one by one
failed=0
for tool in "${tools[@]}"; do
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  log="$OUT/sanitize_$tool.log"
  t0=$SECONDS
  "$CS" --tool "$tool" "${filter[@]}" "${extra[@]}" --error-exitcode 99 --print-limit 20 \
    "$PY" tests/cuda/sanitize_driver.py "${quick[@]}" >"$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|error\(s\)|hazard" "$log" | tail -1)
  if [ $rc -eq 0 ] && grep -q "cases run" "$log"; then
    printf 'sanitize %-10s PASS  %4ds  %s\n' "$tool" $((SECONDS - t0)) "$summary"
  else
    printf 'sanitize %-10s FAIL  %4ds  rc=%d %s\n' "$tool" $((SECONDS - t0)) $rc "$summary"
    tail -25 "$log"
    failed=$((failed + 1))
  fi
done
exit $failed
