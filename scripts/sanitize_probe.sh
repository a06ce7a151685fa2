#!/usr/bin/env bash
# A probe of the sanitizers themselves (its H200 results: benchmarks/results/sanitizer/probe_h200.txt), run on the GPU
# machine as a step of scripts/gpu_check.sh (GPU_CHECK_RUN='probe: bash scripts/sanitize_probe.sh'): side by side
# racecheck over the torch-only control cases, racecheck quick in the driver's --vendor-safe mode over every family,
# and initcheck over the control cases and the _grouped_mm path (the driver's family grouped_mm_epilogue). Results in
# $OUT/probe.tar.gz; at most ~6 minutes.
P=/tmp/probe; mkdir -p $P/rc_ctl $P/rc_quick $P/ic
( OUT=$P/rc_quick SANITIZE_QUICK=1 SANITIZE_RESUMES=8 timeout ${PROBE_CAP:-330} bash scripts/sanitize.sh racecheck > $P/rc_quick.txt 2>&1 ) &
( OUT=$P/ic SANITIZE_ONLY=control_torch/bfloat16/aligned,control_torch/float32/aligned,grouped_mm_epilogue/bfloat16/aligned timeout ${PROBE_CAP:-330} bash scripts/sanitize.sh initcheck > $P/ic.txt 2>&1 ) &
( OUT=$P/rc_ctl SANITIZE_ONLY=control_torch/ timeout ${PROBE_CAP:-330} bash scripts/sanitize.sh racecheck > $P/rc_ctl.txt 2>&1 ) &
wait
for f in $P/*.txt; do echo "=== $f"; tail -25 $f; done
grep -h "^case .*: \(ok\|FAILED\|begin\)" $P/rc_ctl/*.log | head -40
grep -h "^case .*: \(FAILED\|CUDA\)" $P/rc_quick/*.log | head -40
tar czf $OUT/probe.tar.gz -C /tmp probe
