// swiglu_linear: checkers, the public C++ API, the backend-independent backward, Meta kernels and autograd.
#include "ops/swiglu_linear/swiglu_linear.h"
#include "ops/linear/linear.h"

#include <torch/autograd.h>
#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/layout.h"

namespace opforge {
namespace swiglu_linear_op {

void check_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  check_floating(op, "input", input);
  check_floating(op, "weight", weight);
  if (has_bias) check_floating(op, "bias", *bias);
  check_same_device(op, "input", input, "weight", weight);
  if (has_bias) check_same_device(op, "input", input, "bias", *bias);
  TORCH_CHECK_VALUE(input.dim() >= 1, "opforge::", op,
                    ": expected input to have at least 1 dimension (*, in_features), but got a 0-dimensional tensor");
  TORCH_CHECK_VALUE(weight.dim() == 2, "opforge::", op,
                    ": expected weight to be 2-D (2 * intermediate, in_features), but got shape ",
                    shape_str(weight.sym_sizes()));
  TORCH_CHECK_VALUE(weight.sym_size(0) % 2 == 0, "opforge::", op,
                    ": expected weight's rows to be even (the gate's and the up projection's rows interleaved), "
                    "but got ",
                    num_str(weight.sym_size(0)));
  TORCH_CHECK_VALUE(input.sym_size(-1) == weight.sym_size(1), "opforge::", op,
                    ": expected input's last dimension to equal weight's in_features ", num_str(weight.sym_size(1)),
                    ", but got ", num_str(input.sym_size(-1)));
  if (has_bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "opforge::", op,
                      ": expected bias of shape [", num_str(weight.sym_size(0)), "] (weight's rows), but got ",
                      shape_str(bias->sym_sizes()));
  }
}

c10::SymDimVector output_sym_sizes(const at::Tensor& input, const at::Tensor& weight) {
  const auto xs = input.sym_sizes();
  c10::SymDimVector out(xs.begin(), xs.end() - 1);
  out.push_back(weight.sym_size(0) / 2);
  return out;
}

namespace {
c10::SymDimVector pre_activation_sym_sizes(const at::Tensor& input, const at::Tensor& weight) {
  const auto xs = input.sym_sizes();
  c10::SymDimVector out(xs.begin(), xs.end() - 1);
  out.push_back(weight.sym_size(0));
  return out;
}
}  // namespace

Problem check(const char* op, const at::Tensor& input, const at::Tensor& weight,
              const std::optional<at::Tensor>& bias) {
  check_args(op, input, weight, bias);
  const auto dtype = input.scalar_type();
  const int64_t M = rows_of(input), K = weight.size(1), N = weight.size(0);
  Problem p{M, K, N, input.reshape({M, K}).contiguous(), to_input_dtype(weight, dtype).contiguous(), {}};
  if (bias.has_value() && bias->defined()) p.b = to_input_dtype(*bias, dtype).contiguous();
  return p;
}

void check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& pre_activation, std::optional<at::ScalarType> bias_dtype) {
  constexpr const char* op = "swiglu_linear_backward";
  check_args(op, input, weight, std::nullopt);
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || is_supported_floating(*bias_dtype), "opforge::", op,
                   ": expected bias_dtype to be a floating dtype (float64, float32, float16 or bfloat16), but got ",
                   *bias_dtype);
  check_floating(op, "grad_output", grad_output);
  check_floating(op, "pre_activation", pre_activation);
  check_same_device(op, "grad_output", grad_output, "input", input);
  check_same_device(op, "pre_activation", pre_activation, "input", input);
  const auto expected = output_sym_sizes(input, weight);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(expected), "opforge::", op, ": expected grad_output of shape ",
                    shape_str(expected), " (input's leading dims, half of weight's rows), but got ",
                    shape_str(grad_output.sym_sizes()));
  const auto expected_z = pre_activation_sym_sizes(input, weight);
  TORCH_CHECK_VALUE(pre_activation.sym_sizes().equals(expected_z), "opforge::", op,
                    ": expected pre_activation of shape ", shape_str(expected_z),
                    " (the forward's input · weightᵀ + bias), but got ", shape_str(pre_activation.sym_sizes()));
}

