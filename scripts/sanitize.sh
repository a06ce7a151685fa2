#!/usr/bin/env bash
# Runs compute-sanitizer's four tools (memcheck, racecheck, initcheck, synccheck) over every opforge CUDA
# kernel, forward and backward (tests/cuda/sanitize_driver.py: every op family, every dtype, odd sizes,
# unaligned base pointers, every run-time knob / kernel path; SANITIZE_QUICK=1: float32 aligned + bfloat16
# unaligned, fewer shapes). memcheck, racecheck, synccheck check only opforge's own kernels: --kernel-name
# kns=opforge (every __global__ in csrc/ lives in namespace opforge; the driver's coverage pass checks that each one
# is launched, under a name the filter matches), and for racecheck also --kernel-name-exclude of cuBLAS's kernel
# names, so no vendor GEMM is ever instrumented; torch's and cuBLAS's kernels run uninstrumented.
# initcheck runs WITHOUT the kernel filter: a kernel the filter leaves out is not instrumented, so initcheck never
# sees its stores, and every byte it wrote reads as uninitialized to the next instrumented kernel. That made the
# 212,799 "Uninitialized __global__ memory read" errors of the first H200 run, all in map_unary_kernel /
# map_binary_kernel (core/map_cuda.cuh) reading linear's cuBLAS GEMM output (the separate activation pass): false
# positives. Unfiltered, every kernel (cuBLAS's, torch's) is instrumented and tracked (slower); initcheck's errors
# are then attributed by the kernel each report names: an error in an opforge kernel counts (FAIL), one in a
# vendor kernel is listed but does not fail the run (not our code; the driver's inputs are all initialized), and
# errors the log does not show (past --print-limit; 0 = print all, the default here) cannot be attributed and count
# as ours. Errors inside the torch-only control cases are counted apart; the summary lists errors by case and kernel.
# (H200, 2026-12-01: 150,928 errors, the 20,000 printed all reads of torch's bf16 add kernel in linear/float32/aligned,
# the case that runs the GEMV knob variants in bfloat16 and accumulates x's gradient over two uses.)
# racecheck on the H200: in two runs the sanitizer itself failed ("Internal Sanitizer Error: The Sanitizer failed to
# handle a hardware exception", once in fake_quant_linear/bfloat16/unaligned, once in linear/float32/aligned's
# backward right after the autograd thread's first cuBLAS call), and every later case then died with "illegal
# memory access" (a lost context), while memcheck passed the same cases. So: the driver runs backward in its own
# thread and stops at a lost context (this script records the case as not checked and resumes after it), the
# driver's first cases (control_torch/*) run torch's own ops alone (what fails there is not opforge's), and
# racecheck runs with its wgmma / bulk-copy checks off (SANITIZE_RACECHECK_VENDOR_CHECKS=1: on), see tool_opts.
# A probe on the H200 (2026-12-01, benchmarks/results/sanitizer/probe_h200.txt) then showed that racecheck dies in
# every 16-bit GEMM of cuBLAS/CUTLASS on 16-byte aligned operands, torch's own included (control_torch/float16 and
# bfloat16 aligned), and in none on unaligned ones or in float32/float64. So racecheck runs the driver's
# --vendor-safe mode (SANITIZE_VENDOR_SAFE=0: off): the 16-bit aligned cases of the GEMM families are not run (their
# unaligned cases are; opforge's vector paths in them read buffers of their own, aligned either way), float32 cases
# launch no 16-bit vendor GEMM, and the coverage pass runs in the same mode.
# Needs a GPU and an opforge build (OPFORGE_LIBRARY or installed).
#
#   bash scripts/sanitize.sh [tool ...]        # default: all four
#   SANITIZE_COVERAGE_ONLY=1 bash scripts/sanitize.sh   # step 1 alone (its log is then reused by later runs)
#
# Per tool:
#   1. coverage (no sanitizer, once per build and mode, cached in $OUT/sanitize_coverage_<mode>.log): which
#      opforge kernels the driver launches and how often; a kernel of csrc/ never launched is a FAIL;
#   2. the sanitized run, logged to $OUT/sanitize_<tool>.log. If the sanitizer itself dies inside a case
#      ("Internal Sanitizer Error", a crash, no "done" line), that case is recorded as NOT CHECKED and the run
#      resumes after it (at most SANITIZE_RESUMES times, default 3: logs sanitize_<tool>_resume<i>.log);
#   3. one final line, which scripts/gpu_check.sh greps:
#        sanitize <tool>: PASS|FAIL|PARTIAL N errors, K kernels, M launches, T s[; not checked: <case> ...]
#      (PARTIAL: no error, but SANITIZE_ONLY limited the cases)
#      N: the sanitizer's error count (memcheck/synccheck: ERROR SUMMARY; initcheck: the errors in opforge
#      kernels plus those not printed, see above, with "V in vendor kernels (not counted)" appended; racecheck:
#      every hazard reported, errors and warnings); K, M: opforge kernels and their launches in the coverage pass (the
#      sanitized run executes the same cases). PASS: 0 errors, every case checked, every kernel covered.
# Memory: memcheck and initcheck run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (each allocation its own, so an
# out-of-bounds or uninitialized access is not hidden inside a cached block); racecheck and synccheck (shared
# memory, barriers) keep the caching allocator, which is much faster under the sanitizer.
# Exit status: number of tools that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
DRIVER=tests/cuda/sanitize_driver.py
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
quick=()
only=()
# SANITIZE_ONLY=<ids or prefixes/>: only those driver cases (e.g. control_torch/ to probe the sanitizer alone); the
# coverage pass still runs every case, so a partial run reports FAIL for the kernels it did not check
[ -n "${SANITIZE_ONLY:-}" ] && only=(--only "$SANITIZE_ONLY")
mode=full
[ "${SANITIZE_QUICK:-0}" = 1 ] && quick=(--quick) && mode=quick
export CUDA_MODULE_LOADING=LAZY   # only the kernels that run are loaded (and patched)
mkdir -p "$OUT"

