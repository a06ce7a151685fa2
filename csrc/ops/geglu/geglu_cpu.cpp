// CPU kernels of geglu and geglu_packed: the gated engine's Vectorized row maps (core/gated_cpu.h) with gelu (erf
// form) or gelu_tanh, fp32 math for float16/bfloat16.
#include <torch/library.h>

#include "core/gated_cpu.h"
#include "ops/geglu/geglu.h"

namespace opforge {
namespace {

at::Tensor geglu_cpu(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  return with_gelu_approximate("geglu", approximate, [&](auto A) {
    return cpu::gated_forward<decltype(A)::value>("geglu", gate, up);
  });
}

std::tuple<at::Tensor, at::Tensor> geglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& gate,
                                                      const at::Tensor& up, c10::string_view approximate) {
  return with_gelu_approximate("geglu_backward", approximate, [&](auto A) {
    return cpu::gated_backward<decltype(A)::value>("geglu_backward", grad_output, gate, up);
  });
}

at::Tensor geglu_packed_cpu(const at::Tensor& input, c10::string_view approximate) {
  return with_gelu_approximate("geglu_packed", approximate, [&](auto A) {
    return cpu::gated_packed_forward<decltype(A)::value>("geglu_packed", input);
  });
}

at::Tensor geglu_packed_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                                     c10::string_view approximate) {
  return with_gelu_approximate("geglu_packed_backward", approximate, [&](auto A) {
    return cpu::gated_packed_backward<decltype(A)::value>("geglu_packed_backward", grad_output, input);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("geglu", &geglu_cpu);
  m.impl("geglu_backward", &geglu_backward_cpu);
  m.impl("geglu_packed", &geglu_packed_cpu);
  m.impl("geglu_packed_backward", &geglu_packed_backward_cpu);
}

}  // namespace opforge
