// fake_quant_linear: checkers, the forward and backward shared by the backends, the public C++ API, Meta
// kernels, autograd and autocast.
#include "ops/fake_quant_linear/fake_quant_linear.h"

#include <torch/library.h>

#include <cstring>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/layout.h"
#include "ops/linear/linear.h"

namespace opforge {
namespace fake_quant_linear_op {

void check_quant_args(const char* op, int64_t weight_bits, int64_t group_size, const c10::SymInt& K) {
  // the argument's name as the op's schema spells it: fake_quant_linear's weight_bits, fake_quantize_weight's bits
  const char* bits_name = std::strcmp(op, "fake_quantize_weight") == 0 ? "bits" : "weight_bits";
  TORCH_CHECK_VALUE(weight_bits >= 2 && weight_bits <= 8, "opforge::", op, ": expected ", bits_name,
                    " in [2, 8], but got ", num_str(weight_bits));
  TORCH_CHECK_VALUE(group_size >= -1, "opforge::", op,
                    ": expected group_size to be -1 (per channel), 0 (per tensor) or a positive divisor of "
                    "in_features, but got ",
                    num_str(group_size));
  if (group_size > 0) {
    TORCH_CHECK_VALUE(K % group_size == 0, "opforge::", op, ": expected group_size to divide in_features ",
                      num_str(K), " (groups run along K; -1 for per channel, 0 for per tensor), but got ",
                      num_str(group_size));
  }
}

void check_fake_quant_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size) {
  linear_op::check_linear_args(op, input, weight, bias);
  check_quant_args(op, weight_bits, group_size, weight.sym_size(1));
}

void check_fake_quant_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& weight, const at::Tensor& weight_mask,
                                           const std::optional<at::Tensor>& input_mask,
                                           std::optional<at::ScalarType> weight_dtype,
                                           std::optional<at::ScalarType> bias_dtype) {
  constexpr const char* op = "fake_quant_linear_backward";
  linear_op::check_linear_backward_args(grad_output, input, weight, bias_dtype, "none", std::nullopt);
  TORCH_CHECK_TYPE(!weight_dtype.has_value() || is_supported_floating(*weight_dtype), "opforge::", op,
                   ": expected weight_dtype to be a floating dtype (float64, float32, float16 or bfloat16), but got ",
                   *weight_dtype);
  auto check_mask = [&](const char* name, const at::Tensor& m, const at::Tensor& like, const char* like_name) {
    TORCH_CHECK_TYPE(m.scalar_type() == at::kBool, "opforge::", op, ": expected ", name, " of dtype bool, but got ",
                     m.scalar_type());
    check_same_device(op, name, m, like_name, like);
    TORCH_CHECK_VALUE(m.sym_sizes().equals(like.sym_sizes()), "opforge::", op, ": expected ", name,
                      " of shape ", shape_str(like.sym_sizes()), " (", like_name, "'s), but got ",
                      shape_str(m.sym_sizes()));
  };
  check_mask("weight_mask", weight_mask, weight, "weight");
  if (input_mask.has_value() && input_mask->defined()) check_mask("input_mask", *input_mask, input, "input");
}

void check_fake_quantize_weight_args(const at::Tensor& weight, int64_t bits, int64_t group_size) {
  check_floating("fake_quantize_weight", "weight", weight);
  TORCH_CHECK_VALUE(weight.dim() == 2, "opforge::fake_quantize_weight: expected weight to be 2-D (out_features, "
                    "in_features), but got shape ", shape_str(weight.sym_sizes()));
  check_quant_args("fake_quantize_weight", bits, group_size, weight.sym_size(1));
}

c10::SymDimVector qparams_sym_sizes(const at::Tensor& weight, int64_t group_size) {
  if (group_size == 0) return {c10::SymInt(1), c10::SymInt(1)};
  if (group_size < 0) return {weight.sym_size(0), c10::SymInt(1)};
  return {weight.sym_size(0), weight.sym_size(1) / group_size};
}

