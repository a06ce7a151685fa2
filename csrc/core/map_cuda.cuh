// Generic elementwise CUDA kernels over flat contiguous arrays: 16-byte vector loads and stores
// (when every pointer is 16-byte aligned), a scalar tail, fp32 math for float16/bfloat16, a grid-stride
// loop with 64-bit indices. Each launcher does: device guard, current stream, launch, launch check;
// empty inputs launch nothing.
#pragma once

#include <ATen/OpMathType.h>

#include "core/cuda_utils.cuh"

namespace opforge {
namespace cuda {

constexpr int kMapThreads = 256;

// out[i] = op(a[i]) for i in [0, n). VEC elements per access (1 when a pointer is not 16-byte aligned).
template <int VEC, typename scalar_t, typename Op>
__global__ void map_unary_kernel(const scalar_t* __restrict__ a,  // [n]
                                 scalar_t* __restrict__ out,      // [n]
                                 int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = first; v < nvec; v += stride) {
    const Vec<scalar_t, VEC> x = reinterpret_cast<const Vec<scalar_t, VEC>*>(a)[v];
    Vec<scalar_t, VEC> y;
#pragma unroll
    for (int k = 0; k < VEC; ++k) y.val[k] = static_cast<scalar_t>(op(static_cast<opmath_t>(x.val[k])));
    reinterpret_cast<Vec<scalar_t, VEC>*>(out)[v] = y;
  }
  for (int64_t i = nvec * VEC + first; i < n; i += stride)
    out[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i])));
}

// out[i] = op(a[i], b[i mod period]) for i in [0, n); period == n means b is as long as a.
template <int VEC, typename scalar_t, typename Op>
__global__ void map_binary_kernel(const scalar_t* __restrict__ a,  // [n]
                                  const scalar_t* __restrict__ b,  // [period]
                                  scalar_t* __restrict__ out,      // [n]
                                  int64_t n, int64_t period, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = first; v < nvec; v += stride) {
    const int64_t i = v * VEC;
    const int64_t j = period == n ? i : i % period;  // period % VEC == 0 when VEC > 1
    const Vec<scalar_t, VEC> x = reinterpret_cast<const Vec<scalar_t, VEC>*>(a)[v];
    const Vec<scalar_t, VEC> c = *reinterpret_cast<const Vec<scalar_t, VEC>*>(b + j);
    Vec<scalar_t, VEC> y;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      y.val[k] = static_cast<scalar_t>(op(static_cast<opmath_t>(x.val[k]), static_cast<opmath_t>(c.val[k])));
    reinterpret_cast<Vec<scalar_t, VEC>*>(out)[v] = y;
  }
  for (int64_t i = nvec * VEC + first; i < n; i += stride)
    out[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[period == n ? i : i % period])));
}

/// Launches out[i] = op(a[i]) over A.numel() elements.
template <typename scalar_t, typename Op>
void launch_unary(const at::Tensor& A, at::Tensor& Out, Op op) {
  const int64_t n = A.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(A.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  constexpr int VEC = vec_size<scalar_t>();
  if (is_aligned16(a) && is_aligned16(out)) {
    map_unary_kernel<VEC><<<grid_for(n / VEC + 1, kMapThreads), kMapThreads, 0, stream>>>(a, out, n, op);
  } else {
    map_unary_kernel<1><<<grid_for(n, kMapThreads), kMapThreads, 0, stream>>>(a, out, n, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// Launches out[i] = op(a[i], b[i mod period]) over A.numel() elements (period == n: b as long as a).
template <typename scalar_t, typename Op>
void launch_binary(const at::Tensor& A, const at::Tensor& B, int64_t period, at::Tensor& Out, Op op) {
  const int64_t n = A.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(A.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  constexpr int VEC = vec_size<scalar_t>();
  if (is_aligned16(a) && is_aligned16(b) && is_aligned16(out) && period % VEC == 0) {
    map_binary_kernel<VEC><<<grid_for(n / VEC + 1, kMapThreads), kMapThreads, 0, stream>>>(a, b, out, n, period, op);
  } else {
    map_binary_kernel<1><<<grid_for(n, kMapThreads), kMapThreads, 0, stream>>>(a, b, out, n, period, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// (out0[i], out1[i]) = op(a[i], b[i], c[i]) for i in [0, n): three inputs, two outputs.
template <int VEC, typename scalar_t, typename Op>
__global__ void map3_to2_kernel(const scalar_t* __restrict__ a,  // [n]
                                   const scalar_t* __restrict__ b,  // [n]
                                   const scalar_t* __restrict__ c,  // [n]
                                   scalar_t* __restrict__ out0,     // [n]
                                   scalar_t* __restrict__ out1,     // [n]
                                   int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = first; v < nvec; v += stride) {
    const Vec<scalar_t, VEC> x = reinterpret_cast<const Vec<scalar_t, VEC>*>(a)[v];
    const Vec<scalar_t, VEC> y = reinterpret_cast<const Vec<scalar_t, VEC>*>(b)[v];
    const Vec<scalar_t, VEC> z = reinterpret_cast<const Vec<scalar_t, VEC>*>(c)[v];
    Vec<scalar_t, VEC> r0, r1;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      opmath_t o0, o1;
      op(static_cast<opmath_t>(x.val[k]), static_cast<opmath_t>(y.val[k]), static_cast<opmath_t>(z.val[k]), o0, o1);
      r0.val[k] = static_cast<scalar_t>(o0);
      r1.val[k] = static_cast<scalar_t>(o1);
    }
    reinterpret_cast<Vec<scalar_t, VEC>*>(out0)[v] = r0;
    reinterpret_cast<Vec<scalar_t, VEC>*>(out1)[v] = r1;
  }
  for (int64_t i = nvec * VEC + first; i < n; i += stride) {
    opmath_t o0, o1;
    op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i]), static_cast<opmath_t>(c[i]), o0, o1);
    out0[i] = static_cast<scalar_t>(o0);
    out1[i] = static_cast<scalar_t>(o1);
  }
}

/// Launches map3_to2_kernel on tensors of n elements (all contiguous, same dtype and device).
/// `op(a, b, c, out0&, out1&)` runs in opmath (fp32 for fp16/bf16).
template <typename scalar_t, typename Op>
void launch_map3_to2(const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, at::Tensor& Out0,
                     at::Tensor& Out1, Op op) {
  const int64_t n = A.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(A.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  const scalar_t* c = C.const_data_ptr<scalar_t>();
  scalar_t* o0 = Out0.mutable_data_ptr<scalar_t>();
  scalar_t* o1 = Out1.mutable_data_ptr<scalar_t>();
  constexpr int VEC = vec_size<scalar_t>();
  if (is_aligned16(a) && is_aligned16(b) && is_aligned16(c) && is_aligned16(o0) && is_aligned16(o1)) {
    map3_to2_kernel<VEC><<<grid_for(n / VEC + 1, kMapThreads), kMapThreads, 0, stream>>>(a, b, c, o0, o1, n, op);
  } else {
    map3_to2_kernel<1><<<grid_for(n, kMapThreads), kMapThreads, 0, stream>>>(a, b, c, o0, o1, n, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace opforge
