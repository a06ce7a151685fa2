// CPU kernels of linear_cat: ATen's GEMM (at::addmm_ / at::mm) piece by piece.
// Forward: the pieces' products accumulate into one buffer in opmath (float32; float64 for float64) that starts
// as the bias, then round once to the output dtype. float16/bfloat16 pieces are converted to float32 for the
// GEMM (a float32 copy of each piece and of W's slices while it runs: the CPU trades memory for the single
// rounding). Backward: each piece's gradient and each column slice of the weight gradient is its own GEMM.
#include <torch/library.h>

#include "core/check.h"
#include "ops/linear_cat/linear_cat.h"

namespace opforge {
namespace {

at::ScalarType opmath_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor linear_cat_cpu(at::TensorList inputs, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const auto p = linear_cat_op::check_linear_cat(inputs, weight, bias, /*contiguous=*/false);
  const auto dtype = inputs[0].scalar_type(), acc_t = opmath_dtype(dtype);
  // acc[M, N] = b (or 0), then acc += X_i · W_iᵀ for each piece, in opmath
  at::Tensor acc = at::empty({p.M, p.N}, inputs[0].options().dtype(acc_t));
  if (p.b.defined()) acc.copy_(p.b.expand({p.M, p.N})); else acc.zero_();
  for (size_t i = 0; i < p.X.size(); ++i) {
    if (p.Ki[i] == 0 || p.M == 0 || p.N == 0) continue;
    const at::Tensor Wi = p.W.narrow(1, p.k0[i], p.Ki[i]);  // [N, K_i]
    acc.addmm_(p.X[i].to(acc_t), Wi.to(acc_t).t());
  }
  auto sizes = linear_cat_op::output_sym_sizes(inputs, weight);
  std::vector<int64_t> out_sizes;
  for (const auto& s : sizes) out_sizes.push_back(s.expect_int());
  return acc.to(dtype).view(out_sizes);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> linear_cat_backward_cpu(
    const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype) {
  linear_cat_op::check_linear_cat_backward_args(grad_output, inputs, weight, bias_dtype);
  const auto p = linear_cat_op::check_linear_cat(inputs, weight, std::nullopt, /*contiguous=*/false);
  const at::Tensor dY = linear_cat_op::grad_output_2d(grad_output, p, /*contiguous=*/false);  // [M, N]
  const auto dtype = inputs[0].scalar_type();
  std::vector<at::Tensor> grad_inputs;
  at::Tensor grad_weight, grad_bias;
  if (output_mask[0]) {
    // dX_i = dY · W[:, k_i : k_i + K_i]  (an empty sum, N == 0, gives zeros)
    for (size_t i = 0; i < p.X.size(); ++i)
      grad_inputs.push_back(at::mm(dY, p.W.narrow(1, p.k0[i], p.Ki[i])).view(inputs[i].sizes()));
  }
  if (output_mask[1]) {
    // dW[:, k_i : k_i + K_i] = dYᵀ · X_i, in the wider of the pieces' and weight's dtypes, rounded once to weight's
    const auto dt = at::promote_types(dtype, weight.scalar_type());
    grad_weight = at::empty({p.N, p.K}, weight.options().memory_format(at::MemoryFormat::Contiguous));
    const at::Tensor dYt = dY.t().to(dt);
    for (size_t i = 0; i < p.X.size(); ++i) {
      if (p.Ki[i] == 0) continue;
      grad_weight.narrow(1, p.k0[i], p.Ki[i]).copy_(at::mm(dYt, p.X[i].to(dt)));
    }
  }
  if (output_mask[2]) {
    // db = Σ_rows dY, accumulated in opmath, rounded once to bias's dtype
    grad_bias = at::sum(dY, {0}, /*keepdim=*/false, opmath_dtype(dtype)).to(bias_dtype.value_or(dtype));
  }
  return {grad_inputs, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("linear_cat", &linear_cat_cpu);
  m.impl("linear_cat_backward", &linear_cat_backward_cpu);
}

}  // namespace opforge
