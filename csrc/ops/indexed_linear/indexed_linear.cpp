// indexed_linear: checkers, the public C++ API, Meta kernels and autograd.
#include "ops/indexed_linear/indexed_linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "opforge/opforge.h"

namespace opforge {
namespace indexed_linear_op {

void check_indexed_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& index, const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  check_floating(op, "input", input);
  check_floating(op, "weight", weight);
  if (has_bias) check_floating(op, "bias", *bias);
  TORCH_CHECK_VALUE(index.defined(), "opforge::", op, ": expected index to be a tensor, but got None");
  TORCH_CHECK_TYPE(index.scalar_type() == at::kLong, "opforge::", op,
                   ": expected index to have dtype int64, but got ", index.scalar_type());
  check_same_device(op, "input", input, "weight", weight);
  check_same_device(op, "input", input, "index", index);
  if (has_bias) check_same_device(op, "input", input, "bias", *bias);
  TORCH_CHECK_VALUE(input.dim() == 2, "opforge::", op, ": expected input to be 2-D (T, in_features), but got shape ",
                    shape_str(input.sym_sizes()));
  TORCH_CHECK_VALUE(weight.dim() == 3, "opforge::", op,
                    ": expected weight to be 3-D (num_experts, out_features, in_features), but got shape ",
                    shape_str(weight.sym_sizes()));
  TORCH_CHECK_VALUE(index.dim() == 1, "opforge::", op, ": expected index to be 1-D (T,), but got shape ",
                    shape_str(index.sym_sizes()));
  TORCH_CHECK_VALUE(index.sym_size(0) == input.sym_size(0), "opforge::", op,
                    ": expected index of length ", num_str(input.sym_size(0)), " (input's rows), but got ",
                    num_str(index.sym_size(0)));
  TORCH_CHECK_VALUE(input.sym_size(1) == weight.sym_size(2), "opforge::", op,
                    ": expected input's last dimension to equal weight's in_features ", num_str(weight.sym_size(2)),
                    ", but got ", num_str(input.sym_size(1)));
  if (has_bias) {
    TORCH_CHECK_VALUE(bias->dim() == 2 && bias->sym_size(0) == weight.sym_size(0) &&
                          bias->sym_size(1) == weight.sym_size(1),
                      "opforge::", op, ": expected bias of shape [", num_str(weight.sym_size(0)), ", ",
                      num_str(weight.sym_size(1)), "] (num_experts, out_features), but got ",
                      shape_str(bias->sym_sizes()));
  }
}

IndexedLinearProblem check_indexed_linear(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                          const at::Tensor& index, const std::optional<at::Tensor>& bias) {
  check_indexed_linear_args(op, input, weight, index, bias);
  const auto dtype = input.scalar_type();
  IndexedLinearProblem p{input.size(0), input.size(1), weight.size(1), weight.size(0), input.contiguous(),
                         to_input_dtype(weight, dtype).contiguous(), index.contiguous(), {}};
  if (bias.has_value() && bias->defined()) p.b = to_input_dtype(*bias, dtype).contiguous();
  return p;
}

void check_index_values_cpu(const char* op, const at::Tensor& index, int64_t E) {
  const auto* idx = index.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < index.numel(); ++t) {
    TORCH_CHECK_INDEX(idx[t] >= -1 && idx[t] < E, "opforge::", op, ": expected every index in [-1, ", num_str(E),
                      ") (−1: no weight; num_experts = ", num_str(E), "), but got ", num_str(idx[t]),
                      " at position ", num_str(t));
  }
}

void check_index_sorted_cpu(const char* op, const at::Tensor& index) {
  const auto* idx = index.const_data_ptr<int64_t>();
  for (int64_t t = 1; t < index.numel(); ++t) {
    const int64_t prev = idx[t - 1], cur = idx[t];
    const bool ok = cur == -1 || (prev != -1 && cur >= prev);
    TORCH_CHECK_VALUE(ok, "opforge::", op, ": expected index sorted by expert (non-decreasing, rows of -1 last) as "
                      "index_sorted=True promises, but got ", num_str(cur), " at position ", num_str(t), " after ",
                      num_str(prev));
  }
}

void check_indexed_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                        const at::Tensor& weight, const at::Tensor& index,
                                        std::optional<at::ScalarType> bias_dtype) {
  check_indexed_linear_args("indexed_linear_backward", input, weight, index, std::nullopt);
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || is_supported_floating(*bias_dtype),
                   "opforge::indexed_linear_backward: expected bias_dtype to be a floating dtype (float64, float32, "
                   "float16 or bfloat16), but got ",
                   *bias_dtype);
  check_floating("indexed_linear_backward", "grad_output", grad_output);
  check_same_device("indexed_linear_backward", "grad_output", grad_output, "input", input);
  TORCH_CHECK_VALUE(grad_output.dim() == 2 && grad_output.sym_size(0) == input.sym_size(0) &&
                        grad_output.sym_size(1) == weight.sym_size(1),
                    "opforge::indexed_linear_backward: expected grad_output of shape [", num_str(input.sym_size(0)),
                    ", ", num_str(weight.sym_size(1)), "], but got ", shape_str(grad_output.sym_sizes()));
}

