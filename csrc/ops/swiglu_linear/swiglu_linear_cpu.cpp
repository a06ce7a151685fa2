// CPU kernels of swiglu_linear: ATen's GEMM (as torch.nn.functional.linear) for z, then opforge's swiglu on the
// interleaved columns; the backward is swiglu_linear_op::backward (opforge's swiglu_backward and linear_backward).
#include <torch/library.h>

#include "ops/swiglu_linear/swiglu_linear.h"

namespace opforge {
namespace {

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& input, const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias) {
  const auto p = swiglu_linear_op::check("swiglu_linear", input, weight, bias);
  const at::Tensor Z = at::linear(p.X, p.W, p.b.defined() ? std::optional<at::Tensor>(p.b) : std::nullopt);  // [M, 2I]
  const at::Tensor Y = swiglu_linear_op::swiglu_of_interleaved(Z);
  const auto lead = input.sizes().slice(0, input.dim() - 1);
  std::vector<int64_t> y_shape(lead.begin(), lead.end()), z_shape(lead.begin(), lead.end());
  y_shape.push_back(p.N / 2);
  z_shape.push_back(p.N);
  return {Y.view(y_shape), Z.view(z_shape)};
}

at::Tensor swiglu_linear_cpu(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return std::get<0>(forward_cpu(input, weight, bias));
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("swiglu_linear", &swiglu_linear_cpu);
  m.impl("_swiglu_linear_forward", &forward_cpu);
  m.impl("swiglu_linear_backward", &swiglu_linear_op::backward);
}

}  // namespace opforge
