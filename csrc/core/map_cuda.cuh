// Generic elementwise CUDA kernels over flat contiguous arrays: 16-byte vector loads and stores
// (when every pointer is 16-byte aligned), a scalar tail, fp32 math for float16/bfloat16, a grid-stride
// loop with 64-bit indices. The *_rows launchers (at the end) read inputs that are row-strided 2-D views
// [rows, cols] (element i at (i / cols) * row_stride + i % cols: column slices of a wider tensor, as swiglu's
// gate/up views of a fused projection) without copying; their outputs are contiguous, except through the
// launch_map3_to2_rows overload with output row strides (the two halves of one gradient buffer, as
// swiglu_packed_backward writes them).
// Each launcher goes through launch_vec_or_scalar (device guard, current stream, the vector or scalar
// instantiation, launch check); empty inputs launch nothing.
#pragma once

#include <ATen/OpMathType.h>

#include <type_traits>
#include <utility>

#include "core/cuda_utils.cuh"

namespace opforge {
namespace cuda {

constexpr int kMapThreads = 256;

/// The launch shared by every launcher here: on `device`'s current stream, calls
/// launch(std::integral_constant<int, W>{}, blocks, stream) with W = VEC when `vectorize`, else W = 1 (blocks
/// enough for n / W accesses and a tail), then checks the launch. n == 0 launches nothing.
template <int VEC, typename Launch>
void launch_vec_or_scalar(c10::Device device, int64_t n, bool vectorize, const Launch& launch) {
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (vectorize) {
    launch(std::integral_constant<int, VEC>{}, grid_for(n / VEC + 1, kMapThreads), stream);
  } else {
    launch(std::integral_constant<int, 1>{}, grid_for(n, kMapThreads), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The grid-stride walk of map_unary_kernel and map3_to2_kernel: vec(v) for each VEC-wide access v in [0, n / VEC), then
// tail(i) for each element i in [n / VEC · VEC, n), both strided by the grid's thread count.
// The bodies must hold no loop of their own (each_lane instead): nvcc unrolls a grid-stride loop whose body calls
// a function with a loop less than the same loop written inline (sm_90: fp32 and fp64 kernels without their 4x
// unroll). map_binary_kernel keeps its loops inline: through this walk, swiglu's GatedOp<kSiLU> instantiations lose the
// loop's unswitching on period == n (sm_90, bf16: 632 instructions instead of 846, 2 vector loads instead of 4; the
// same with the bodies by value or __restrict__).
template <int VEC, typename VecBody, typename TailBody>
__device__ __forceinline__ void map_grid_stride(int64_t n, const VecBody& vec, const TailBody& tail) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t v = first; v < nvec; v += stride) vec(v);
  for (int64_t i = nvec * VEC + first; i < n; i += stride) tail(i);
}

// f(0), f(1), ..., f(W - 1), written out (no loop: see map_grid_stride).
template <int W, typename F>
__device__ __forceinline__ void each_lane(const F& f) {
  [&]<int... k>(std::integer_sequence<int, k...>) { (f(k), ...); }(std::make_integer_sequence<int, W>{});
}

// out[i] = op(a[i]) for i in [0, n). VEC elements per access (1 when a pointer is not 16-byte aligned).
template <int VEC, typename scalar_t, typename Op>
__global__ void map_unary_kernel(const scalar_t* __restrict__ a,  // [n]
                                 scalar_t* __restrict__ out,      // [n]
                                 int64_t n, Op op) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, VEC>;
  map_grid_stride<VEC>(n, [&](int64_t v) {
        const V x = reinterpret_cast<const V*>(a)[v];
        V y;
        each_lane<VEC>([&](int k) { y.val[k] = static_cast<scalar_t>(op(static_cast<opmath_t>(x.val[k]))); });
        reinterpret_cast<V*>(out)[v] = y;
      },
      [&](int64_t i) { out[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i]))); });
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
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  launch_vec_or_scalar<vec_size<scalar_t>()>(A.device(), n, is_aligned16(a) && is_aligned16(out),
                                             [&](auto w, int64_t blocks, cudaStream_t stream) {
    map_unary_kernel<decltype(w)::value><<<blocks, kMapThreads, 0, stream>>>(a, out, n, op);
  });
}

