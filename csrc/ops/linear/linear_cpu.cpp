// CPU kernels of linear: ATen's GEMM (at::addmm / at::mm, i.e. MKL/oneDNN/OpenBLAS as torch was built)
// on the 2-D problem from the checker; grad_bias through ATen's reduction with fp32 accumulation.
// ATen's GEMM takes any strides, so the operands stay strided views (no copies): the forward and
// grad_input make the same GEMM calls as torch.nn.functional.linear.
#include <torch/library.h>

#include "core/check.h"
#include "ops/linear/linear.h"

namespace opforge {
namespace {

/// The accumulation dtype of a reduction over dtype `t`: float64 stays float64, the rest go to float32.
at::ScalarType opmath_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto p = linear_op::check_linear(input, weight, bias, /*contiguous=*/false);
  std::vector<int64_t> out_sizes = input.sizes().vec();  // (*, N)
  out_sizes.back() = p.N;
  at::Tensor Y;  // [M, N]
  if (p.K == 0) {
    // An empty sum: y = b (broadcast over rows) or 0. A fresh tensor, never a view of bias.
    Y = at::empty({p.M, p.N}, p.X.options());
    if (p.b.defined()) Y.copy_(p.b.expand({p.M, p.N})); else Y.zero_();
  } else if (p.b.defined()) {
    Y = at::addmm(p.b, p.X, p.W.t());  // Y = b + X · Wᵀ
  } else {
    Y = at::mm(p.X, p.W.t());  // Y = X · Wᵀ
  }
  return Y.view(out_sizes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cpu(const at::Tensor& grad_output,
                                                                   const at::Tensor& input, const at::Tensor& weight,
                                                                   std::array<bool, 3> output_mask,
                                                                   std::optional<at::ScalarType> bias_dtype) {
  const auto p = linear_op::check_linear_backward(grad_output, input, weight, bias_dtype, /*contiguous=*/false);
  at::Tensor grad_input, grad_weight, grad_bias;
  // An empty reduction (N == 0 for dX, M == 0 for dW and db) gives zeros: at::mm and at::sum do that.
  if (output_mask[0]) grad_input = at::mm(p.dY, p.W).view(input.sizes());              // dX = dY · W
  if (output_mask[1]) {
    // dW = dYᵀ · X, accumulated in the wider of input's and weight's dtypes (an fp16 input with an fp32
    // weight sums in fp32), rounded once to weight's dtype
    const auto dt = at::promote_types(p.dY.scalar_type(), weight.scalar_type());
    grad_weight = at::mm(p.dY.t().to(dt), p.X.to(dt)).to(weight.scalar_type());
  }
  if (output_mask[2]) {
    // db = Σ_rows dY, accumulated in fp32 (fp64 for fp64), rounded once to bias's dtype
    grad_bias = at::sum(p.dY, {0}, /*keepdim=*/false, opmath_dtype(p.dY.scalar_type()))
                    .to(linear_op::grad_bias_dtype(input, bias_dtype));
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("linear", &linear_cpu);
  m.impl("linear_backward", &linear_backward_cpu);
}

}  // namespace opforge
