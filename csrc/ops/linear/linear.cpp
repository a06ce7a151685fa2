// linear: checkers, the public C++ API, Meta kernels and autograd.
#include "ops/linear/linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <type_traits>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/layout.h"

namespace opforge {
namespace linear_op {

void check_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
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
                    ": expected weight to be 2-D (out_features, in_features), but got shape ",
                    shape_str(weight.sym_sizes()));
  TORCH_CHECK_VALUE(input.sym_size(-1) == weight.sym_size(1), "opforge::", op,
                    ": expected input's last dimension to equal weight's in_features ", num_str(weight.sym_size(1)),
                    ", but got ", num_str(input.sym_size(-1)), " (input of shape ", shape_str(input.sym_sizes()),
                    ", weight of shape ", shape_str(weight.sym_sizes()), ")");
  if (has_bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "opforge::", op,
                      ": expected bias of shape [", num_str(weight.sym_size(0)), "] (weight's out_features), but got ",
                      shape_str(bias->sym_sizes()));
  }
}

c10::SymDimVector output_sym_sizes(const at::Tensor& input, const at::Tensor& weight) {
  const auto xs = input.sym_sizes();
  c10::SymDimVector out(xs.begin(), xs.end() - 1);
  out.push_back(weight.sym_size(0));
  return out;
}

namespace {
at::Tensor maybe_contiguous(const at::Tensor& t, bool contiguous) { return contiguous ? t.contiguous() : t; }
// t as [rows, cols]: t itself when it is 2-D already (no new view on the common path), else a reshape.
at::Tensor as_2d(const at::Tensor& t, int64_t rows, int64_t cols) { return t.dim() == 2 ? t : t.reshape({rows, cols}); }
}  // namespace

LinearProblem check_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::string_view activation, bool contiguous) {
  check_linear_args("linear", input, weight, bias);
  const Activation act = parse_activation("linear", activation);
  const auto dtype = input.scalar_type();
  const int64_t M = rows_of(input), K = weight.size(1), N = weight.size(0);
  LinearProblem p{M, K, N, act, maybe_contiguous(as_2d(input, M, K), contiguous),
                  maybe_contiguous(to_input_dtype(weight, dtype), contiguous), {}};
  if (bias.has_value() && bias->defined()) p.b = to_input_dtype(*bias, dtype).contiguous();
  return p;
}

Activation check_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& weight, std::optional<at::ScalarType> bias_dtype,
                                      c10::string_view activation, const std::optional<at::Tensor>& pre_activation) {
  check_linear_args("linear_backward", input, weight, std::nullopt);
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || is_supported_floating(*bias_dtype),
                   "opforge::linear_backward: expected bias_dtype to be a floating dtype (float64, float32, float16 "
                   "or bfloat16), but got ",
                   *bias_dtype);
  check_floating("linear_backward", "grad_output", grad_output);
  check_same_device("linear_backward", "grad_output", grad_output, "input", input);
  const auto expected = output_sym_sizes(input, weight);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(expected), "opforge::linear_backward: expected grad_output of shape ",
                    shape_str(expected), " (input's leading dims, out_features), but got ",
                    shape_str(grad_output.sym_sizes()));
  const Activation act = parse_activation("linear_backward", activation);
  const bool has_z = pre_activation.has_value() && pre_activation->defined();
  TORCH_CHECK_VALUE(act == Activation::kNone || has_z, "opforge::linear_backward: expected pre_activation (the "
                    "forward's input · weightᵀ + bias) for activation \"", activation_name(act),
                    "\", but got None");
  if (has_z) {
    check_floating("linear_backward", "pre_activation", *pre_activation);
    check_same_device("linear_backward", "pre_activation", *pre_activation, "input", input);
    TORCH_CHECK_VALUE(pre_activation->sym_sizes().equals(expected),
                      "opforge::linear_backward: expected pre_activation of shape ", shape_str(expected),
                      " (grad_output's shape), but got ", shape_str(pre_activation->sym_sizes()));
  }
  return act;
}

at::Tensor aten_activation_backward(const at::Tensor& dY, const at::Tensor& Z, Activation act) {
  switch (act) {
    case Activation::kNone: return dY;
    case Activation::kReLU: return at::threshold_backward(dY, Z, 0);  // Z may be relu's output: same sign test
    case Activation::kGELU: return at::gelu_backward(dY, Z, "none");
    case Activation::kGELUTanh: return at::gelu_backward(dY, Z, "tanh");
    case Activation::kSiLU: return at::silu_backward(dY, Z);
    case Activation::kSigmoid: break;  // not a linear activation (the parser rejects it)
  }
  TORCH_INTERNAL_ASSERT(false, "opforge::linear_backward: unhandled activation");
}