/// Launches out[i] = op(a[i], b[i mod period]) over A.numel() elements (period == n: b as long as a).
template <typename scalar_t, typename Op>
void launch_binary(const at::Tensor& A, const at::Tensor& B, int64_t period, at::Tensor& Out, Op op) {
  const int64_t n = A.numel();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  constexpr int VEC = vec_size<scalar_t>();
  const bool vectorize = is_aligned16(a) && is_aligned16(b) && is_aligned16(out) && period % VEC == 0;
  launch_vec_or_scalar<VEC>(A.device(), n, vectorize, [&](auto w, int64_t blocks, cudaStream_t stream) {
    map_binary_kernel<decltype(w)::value><<<blocks, kMapThreads, 0, stream>>>(a, b, out, n, period, op);
  });
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
  using V = Vec<scalar_t, VEC>;
  map_grid_stride<VEC>(n, [&](int64_t v) {
        const V x = reinterpret_cast<const V*>(a)[v], y = reinterpret_cast<const V*>(b)[v],
                z = reinterpret_cast<const V*>(c)[v];
        V r0, r1;
        each_lane<VEC>([&](int k) {
          opmath_t o0, o1;
          op(static_cast<opmath_t>(x.val[k]), static_cast<opmath_t>(y.val[k]), static_cast<opmath_t>(z.val[k]), o0, o1);
          r0.val[k] = static_cast<scalar_t>(o0);
          r1.val[k] = static_cast<scalar_t>(o1);
        });
        reinterpret_cast<V*>(out0)[v] = r0;
        reinterpret_cast<V*>(out1)[v] = r1;
      },
      [&](int64_t i) {
        opmath_t o0, o1;
        op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i]), static_cast<opmath_t>(c[i]), o0, o1);
        out0[i] = static_cast<scalar_t>(o0);
        out1[i] = static_cast<scalar_t>(o1);
      });
}

/// Launches map3_to2_kernel on tensors of n elements (all contiguous, same dtype and device).
/// `op(a, b, c, out0&, out1&)` runs in opmath (fp32 for fp16/bf16).
template <typename scalar_t, typename Op>
void launch_map3_to2(const at::Tensor& A, const at::Tensor& B, const at::Tensor& C, at::Tensor& Out0,
                     at::Tensor& Out1, Op op) {
  const int64_t n = A.numel();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  const scalar_t* c = C.const_data_ptr<scalar_t>();
  scalar_t* o0 = Out0.mutable_data_ptr<scalar_t>();
  scalar_t* o1 = Out1.mutable_data_ptr<scalar_t>();
  const bool vectorize = is_aligned16(a) && is_aligned16(b) && is_aligned16(c) && is_aligned16(o0) && is_aligned16(o1);
  launch_vec_or_scalar<vec_size<scalar_t>()>(A.device(), n, vectorize, [&](auto w, int64_t blocks, cudaStream_t stream) {
    map3_to2_kernel<decltype(w)::value><<<blocks, kMapThreads, 0, stream>>>(a, b, c, o0, o1, n, op);
  });
}

// ---- row-strided inputs -------------------------------------------------------------------------------------

// out[0, W) = op(a[0, W), b[0, W)) as one W-wide access per pointer (W == 1: scalar), math in opmath; returns the
// values stored (for an epilogue over them, e.g. an amax).
template <int W, typename scalar_t, typename Op>
__device__ __forceinline__ Vec<scalar_t, W> binary_lanes(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                                         scalar_t* __restrict__ out, const Op& op) {
  using opmath_t = at::opmath_type<scalar_t>;
  const Vec<scalar_t, W> x = *reinterpret_cast<const Vec<scalar_t, W>*>(a);
  const Vec<scalar_t, W> c = *reinterpret_cast<const Vec<scalar_t, W>*>(b);
  Vec<scalar_t, W> y;
#pragma unroll
  for (int k = 0; k < W; ++k)
    y.val[k] = static_cast<scalar_t>(op(static_cast<opmath_t>(x.val[k]), static_cast<opmath_t>(c.val[k])));
  *reinterpret_cast<Vec<scalar_t, W>*>(out) = y;
  return y;
}

// (out0, out1)[0, W) = op(a, b, c)[0, W) as one W-wide access per pointer (W == 1: scalar), math in opmath.
template <int W, typename scalar_t, typename Op>
__device__ __forceinline__ void map3_to2_lanes(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                                               const scalar_t* __restrict__ c, scalar_t* __restrict__ out0,
                                               scalar_t* __restrict__ out1, const Op& op) {
  using opmath_t = at::opmath_type<scalar_t>;
  const Vec<scalar_t, W> x = *reinterpret_cast<const Vec<scalar_t, W>*>(a);
  const Vec<scalar_t, W> y = *reinterpret_cast<const Vec<scalar_t, W>*>(b);
  const Vec<scalar_t, W> z = *reinterpret_cast<const Vec<scalar_t, W>*>(c);
  Vec<scalar_t, W> r0, r1;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    opmath_t o0, o1;
    op(static_cast<opmath_t>(x.val[k]), static_cast<opmath_t>(y.val[k]), static_cast<opmath_t>(z.val[k]), o0, o1);
    r0.val[k] = static_cast<scalar_t>(o0);
    r1.val[k] = static_cast<scalar_t>(o1);
  }
  *reinterpret_cast<Vec<scalar_t, W>*>(out0) = r0;
  *reinterpret_cast<Vec<scalar_t, W>*>(out1) = r1;
}

