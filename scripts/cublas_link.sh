# cuBLAS headers and libraries for a CUDA toolkit that lacks them, taken from torch's nvidia wheels.
# Shared by scripts/gpu_check.sh and scripts/cuda_compile_check.sh. Source it, then:
#
#   opforge_link_cublas <python> <cuda_home> [all]
#
# "all": also when the toolkit has cuBLAS, link every header and library of the wheels that it lacks (torch's
# CMake config asks for more than cuBLAS: cuda_compile_check.sh's toolkit has only nvcc and cudart).
# Sets OPFORGE_CUBLAS_STATUS (present | linked | shim | missing) and OPFORGE_CUBLAS_DETAIL (where), and, when
# the toolkit is not writable, OPFORGE_CUBLAS_SHIM: a folder with include/ and lib/ links to pass to CMake
# (-DCMAKE_CUDA_FLAGS=-I$shim/include, -DCMAKE_LIBRARY_PATH=$shim/lib). Returns 1 only when no cuBLAS is found.
opforge_link_cublas() {
  local py=$1 cuda_home=$2 mode=${3:-} nv libdir f name
  OPFORGE_CUBLAS_SHIM=
  if [ -f "$cuda_home/include/cublas_v2.h" ] && [ "$mode" != all ]; then
    OPFORGE_CUBLAS_STATUS=present OPFORGE_CUBLAS_DETAIL="$cuda_home/include/cublas_v2.h"
    return 0
  fi
  nv=$("$py" - <<'PYEOF'
import glob, site, sys, sysconfig
paths = [sysconfig.get_paths()["purelib"], *site.getsitepackages(), site.getusersitepackages(), *sys.path]
for p in paths:
    for h in sorted(glob.glob(f"{p}/nvidia/*/include/cublas_v2.h")):
        print(h.rsplit("/include/", 1)[0]); raise SystemExit
PYEOF
)
  if [ -z "$nv" ]; then
    OPFORGE_CUBLAS_STATUS=missing OPFORGE_CUBLAS_DETAIL="no cublas_v2.h in $cuda_home nor in torch's nvidia wheels"
    return 1
  fi
  libdir=$cuda_home/lib64
  [ -d "$libdir" ] || libdir=$cuda_home/lib
  if [ -w "$cuda_home/include" ] && [ -w "$libdir" ]; then
    for f in "$nv"/include/*; do [ -e "$cuda_home/include/$(basename "$f")" ] || ln -s "$f" "$cuda_home/include/"; done
    for f in "$nv"/lib/lib*.so*; do
      name=$(basename "$f")
      [ -e "$libdir/$name" ] || ln -s "$f" "$libdir/$name"
      [ -e "$libdir/${name%%.so*}.so" ] || ln -s "$f" "$libdir/${name%%.so*}.so"
    done
    OPFORGE_CUBLAS_STATUS=linked OPFORGE_CUBLAS_DETAIL="linked from $nv into $cuda_home"
  else
    OPFORGE_CUBLAS_SHIM=/tmp/opforge-cublas-shim
    mkdir -p "$OPFORGE_CUBLAS_SHIM/include" "$OPFORGE_CUBLAS_SHIM/lib"
    for f in "$nv"/include/cublas*.h; do ln -sf "$f" "$OPFORGE_CUBLAS_SHIM/include/"; done
    for f in "$nv"/lib/libcublas*.so*; do
      name=$(basename "$f")
      ln -sf "$f" "$OPFORGE_CUBLAS_SHIM/lib/$name"
      ln -sf "$f" "$OPFORGE_CUBLAS_SHIM/lib/${name%%.so*}.so"
    done
    OPFORGE_CUBLAS_STATUS=shim OPFORGE_CUBLAS_DETAIL="$cuda_home not writable: shim $OPFORGE_CUBLAS_SHIM -> $nv"
  fi
}