LinearBackwardProblem check_linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                            const at::Tensor& weight, std::optional<at::ScalarType> bias_dtype,
                                            c10::string_view activation,
                                            const std::optional<at::Tensor>& pre_activation, bool contiguous) {
  const Activation act =
      check_linear_backward_args(grad_output, input, weight, bias_dtype, activation, pre_activation);
  const auto dtype = input.scalar_type();
  const int64_t M = rows_of(input), K = weight.size(1), N = weight.size(0);
  at::Tensor Z;  // only an activation's derivative reads it
  if (act != Activation::kNone) Z = as_2d(to_input_dtype(*pre_activation, dtype), M, N).contiguous();
  return {M,
          K,
          N,
          act,
          maybe_contiguous(as_2d(to_input_dtype(grad_output, dtype), M, N), contiguous),
          maybe_contiguous(as_2d(input, M, K), contiguous),
          maybe_contiguous(to_input_dtype(weight, dtype), contiguous),
          Z};
}

}  // namespace linear_op

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  c10::string_view activation) {
  static auto op = typed_op<decltype(linear)>("opforge::linear");
  return op.call(input, weight, bias, activation);
}
std::tuple<at::Tensor, at::Tensor> _linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   c10::string_view activation) {
  static auto op = typed_op<decltype(_linear_forward)>("opforge::_linear_forward");
  return op.call(input, weight, bias, activation);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                               const at::Tensor& weight,
                                                               std::array<bool, 3> output_mask,
                                                               std::optional<at::ScalarType> bias_dtype,
                                                               c10::string_view activation,
                                                               const std::optional<at::Tensor>& pre_activation) {
  static auto op = typed_op<decltype(linear_backward)>("opforge::linear_backward");
  return op.call(grad_output, input, weight, output_mask, bias_dtype, activation, pre_activation);
}

namespace {

// ---- Meta: the same checkers, then outputs with the real kernels' shapes, dtypes and strides -------
// Real kernels return contiguous tensors: output and pre_activation (*, N) in input's dtype; grad_input
// in input's shape and dtype, grad_weight in weight's shape and dtype, grad_bias (N,) in bias_dtype.

at::Tensor linear_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       c10::string_view activation) {
  linear_op::check_linear_args("linear", input, weight, bias);
  parse_activation("linear", activation);
  return at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options());
}