// out[i] = op(a[r * sa + col], b[r * sb + col]) for i = r * cols + col in [0, n): a and b row-strided
// [n / cols, cols] views, out contiguous. VEC elements per access: VEC > 1 needs cols, sa, sb multiples of VEC
// (so an access never straddles a row and n % VEC == 0) and 16-byte aligned pointers.
template <int VEC, typename scalar_t, typename Op>
__global__ void map_binary_rows_kernel(const scalar_t* __restrict__ a, int64_t sa,  // [n / cols, cols] by sa
                                       const scalar_t* __restrict__ b, int64_t sb,  // [n / cols, cols] by sb
                                       scalar_t* __restrict__ out,                  // [n]
                                       int64_t n, int64_t cols, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n; i += stride * VEC) {
    const int64_t r = i / cols, col = i - r * cols;  // one division for both inputs
    binary_lanes<VEC>(a + r * sa + col, b + r * sb + col, out + i, op);
  }
}

// The walk of the map3_to2 rows kernels: (out0, out1)[r, col] = op(a, b, c)[r, col] for i = r * cols + col in
// [0, n), every operand a row-strided [n / cols, cols] view (row strides sa, sb, sc, so0, so1); VEC elements per
// access, map_binary_rows_kernel's VEC rule (outputs included).
template <int VEC, typename scalar_t, typename Op>
__device__ __forceinline__ void map3_to2_rows_walk(const scalar_t* __restrict__ a, int64_t sa,
                                                   const scalar_t* __restrict__ b, int64_t sb,
                                                   const scalar_t* __restrict__ c, int64_t sc,
                                                   scalar_t* __restrict__ out0, int64_t so0,
                                                   scalar_t* __restrict__ out1, int64_t so1, int64_t n,
                                                   int64_t cols, const Op& op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; i < n; i += stride * VEC) {
    const int64_t r = i / cols, col = i - r * cols;  // one division for the five operands
    map3_to2_lanes<VEC>(a + r * sa + col, b + r * sb + col, c + r * sc + col, out0 + r * so0 + col,
                        out1 + r * so1 + col, op);
  }
}

// map3_to2_kernel over row-strided [n / cols, cols] inputs (row strides sa, sb, sc), contiguous outputs;
// map_binary_rows_kernel's VEC rule. (The walk with output row strides cols: r * cols + col is i.)
template <int VEC, typename scalar_t, typename Op>
__global__ void map3_to2_rows_kernel(const scalar_t* __restrict__ a, int64_t sa,  // [n / cols, cols] by sa
                                     const scalar_t* __restrict__ b, int64_t sb,  // [n / cols, cols] by sb
                                     const scalar_t* __restrict__ c, int64_t sc,  // [n / cols, cols] by sc
                                     scalar_t* __restrict__ out0,                 // [n]
                                     scalar_t* __restrict__ out1,                 // [n]
                                     int64_t n, int64_t cols, Op op) {
  map3_to2_rows_walk<VEC>(a, sa, b, sb, c, sc, out0, cols, out1, cols, n, cols, op);
}

// map3_to2_rows_kernel with row-strided outputs too (row strides so0, so1 >= cols): e.g. the two halves
// [..., :cols], [..., cols:] of one [n / cols, 2 * cols] gradient buffer.
template <int VEC, typename scalar_t, typename Op>
__global__ void map3_to2_rows_kernel(const scalar_t* __restrict__ a, int64_t sa,  // [n / cols, cols] by sa
                                     const scalar_t* __restrict__ b, int64_t sb,  // [n / cols, cols] by sb
                                     const scalar_t* __restrict__ c, int64_t sc,  // [n / cols, cols] by sc
                                     scalar_t* __restrict__ out0, int64_t so0,    // [n / cols, cols] by so0
                                     scalar_t* __restrict__ out1, int64_t so1,    // [n / cols, cols] by so1
                                     int64_t n, int64_t cols, Op op) {
  map3_to2_rows_walk<VEC>(a, sa, b, sb, c, sc, out0, so0, out1, so1, n, cols, op);
}

