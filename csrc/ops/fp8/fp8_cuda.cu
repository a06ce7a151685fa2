// CUDA kernels of quantize_fp8 (and the quantization inside fp8_linear), with fp8_math.h's scalar math, so CPU and
// CUDA give the same bits:
//   rowwise     one kernel, a block per row: amax of the row (16-byte loads, a block reduction), the row's scale,
//               then the saturated cast of the row (its second read hits L1/L2);
//   tensorwise  two kernels: a grid-stride amax into one device word (atomicMax), then the cast, each block
//               computing the scale from that word. No host synchronization.
// amax is reduced as the bit patterns of |x|: for non-negative IEEE values the unsigned order is the numeric order,
// and every NaN pattern is above inf's, so the integer max propagates NaN as the recipe asks.
// The GEMMs are at::_scaled_mm (fp8.cpp: scaled_gemm). Fusing this quantization into the producers' epilogues
// (rms_norm, swiglu, GEMM) removes the separate read of the high-precision tensor; the kernels here are the
// reference those fusions are checked against.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "ops/fp8/fp8.h"
#include "ops/fp8/fp8_math.h"

namespace opforge {
namespace fp8_op {
namespace {

constexpr int kThreads = 256;

/// The accumulation type of amax (exact for the input) and the unsigned integer of its bit pattern.
template <typename scalar_t>
struct AmaxTraits {
  using acc_t = float;
  using bits_t = uint32_t;
  __device__ static bits_t bits_of_abs(scalar_t x) { return __float_as_uint(fabsf(static_cast<float>(x))); }
  __device__ static double value_of(bits_t b) { return static_cast<double>(__uint_as_float(b)); }
};
template <>
struct AmaxTraits<double> {
  using acc_t = double;
  using bits_t = unsigned long long;
  __device__ static bits_t bits_of_abs(double x) {
    return static_cast<bits_t>(__double_as_longlong(fabs(x)));
  }
  __device__ static double value_of(bits_t b) { return __longlong_as_double(static_cast<long long>(b)); }
};

template <typename bits_t>
__device__ __forceinline__ bits_t warp_max(bits_t v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const bits_t o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

/// The block's max of v (every thread gets it). smem: kThreads / 32 words.
template <typename bits_t>
__device__ __forceinline__ bits_t block_max(bits_t v, bits_t* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = warp_max(v);
  __syncthreads();  // the previous row's readers of smem are done
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = smem[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) v = smem[w] > v ? smem[w] : v;
  return v;
}

template <typename scalar_t, typename fp8_t, int VEC>
__device__ __forceinline__ void cast_vec(const scalar_t* __restrict__ x, fp8_t* __restrict__ y, float scale) {
  const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(x);
  cuda::Vec<fp8_t, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out.val[j] = fp8::saturate_cast<fp8_t>(static_cast<float>(in.val[j]), scale);
  *reinterpret_cast<cuda::Vec<fp8_t, VEC>*>(y) = out;
}

/// Rowwise: block b handles rows b, b + gridDim.x, ... of X [R, C]; VEC elements per access (C % VEC == 0).
template <typename scalar_t, typename fp8_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    quantize_rowwise_kernel(const scalar_t* __restrict__ X, fp8_t* __restrict__ Y, float* __restrict__ scale,
                            int64_t R, int64_t C) {
  using T = AmaxTraits<scalar_t>;
  using bits_t = typename T::bits_t;
  __shared__ bits_t smem[kThreads / 32];
  const int64_t nvec = C / VEC;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {  // uniform per block: barriers are safe
    const scalar_t* x = X + r * C;  // 64-bit offsets
    fp8_t* y = Y + r * C;
    bits_t m = 0;
    for (int64_t v = threadIdx.x; v < nvec; v += kThreads) {
      const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(x + v * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const bits_t b = T::bits_of_abs(in.val[j]);
        m = b > m ? b : m;
      }
    }
    m = block_max(m, smem);
    const float s = fp8::scale_of(T::value_of(m), fp8::max_of<fp8_t>());
    if (threadIdx.x == 0) scale[r] = s;
    for (int64_t v = threadIdx.x; v < nvec; v += kThreads) cast_vec<scalar_t, fp8_t, VEC>(x + v * VEC, y + v * VEC, s);
  }
}

/// Tensorwise, pass 1: atomicMax of |x|'s bit patterns over X [n] into *amax (zero-initialised).
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const scalar_t* __restrict__ X, int64_t n, typename AmaxTraits<scalar_t>::bits_t* __restrict__ amax) {
  using T = AmaxTraits<scalar_t>;
  using bits_t = typename T::bits_t;
  __shared__ bits_t smem[kThreads / 32];
  bits_t m = 0;
  const int64_t nvec = n / VEC, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < nvec; v += stride) {
    const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(X + v * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const bits_t b = T::bits_of_abs(in.val[j]);
      m = b > m ? b : m;
    }
  }
  for (int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const bits_t b = T::bits_of_abs(X[i]);  // the tail after the last full vector
    m = b > m ? b : m;
  }
  m = block_max(m, smem);
  if (threadIdx.x == 0) atomicMax(amax, m);
}

/// Tensorwise, pass 2: the scale from *amax (each block computes it; block 0 stores it), then the cast.
template <typename scalar_t, typename fp8_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    cast_tensorwise_kernel(const scalar_t* __restrict__ X, fp8_t* __restrict__ Y, int64_t n,
                           const typename AmaxTraits<scalar_t>::bits_t* __restrict__ amax, float* __restrict__ scale) {
  using T = AmaxTraits<scalar_t>;
  const float s = fp8::scale_of(T::value_of(*amax), fp8::max_of<fp8_t>());
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = s;
  const int64_t nvec = n / VEC, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < nvec; v += stride) {
    cast_vec<scalar_t, fp8_t, VEC>(X + v * VEC, Y + v * VEC, s);
  }
  for (int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    Y[i] = fp8::saturate_cast<fp8_t>(static_cast<float>(X[i]), s);
  }
}

template <typename scalar_t, typename fp8_t, int VEC>
void launch(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise) {
  const int64_t R = X.size(0), C = X.size(1), n = R * C;
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* x = X.const_data_ptr<scalar_t>();
  fp8_t* y = reinterpret_cast<fp8_t*>(data.mutable_data_ptr());
  float* s = scale.mutable_data_ptr<float>();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rowwise) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(R, sms * 16));
    quantize_rowwise_kernel<scalar_t, fp8_t, VEC><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, y, s, R, C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  using bits_t = typename AmaxTraits<scalar_t>::bits_t;
  at::Tensor amax = at::zeros({static_cast<int64_t>(sizeof(bits_t))}, X.options().dtype(at::kByte));
  bits_t* a = reinterpret_cast<bits_t*>(amax.mutable_data_ptr());
  const int64_t blocks = cuda::grid_for((n + VEC - 1) / VEC, kThreads);
  amax_kernel<scalar_t, VEC><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cast_tensorwise_kernel<scalar_t, fp8_t, VEC><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, y, n, a, s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename fp8_t>
