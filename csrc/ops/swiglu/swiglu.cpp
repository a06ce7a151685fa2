// swiglu: checker, public C++ API, Meta kernels and autograd.
#include "ops/swiglu/swiglu.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"

namespace opforge {

std::pair<at::Tensor, at::Tensor> check_swiglu(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_floating(op, "gate", gate);
  check_floating(op, "up", up);
  check_same_device(op, "gate", gate, "up", up);
  TORCH_CHECK_VALUE(gate.sym_sizes().equals(up.sym_sizes()), "opforge::", op,
                    ": expected gate and up of the same shape, but got ", shape_str(gate.sym_sizes()), " and ",
                    shape_str(up.sym_sizes()));
  return {gate, to_input_dtype(up, gate.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> check_swiglu_backward(const at::Tensor& grad_output,
                                                                     const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_swiglu("swiglu_backward", gate, up);
  check_floating("swiglu_backward", "grad_output", grad_output);
  check_same_device("swiglu_backward", "grad_output", grad_output, "gate", gate);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(gate.sym_sizes()),
                    "opforge::swiglu_backward: expected grad_output of gate's shape ", shape_str(gate.sym_sizes()),
                    ", but got ", shape_str(grad_output.sym_sizes()));
  return {to_input_dtype(grad_output, gate.scalar_type()), G, U};
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  static auto op = typed_op<decltype(swiglu)>("opforge::swiglu");
  return op.call(gate, up);
}
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  static auto op = typed_op<decltype(swiglu_backward)>("opforge::swiglu_backward");
  return op.call(grad_output, gate, up);
}

namespace {

at::Tensor swiglu_meta(const at::Tensor& gate, const at::Tensor& up) {
  check_swiglu("swiglu", gate, up);
  return at::empty_symint(gate.sym_sizes(), gate.options());
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_meta(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  check_swiglu_backward(grad_output, gate, up);
  return {at::empty_symint(gate.sym_sizes(), gate.options()),
          at::empty_symint(up.sym_sizes(), up.options())};
}

// swiglu: y = silu(gate)·up; saves gate and up. One fused pass yields both gradients.
variable_list swiglu_backward_fn(const BackwardArgs& a) {
  auto [grad_gate, grad_up] = opforge::swiglu_backward(a.grads[0], a.saved[0], a.saved[1]);
  return {grad_gate, grad_up};
}

// The same in differentiable ATen ops (double backward, torch.func).
variable_list swiglu_double_backward_fn(const BackwardArgs& a) {
  const at::Tensor &gate = a.saved[0], &up = a.saved[1];
  const at::Tensor upc = up.to(gate.scalar_type());
  at::Tensor grad_gate, grad_up;
  // silu'(g) = s · (1 + g · (1 − s)), s = sigmoid(g): ATen's silu_backward has no derivative of its own
  if (a.needs[0]) {
    const at::Tensor s = at::sigmoid(gate);
    grad_gate = a.grads[0] * upc * s * (1 + gate * (1 - s));
  }
  if (a.needs[1]) grad_up = (a.grads[0] * at::silu(gate)).to(up.scalar_type());
  return {grad_gate, grad_up};
}

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return autograd_one_output(
      "swiglu", "opforge::SwigluBackward", swiglu_backward_fn, swiglu_double_backward_fn,
      [&] { return opforge::swiglu(gate, up); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(gate);
        n.save(up);
      },
      gate, up);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("swiglu", &swiglu_meta);
  m.impl("swiglu_backward", &swiglu_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("swiglu", &swiglu_autograd);
  register_backward_op_autograd(m, "swiglu_backward");
}

// torch.autocast: as the native ops these mirror (core/autocast.h)
OPFORGE_AUTOCAST(swiglu, {{"swiglu", AutocastPolicy::kInputDtype}, {"swiglu_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
