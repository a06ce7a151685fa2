// CUDA kernels of the elementwise ops: the math as functors, run by the shared vectorized
// elementwise kernels of core/map_cuda.cuh (16-byte loads/stores, scalar tail, fp32 opmath).
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "core/activation.h"
#include "core/dispatch.h"
#include "core/map_cuda.cuh"
#include "ops/elementwise/elementwise.h"

namespace opforge {
namespace {

using cuda::launch_binary;
using cuda::launch_unary;

// sigmoid: y = σ(x) and dx = dy · y · (1 − y), core/activation.h's act::Value / act::Backward<kSigmoid>.
using SigmoidOp = act::Value<Activation::kSigmoid>;
using SigmoidBackwardOp = act::Backward<Activation::kSigmoid>;
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
  at::Tensor Y = at::empty(X.sizes(), X.options());
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::unary_cuda", [&] { launch_unary<scalar_t>(X, Y, op); });
  return Y;
}

template <typename Op>
at::Tensor unary_backward_cuda(const char* op_name, const at::Tensor& grad_output, const at::Tensor& saved,
                               const char* saved_name, Op op) {
  auto [dY, S] = elementwise::check_unary_backward(op_name, grad_output, saved, saved_name);
  at::Tensor dX = at::empty(dY.sizes(), dY.options());
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