help=$("$CS" --help 2>&1 || true)
has_opt() { grep -q -- "$1" <<<"$help"; }
if has_opt "--kernel-name "; then
  filter=(--kernel-name kns=opforge)
  if grep -q "regex" <<<"$help"; then
    exclude_vendor=(--kernel-name-exclude "regex=gemm|gemv|nvjet|cublas|cutlass|xmma|splitK|cudnn")
  else
    exclude_vendor=(--kernel-name-exclude kns=gemm)
  fi
else  # older compute-sanitizer
  filter=(--filter kns=opforge)
  exclude_vendor=()
fi

# ---- 1. coverage (no sanitizer) ---------------------------------------------------------------------------
lib=${OPFORGE_LIBRARY:-$("$PY" -c "import opforge; print(opforge.library_path)" 2>/dev/null | tail -1)}
# coverage [--vendor-safe]: the coverage pass of this mode (cached per build, driver, mode and flag); sets cov_log,
# cov_rc, cov_line, kernels, launches
coverage() {
  local tag=$mode${1:+-vendor-safe}
  local stamp="$lib $(stat -c %Y "$lib" 2>/dev/null) $(stat -c %Y "$DRIVER") $tag"
  cov_log="$OUT/sanitize_coverage_$tag.log"
  if [ ! -f "$cov_log" ] || [ "$(head -1 "$cov_log")" != "stamp: $stamp" ]; then
    { echo "stamp: $stamp"; "$PY" "$DRIVER" "${quick[@]}" "$@" --coverage --tool coverage 2>&1; echo "coverage rc $?"; } >"$cov_log"
  fi
  cov_rc=$(sed -n 's/^coverage rc //p' "$cov_log" | tail -1)
  cov_line=$(grep -E "^coverage: [0-9]+ kernels" "$cov_log" | tail -1)
  kernels=$(sed -E 's/^coverage: ([0-9]+) kernels, ([0-9]+) launches.*/\1/' <<<"$cov_line")
  launches=$(sed -E 's/^coverage: ([0-9]+) kernels, ([0-9]+) launches.*/\2/' <<<"$cov_line")
  [ -n "$kernels" ] || kernels="?"
  [ -n "$launches" ] || launches="?"
  if [ "${cov_rc:-1}" != 0 ]; then
    echo "sanitize coverage${1:+ ($1)}: FAIL (rc ${cov_rc:-?}; $cov_log):"
    grep -E "MISSING|FILTER|FAILED|Error" "$cov_log" | head -20
  fi
}
coverage

