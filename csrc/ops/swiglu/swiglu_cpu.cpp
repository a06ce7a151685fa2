// CPU kernels of swiglu and swiglu_packed: the gated engine's Vectorized row maps (core/gated_cpu.h) with silu.
#include <torch/library.h>

#include "core/gated_cpu.h"

namespace opforge {
namespace {

constexpr Activation kSwiglu = Activation::kSiLU;

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return cpu::gated_forward<kSwiglu>("swiglu", gate, up);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  return cpu::gated_backward<kSwiglu>("swiglu_backward", grad_output, gate, up);
}

at::Tensor swiglu_packed_cpu(const at::Tensor& input) { return cpu::gated_packed_forward<kSwiglu>("swiglu_packed", input); }

std::tuple<at::Tensor, at::Tensor> swiglu_packed_amax_cpu(const at::Tensor& input) {
  return cpu::gated_packed_forward_amax<kSwiglu>("swiglu_packed", input);
}

at::Tensor swiglu_packed_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input) {
  return cpu::gated_packed_backward<kSwiglu>("swiglu_packed_backward", grad_output, input);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("swiglu_packed", &swiglu_packed_cpu);
  m.impl("_swiglu_packed_amax", &swiglu_packed_amax_cpu);
  m.impl("swiglu_packed_backward", &swiglu_packed_backward_cpu);
}

}  // namespace opforge
