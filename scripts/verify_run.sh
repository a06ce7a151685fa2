# Short GPU call: build + linear/swiglu CUDA suites (gpu_check), then every bad-input test.
set -u
export GPU_CHECK_BENCH=none GPU_CHECK_PYTEST_TIMEOUT=150
export GPU_CHECK_PYTEST_ARGS="tests/python/test_linear.py tests/python/test_swiglu.py -n 12 -q"
bash scripts/gpu_check.sh > $OUT/gpu_check.out 2>&1
tail -9 $OUT/gpu_check.out; grep -E "^FAILED|crashed" $OUT/pytest.log | head -10
export PYTHONPATH=$PWD/python OPFORGE_LIBRARY=$PWD/build/gpu/libopforge.so
timeout 100 python3 -m pytest -q -n 12 tests/python/test_elementwise.py tests/python/test_rms_norm.py -k bad 2>&1 | tail -4
ldd build/gpu/libopforge.so | grep -c stdc
