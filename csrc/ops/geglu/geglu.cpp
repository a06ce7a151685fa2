// geglu and geglu_packed (ops/geglu/geglu.h): public C++ API, Meta kernels and autograd. Checkers, Meta and kernels:
// the gated engine (core/gated.h) with Activation::kGELU (approximate "none") or kGELUTanh ("tanh").
#include "ops/geglu/geglu.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/dispatch.h"
#include "core/gated.h"
#include "opforge/opforge.h"

namespace opforge {

at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  static auto op = typed_op<decltype(geglu)>("opforge::geglu");
  return op.call(gate, up, approximate);
}
std::tuple<at::Tensor, at::Tensor> geglu_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                  const at::Tensor& up, c10::string_view approximate) {
  static auto op = typed_op<decltype(geglu_backward)>("opforge::geglu_backward");
  return op.call(grad_output, gate, up, approximate);
}

at::Tensor geglu_packed(const at::Tensor& input, c10::string_view approximate) {
  static auto op = typed_op<decltype(geglu_packed)>("opforge::geglu_packed");
  return op.call(input, approximate);
}
at::Tensor geglu_packed_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                 c10::string_view approximate) {
  static auto op = typed_op<decltype(geglu_packed_backward)>("opforge::geglu_packed_backward");
  return op.call(grad_output, input, approximate);
}

