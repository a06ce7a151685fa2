// CUDA kernels of the elementwise ops: 16-byte vector loads and stores with a scalar tail, fp32
// math for float16/bfloat16, a grid-stride loop with 64-bit indices.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "ops/elementwise/elementwise.h"

namespace opforge {
namespace {

using cuda::Vec;

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

constexpr int kThreads = 256;

// Launcher: device guard, current stream, launch, launch check. Empty inputs launch nothing.
template <typename scalar_t, typename Op>
void launch_unary(const at::Tensor& A, at::Tensor& Out, Op op) {
  const int64_t n = A.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(A.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  constexpr int VEC = cuda::vec_size<scalar_t>();
  if (cuda::is_aligned16(a) && cuda::is_aligned16(out)) {
    map_unary_kernel<VEC><<<cuda::grid_for(n / VEC + 1, kThreads), kThreads, 0, stream>>>(a, out, n, op);
  } else {
    map_unary_kernel<1><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(a, out, n, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename Op>
void launch_binary(const at::Tensor& A, const at::Tensor& B, int64_t period, at::Tensor& Out, Op op) {
  const int64_t n = A.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(A.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* a = A.const_data_ptr<scalar_t>();
  const scalar_t* b = B.const_data_ptr<scalar_t>();
  scalar_t* out = Out.mutable_data_ptr<scalar_t>();
  constexpr int VEC = cuda::vec_size<scalar_t>();
  if (cuda::is_aligned16(a) && cuda::is_aligned16(b) && cuda::is_aligned16(out) && period % VEC == 0) {
    map_binary_kernel<VEC><<<cuda::grid_for(n / VEC + 1, kThreads), kThreads, 0, stream>>>(a, b, out, n, period, op);
  } else {
    map_binary_kernel<1><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(a, b, out, n, period, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// y = 1 / (1 + exp(-x)); exp(-x) = inf gives exactly 0 and exp(-x) = 0 exactly 1, never NaN.
struct SigmoidOp {
  template <typename T>
  __device__ T operator()(T x) const { return T(1) / (T(1) + exp(-x)); }
};
// dx = dy · y · (1 − y)
struct SigmoidBackwardOp {
  template <typename T>
  __device__ T operator()(T dy, T y) const { return dy * y * (T(1) - y); }
};
// y = x²
struct SquareOp {
  template <typename T>
  __device__ T operator()(T x) const { return x * x; }
};
// dx = 2 · x · dy
struct SquareBackwardOp {
  template <typename T>
  __device__ T operator()(T dy, T x) const { return T(2) * x * dy; }
};
// y = x² + b
struct SquareAddOp {
  template <typename T>
  __device__ T operator()(T x, T b) const { return x * x + b; }
};

template <typename Op>
at::Tensor unary_cuda(const char* op_name, const at::Tensor& input, Op op) {
  const at::Tensor X = elementwise::check_unary(op_name, input);
  at::Tensor Y = at::empty_like(X);
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::unary_cuda", [&] { launch_unary<scalar_t>(X, Y, op); });
  return Y;
}

template <typename Op>
at::Tensor unary_backward_cuda(const char* op_name, const at::Tensor& grad_output, const at::Tensor& saved,
                               const char* saved_name, Op op) {
  auto [dY, S] = elementwise::check_unary_backward(op_name, grad_output, saved, saved_name);
  at::Tensor dX = at::empty_like(dY);
  OPFORGE_DISPATCH_FLOATING(dY.scalar_type(), "opforge::unary_backward_cuda", [&] { launch_binary<scalar_t>(dY, S, dY.numel(), dX, op); });
  return dX;
}

at::Tensor sigmoid_cuda(const at::Tensor& input) { return unary_cuda("sigmoid", input, SigmoidOp{}); }
at::Tensor square_cuda(const at::Tensor& input) { return unary_cuda("square", input, SquareOp{}); }
at::Tensor sigmoid_backward_cuda(const at::Tensor& grad_output, const at::Tensor& output) {
  return unary_backward_cuda("sigmoid_backward", grad_output, output, "output", SigmoidBackwardOp{});
}
at::Tensor square_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input) {
  return unary_backward_cuda("square_backward", grad_output, input, "input", SquareBackwardOp{});
}
at::Tensor square_add_cuda(const at::Tensor& input, const at::Tensor& other) {
  const auto p = elementwise::check_square_add(input, other);
  at::Tensor Y = at::empty(input.sizes(), p.X.options());
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "square_add",
                            [&] { launch_binary<scalar_t>(p.X, p.B, p.period, Y, SquareAddOp{}); });
  return Y;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("sigmoid", &sigmoid_cuda);
  m.impl("sigmoid_backward", &sigmoid_backward_cuda);
  m.impl("square", &square_cuda);
  m.impl("square_backward", &square_backward_cuda);
  m.impl("square_add", &square_add_cuda);
}

}  // namespace opforge