FakeQuantized empty_fake_quantized(const at::Tensor& X, Grouping g, bool want_mask) {
  const int64_t R = X.size(0), K = X.size(1), L = g.length;
  FakeQuantized out;
  out.output = at::empty_like(X);
  if (want_mask) out.mask = at::empty(X.sizes(), X.options().dtype(at::kBool));
  const auto fopts = X.options().dtype(at::kFloat);
  const int64_t qrows = g.per_tensor ? 1 : R, qcols = g.per_tensor ? 1 : (L > 0 ? K / L : 0);
  out.scale = at::empty({qrows, qcols}, fopts);
  out.zero_point = at::empty({qrows, qcols}, fopts.dtype(at::kInt));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_forward_impl(
    FakeQuantizeRowsFn fq_rows, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size, bool symmetric, bool act_quant,
    bool want_masks) {
  check_fake_quant_linear_args("fake_quant_linear", input, weight, bias, weight_bits, group_size);
  const int64_t M = rows_of(input), K = weight.size(1);
  // fq_w in weight's own dtype (as torch.fake_quantize_* returns it), then converted once to input's dtype.
  FakeQuantized w = fq_rows(weight.contiguous(), weight_bits, grouping_of(group_size, K), symmetric, want_masks);
  at::Tensor Wq = to_input_dtype(w.output, input.scalar_type());
  at::Tensor Xq, Xm;
  if (act_quant) {
    FakeQuantized x = fq_rows(input.reshape({M, K}).contiguous(), 8, Grouping{false, K}, false, want_masks);
    Xq = x.output.view(input.sizes());
    if (want_masks) Xm = x.mask.view(input.sizes());
  }
  at::Tensor Y = opforge::linear(act_quant ? Xq : input, Wq, bias, "none");
  if (!want_masks) return {Y, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  if (!act_quant) {
    Xq = at::empty({0}, input.options());
    Xm = at::empty({0}, input.options().dtype(at::kBool));
  }
  return {Y, Wq, w.mask, Xq, Xm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_backward_impl(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_mask,
    const std::optional<at::Tensor>& input_mask, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> weight_dtype, std::optional<at::ScalarType> bias_dtype) {
  check_fake_quant_linear_backward_args(grad_output, input, weight, weight_mask, input_mask, weight_dtype,
                                        bias_dtype);
  auto [dX, dW, db] = opforge::linear_backward(grad_output, input, weight, output_mask, bias_dtype, "none",
                                               std::nullopt);
  // The straight-through estimator: gradients of values the quantizer clamped are zero (as torch's
  // fake_quantize backward, grad · mask).
  if (dX.defined() && input_mask.has_value() && input_mask->defined()) dX.mul_(*input_mask);
  if (dW.defined()) {
    dW.mul_(weight_mask);
    if (weight_dtype.has_value() && *weight_dtype != dW.scalar_type()) dW = dW.to(*weight_dtype);
  }
  return {dX, dW, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight_impl(FakeQuantizeRowsFn fq_rows,
                                                                                    const at::Tensor& weight,
                                                                                    int64_t bits, int64_t group_size,
                                                                                    bool symmetric) {
  check_fake_quantize_weight_args(weight, bits, group_size);
  FakeQuantized w = fq_rows(weight.contiguous(), bits, grouping_of(group_size, weight.size(1)), symmetric, true);
  return {w.output, w.mask, w.scale, w.zero_point};
}

}  // namespace fake_quant_linear_op

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor fake_quant_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             int64_t weight_bits, int64_t group_size, bool symmetric, bool act_quant) {
  static auto op = typed_op<decltype(fake_quant_linear)>("opforge::fake_quant_linear");
  return op.call(input, weight, bias, weight_bits, group_size, symmetric, act_quant);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _fake_quant_linear_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t weight_bits,
    int64_t group_size, bool symmetric, bool act_quant) {
  static auto op = typed_op<decltype(_fake_quant_linear_forward)>("opforge::_fake_quant_linear_forward");
  return op.call(input, weight, bias, weight_bits, group_size, symmetric, act_quant);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_mask,
    const std::optional<at::Tensor>& input_mask, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> weight_dtype, std::optional<at::ScalarType> bias_dtype) {
  static auto op = typed_op<decltype(fake_quant_linear_backward)>("opforge::fake_quant_linear_backward");
  return op.call(grad_output, input, weight, weight_mask, input_mask, output_mask, weight_dtype, bias_dtype);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight(const at::Tensor& weight, int64_t bits,
                                                                                int64_t group_size, bool symmetric) {
  static auto op = typed_op<decltype(fake_quantize_weight)>("opforge::fake_quantize_weight");
  return op.call(weight, bits, group_size, symmetric);
}

namespace {
using namespace fake_quant_linear_op;

// ---- Meta: the same checkers, then outputs with the real kernels' shapes, dtypes and strides -------

at::Tensor fake_quant_linear_meta(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size,
                                  bool, bool) {
  check_fake_quant_linear_args("fake_quant_linear", input, weight, bias, weight_bits, group_size);
  return at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_forward_meta(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t weight_bits,
    int64_t group_size, bool, bool act_quant) {
  check_fake_quant_linear_args("fake_quant_linear", input, weight, bias, weight_bits, group_size);
  const auto bool_opts = input.options().dtype(at::kBool);
  at::Tensor Xq, Xm;
  if (act_quant) {
    Xq = at::empty_symint(input.sym_sizes(), input.options());
    Xm = at::empty_symint(input.sym_sizes(), bool_opts);
  } else {
    Xq = at::empty({0}, input.options());
    Xm = at::empty({0}, bool_opts);
  }
  return {at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options()),
          at::empty_symint(weight.sym_sizes(), input.options()), at::empty_symint(weight.sym_sizes(), bool_opts), Xq,
          Xm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_mask,
    const std::optional<at::Tensor>& input_mask, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> weight_dtype, std::optional<at::ScalarType> bias_dtype) {
  check_fake_quant_linear_backward_args(grad_output, input, weight, weight_mask, input_mask, weight_dtype,
                                        bias_dtype);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) {
    grad_weight = at::empty_symint(weight.sym_sizes(), weight.options().dtype(weight_dtype.value_or(weight.scalar_type())));
  }
  if (output_mask[2]) {
    grad_bias = at::empty_symint({weight.sym_size(0)},
                                 input.options().dtype(linear_op::grad_bias_dtype(input, bias_dtype)));
  }
  return {grad_input, grad_weight, grad_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight_meta(const at::Tensor& weight,
                                                                                    int64_t bits, int64_t group_size,
                                                                                    bool) {
  check_fake_quantize_weight_args(weight, bits, group_size);
  const auto qs = qparams_sym_sizes(weight, group_size);
  return {at::empty_symint(weight.sym_sizes(), weight.options()),
          at::empty_symint(weight.sym_sizes(), weight.options().dtype(at::kBool)),
          at::empty_symint(qs, weight.options().dtype(at::kFloat)),
          at::empty_symint(qs, weight.options().dtype(at::kInt))};
}

// ---- Autograd ----------------------------------------------------------------------------------------

// Saved: 0 the GEMM's input (fq_a(input) with act_quant, else input), 1 fq_w(weight) in input's dtype,
// 2 weight's in-range mask, 3 input's in-range mask (undefined without act_quant). Attributes: weight's dtype,
// bias's dtype (-1 without bias). Edges: 0 input, 1 weight, 2 bias.
variable_list fake_quant_linear_backward_fn(const BackwardArgs& a) {
  const auto weight_dtype = static_cast<at::ScalarType>(a.attrs[0].toInt());
  const int64_t bias_dtype = a.attrs[1].toInt();
  std::optional<at::ScalarType> bdt;
  if (bias_dtype >= 0) bdt = static_cast<at::ScalarType>(bias_dtype);
  std::optional<at::Tensor> input_mask;
  if (a.saved[3].defined()) input_mask = a.saved[3];
  auto [grad_input, grad_weight, grad_bias] = opforge::fake_quant_linear_backward(
      a.grads[0], a.saved[0], a.saved[1], a.saved[2], input_mask, {a.needs[0], a.needs[1], bdt && a.needs[2]},
      weight_dtype, bdt);
  return {grad_input, grad_weight, grad_bias};
}

using FakeQuantLinearForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// fake_quant_linear's and _fake_quant_linear_forward's Autograd kernel: `forward(grad)` returns
// _fake_quant_linear_forward's (output, weight_fq, weight_mask, input_fq, input_mask); only the output is
// differentiable.
template <typename Forward>
FakeQuantLinearForward fake_quant_linear_recorded(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                                  const std::optional<at::Tensor>& bias, bool act_quant,
                                                  Forward&& forward) {
  return autograd_op(
      {op, "opforge::FakeQuantLinearBackward", fake_quant_linear_backward_fn, nullptr},
      {kDifferentiable, kNotDifferentiable, kNotDifferentiable, kNotDifferentiable, kNotDifferentiable}, forward,
      [&](OpNode& n, const FakeQuantLinearForward& out) {
        const auto& [Y, Wq, Wm, Xq, Xm] = out;
        // fq_a(input) and fq_w(weight) stand in for input and weight: tied to them (core/autograd.h)
        n.save(act_quant ? saved_in_place_of(Xq, input, "fake_quant_linear") : input);
        n.save(saved_in_place_of(Wq, weight, "fake_quant_linear"));
        n.save(Wm);
        n.save(act_quant ? Xm : at::Tensor());
        n.attr(static_cast<int64_t>(weight.scalar_type()));
        n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
      },
      input, weight, bias);
}

// fake_quant_linear: without gradients the public kernel alone (no masks kept), with them the private forward.
at::Tensor fake_quant_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size,
                                      bool symmetric, bool act_quant) {
  return std::get<0>(
      fake_quant_linear_recorded("fake_quant_linear", input, weight, bias, act_quant, [&](bool grad) {
        if (!grad) {
          return FakeQuantLinearForward{
              opforge::fake_quant_linear(input, weight, bias, weight_bits, group_size, symmetric, act_quant), {}, {},
              {}, {}};
        }
        return opforge::_fake_quant_linear_forward(input, weight, bias, weight_bits, group_size, symmetric,
                                                   act_quant);
      }));
}

// _fake_quant_linear_forward called directly: the output differentiable as fake_quant_linear's, the saved
// tensors not (they get no history).
FakeQuantLinearForward fake_quant_linear_forward_autograd(const at::Tensor& input, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias, int64_t weight_bits,
                                                          int64_t group_size, bool symmetric, bool act_quant) {
  return fake_quant_linear_recorded("_fake_quant_linear_forward", input, weight, bias, act_quant, [&](bool) {
    return opforge::_fake_quant_linear_forward(input, weight, bias, weight_bits, group_size, symmetric, act_quant);
  });
}

// fake_quantize_weight is not differentiable (its outputs carry no history; fake_quant_linear is the
// differentiable op): it runs below autograd.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight_autograd(const at::Tensor& weight,
                                                                                        int64_t bits,
                                                                                        int64_t group_size,
                                                                                        bool symmetric) {
  check_no_forward_ad("fake_quantize_weight", weight);
  at::AutoDispatchBelowADInplaceOrView guard;
  return opforge::fake_quantize_weight(weight, bits, group_size, symmetric);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("fake_quant_linear", &fake_quant_linear_meta);
  m.impl("_fake_quant_linear_forward", &fake_quant_linear_forward_meta);
  m.impl("fake_quant_linear_backward", &fake_quant_linear_backward_meta);
  m.impl("fake_quantize_weight", &fake_quantize_weight_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("fake_quant_linear", &fake_quant_linear_autograd);
  m.impl("_fake_quant_linear_forward", &fake_quant_linear_forward_autograd);
  register_backward_op_autograd(m, "fake_quant_linear_backward");
  m.impl("fake_quantize_weight", &fake_quantize_weight_autograd);
}

// torch.autocast (core/autocast.h): input and bias to the autocast dtype, the weight left as it is (it is quantized
// from its own precision, e.g. float32 master weights, and fq_w is then converted to input's dtype: what torchao's
// QAT does under autocast, where the fake quantization of the float32 weight happens before F.linear casts). The
// backward and the weight quantizer keep their dtypes.
OPFORGE_AUTOCAST(fake_quant_linear,
                 {{"fake_quant_linear", AutocastPolicy::kLowerPrecision, {"input", "bias"}},
                  {"_fake_quant_linear_forward", AutocastPolicy::kLowerPrecision, {"input", "bias"}},
                  {"fake_quant_linear_backward", AutocastPolicy::kInputDtype},
                  {"fake_quantize_weight", AutocastPolicy::kInputDtype}})

}  // namespace opforge
