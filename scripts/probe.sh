set -x
nvidia-smi -L; python3 -c "import torch;print(torch.__version__, torch.version.cuda, torch.cuda.is_available())"; which cmake nvcc; cmake --version|head -1
ls /usr/local/cuda/include/cublas_v2.h /usr/local/cuda/lib64/libcublas.so 2>&1; python3 -c "import torch,os;print(os.path.dirname(torch.__file__))"; ls $(python3 -c "import site;print(site.getsitepackages()[0])")/nvidia 2>&1 | head; 
ls /usr/lib/x86_64-linux-gnu/libgtest* /usr/src/googletest 2>&1 | head -3; python3 -c "import liger_kernel" 2>&1 | tail -1
cmake -S . -B build/gpu -G Ninja -DCMAKE_PREFIX_PATH=$(python3 -c "import torch;print(torch.utils.cmake_prefix_path)") -DTORCH_CUDA_ARCH_LIST=9.0 2>&1 | grep -E "opforge:|Error" -A3
time ninja -C build/gpu 2>&1 | tail -3
OPFORGE_LIBRARY=$PWD/build/gpu/libopforge.so PYTHONPATH=$PWD/python python3 -m pytest -q tests/python 2>&1 | tail -3
