# One GPU call: the full check (build, CUDA tests, rms_norm benchmark), then tuning probes:
# rms_norm with MAXV=2 (a second build) and the GEMV instantiations.
set -u
R=$PWD
( cmake -S . -B build/gpu2 -G Ninja -DCMAKE_PREFIX_PATH=$(python3 -c "import torch;print(torch.utils.cmake_prefix_path)") \
    -DTORCH_CUDA_ARCH_LIST=9.0 -DCMAKE_CUDA_FLAGS=-DOPFORGE_RMS_MAXV=2 > /dev/null 2>&1 && sleep 100 && ninja -C build/gpu2 -j6 > $OUT/gpu2_build.log 2>&1 ) &
GPU_CHECK_BENCH="rms_norm" GPU_CHECK_PYTEST_TIMEOUT=280 GPU_CHECK_PYTEST_ARGS="tests/python -n 8 -q" bash scripts/gpu_check.sh > $OUT/gpu_check.out 2>&1
tail -14 $OUT/gpu_check.out
grep -o "static-lib[a-z+]*" build/gpu/build.ninja | sort | uniq -c; ldd build/gpu/libopforge.so | grep -c stdc
wait
export PYTHONPATH=/tmp/site:$R/python
echo "== rms_norm MAXV=2"; OPFORGE_LIBRARY=$R/build/gpu2/libopforge.so timeout 100 python3 benchmarks/bench_rms_norm.py --no-compile --dtypes bf16 --csv /tmp/maxv2.csv > $OUT/rms_maxv2.txt 2>&1; tail -30 $OUT/rms_maxv2.txt
for c in 8,4 4,4 8,2 4,8 16,2; do OPFORGE_GEMV_CONFIG=$c OPFORGE_LIBRARY=$R/build/gpu/libopforge.so timeout 60 python3 benchmarks/probe_gemv.py 2>&1 | grep -v "^ *(.*float32"; done
