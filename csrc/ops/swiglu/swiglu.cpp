// swiglu, swiglu_packed and _swiglu_packed_amax (swiglu_packed plus max |output|), y = silu(gate) · up (Shazeer 2020, "GLU Variants Improve Transformer"): public C++ API,
// Meta kernels and autograd. Checkers, Meta and kernels: the gated engine (core/gated.h) with Activation::kSiLU.
#include "opforge/opforge.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/gated.h"

namespace opforge {

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  static auto op = typed_op<decltype(swiglu)>("opforge::swiglu");
  return op.call(gate, up);
}
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                   const at::Tensor& up) {
  static auto op = typed_op<decltype(swiglu_backward)>("opforge::swiglu_backward");
  return op.call(grad_output, gate, up);
}

at::Tensor swiglu_packed(const at::Tensor& input) {
  static auto op = typed_op<decltype(swiglu_packed)>("opforge::swiglu_packed");
  return op.call(input);
}
std::tuple<at::Tensor, at::Tensor> _swiglu_packed_amax(const at::Tensor& input) {
  static auto op = typed_op<decltype(_swiglu_packed_amax)>("opforge::_swiglu_packed_amax");
  return op.call(input);
}
at::Tensor swiglu_packed_backward(const at::Tensor& grad_output, const at::Tensor& input) {
  static auto op = typed_op<decltype(swiglu_packed_backward)>("opforge::swiglu_packed_backward");
  return op.call(grad_output, input);
}

namespace {

at::Tensor swiglu_meta(const at::Tensor& gate, const at::Tensor& up) { return gated_meta("swiglu", gate, up); }

std::tuple<at::Tensor, at::Tensor> swiglu_backward_meta(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  return gated_backward_meta("swiglu_backward", grad_output, gate, up);
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
  return autograd_op(
      {"swiglu", "opforge::SwigluBackward", swiglu_backward_fn, swiglu_double_backward_fn}, {kDifferentiable},
      [&](bool) { return opforge::swiglu(gate, up); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(gate);
        n.save(up);
      },
      gate, up);
}

// ---- swiglu_packed: swiglu over input = [gate | up] (*, 2I); one gradient, grad_input (*, 2I) ----

at::Tensor swiglu_packed_meta(const at::Tensor& input) { return gated_packed_meta("swiglu_packed", input); }

at::Tensor swiglu_packed_backward_meta(const at::Tensor& grad_output, const at::Tensor& input) {
  return gated_packed_backward_meta("swiglu_packed_backward", grad_output, input);
}

// y = silu(input[..., :I]) · input[..., I:]; saves input. One fused pass writes both halves of grad_input.
variable_list swiglu_packed_backward_fn(const BackwardArgs& a) {
  return {opforge::swiglu_packed_backward(a.grads[0], a.saved[0])};
}

// The same in differentiable ATen ops (double backward, torch.func): swiglu_double_backward_fn's math on the halves.
variable_list swiglu_packed_double_backward_fn(const BackwardArgs& a) {
  if (!a.needs[0]) return {at::Tensor()};
  const at::Tensor& input = a.saved[0];
  const c10::SymInt I = input.sym_size(-1) / 2;
  const at::Tensor gate = input.narrow_symint(-1, 0, I), up = input.narrow_symint(-1, I, I);
  const at::Tensor& dy = a.grads[0];
  const at::Tensor s = at::sigmoid(gate);
  return {at::cat({dy * up * s * (1 + gate * (1 - s)), dy * at::silu(gate)}, -1)};
}

at::Tensor swiglu_packed_autograd(const at::Tensor& input) {
  return autograd_op(
      {"swiglu_packed", "opforge::SwigluPackedBackward", swiglu_packed_backward_fn, swiglu_packed_double_backward_fn},
      {kDifferentiable}, [&](bool) { return opforge::swiglu_packed(input); },
      [&](OpNode& n, const at::Tensor&) { n.save(input); }, input);
}

// _swiglu_packed_amax: swiglu_packed's node (same backward, same saved input) over (output, amax), amax without
// history.
std::tuple<at::Tensor, at::Tensor> swiglu_packed_amax_meta(const at::Tensor& input) {
  return gated_packed_amax_meta("swiglu_packed", input);
}

std::tuple<at::Tensor, at::Tensor> swiglu_packed_amax_autograd(const at::Tensor& input) {
  return autograd_op(
      {"_swiglu_packed_amax", "opforge::SwigluPackedBackward", swiglu_packed_backward_fn,
       swiglu_packed_double_backward_fn},
      {kDifferentiable, kNotDifferentiable}, [&](bool) { return opforge::_swiglu_packed_amax(input); },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>&) { n.save(input); }, input);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("swiglu", &swiglu_meta);
  m.impl("swiglu_backward", &swiglu_backward_meta);
  m.impl("swiglu_packed", &swiglu_packed_meta);
  m.impl("_swiglu_packed_amax", &swiglu_packed_amax_meta);
  m.impl("swiglu_packed_backward", &swiglu_packed_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("swiglu", &swiglu_autograd);
  register_backward_op_autograd(m, "swiglu_backward");
  m.impl("swiglu_packed", &swiglu_packed_autograd);
  m.impl("_swiglu_packed_amax", &swiglu_packed_amax_autograd);
  register_backward_op_autograd(m, "swiglu_packed_backward");
}

// torch.autocast: as the native ops these mirror (core/autocast.h); swiglu_packed as swiglu
OPFORGE_AUTOCAST(swiglu, {{"swiglu", AutocastPolicy::kInputDtype},
                          {"swiglu_backward", AutocastPolicy::kInputDtype},
                          {"swiglu_packed", AutocastPolicy::kInputDtype},
                          {"_swiglu_packed_amax", AutocastPolicy::kInputDtype},
                          {"swiglu_packed_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