at::Tensor swiglu_of_interleaved(const at::Tensor& Z) {
  const at::Tensor pairs = Z.unflatten(-1, {Z.size(-1) / 2, 2});  // [..., I, 2]: (gate, up) per output
  return opforge::swiglu(pairs.select(-1, 0), pairs.select(-1, 1)).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                        const at::Tensor& weight, const at::Tensor& pre_activation,
                                                        std::array<bool, 3> output_mask,
                                                        std::optional<at::ScalarType> bias_dtype) {
  check_backward_args(grad_output, input, weight, pre_activation, bias_dtype);
  const auto dtype = input.scalar_type();
  const at::Tensor Z = to_input_dtype(pre_activation, dtype);
  const at::Tensor pairs = Z.unflatten(-1, {Z.size(-1) / 2, 2});
  auto [dg, du] = opforge::swiglu_backward(to_input_dtype(grad_output, dtype), pairs.select(-1, 0), pairs.select(-1, 1));
  const at::Tensor dZ = at::stack({dg, du}, -1).flatten(-2);  // interleaved again: [..., 2I]
  return opforge::linear_backward(dZ, input, weight, output_mask, bias_dtype, "none", std::nullopt);
}

}  // namespace swiglu_linear_op

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor swiglu_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static auto op = typed_op<decltype(swiglu_linear)>("opforge::swiglu_linear");
  return op.call(input, weight, bias);
}
std::tuple<at::Tensor, at::Tensor> _swiglu_linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias) {
  static auto op = typed_op<decltype(_swiglu_linear_forward)>("opforge::_swiglu_linear_forward");
  return op.call(input, weight, bias);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_linear_backward(const at::Tensor& grad_output,
                                                                      const at::Tensor& input, const at::Tensor& weight,
                                                                      const at::Tensor& pre_activation,
                                                                      std::array<bool, 3> output_mask,
                                                                      std::optional<at::ScalarType> bias_dtype) {
  static auto op = typed_op<decltype(swiglu_linear_backward)>("opforge::swiglu_linear_backward");
  return op.call(grad_output, input, weight, pre_activation, output_mask, bias_dtype);
}

namespace {

// ---- Meta: outputs as the real kernels return them, contiguous: output (*, I) and pre_activation (*, 2I) in
// input's dtype; grad_input in input's shape and dtype, grad_weight in weight's, grad_bias (2I,) in bias_dtype.

at::Tensor swiglu_linear_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  swiglu_linear_op::check_args("swiglu_linear", input, weight, bias);
  return at::empty_symint(swiglu_linear_op::output_sym_sizes(input, weight), input.options());
}

std::tuple<at::Tensor, at::Tensor> swiglu_linear_forward_meta(const at::Tensor& input, const at::Tensor& weight,
                                                              const std::optional<at::Tensor>& bias) {
  swiglu_linear_op::check_args("swiglu_linear", input, weight, bias);
  return {at::empty_symint(swiglu_linear_op::output_sym_sizes(input, weight), input.options()),
          at::empty_symint(swiglu_linear_op::pre_activation_sym_sizes(input, weight), input.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_linear_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& pre_activation,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype) {
  swiglu_linear_op::check_backward_args(grad_output, input, weight, pre_activation, bias_dtype);
  return linear_op::empty_backward_outputs(input, weight, output_mask, bias_dtype);
}

// ---- Autograd: saved input, weight, bias (or undefined) and z; attribute: bias dtype (-1 without bias).
// Edges: 0 input, 1 weight, 2 bias.
variable_list swiglu_linear_backward_fn(const BackwardArgs& a) {
  const int64_t bias_dtype = a.attrs[0].toInt();
  std::optional<at::ScalarType> bdt;
  if (bias_dtype >= 0) bdt = static_cast<at::ScalarType>(bias_dtype);
  auto [grad_input, grad_weight, grad_bias] = opforge::swiglu_linear_backward(
      a.grads[0], a.saved[0], a.saved[1], a.saved[3], {a.needs[0], a.needs[1], bdt && a.needs[2]}, bdt);
  return {grad_input, grad_weight, grad_bias};
}

// The same in differentiable ATen ops (double backward, torch.func): z recomputed from input, weight and bias.
variable_list swiglu_linear_double_backward_fn(const BackwardArgs& a) {
  const at::Tensor &X = a.saved[0], &W = a.saved[1], &b = a.saved[2];
  const auto dtype = X.scalar_type();
  const at::Tensor Wc = W.to(dtype);
  const at::Tensor Z = at::linear(X, Wc, b.defined() ? std::optional<at::Tensor>(b.to(dtype)) : std::nullopt);
  const at::Tensor pairs = Z.unflatten(-1, {Z.size(-1) / 2, 2});
  const at::Tensor g = pairs.select(-1, 0), u = pairs.select(-1, 1);
  const at::Tensor s = at::sigmoid(g);
  const at::Tensor& dy = a.grads[0];
  const at::Tensor dZ = at::stack({dy * u * s * (1 + g * (1 - s)), dy * g * s}, -1).flatten(-2);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (a.needs[0]) grad_input = at::matmul(dZ, Wc);
  const at::Tensor dZ2 = dZ.reshape({-1, dZ.size(-1)});
  if (a.needs[1]) grad_weight = dZ2.t().mm(X.reshape({-1, X.size(-1)})).to(W.scalar_type());
  if (a.needs[2] && b.defined()) grad_bias = dZ2.sum(0).to(b.scalar_type());
  return {grad_input, grad_weight, grad_bias};
}

void save(OpNode& n, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
          const at::Tensor& z) {
  n.save(input);
  n.save(weight);
  n.save(bias);
  n.save(z);
  n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
}

// Without gradients the public kernel alone (z not kept); with them _swiglu_linear_forward, whose z backward reads.
at::Tensor swiglu_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias) {
  return std::get<0>(autograd_op(
      {"swiglu_linear", "opforge::SwigluLinearBackward", swiglu_linear_backward_fn, swiglu_linear_double_backward_fn},
      {kDifferentiable, kNotDifferentiable},
      [&](bool grad) -> std::tuple<at::Tensor, at::Tensor> {
        if (!grad) return {opforge::swiglu_linear(input, weight, bias), at::Tensor()};
        return opforge::_swiglu_linear_forward(input, weight, bias);
      },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>& out) { save(n, input, weight, bias, std::get<1>(out)); },
      input, weight, bias));
}

std::tuple<at::Tensor, at::Tensor> swiglu_linear_forward_autograd(const at::Tensor& input, const at::Tensor& weight,
                                                                  const std::optional<at::Tensor>& bias) {
  return autograd_op(
      {"_swiglu_linear_forward", "opforge::SwigluLinearBackward", swiglu_linear_backward_fn,
       swiglu_linear_double_backward_fn},
      {kDifferentiable, kNotDifferentiable},
      [&](bool) { return opforge::_swiglu_linear_forward(input, weight, bias); },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>& out) { save(n, input, weight, bias, std::get<1>(out)); },
      input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("swiglu_linear", &swiglu_linear_meta);
  m.impl("_swiglu_linear_forward", &swiglu_linear_forward_meta);
  m.impl("swiglu_linear_backward", &swiglu_linear_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("swiglu_linear", &swiglu_linear_autograd);
  m.impl("_swiglu_linear_forward", &swiglu_linear_forward_autograd);
  register_backward_op_autograd(m, "swiglu_linear_backward");
}

// torch.autocast: as linear (core/autocast.h)
OPFORGE_AUTOCAST(swiglu_linear, {{"swiglu_linear", AutocastPolicy::kLowerPrecision},
                                 {"_swiglu_linear_forward", AutocastPolicy::kLowerPrecision},
                                 {"swiglu_linear_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