void launch_vec(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise) {
  constexpr int kVec = cuda::vec_size<scalar_t>();
  // rows start on a vector boundary when C % VEC == 0 (rowwise); the flat tensorwise loop has a scalar tail
  const bool vectorized = cuda::is_aligned16(X.const_data_ptr()) && (!rowwise || X.size(1) % kVec == 0);
  if (vectorized) {
    launch<scalar_t, fp8_t, kVec>(X, data, scale, rowwise);
  } else {
    launch<scalar_t, fp8_t, 1>(X, data, scale, rowwise);
  }
}

}  // namespace

void quantize_rows_cuda(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data.is_contiguous());
  const c10::cuda::CUDAGuard device_guard(X.device());
  if (X.numel() == 0) {  // empty groups: amax 0, the floor's scale (as the CPU kernel)
    const float s = data.scalar_type() == at::kFloat8_e4m3fn
                        ? fp8::scale_of(0.0, fp8::max_of<c10::Float8_e4m3fn>())
                        : fp8::scale_of(0.0, fp8::max_of<c10::Float8_e5m2>());
    if (scale.numel() > 0) scale.fill_(s);
    return;
  }
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      launch_vec<scalar_t, c10::Float8_e4m3fn>(X, data, scale, rowwise);
    } else {
      launch_vec<scalar_t, c10::Float8_e5m2>(X, data, scale, rowwise);
    }
  });
}

}  // namespace fp8_op

TORCH_LIBRARY_IMPL(opforge, CUDA, m) { fp8_op::Kernels<&fp8_op::quantize_rows_cuda>::register_for(m); }

}  // namespace opforge