namespace {

// Every kernel (CPU, CUDA, Meta, Autograd) parses approximate before it checks the tensors, so a bad value raises
// the same error everywhere.

at::Tensor geglu_meta(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  parse_gelu_approximate("geglu", approximate);
  return gated_meta("geglu", gate, up);
}

std::tuple<at::Tensor, at::Tensor> geglu_backward_meta(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up, c10::string_view approximate) {
  parse_gelu_approximate("geglu_backward", approximate);
  return gated_backward_meta("geglu_backward", grad_output, gate, up);
}

at::Tensor geglu_packed_meta(const at::Tensor& input, c10::string_view approximate) {
  parse_gelu_approximate("geglu_packed", approximate);
  return gated_packed_meta("geglu_packed", input);
}

at::Tensor geglu_packed_backward_meta(const at::Tensor& grad_output, const at::Tensor& input,
                                      c10::string_view approximate) {
  parse_gelu_approximate("geglu_packed_backward", approximate);
  return gated_packed_backward_meta("geglu_packed_backward", grad_output, input);
}

// (gelu(g), gelu'(g)) in differentiable ATen ops (the double backward and torch.func), core/activation.h's formulas:
//   erf    c = Φ(g) = ½(1 + erf(g/√2)):    gelu = g · c,         gelu' = c + g · φ(g), φ(g) = exp(−g²/2)/√(2π)
//   tanh   t = tanh(√(2/π)(g + κg³)):      gelu = ½g · (1 + t),  gelu' = ½(1 + t) + ½g(1 − t²) · √(2/π)(1 + 3κg²)
// (ATen's gelu_backward is differentiable once only: a third derivative through it would raise.)
std::pair<at::Tensor, at::Tensor> gelu_value_and_derivative(const at::Tensor& g, Activation act) {
  if (act == Activation::kGELUTanh) {
    const at::Tensor g2 = g * g;
    const at::Tensor t = at::tanh((g + g2 * g * act::kGeluTanhKappa) * act::kSqrt2OverPi);
    const at::Tensor half_g = g * 0.5;
    return {half_g * (t + 1), (t + 1) * 0.5 + half_g * (1 - t * t) * ((g2 * (3 * act::kGeluTanhKappa) + 1) *
                                                                       act::kSqrt2OverPi)};
  }
  const at::Tensor cdf = (at::erf(g * act::kSqrt1_2) + 1) * 0.5;
  return {g * cdf, cdf + g * at::exp(g * g * -0.5) * act::kInvSqrt2Pi};
}

Activation saved_activation(const BackwardArgs& a) { return static_cast<Activation>(a.attrs[0].toInt()); }

// geglu: y = gelu(gate)·up; saves gate, up and the activation. One fused pass yields both gradients.
variable_list geglu_backward_fn(const BackwardArgs& a) {
  auto [grad_gate, grad_up] = opforge::geglu_backward(a.grads[0], a.saved[0], a.saved[1],
                                                      gelu_approximate_name(saved_activation(a)));
  return {grad_gate, grad_up};
}

// The same in differentiable ATen ops (double backward, torch.func).
variable_list geglu_double_backward_fn(const BackwardArgs& a) {
  const at::Tensor &gate = a.saved[0], &up = a.saved[1];
  const auto [value, derivative] = gelu_value_and_derivative(gate, saved_activation(a));
  at::Tensor grad_gate, grad_up;
  if (a.needs[0]) grad_gate = a.grads[0] * up.to(gate.scalar_type()) * derivative;
  if (a.needs[1]) grad_up = (a.grads[0] * value).to(up.scalar_type());
  return {grad_gate, grad_up};
}

at::Tensor geglu_autograd(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  const Activation act = parse_gelu_approximate("geglu", approximate);
  return autograd_op(
      {"geglu", "opforge::GegluBackward", geglu_backward_fn, geglu_double_backward_fn}, {kDifferentiable},
      [&](bool) { return opforge::geglu(gate, up, approximate); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(gate);
        n.save(up);
        n.attr(static_cast<int64_t>(act));
      },
      gate, up);
}

// ---- geglu_packed: geglu over input = [gate | up] (*, 2I); one gradient, grad_input (*, 2I) ----

// y = gelu(input[..., :I]) · input[..., I:]; saves input and the activation. One fused pass writes both halves.
variable_list geglu_packed_backward_fn(const BackwardArgs& a) {
  return {opforge::geglu_packed_backward(a.grads[0], a.saved[0], gelu_approximate_name(saved_activation(a)))};
}

// The same in differentiable ATen ops (double backward, torch.func): geglu_double_backward_fn's math on the halves.
variable_list geglu_packed_double_backward_fn(const BackwardArgs& a) {
  if (!a.needs[0]) return {at::Tensor()};
  const at::Tensor& input = a.saved[0];
  const c10::SymInt I = input.sym_size(-1) / 2;
  const at::Tensor gate = input.narrow_symint(-1, 0, I), up = input.narrow_symint(-1, I, I);
  const at::Tensor& dy = a.grads[0];
  const auto [value, derivative] = gelu_value_and_derivative(gate, saved_activation(a));
  return {at::cat({dy * up * derivative, dy * value}, -1)};
}

at::Tensor geglu_packed_autograd(const at::Tensor& input, c10::string_view approximate) {
  const Activation act = parse_gelu_approximate("geglu_packed", approximate);
  return autograd_op(
      {"geglu_packed", "opforge::GegluPackedBackward", geglu_packed_backward_fn, geglu_packed_double_backward_fn},
      {kDifferentiable}, [&](bool) { return opforge::geglu_packed(input, approximate); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(input);
        n.attr(static_cast<int64_t>(act));
      },
      input);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("geglu", &geglu_meta);
  m.impl("geglu_backward", &geglu_backward_meta);
  m.impl("geglu_packed", &geglu_packed_meta);
  m.impl("geglu_packed_backward", &geglu_packed_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("geglu", &geglu_autograd);
  register_backward_op_autograd(m, "geglu_backward");
  m.impl("geglu_packed", &geglu_packed_autograd);
  register_backward_op_autograd(m, "geglu_packed_backward");
}

// torch.autocast: as swiglu (and torch's gelu and mul, which autocast leaves in the input dtype)
OPFORGE_AUTOCAST(geglu, {{"geglu", AutocastPolicy::kInputDtype},
                         {"geglu_backward", AutocastPolicy::kInputDtype},
                         {"geglu_packed", AutocastPolicy::kInputDtype},
                         {"geglu_packed_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
