// linear_cat: checkers, the public C++ API, Meta kernels and autograd.
#include "ops/linear_cat/linear_cat.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/layout.h"
#include "core/legacy_batched.h"
#include "opforge/opforge.h"

namespace opforge {
namespace linear_cat_op {

void check_linear_cat_args(const char* op, at::TensorList inputs, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!inputs.empty(), "opforge::", op, ": expected a non-empty list of inputs, but got an empty list");
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string name = "inputs[" + num_str(static_cast<int64_t>(i)) + "]";
    check_floating(op, name.c_str(), inputs[i]);
    TORCH_CHECK_TYPE(inputs[i].scalar_type() == inputs[0].scalar_type(), "opforge::", op,
                     ": expected every input to have inputs[0]'s dtype ", inputs[0].scalar_type(), ", but got ",
                     inputs[i].scalar_type(), " for ", name);
    check_same_device(op, "inputs[0]", inputs[0], name.c_str(), inputs[i]);
    TORCH_CHECK_VALUE(inputs[i].dim() >= 1, "opforge::", op, ": expected ", name,
                      " to have at least 1 dimension (*, K_i), but got a 0-dimensional tensor");
    const auto a = inputs[0].sym_sizes(), s = inputs[i].sym_sizes();
    TORCH_CHECK_VALUE(a.size() == s.size() && a.slice(0, a.size() - 1).equals(s.slice(0, s.size() - 1)), "opforge::",
                      op, ": expected every input to have inputs[0]'s leading dims ",
                      shape_str(a.slice(0, a.size() - 1)), ", but got ", name, " of shape ", shape_str(s));
  }
  check_floating(op, "weight", weight);
  check_same_device(op, "inputs[0]", inputs[0], "weight", weight);
  TORCH_CHECK_VALUE(weight.dim() == 2, "opforge::", op,
                    ": expected weight to be 2-D (out_features, in_features), but got shape ",
                    shape_str(weight.sym_sizes()));
  c10::SymInt K = 0;
  for (const auto& x : inputs) K = K + x.sym_size(-1);
  TORCH_CHECK_VALUE(K == weight.sym_size(1), "opforge::", op,
                    ": expected the inputs' last dims to sum to weight's in_features ", num_str(weight.sym_size(1)),
                    ", but got ", num_str(K));
  if (has_bias) {
    check_floating(op, "bias", *bias);
    check_same_device(op, "inputs[0]", inputs[0], "bias", *bias);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), "opforge::", op,
                      ": expected bias of shape [", num_str(weight.sym_size(0)), "] (weight's out_features), but got ",
                      shape_str(bias->sym_sizes()));
  }
}

c10::SymDimVector output_sym_sizes(at::TensorList inputs, const at::Tensor& weight) {
  const auto xs = inputs[0].sym_sizes();
  c10::SymDimVector out(xs.begin(), xs.end() - 1);
  out.push_back(weight.sym_size(0));
  return out;
}

namespace {
// A 2-D [r, c] matrix a BLAS reads directly: unit column stride and row stride >= max(1, c).
at::Tensor blas_ready(const at::Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  const bool ok = (t.stride(1) == 1 || c <= 1) && (t.stride(0) >= std::max<int64_t>(1, c) || r <= 1);
  return ok ? t : t.contiguous();
}
}  // namespace

LinearCatProblem check_linear_cat(at::TensorList inputs, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, bool contiguous) {
  check_linear_cat_args("linear_cat", inputs, weight, bias);
  const auto dtype = inputs[0].scalar_type();
  LinearCatProblem p;
  p.M = 1;
  for (int64_t d = 0; d + 1 < inputs[0].dim(); ++d) p.M *= inputs[0].size(d);
  p.N = weight.size(0);
  p.K = weight.size(1);
  int64_t k0 = 0;
  for (const auto& x : inputs) {
    const int64_t Ki = x.size(-1);
    at::Tensor X2 = x.dim() == 2 ? x : x.reshape({p.M, Ki});
    p.X.push_back(contiguous ? blas_ready(X2) : X2);
    p.k0.push_back(k0);
    p.Ki.push_back(Ki);
    k0 += Ki;
  }
  at::Tensor W = to_input_dtype(weight, dtype);
  p.W = contiguous ? blas_ready(W) : W;
  if (bias.has_value() && bias->defined()) p.b = to_input_dtype(*bias, dtype).contiguous();
  return p;
}

void check_linear_cat_backward_args(const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight,
                                    std::optional<at::ScalarType> bias_dtype) {
  check_linear_cat_args("linear_cat_backward", inputs, weight, std::nullopt);
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || is_supported_floating(*bias_dtype),
                   "opforge::linear_cat_backward: expected bias_dtype to be a floating dtype (float64, float32, "
                   "float16 or bfloat16), but got ",
                   *bias_dtype);
  check_floating("linear_cat_backward", "grad_output", grad_output);
  check_same_device("linear_cat_backward", "grad_output", grad_output, "inputs[0]", inputs[0]);
  const auto expected = output_sym_sizes(inputs, weight);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(expected),
                    "opforge::linear_cat_backward: expected grad_output of shape ", shape_str(expected),
                    " (the inputs' leading dims, out_features), but got ", shape_str(grad_output.sym_sizes()));
}

at::Tensor grad_output_2d(const at::Tensor& grad_output, const LinearCatProblem& p, bool contiguous) {
  at::Tensor dY = to_input_dtype(grad_output, p.X[0].scalar_type());
  if (dY.dim() != 2) dY = dY.reshape({p.M, p.N});
  return contiguous ? blas_ready(dY) : dY;
}

}  // namespace linear_cat_op

