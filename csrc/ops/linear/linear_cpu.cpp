// CPU kernels of linear: ATen's GEMM (at::addmm / at::mm, i.e. MKL/oneDNN/OpenBLAS as torch was built)
// on the 2-D problem from the checker, then ATen's activation functions (at::relu, at::gelu, at::silu)
// and their backward functions; grad_bias through ATen's reduction with fp32 accumulation.
// ATen's GEMM takes any strides, so the operands stay strided views (no copies): the forward and
// grad_input make the same GEMM calls as torch.nn.functional.linear.
#include <torch/library.h>

#include <array>

#include "core/check.h"
#include "ops/linear/linear.h"

namespace opforge {
namespace {

/// weightᵀ [K, N], a view of W [N, K] with the same sizes, strides, storage, version counter and dispatch keys as
/// W.t(), made directly: W.t() goes through the dispatcher twice (t, then as_strided), ~2 300 instructions a call,
/// a tenth of a tiny linear's host time (docs/performance/overhead.md).
at::Tensor transposed(const at::Tensor& W) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(W.storage()), W.key_set(),
                                                   W.dtype());
  const std::array<int64_t, 2> sizes{W.size(1), W.size(0)}, strides{W.stride(1), W.stride(0)};
  impl->set_sizes_and_strides(c10::IntArrayRef(sizes), c10::IntArrayRef(strides), W.storage_offset());
  impl->set_version_counter(W.unsafeGetTensorImpl()->version_counter());
  return at::Tensor(std::move(impl));
}

/// Z[M, N] = X · Wᵀ + b, a new contiguous tensor (never a view of bias).
at::Tensor pre_activation(const linear_op::LinearProblem& p) {
  if (p.K == 0) {
    // An empty sum: z = b (broadcast over rows) or 0.
    at::Tensor Z = at::empty({p.M, p.N}, p.X.options());
    if (p.b.defined()) Z.copy_(p.b.expand({p.M, p.N})); else Z.zero_();
    return Z;
  }
  if (p.b.defined()) return at::addmm(p.b, p.X, transposed(p.W));  // Z = b + X · Wᵀ
  return at::mm(p.X, transposed(p.W));                              // Z = X · Wᵀ
}

/// y = act(z), a new tensor (z is left as it is).
at::Tensor activate(const at::Tensor& Z, Activation act) {
  switch (act) {
    case Activation::kNone: return Z.clone();
    case Activation::kReLU: return at::relu(Z);
    case Activation::kGELU: return at::gelu(Z, "none");
    case Activation::kGELUTanh: return at::gelu(Z, "tanh");
    case Activation::kSiLU: return at::silu(Z);
    case Activation::kSigmoid: break;  // not a linear activation (the parser rejects it)
  }
  TORCH_INTERNAL_ASSERT(false, "opforge::linear: unhandled activation");
}

/// y = act(z) in place of z.
void activate_(at::Tensor& Z, Activation act) {
  switch (act) {
    case Activation::kNone: return;
    case Activation::kReLU: at::relu_(Z); return;
    case Activation::kGELU: at::gelu_(Z, "none"); return;
    case Activation::kGELUTanh: at::gelu_(Z, "tanh"); return;
    case Activation::kSiLU: at::silu_(Z); return;
    case Activation::kSigmoid: break;
  }
  TORCH_INTERNAL_ASSERT(false, "opforge::linear: unhandled activation");
}

at::Tensor linear_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      c10::string_view activation) {
  const auto p = linear_op::check_linear(input, weight, bias, activation, /*contiguous=*/false);
  at::Tensor Y = pre_activation(p);  // [M, N]
  activate_(Y, p.act);
  return linear_op::as_output(Y, input, weight);
}

std::tuple<at::Tensor, at::Tensor> linear_forward_cpu(const at::Tensor& input, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias,
                                                      c10::string_view activation) {
  const auto p = linear_op::check_linear(input, weight, bias, activation, /*contiguous=*/false);
  const at::Tensor Z = pre_activation(p);  // [M, N]
  return {linear_op::as_output(activate(Z, p.act), input, weight), linear_op::as_output(Z, input, weight)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype, c10::string_view activation,
    const std::optional<at::Tensor>& pre_activation) {
  const auto p = linear_op::check_linear_backward(grad_output, input, weight, bias_dtype, activation, pre_activation,
                                                  /*contiguous=*/false);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (!(output_mask[0] || output_mask[1] || output_mask[2])) return {grad_input, grad_weight, grad_bias};
  const at::Tensor dZ = linear_op::aten_activation_backward(p.dY, p.Z, p.act);  // [M, N]
  // An empty reduction (N == 0 for dX, M == 0 for dW and db) gives zeros: at::mm and at::sum do that.
  if (output_mask[0]) grad_input = at::mm(dZ, p.W).view(input.sizes());  // dX = dZ · W
  if (output_mask[1]) {
    // dW = dZᵀ · X, accumulated in the wider of input's and weight's dtypes (an fp16 input with an fp32
    // weight sums in fp32), rounded once to weight's dtype
    const auto dt = at::promote_types(dZ.scalar_type(), weight.scalar_type());
    grad_weight = at::mm(dZ.t().to(dt), p.X.to(dt)).to(weight.scalar_type());
  }
  if (output_mask[2]) {
    grad_bias = linear_op::sum_rows(dZ, linear_op::grad_bias_dtype(input, bias_dtype));  // db = Σ_rows dZ
  }
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("_linear_forward", &linear_forward_cpu);
  m.impl("linear", &linear_cpu);
  m.impl("linear_backward", &linear_backward_cpu);
}

}  // namespace opforge