IndexedLinearProblem check_indexed_linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                   const at::Tensor& weight, const at::Tensor& index,
                                                   std::optional<at::ScalarType> bias_dtype) {
  check_indexed_linear_backward_args(grad_output, input, weight, index, bias_dtype);
  return check_indexed_linear("indexed_linear_backward", input, weight, index, std::nullopt);
}

}  // namespace indexed_linear_op

// ---- public C++ API ----------------------------------------------------------------------------------

at::Tensor indexed_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                          const std::optional<at::Tensor>& bias, bool index_sorted) {
  static auto op = typed_op<decltype(indexed_linear)>("opforge::indexed_linear");
  return op.call(input, weight, index, bias, index_sorted);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> indexed_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype, bool index_sorted) {
  static auto op = typed_op<decltype(indexed_linear_backward)>("opforge::indexed_linear_backward");
  return op.call(grad_output, input, weight, index, output_mask, bias_dtype, index_sorted);
}

namespace {

// ---- Meta ------------------------------------------------------------------------------------------------

at::Tensor indexed_linear_meta(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                               const std::optional<at::Tensor>& bias, bool /*index_sorted*/) {
  indexed_linear_op::check_indexed_linear_args("indexed_linear", input, weight, index, bias);
  return at::empty_symint({input.sym_size(0), weight.sym_size(1)}, input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> indexed_linear_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype, bool /*index_sorted*/) {
  indexed_linear_op::check_indexed_linear_backward_args(grad_output, input, weight, index, bias_dtype);
  at::Tensor gi, gw, gb;
  if (output_mask[0]) gi = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) gw = at::empty_symint(weight.sym_sizes(), weight.options().memory_format(at::MemoryFormat::Contiguous));
  if (output_mask[2])
    gb = at::empty_symint({weight.sym_size(0), weight.sym_size(1)},
                          input.options().dtype(bias_dtype.value_or(input.scalar_type())));
  return {gi, gw, gb};
}

// ---- Autograd ----------------------------------------------------------------------------------------------
// Saved: input, weight, index. Attributes: bias dtype (-1 without bias), index_sorted. Edges: input, weight, bias.

variable_list indexed_linear_backward_fn(const BackwardArgs& a) {
  const int64_t bias_dtype = a.attrs[0].toInt();
  std::optional<at::ScalarType> bdt;
  if (bias_dtype >= 0) bdt = static_cast<at::ScalarType>(bias_dtype);
  auto [gi, gw, gb] = opforge::indexed_linear_backward(a.grads[0], a.saved[0], a.saved[1], a.saved[2],
                                                       {a.needs[0], a.needs[1], bdt.has_value() && a.needs[2]}, bdt,
                                                       a.attrs[1].toBool());
  return {gi, gw, gb};
}

// The same in differentiable ATen ops (double backward). Rows with index −1 (or out of range) contribute nothing.
variable_list indexed_linear_double_backward_fn(const BackwardArgs& a) {
  const int64_t bias_dtype = a.attrs[0].toInt();
  const at::Tensor &X = a.saved[0], &W = a.saved[1], &index = a.saved[2];
  const int64_t E = W.size(0);
  const at::Tensor valid = index.ge(0).logical_and(index.lt(E));
  const at::Tensor e = at::where(valid, index, at::zeros_like(index));
  const at::Tensor dY = a.grads[0] * valid.unsqueeze(1).to(a.grads[0].scalar_type());
  const at::Tensor We = W.to(X.scalar_type()).index_select(0, e);  // [T, N, K]
  variable_list out(3);
  if (a.needs[0]) out[0] = at::bmm(dY.unsqueeze(1), We).squeeze(1);
  if (a.needs[1]) {
    const at::Tensor per_token = dY.unsqueeze(2) * X.unsqueeze(1);  // [T, N, K]
    out[1] = at::zeros({E, W.size(1), W.size(2)}, per_token.options()).index_add(0, e, per_token).to(W.scalar_type());
  }
  if (a.needs[2] && bias_dtype >= 0)
    out[2] = at::zeros({E, W.size(1)}, dY.options()).index_add(0, e, dY).to(static_cast<at::ScalarType>(bias_dtype));
  return out;
}

at::Tensor indexed_linear_autograd(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                                   const std::optional<at::Tensor>& bias, bool index_sorted) {
  return autograd_op(
      {"indexed_linear", "opforge::IndexedLinearBackward", indexed_linear_backward_fn,
       indexed_linear_double_backward_fn},
      {kDifferentiable}, [&](bool) { return opforge::indexed_linear(input, weight, index, bias, index_sorted); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(input);
        n.save(weight);
        n.save(index);
        n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
        n.attr(index_sorted);
      },
      input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("indexed_linear", &indexed_linear_meta);
  m.impl("indexed_linear_backward", &indexed_linear_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("indexed_linear", &indexed_linear_autograd);
  register_backward_op_autograd(m, "indexed_linear_backward");
}

// torch.autocast: as torch's linear (index is not floating, so never cast)
OPFORGE_AUTOCAST(indexed_linear, {{"indexed_linear", AutocastPolicy::kLowerPrecision}, {"indexed_linear_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