// ---- public C++ API ----------------------------------------------------------------------------------

at::Tensor linear_cat(at::TensorList inputs, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static auto op = typed_op<decltype(linear_cat)>("opforge::linear_cat");
  return op.call(inputs, weight, bias);
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> linear_cat_backward(
    const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype) {
  static auto op = typed_op<decltype(linear_cat_backward)>("opforge::linear_cat_backward");
  return op.call(grad_output, inputs, weight, output_mask, bias_dtype);
}

namespace {

// ---- Meta: outputs with the real kernels' shapes, dtypes and (contiguous) strides ----------------------

at::Tensor linear_cat_meta(at::TensorList inputs, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  linear_cat_op::check_linear_cat_args("linear_cat", inputs, weight, bias);
  return at::empty_symint(linear_cat_op::output_sym_sizes(inputs, weight), inputs[0].options());
}

std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> linear_cat_backward_meta(
    const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype) {
  linear_cat_op::check_linear_cat_backward_args(grad_output, inputs, weight, bias_dtype);
  std::vector<at::Tensor> grad_inputs;
  at::Tensor grad_weight, grad_bias;
  if (output_mask[0])
    for (const auto& x : inputs) grad_inputs.push_back(at::empty_symint(x.sym_sizes(), x.options()));
  if (output_mask[1]) grad_weight = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2])
    grad_bias = at::empty_symint({weight.sym_size(0)},
                                 inputs[0].options().dtype(bias_dtype.value_or(inputs[0].scalar_type())));
  return {grad_inputs, grad_weight, grad_bias};
}

// ---- Autograd ------------------------------------------------------------------------------------------
// Saved: the P pieces, weight. Attributes: P, bias dtype (-1 without bias). Edges: the P pieces, weight, bias.

variable_list linear_cat_backward_fn(const BackwardArgs& a) {
  const int64_t P = a.attrs[0].toInt(), bias_dtype = a.attrs[1].toInt();
  std::optional<at::ScalarType> bdt;
  if (bias_dtype >= 0) bdt = static_cast<at::ScalarType>(bias_dtype);
  bool need_inputs = false;
  for (int64_t i = 0; i < P; ++i) need_inputs = need_inputs || a.needs[i];
  std::vector<at::Tensor> pieces(a.saved.begin(), a.saved.begin() + P);
  auto [grad_inputs, grad_weight, grad_bias] = opforge::linear_cat_backward(
      a.grads[0], pieces, a.saved[P], {need_inputs, a.needs[P], bdt.has_value() && a.needs[P + 1]}, bdt);
  variable_list out(P + 2);
  for (int64_t i = 0; i < P && i < static_cast<int64_t>(grad_inputs.size()); ++i) out[i] = grad_inputs[i];
  out[P] = grad_weight;
  out[P + 1] = grad_bias;
  return out;
}

// The same in differentiable ATen ops (double backward, torch.func with create_graph).
variable_list linear_cat_double_backward_fn(const BackwardArgs& a) {
  const int64_t P = a.attrs[0].toInt(), bias_dtype = a.attrs[1].toInt();
  const at::Tensor& W = a.saved[P];
  const auto dtype = a.saved[0].scalar_type();
  const at::Tensor Wc = W.to(dtype);
  const at::Tensor& dY = a.grads[0];
  const int64_t M = rows_of(dY);
  const at::Tensor dY2 = dY.reshape({M, dY.size(-1)});
  variable_list out(P + 2);
  std::vector<at::Tensor> dW_parts;
  int64_t k0 = 0;
  for (int64_t i = 0; i < P; ++i) {
    const at::Tensor& X = a.saved[i];
    const int64_t Ki = X.size(-1);
    const at::Tensor Wi = Wc.narrow(1, k0, Ki);
    if (a.needs[i]) out[i] = at::matmul(dY, Wi);
    if (a.needs[P]) dW_parts.push_back(dY2.t().mm(X.reshape({M, Ki})));
    k0 += Ki;
  }
  if (a.needs[P]) out[P] = at::cat(dW_parts, 1).to(W.scalar_type());
  if (a.needs[P + 1] && bias_dtype >= 0) out[P + 1] = dY2.sum(0).to(static_cast<at::ScalarType>(bias_dtype));
  return out;
}

at::Tensor linear_cat_autograd(at::TensorList inputs, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  return autograd_op(
      {"linear_cat", "opforge::LinearCatBackward", linear_cat_backward_fn, linear_cat_double_backward_fn},
      {kDifferentiable}, [&](bool) { return opforge::linear_cat(inputs, weight, bias); },
      [&](OpNode& n, const at::Tensor&) {
        for (const auto& x : inputs) n.save(x);
        n.save(weight);
        n.attr(static_cast<int64_t>(inputs.size()));
        n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
      },
      inputs, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("linear_cat", &linear_cat_meta);
  m.impl("linear_cat_backward", &linear_cat_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("linear_cat", &linear_cat_autograd);
  register_backward_op_autograd(m, "linear_cat_backward");
}

// torch.autograd.grad(..., is_grads_batched=True) runs the backward under torch's legacy vmap, whose own fallback
// refuses an op with a Tensor[] argument or return: the list-aware per-sample loop of core/legacy_batched.
TORCH_LIBRARY_IMPL(opforge, Batched, m) {
  register_legacy_batched_loop(m, "linear_cat");
  register_legacy_batched_loop(m, "linear_cat_backward");
}

// torch.autocast: as torch's linear (and cat, which follows its inputs' dtype after they are cast)
OPFORGE_AUTOCAST(linear_cat, {{"linear_cat", AutocastPolicy::kLowerPrecision}, {"linear_cat_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
