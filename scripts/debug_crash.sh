# One-off: locate the crash seen on the GPU machine when an opforge check message formats a number.
set -x
export PYTHONPATH=$PWD/python
cmake -S . -B build/a -G Ninja -DCMAKE_PREFIX_PATH=$(python3 -c "import torch;print(torch.utils.cmake_prefix_path)") -DTORCH_CUDA_ARCH_LIST=9.0 -DOPFORGE_CUDA=OFF > /dev/null 2>&1
ninja -C build/a > /dev/null 2>&1
cat > /tmp/repro.py <<'PY'
import torch, opforge
for f in [lambda: opforge.sigmoid(torch.ones(2, dtype=torch.int32)), lambda: opforge.linear(torch.randn(4, 8), torch.randn(8))]:
    try: f()
    except Exception as e: print("OK raised", type(e).__name__, str(e)[:90], flush=True)
PY
g++ --version | head -1; python3 -c "import torch; print(torch.__config__.show())" | grep -i -E "gcc|abi|c\+\+" | head -5
for v in a; do echo "== build $v"; OPFORGE_LIBRARY=$PWD/build/$v/libopforge.so timeout 60 python3 /tmp/repro.py; echo "rc=$?"; done
OPFORGE_LIBRARY=$PWD/build/a/libopforge.so timeout 120 cuda-gdb -batch -ex run -ex 'bt 7' -ex 'info sharedlibrary' --args python3 /tmp/repro.py 2>&1 | grep -v "^\[New\|^\[Thread" | grep -E "^#|stdc|libc10|libgcc|opforge" | cut -c1-250 | head -30; ldd build/a/libopforge.so | head; cat /proc/cpuinfo | grep -m1 flags | tr ' ' '\n' | grep -c avx2
