// CUDA kernels of swiglu_linear.
//
// Forward: one of two paths, chosen per shape by the measured table kSwiGLUTable (core/gemm_cuda.cu, swiglu_choice;
// the test hook gemm_sm90 overrides it):
//   fused     bfloat16 on an sm90 GPU with opforge's CUTLASS kernels built: ONE kernel, the GEMM whose epilogue
//             writes y = silu(z[:, 2j]) · z[:, 2j + 1] and, where backward needs it, z = x · Wᵀ + b (core/gemm.h
//             gemm_swiglu; core/gemm_sm90.cuh). The public op (swiglu_linear, run by autograd when no input needs a
//             gradient) asks for y alone, so the kernel may skip z's store entirely; _swiglu_linear_forward (the
//             forward autograd runs when a gradient is needed) asks for both.
//   two-pass  everywhere else (float16, float32, float64, another GPU, a shape or alignment the kernels do not take,
//             or a shape where the table found the fused kernel slower): the GEMM of core/gemm.h (cuBLASLt with the
//             bias epilogue), then opforge's swiglu kernel on z's interleaved columns.
// Backward: swiglu_linear_op::backward (opforge's swiglu_backward, then linear_backward's cuBLAS(Lt) GEMMs).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "core/gemm.h"
#include "ops/swiglu_linear/swiglu_linear.h"

namespace opforge {
namespace {

/// y and z (z undefined where !want_z and the fused kernel ran: nothing reads it).
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias, bool want_z) {
  const auto p = swiglu_linear_op::check("swiglu_linear", input, weight, bias);
  c10::cuda::CUDAGuard guard(input.device());
  gemm::check_int_dims("swiglu_linear", p.M, p.K, p.N);
  const auto lead = input.sizes().slice(0, input.dim() - 1);
  std::vector<int64_t> y_shape(lead.begin(), lead.end()), z_shape(lead.begin(), lead.end());
  y_shape.push_back(p.N / 2);
  z_shape.push_back(p.N);
  at::Tensor Y = at::empty({p.M, p.N / 2}, p.X.options());
  if (p.M == 0 || p.N == 0) return {Y.view(y_shape), at::empty({p.M, p.N}, p.X.options()).view(z_shape)};
  if (p.K > 0 && !want_z && gemm::gemm_swiglu(at::Tensor(), Y, p.X, p.W, p.b)) return {Y.view(y_shape), at::Tensor()};
  at::Tensor Z = at::empty({p.M, p.N}, p.X.options());
  if (p.K > 0 && want_z && gemm::gemm_swiglu(Z, Y, p.X, p.W, p.b)) return {Y.view(y_shape), Z.view(z_shape)};
  gemm::GemmArgs args;
  args.trans_b = true;
  args.bias = p.b;
  gemm::gemm(Z, p.X, p.W, args);
  Y = swiglu_linear_op::swiglu_of_interleaved(Z);
  return {Y.view(y_shape), Z.view(z_shape)};
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& input, const at::Tensor& weight,
                                                const std::optional<at::Tensor>& bias) {
  return forward_impl(input, weight, bias, /*want_z=*/true);
}

at::Tensor swiglu_linear_cuda(const at::Tensor& input, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias) {
  return std::get<0>(forward_impl(input, weight, bias, /*want_z=*/false));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_linear_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& pre_activation,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype) {
  c10::cuda::CUDAGuard guard(input.device());
  return swiglu_linear_op::backward(grad_output, input, weight, pre_activation, output_mask, bias_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("swiglu_linear", &swiglu_linear_cuda);
  m.impl("_swiglu_linear_forward", &forward_cuda);
  m.impl("swiglu_linear_backward", &swiglu_linear_backward_cuda);
}

}  // namespace opforge