# SANITIZE_COVERAGE_ONLY=1: the coverage pass alone (scripts/gpu_check.sh runs it once before starting the tools
# side by side, which then share its cached log)
if [ "${SANITIZE_COVERAGE_ONLY:-0}" = 1 ]; then
  echo "sanitize coverage: ${cov_line:-no coverage line} (rc ${cov_rc:-?})"
  [ "${cov_rc:-1}" = 0 ]; exit $?
fi

# ---- 2. the sanitized runs ----------------------------------------------------------------------------------
# errors_in LOG TOOL: the error count the sanitizer reported in LOG (empty when it printed no summary)
errors_in() {
  if [ "$2" = racecheck ]; then
    sed -nE 's/.*RACECHECK SUMMARY: ([0-9]+) hazards? displayed \(([0-9]+) errors?, ([0-9]+) warnings?\).*/\2 \3/p' "$1" \
      | tail -1 | awk '{print $1 + $2}'
  else
    sed -nE 's/.*ERROR SUMMARY: ([0-9]+) errors?.*/\1/p' "$1" | tail -1
  fi
}

# An initcheck report is its header line ("Uninitialized __global__ memory read ...", "Host API memory access error
# ...") and the lines up to the next blank "=========" line: "at <function>" (possibly an inlined helper such as
# c10::BFloat16::operator float) and "Device Frame: <kernel>" lines. A report is opforge's when any of its lines
# names an opforge function (the kernel is often only in a Device Frame); a host API report (a cudaMemcpy reading
# device memory no kernel was seen writing) names no kernel and counts as unattributed.
# initcheck_reports LOG: one line per printed report, "<case>|<class>|<where>" (class: control = inside the driver's
# torch-only control cases (control_torch/*: torch's and cuBLAS's kernels alone; not opforge's), ours, vendor, or
# host = a host API report naming no kernel; where: the opforge kernel it names, else its "at" function, else
# "host API (cudaMemcpy)"), then "summary||<ERROR SUMMARY count>"
initcheck_reports() {
  awk 'function fname(line) { sub(/^=========  +(at |Device Frame: )/, "", line); gsub(/<unnamed>::/, "", line)
                              sub(/\(.*/, "", line); sub(/<.*/, "", line); return line }
       function close_report() {
         if (!open) return
         cls = cs ~ /^control_torch\// ? "control" : (cs ~ /^grouped_mm_epilogue\// ? "tma" : \
               (ok != "" ? "ours" : (at != "" ? "vendor" : "host")))
         print cs "|" cls "|" (ok != "" ? ok : (at != "" ? at : "host API (cudaMemcpy)")); open = 0 }
       /^case [^ ]+: begin$/ {close_report(); cs = $2; sub(/:$/, "", cs); next}
       /^========= [A-Z][a-z]+.*(memory|access)/ && !/SUMMARY/ {close_report(); open = 1; ok = ""; at = ""; next}
       open && /^=========  +(at |Device Frame:)/ {f = fname($0); if (at == "") at = f; if ($0 ~ /opforge/ && ok == "") ok = f; next}
       open && /^========= *$/ {close_report(); next}
       /ERROR SUMMARY: [0-9]+ error/ {close_report(); match($0, /ERROR SUMMARY: [0-9]+/); total = substr($0, RSTART + 15, RLENGTH - 15) + 0}
       END {close_report(); print "summary||" total + 0}' "$1"
}

# initcheck_split LOG: "OURS VENDOR UNPRINTED CONTROL TMA": reports naming opforge, those naming only other kernels,
# ERROR SUMMARY minus the printed ones plus the host API reports (unattributed: they count as ours), control's, and
# those of the grouped_mm_epilogue cases (opforge's scatter_rows_kernel and torch's copies reading torch._grouped_mm's
# output, whose CUTLASS TMA stores initcheck does not track: the control case shows torch's own add reading every
# element of such an output as uninitialized; counted apart, not as errors; memcheck checks these cases in full)
initcheck_split() {
  initcheck_reports "$1" | awk -F'|' '$1 == "summary" {total = $3; next} {n[$2]++}
    END {un = total - n["ours"] - n["vendor"] - n["control"] - n["tma"]; if (un < 0) un = 0
         print n["ours"] + 0, n["vendor"] + 0, un, n["control"] + 0, n["tma"] + 0}'
}

