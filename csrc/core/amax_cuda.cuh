// amax = max |y| of a kernel's output, reduced as the kernel stores y (the producers' side of FP8 tensorwise
// current scaling: rms_norm, fused_add_rms_norm and swiglu_packed's *_amax ops hand it to the FP8 GEMM that reads y).
//
// The value is reduced as the unsigned bit pattern of |float(y)| (|double(y)| for float64): for non-negative IEEE
// values the unsigned order is the numeric order, and every NaN pattern sorts above inf's, so the integer max is NaN
// when any stored value is NaN, else inf when any is inf, else the largest magnitude; 0 (the zeroed word) for an
// empty output. The word is zeroed by a cudaMemsetAsync on the current stream (no kernel launch) and is then the
// bits of the float32 (float64) result, i.e. the amax tensor itself.
//
//   AmaxBits<T>                 bits_t (uint32_t, or unsigned long long for double) and bits_of_abs(y)
//   amax_fold(m, y)             a thread's running max over the values it stores
//   warp_amax_atomic(m, amax)   the warp's max (all 32 lanes active), one atomicMax by lane 0 where it can raise
//                               *amax (a relaxed L2 read first skips the atomics that would not change it)
//   block_amax_atomic(m, amax)  the same over a 1-D block whose threads all reach the call (one atomicMax)
//   zeroed_amax_tensor(like)    the [1] float32 (float64) amax tensor on like's device, zeroed
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "core/amax.h"

namespace opforge {
namespace cuda {

/// The bits type of amax for an output of T, and the bit pattern of |y| as the amax's dtype (float32 for
/// float32/float16/bfloat16, float64 for float64) holds it.
template <typename T>
struct AmaxBits {
  using bits_t = uint32_t;
  __device__ __forceinline__ static bits_t bits_of_abs(T y) { return __float_as_uint(fabsf(static_cast<float>(y))); }
};
template <>
struct AmaxBits<double> {
  using bits_t = unsigned long long;
  __device__ __forceinline__ static bits_t bits_of_abs(double y) {
    return static_cast<bits_t>(__double_as_longlong(fabs(y)));
  }
};

/// m = max(m, bits of |y|): a thread's running amax over the values (as stored, in T) it writes.
template <typename T>
__device__ __forceinline__ void amax_fold(typename AmaxBits<T>::bits_t& m, T y) {
  const typename AmaxBits<T>::bits_t b = AmaxBits<T>::bits_of_abs(y);
  m = b > m ? b : m;
}

/// The max of v over the 32 lanes of the warp (all lanes active), in every lane.
template <typename bits_t>
__device__ __forceinline__ bits_t warp_max_bits(bits_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const bits_t u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

/// atomicMax(amax, m) unless *amax (read from L2) is already >= m: the word only grows, so a skipped atomic could not
/// have changed it, and most of the blocks of a large output skip theirs.
template <typename bits_t>
__device__ __forceinline__ void raise_amax(bits_t* amax, bits_t m) {
  if (m > __ldcg(amax)) atomicMax(amax, m);
}

/// The warp's max of m into *amax, by lane 0. Every lane of the warp must call it (whole warps only).
template <typename bits_t>
__device__ __forceinline__ void warp_amax_atomic(bits_t m, bits_t* amax) {
  m = warp_max_bits(m);
  if ((threadIdx.x & 31) == 0) raise_amax(amax, m);
}

/// The block's max of m into *amax, one atomicMax by thread 0 at most: a 1-D block (blockDim.x a multiple of 32, at
/// most 1024) every thread of which calls it; smem: 32 words of shared memory, not in use across the call.
template <typename bits_t>
__device__ __forceinline__ void block_amax_atomic(bits_t m, bits_t* amax, bits_t* smem) {
  m = warp_max_bits(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if (lane == 0) smem[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < nwarps; ++w) m = smem[w] > m ? smem[w] : m;
    raise_amax(amax, m);
  }
}

/// The amax output of a producer of `like`'s dtype: shape [1], float32 (float64 for float64), on like's device,
/// zeroed by a memset on the current stream (the value of an empty output).
inline at::Tensor zeroed_amax_tensor(const at::Tensor& like) {
  at::Tensor amax = empty_amax(like);
  C10_CUDA_CHECK(cudaMemsetAsync(amax.mutable_data_ptr(), 0, static_cast<size_t>(amax.nbytes()),
                                 at::cuda::getCurrentCUDAStream()));
  return amax;
}

}  // namespace cuda
}  // namespace opforge
