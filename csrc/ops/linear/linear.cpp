// linear: checkers, the public C++ API, Meta kernels and autograd.
#include "ops/linear/linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"

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
// Rows of the flattened problem: the product of input's leading dims (well defined when K == 0).
int64_t rows_of(const at::Tensor& input) {
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) M *= input.size(d);
  return M;
}
at::Tensor maybe_contiguous(const at::Tensor& t, bool contiguous) { return contiguous ? t.contiguous() : t; }
}  // namespace

LinearProblem check_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           bool contiguous) {
  check_linear_args("linear", input, weight, bias);
  const auto dtype = input.scalar_type();
  const int64_t M = rows_of(input), K = weight.size(1), N = weight.size(0);
  LinearProblem p{M, K, N, maybe_contiguous(input.reshape({M, K}), contiguous),
                  maybe_contiguous(to_input_dtype(weight, dtype), contiguous), {}};
  if (bias.has_value() && bias->defined()) p.b = to_input_dtype(*bias, dtype).contiguous();
  return p;
}

void check_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                                std::optional<at::ScalarType> bias_dtype) {
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
}

LinearBackwardProblem check_linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                            const at::Tensor& weight, std::optional<at::ScalarType> bias_dtype,
                                            bool contiguous) {
  check_linear_backward_args(grad_output, input, weight, bias_dtype);
  const auto dtype = input.scalar_type();
  const int64_t M = rows_of(input), K = weight.size(1), N = weight.size(0);
  return {M,
          K,
          N,
          maybe_contiguous(to_input_dtype(grad_output, dtype).reshape({M, N}), contiguous),
          maybe_contiguous(input.reshape({M, K}), contiguous),
          maybe_contiguous(to_input_dtype(weight, dtype), contiguous)};
}

}  // namespace linear_op

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static auto op = typed_op<decltype(linear)>("opforge::linear");
  return op.call(input, weight, bias);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                               const at::Tensor& weight,
                                                               std::array<bool, 3> output_mask,
                                                               std::optional<at::ScalarType> bias_dtype) {
  static auto op = typed_op<decltype(linear_backward)>("opforge::linear_backward");
  return op.call(grad_output, input, weight, output_mask, bias_dtype);
}

namespace {

// ---- Meta: the same checkers, then outputs with the real kernels' shapes, dtypes and strides -------
// Real kernels return contiguous tensors: output (*, N) in input's dtype; grad_input in input's shape
// and dtype, grad_weight in weight's shape and dtype, grad_bias (N,) in bias_dtype.

at::Tensor linear_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  linear_op::check_linear_args("linear", input, weight, bias);
  return at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward_meta(const at::Tensor& grad_output,
                                                                    const at::Tensor& input, const at::Tensor& weight,
                                                                    std::array<bool, 3> output_mask,
                                                                    std::optional<at::ScalarType> bias_dtype) {
  linear_op::check_linear_backward_args(grad_output, input, weight, bias_dtype);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) grad_weight = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2]) {
    grad_bias = at::empty_symint({weight.sym_size(0)},
                                 input.options().dtype(linear_op::grad_bias_dtype(input, bias_dtype)));
  }
  return {grad_input, grad_weight, grad_bias};
}

// ---- Autograd: save what backward needs, redispatch below autograd, route backward to the op -------

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const bool has_bias = bias.has_value() && bias->defined();
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = has_bias;
    if (has_bias) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    return opforge::linear(input, weight, bias);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // grad_bias only when there is a bias and it requires grad (never for bias=None).
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    if (!grads[0].defined() || !(mask[0] || mask[1] || mask[2])) return {at::Tensor(), at::Tensor(), at::Tensor()};
    std::optional<at::ScalarType> bias_dtype;
    if (has_bias) bias_dtype = ctx->saved_data["bias_dtype"].toScalarType();
    auto [grad_input, grad_weight, grad_bias] = opforge::linear_backward(grads[0], saved[0], saved[1], mask, bias_dtype);
    return {grad_input, grad_weight, grad_bias};
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return LinearFunction::apply(input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("linear", &linear_meta);
  m.impl("linear_backward", &linear_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("linear", &linear_autograd);
  register_backward_op_autograd(m, "linear_backward");
}

}  // namespace opforge