std::tuple<at::Tensor, at::Tensor> linear_forward_meta(const at::Tensor& input, const at::Tensor& weight,
                                                       const std::optional<at::Tensor>& bias,
                                                       c10::string_view activation) {
  linear_op::check_linear_args("linear", input, weight, bias);
  parse_activation("linear", activation);
  const auto sizes = linear_op::output_sym_sizes(input, weight);
  return {at::empty_symint(sizes, input.options()), at::empty_symint(sizes, input.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype, c10::string_view activation,
    const std::optional<at::Tensor>& pre_activation) {
  linear_op::check_linear_backward_args(grad_output, input, weight, bias_dtype, activation, pre_activation);
  return linear_op::empty_backward_outputs(input, weight, output_mask, bias_dtype);
}

// ---- Autograd: save what backward needs, redispatch below autograd, route backward to the op -------

// linear: saved input, weight, bias (or undefined), z (pre-activation: the forward's z for gelu, gelu_tanh and
// silu, relu's output for relu, undefined for none); attributes: activation (int), bias dtype (int, -1 without
// bias). Edges: 0 input, 1 weight, 2 bias (an empty edge without bias).
variable_list linear_backward_fn(const BackwardArgs& a) {
  const auto act = static_cast<Activation>(a.attrs[0].toInt());
  const int64_t bias_dtype = a.attrs[1].toInt();
  std::optional<at::Tensor> z;
  if (act != Activation::kNone) z = a.saved[3];
  std::optional<at::ScalarType> bdt;
  if (bias_dtype >= 0) bdt = static_cast<at::ScalarType>(bias_dtype);
  auto [grad_input, grad_weight, grad_bias] =
      opforge::linear_backward(a.grads[0], a.saved[0], a.saved[1], {a.needs[0], a.needs[1], bdt && a.needs[2]}, bdt,
                               activation_name(act), z);
  return {grad_input, grad_weight, grad_bias};
}

// The same in differentiable ATen ops, for double backward and torch.func: z is recomputed from input, weight and
// bias so that its own dependence on them is differentiated too.
variable_list linear_double_backward_fn(const BackwardArgs& a) {
  const auto act = static_cast<Activation>(a.attrs[0].toInt());
  const at::Tensor &X = a.saved[0], &W = a.saved[1], &b = a.saved[2];
  const auto dtype = X.scalar_type();
  const at::Tensor Wc = W.to(dtype);
  at::Tensor dZ = a.grads[0];
  if (act != Activation::kNone) {
    const at::Tensor Z = at::linear(X, Wc, b.defined() ? std::optional<at::Tensor>(b.to(dtype)) : std::nullopt);
    if (act == Activation::kSiLU) {  // silu'(z) = s · (1 + z · (1 − s)): ATen's silu_backward has no derivative
      const at::Tensor s = at::sigmoid(Z);
      dZ = dZ * s * (1 + Z * (1 - s));
    } else {
      dZ = linear_op::aten_activation_backward(dZ, Z, act);
    }
  }
  at::Tensor grad_input, grad_weight, grad_bias;
  if (a.needs[0]) grad_input = at::matmul(dZ, Wc);
  const at::Tensor dZ2 = dZ.reshape({-1, dZ.size(-1)});
  if (a.needs[1]) grad_weight = dZ2.t().mm(X.reshape({-1, X.size(-1)})).to(W.scalar_type());
  if (a.needs[2] && b.defined()) grad_bias = dZ2.sum(0).to(b.scalar_type());
  return {grad_input, grad_weight, grad_bias};
}

// Saves what linear's node needs: input, weight, bias, z, activation, bias dtype.
void save_linear(OpNode& n, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                 Activation act, const at::Tensor& z) {
  n.save(input);
  n.save(weight);
  n.save(bias);
  n.save(z);
  n.attr(static_cast<int64_t>(act));
  n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
}

// linear: the forward returns (output, pre-activation to save): without gradients the public kernel alone (no
// node, no pre-activation kept); with them the private `_linear_forward` for gelu, gelu_tanh and silu, whose
// derivatives read z.
at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::string_view activation) {
  Activation act = Activation::kNone;
  return std::get<0>(autograd_op(
      {"linear", "opforge::LinearBackward", linear_backward_fn, linear_double_backward_fn},
      {kDifferentiable, kNotDifferentiable},
      [&](bool grad) -> std::tuple<at::Tensor, at::Tensor> {
        if (grad) act = parse_activation("linear", activation);
        if (!grad || act == Activation::kNone || act == Activation::kReLU)
          return {opforge::linear(input, weight, bias, activation), at::Tensor()};
        return opforge::_linear_forward(input, weight, bias, activation);
      },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>& out) {
        // relu'(z) = [z > 0] = [y > 0]: the output serves as the pre-activation. Saved detached (no grad_fn, so
        // no reference cycle through the node; the version counter is shared, so an in-place change of the
        // output before backward still raises).
        const auto& [y, z] = out;
        save_linear(n, input, weight, bias, act, act == Activation::kReLU ? y.detach() : z);
      },
      input, weight, bias));
}

// _linear_forward called directly: (output, pre_activation); the output differentiable as linear's, the
// pre_activation not (it gets no history).
std::tuple<at::Tensor, at::Tensor> linear_forward_autograd(const at::Tensor& input, const at::Tensor& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           c10::string_view activation) {
  return autograd_op(
      {"_linear_forward", "opforge::LinearBackward", linear_backward_fn, linear_double_backward_fn},
      {kDifferentiable, kNotDifferentiable},
      [&](bool) { return opforge::_linear_forward(input, weight, bias, activation); },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>& out) {
        const auto act = parse_activation("_linear_forward", activation);
        save_linear(n, input, weight, bias, act, act == Activation::kNone ? at::Tensor() : std::get<1>(out));
      },
      input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("linear", &linear_meta);
  m.impl("_linear_forward", &linear_forward_meta);
  m.impl("linear_backward", &linear_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("linear", &linear_autograd);
  m.impl("_linear_forward", &linear_forward_autograd);
  register_backward_op_autograd(m, "linear_backward");
}

// torch.autocast: as the native ops these mirror (core/autocast.h)
OPFORGE_AUTOCAST(linear, {{"linear", AutocastPolicy::kLowerPrecision}, {"_linear_forward", AutocastPolicy::kLowerPrecision}, {"linear_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
