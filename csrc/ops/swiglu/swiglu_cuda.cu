// CUDA kernels of swiglu and swiglu_packed: the gated engine's functors and launchers (core/gated_cuda.cuh) with
// silu, on core/map_cuda.cuh's vectorized elementwise kernels.
#include <torch/library.h>

#include "core/gated_cuda.cuh"

namespace opforge {
namespace {

constexpr Activation kSwiglu = Activation::kSiLU;

at::Tensor swiglu_cuda(const at::Tensor& gate, const at::Tensor& up) {
  return cuda::gated_forward<kSwiglu>("swiglu", gate, up);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  return cuda::gated_backward<kSwiglu>("swiglu_backward", grad_output, gate, up);
}

at::Tensor swiglu_packed_cuda(const at::Tensor& input) {
  return cuda::gated_packed_forward<kSwiglu>("swiglu_packed", input);
}

std::tuple<at::Tensor, at::Tensor> swiglu_packed_amax_cuda(const at::Tensor& input) {
  return cuda::gated_packed_forward_amax<kSwiglu>("swiglu_packed", input);
}

at::Tensor swiglu_packed_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input) {
  return cuda::gated_packed_backward<kSwiglu>("swiglu_packed_backward", grad_output, input);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("swiglu", &swiglu_cuda);
  m.impl("swiglu_backward", &swiglu_backward_cuda);
  m.impl("swiglu_packed", &swiglu_packed_cuda);
  m.impl("_swiglu_packed_amax", &swiglu_packed_amax_cuda);
  m.impl("swiglu_packed_backward", &swiglu_packed_backward_cuda);
}

}  // namespace opforge