# initcheck_by_case LOG: "<errors> <case> <where>" per (case, where) of LOG's reports, most first
initcheck_by_case() {
  initcheck_reports "$1" | awk -F'|' '$1 != "summary" {n[$1 " " $3]++} END {for (x in n) print n[x], x}' | sort -rn | head -12
}

failed=0
for tool in "${tools[@]}"; do
  t0=$SECONDS
  use_exclude=1
  # tool_opts: the sanitizer's options for $tool (racecheck: the vendor exclude filter while use_exclude=1)
  tool_opts() {
    opts=(--tool "$tool")
    # initcheck: no kernel filter (see the top); every error printed up to 20000, so each can be attributed
    if [ "$tool" = initcheck ]; then opts+=(--print-limit "${SANITIZE_INITCHECK_PRINT_LIMIT:-0}")
    else opts+=("${filter[@]}" --print-limit 50); fi
    opts+=(--error-exitcode 99 --show-backtrace device)
    case "$tool" in
      memcheck)  opts+=(--leak-check no) ;;
      racecheck) [ "$use_exclude" = 1 ] && opts+=("${exclude_vendor[@]}")
                 has_opt "--racecheck-report" && opts+=(--racecheck-report hazard)
                 # opforge's kernels use neither wgmma nor cp.async.bulk (grep csrc); cuBLAS's Hopper kernels do, and
                 # racecheck died with "failed to handle a hardware exception" in linear's backward on the H200
                 # (2026-12-01): its wgmma / bulk-copy checks off, which cannot hide a hazard in an opforge kernel
                 if [ "${SANITIZE_RACECHECK_VENDOR_CHECKS:-0}" != 1 ]; then
                   has_opt "--check-warpgroup-mma" && opts+=(--check-warpgroup-mma no)
                   has_opt "--check-bulk-copy" && opts+=(--check-bulk-copy no)
                 fi ;;
    esac
  }
  env_cache=()
  case "$tool" in memcheck|initcheck) env_cache=(PYTORCH_NO_CUDA_MEMORY_CACHING=1) ;; esac
  # racecheck: the driver's --vendor-safe mode (its float32/float64 cases launch no 16-bit vendor GEMM, in which
  # racecheck's process dies on the H200; SANITIZE_VENDOR_SAFE=0: off), with its own coverage pass
  vsafe=()
  if [ "$tool" = racecheck ] && [ "${SANITIZE_VENDOR_SAFE:-1}" = 1 ]; then vsafe=(--vendor-safe); coverage --vendor-safe
  else coverage; fi
  errors=0; vendor_errors=0; control_errors=0; tma_errors=0; no_summary=0; not_checked=(); start=(); finished=0
  rm -f "$OUT/sanitize_${tool}_resume"*.log
  # SANITIZE_RESUMES (default 3): resumes after a crash in an opforge case; a crash in a torch-only control case
  # (racecheck on the H200 dies in torch's own 16-bit cuBLAS GEMMs) is recorded apart and does not use them up
  max_resumes=${SANITIZE_RESUMES:-3}
  control_crashes=()
  for ((attempt = 0; attempt <= max_resumes + ${#control_crashes[@]} && attempt < 24; attempt++)); do
    log="$OUT/sanitize_$tool.log"
    [ $attempt -gt 0 ] && log="$OUT/sanitize_${tool}_resume$attempt.log"
    tool_opts
    env "${env_cache[@]}" "$CS" "${opts[@]}" "$PY" "$DRIVER" "${quick[@]}" "${vsafe[@]}" "${only[@]}" --tool "$tool" \
      "${start[@]}" >"$log" 2>&1
    rc=$?
    n=$(errors_in "$log" "$tool")
    if [ -n "$n" ] && [ "$tool" = initcheck ]; then
      read -r ours vendor unprinted control tma < <(initcheck_split "$log")
      errors=$((errors + ours + unprinted)); vendor_errors=$((vendor_errors + vendor))
      control_errors=$((control_errors + control)); tma_errors=$((tma_errors + tma))
    elif [ -n "$n" ] && ! grep "^case " "$log" | grep -qv "^case control_torch/"; then
      control_errors=$((control_errors + n))  # a run of control cases only: its errors are torch's or the sanitizer's
    elif [ -n "$n" ]; then errors=$((errors + n)); else no_summary=1; fi
    if grep -q "^sanitize_driver: done" "$log"; then finished=1; [ $rc -eq 0 ] || [ $rc -eq 99 ] || echo "sanitize $tool: driver rc $rc ($log)"; break; fi
    # died inside a case: the last case that began and did not end
    # (or the case after whose failure the driver stopped: "CUDA context lost")
    crashed=$(awk '/^case .*: begin$/ {c=$2} /^case .*: (ok|FAILED)/ {if ($2 == c) c=""} /^case .*: CUDA context lost/ {c=$2}
                   END {sub(/:$/, "", c); print c}' "$log")
    reason=$(grep -m1 -oE "Internal Sanitizer Error.*|Segmentation fault|Aborted|Killed" "$log" || echo "rc $rc")
    echo "sanitize $tool: the sanitized process died (${reason}) in case '${crashed:-startup}' ($log)"
    tail -15 "$log"
    if [ -z "$crashed" ]; then
      # died before the first case: with the vendor exclude filter (racecheck), try once without it, in case
      # this compute-sanitizer refuses the include and exclude filters together
      if [ "$tool" = racecheck ] && [ "$use_exclude" = 1 ] && [ ${#exclude_vendor[@]} -gt 0 ] && ! grep -q "^case " "$log"; then
        echo "sanitize $tool: retrying without ${exclude_vendor[*]}"
        use_exclude=0; no_summary=0; errors=0; continue
      fi
      break
    fi
    case "$crashed" in
      control_torch/*) control_crashes+=("$crashed") ;;
      *) not_checked+=("$crashed") ;;
    esac
    start=(--start-after "$crashed")
  done
  secs=$((SECONDS - t0))
  status=PASS
  [ "$finished" = 1 ] && [ "$errors" = 0 ] && [ ${#not_checked[@]} = 0 ] && [ "${cov_rc:-1}" = 0 ] || status=FAIL
  # a Python-level failure of an opforge case fails the tool (a control case that the sanitizer killed does not)
  grep "^case .*: FAILED" "$OUT"/sanitize_"$tool"*.log 2>/dev/null | grep -qv "^case control_torch/" && status=FAIL
  extra=""
  [ ${#control_crashes[@]} -gt 0 ] && extra="; the sanitizer died in torch-only control case(s): ${control_crashes[*]}"
  [ ${#not_checked[@]} -gt 0 ] && extra="; not checked: ${not_checked[*]}"
  [ "$finished" = 1 ] || extra="$extra; did not finish"
  vs=$(grep -h -m1 -oE "vendor-safe: [0-9]+ 16-bit cases with vendor GEMMs" "$OUT/sanitize_$tool.log" 2>/dev/null | head -1)
  [ -n "$vs" ] && extra="$extra; $vs not run (racecheck dies in 16-bit aligned cuBLAS/CUTLASS GEMMs, see the control cases)"
  if [ ${#only[@]} -gt 0 ]; then extra="$extra; partial run (SANITIZE_ONLY=$SANITIZE_ONLY)"; [ "$status" = PASS ] && status=PARTIAL; fi
  [ "$no_summary" = 1 ] && extra="$extra; a run printed no error summary"
  [ "${cov_rc:-1}" = 0 ] || extra="$extra; coverage FAIL ($cov_log)"
  [ "$tool" = initcheck ] && extra="$extra; $vendor_errors in vendor kernels, $control_errors in the torch-only control cases, $tma_errors in grouped_mm_epilogue cases (reads of torch._grouped_mm's TMA-stored output) (not counted)"
  [ "$tool" != initcheck ] && [ "$control_errors" -gt 0 ] && extra="$extra; $control_errors in runs of torch-only control cases (not counted)"
  if [ "$tool" = initcheck ] && [ $((vendor_errors + control_errors + tma_errors)) -gt 0 ]; then
    echo "sanitize initcheck: errors by case and kernel (control_torch/*: torch's own ops alone):"
    for f in "$OUT"/sanitize_initcheck*.log; do initcheck_by_case "$f"; done | sort -rn | head -12 | sed 's/^/  /'
  fi
  if [ "$status" = FAIL ]; then
    grep -hE "^=========  *(Invalid|Uninitialized|Race|Error|Barrier|.*hazard)" "$OUT"/sanitize_"$tool"*.log | grep -v SUMMARY | sort | uniq -c | sort -rn | head -10
    failed=$((failed + 1))
  fi
  echo "sanitize $tool: $status $errors errors, $kernels kernels, $launches launches, ${secs} s$extra"
done
exit $failed