/// True when a row-strided input (or output) of `cols` columns may be accessed VEC elements at a time:
/// 16-byte aligned base, and cols and the row stride multiples of VEC (no access straddles a row).
template <int VEC>
inline bool rows_vectorizable(const void* p, int64_t cols, int64_t row_stride) {
  return is_aligned16(p) && cols % VEC == 0 && row_stride % VEC == 0;
}

/// Launches out[i] = op(a, b) over the row-strided [n / cols, cols] views A (row stride sa) and B (row
/// stride sb), n = Out.numel(), into contiguous Out (same dtype and device).
template <typename scalar_t, typename Op>
void launch_binary_rows(const at::Tensor& A, int64_t sa, const at::Tensor& B, int64_t sb, int64_t cols,
                        at::Tensor& Out, Op op) {
  const int64_t n = Out.numel();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  constexpr int VEC = vec_size<scalar_t>();
  const bool vectorize =
      rows_vectorizable<VEC>(a, cols, sa) && rows_vectorizable<VEC>(b, cols, sb) && rows_vectorizable<VEC>(out, cols, cols);
  launch_vec_or_scalar<VEC>(A.device(), n, vectorize, [&](auto w, int64_t blocks, cudaStream_t stream) {
    map_binary_rows_kernel<decltype(w)::value><<<blocks, kMapThreads, 0, stream>>>(a, sa, b, sb, out, n, cols, op);
  });
}

// The launch of both launch_map3_to2_rows overloads: kStridedOut picks the kernel with output row strides
// (so0, so1) or the one whose outputs are contiguous (so0 == so1 == cols).
template <typename scalar_t, bool kStridedOut, typename Op>
void launch_map3_to2_rows_impl(const at::Tensor& A, int64_t sa, const at::Tensor& B, int64_t sb, const at::Tensor& C,
                               int64_t sc, int64_t cols, at::Tensor& Out0, int64_t so0, at::Tensor& Out1, int64_t so1,
                               Op op) {
  const int64_t n = Out0.numel();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  const scalar_t* c = C.const_data_ptr<scalar_t>();
  scalar_t* o0 = Out0.mutable_data_ptr<scalar_t>();
  scalar_t* o1 = Out1.mutable_data_ptr<scalar_t>();
  constexpr int VEC = vec_size<scalar_t>();
  const bool vectorize = rows_vectorizable<VEC>(a, cols, sa) && rows_vectorizable<VEC>(b, cols, sb) &&
                         rows_vectorizable<VEC>(c, cols, sc) && rows_vectorizable<VEC>(o0, cols, so0) &&
                         rows_vectorizable<VEC>(o1, cols, so1);
  launch_vec_or_scalar<VEC>(A.device(), n, vectorize, [&](auto w, int64_t blocks, cudaStream_t stream) {
    if constexpr (kStridedOut) {
      map3_to2_rows_kernel<decltype(w)::value>
          <<<blocks, kMapThreads, 0, stream>>>(a, sa, b, sb, c, sc, o0, so0, o1, so1, n, cols, op);
    } else {
      map3_to2_rows_kernel<decltype(w)::value><<<blocks, kMapThreads, 0, stream>>>(a, sa, b, sb, c, sc, o0, o1, n, cols, op);
    }
  });
}

/// Launches map3_to2 over the row-strided [n / cols, cols] views A, B, C (row strides sa, sb, sc),
/// n = Out0.numel(), into Out0 and Out1 (same dtype and device), row-strided [n / cols, cols] views too with row
/// strides so0 and so1 (>= cols; the two halves of one [n / cols, 2 * cols] buffer, say).
/// `op(a, b, c, out0&, out1&)` runs in opmath (fp32 for fp16/bf16).
template <typename scalar_t, typename Op>
void launch_map3_to2_rows(const at::Tensor& A, int64_t sa, const at::Tensor& B, int64_t sb, const at::Tensor& C,
                          int64_t sc, int64_t cols, at::Tensor& Out0, int64_t so0, at::Tensor& Out1, int64_t so1,
                          Op op) {
  launch_map3_to2_rows_impl<scalar_t, /*kStridedOut=*/true>(A, sa, B, sb, C, sc, cols, Out0, so0, Out1, so1, op);
}

/// The same with contiguous Out0 and Out1 (row strides cols), through the kernel without output strides.
template <typename scalar_t, typename Op>
void launch_map3_to2_rows(const at::Tensor& A, int64_t sa, const at::Tensor& B, int64_t sb, const at::Tensor& C,
                          int64_t sc, int64_t cols, at::Tensor& Out0, at::Tensor& Out1, Op op) {
  launch_map3_to2_rows_impl<scalar_t, /*kStridedOut=*/false>(A, sa, B, sb, C, sc, cols, Out0, cols, Out1, cols, op);
}

}  // namespace cuda
}  // namespace opforge
