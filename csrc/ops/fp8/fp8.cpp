// quantize_fp8 and fp8_linear: checkers, the kernel bodies shared by the backends (the scaled GEMM, the
// quantized operands of each GEMM), the public C++ API, Meta kernels, autograd and autocast.
#include "ops/fp8/fp8.h"

#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/layout.h"
#include "ops/linear/linear.h"

namespace opforge {
namespace fp8_op {

Granularity parse_granularity(const char* op, c10::string_view granularity) {
  if (granularity == "tensorwise") return Granularity::kTensorwise;
  if (granularity == "rowwise") return Granularity::kRowwise;
  TORCH_CHECK_VALUE(false, "opforge::", op, ": expected granularity to be \"tensorwise\" or \"rowwise\", but got \"",
                    std::string(granularity), "\"");
}

at::ScalarType fp8_dtype_of(const char* op, const char* name, std::optional<at::ScalarType> dtype,
                            at::ScalarType fallback) {
  const at::ScalarType t = dtype.value_or(fallback);
  TORCH_CHECK_VALUE(t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2, "opforge::", op, ": expected ", name,
                    " to be torch.float8_e4m3fn or torch.float8_e5m2, but got ", t);
  return t;
}

at::ScalarType grad_dtype_of(const char* op, std::optional<at::ScalarType> grad_dtype, Granularity g) {
  return fp8_dtype_of(op, "grad_dtype", grad_dtype,
                      g == Granularity::kRowwise ? at::kFloat8_e4m3fn : at::kFloat8_e5m2);
}

std::pair<at::ScalarType, Granularity> check_quantize_fp8_args(const at::Tensor& input,
                                                              std::optional<at::ScalarType> dtype,
                                                              c10::string_view granularity) {
  constexpr const char* op = "quantize_fp8";
  check_floating(op, "input", input);
  const at::ScalarType t = fp8_dtype_of(op, "dtype", dtype, at::kFloat8_e4m3fn);
  const Granularity g = parse_granularity(op, granularity);
  TORCH_CHECK_VALUE(g == Granularity::kTensorwise || input.dim() >= 1, "opforge::", op,
                    ": expected input with at least 1 dimension for rowwise scales, but got a 0-d tensor");
  return {t, g};
}

c10::SymDimVector scale_sym_sizes(const at::Tensor& input, Granularity g) {
  if (g == Granularity::kTensorwise) return {};
  c10::SymDimVector s(input.sym_sizes().begin(), input.sym_sizes().end());
  s.back() = 1;
  return s;
}

Granularity check_fp8_linear_args(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                  std::optional<at::ScalarType> grad_dtype) {
  constexpr const char* op = "fp8_linear";
  linear_op::check_linear_args(op, input, weight, bias);
  const Granularity g = parse_granularity(op, granularity);
  grad_dtype_of(op, grad_dtype, g);
  return g;
}

Granularity check_fp8_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& weight, c10::string_view granularity,
                                           std::optional<at::ScalarType> grad_dtype,
                                           std::optional<at::ScalarType> bias_dtype) {
  constexpr const char* op = "fp8_linear_backward";
  // linear_backward's checks, each message naming this op
  linear_op::check_linear_args(op, input, weight, std::nullopt);
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || is_supported_floating(*bias_dtype), "opforge::", op,
                   ": expected bias_dtype to be a floating dtype (float64, float32, float16 or bfloat16), but got ",
                   *bias_dtype);
  check_floating(op, "grad_output", grad_output);
  check_same_device(op, "grad_output", grad_output, "input", input);
  const auto expected = linear_op::output_sym_sizes(input, weight);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(expected), "opforge::", op, ": expected grad_output of shape ",
                    shape_str(expected), " (input's leading dims, out_features), but got ",
                    shape_str(grad_output.sym_sizes()));
  const Granularity g = parse_granularity(op, granularity);
  grad_dtype_of(op, grad_dtype, g);
  return g;
}

Operand quantize_operand(const Backend& be, const at::Tensor& X, at::ScalarType dtype, bool rowwise) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2);
  const at::Tensor Xc = X.contiguous();
  Operand out;
  out.data = at::empty(Xc.sizes(), Xc.options().dtype(dtype));
  out.scale = at::empty({rowwise ? Xc.size(0) : 1}, Xc.options().dtype(at::kFloat));
  be.rows(Xc, out.data, out.scale, rowwise);
  return out;
}

Operand quantize_operand_t(const Backend& be, const at::Tensor& X, at::ScalarType dtype, bool rowwise) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2);
  if (!X.is_contiguous() && X.t().is_contiguous()) return quantize_operand(be, X.t(), dtype, rowwise);
  const at::Tensor Xc = X.contiguous();
  Operand out;
  out.data = at::empty({Xc.size(1), Xc.size(0)}, Xc.options().dtype(dtype));
  out.scale = at::empty({rowwise ? Xc.size(1) : 1}, Xc.options().dtype(at::kFloat));
  be.cols(Xc, out.data, out.scale, rowwise);
  return out;
}

std::pair<Operand, Operand> quantize_operand_both(const Backend& be, const at::Tensor& X, at::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2);
  const at::Tensor Xc = X.contiguous();
  Operand q, qt;
  q.data = at::empty(Xc.sizes(), Xc.options().dtype(dtype));
  qt.data = at::empty({Xc.size(1), Xc.size(0)}, Xc.options().dtype(dtype));
  q.scale = at::empty({1}, Xc.options().dtype(at::kFloat));
  qt.scale = q.scale;
  be.both(Xc, q.data, qt.data, q.scale);
  return {q, qt};
}

namespace {

/// Zero-pads a 2-D FP8 tensor to (rows, cols) (FP8's zero byte is +0.0 in both formats; the padding goes
/// through uint8, which constant_pad_nd supports).
at::Tensor pad_fp8(const at::Tensor& t, int64_t rows, int64_t cols) {
  if (t.size(0) == rows && t.size(1) == cols) return t;
  return at::constant_pad_nd(t.view(at::kByte), {0, cols - t.size(1), 0, rows - t.size(0)}, 0)
      .view(t.scalar_type());
}

int64_t round_up16(int64_t v) { return (v + 15) / 16 * 16; }

}  // namespace

at::Tensor scaled_gemm(const Operand& A, const Operand& B, bool rowwise, at::ScalarType out_dtype) {
  const int64_t Ra = A.data.size(0), Rb = B.data.size(0), C = A.data.size(1);
  TORCH_INTERNAL_ASSERT(B.data.size(1) == C);
  const auto opts = A.data.options().dtype(out_dtype);
  if (Ra == 0 || Rb == 0 || C == 0) return at::zeros({Ra, Rb}, opts);
  // _scaled_mm takes the dequantization scales (1 / scale, in fp32 as torchao computes them): (R_a, 1) and
  // (1, R_b) for rowwise, one element each for tensorwise.
  at::Tensor inv_a = A.scale.reciprocal(), inv_b = B.scale.reciprocal();
  at::Tensor a = A.data, b = B.data;
  int64_t Rb_pad = Rb;
  if (A.data.is_cuda()) {
    // The CUDA scaled GEMM needs the contraction and mat2's columns in multiples of 16: zero rows/columns add
    // nothing to the products, and the padded output columns are sliced off.
    const int64_t C_pad = round_up16(C);
    Rb_pad = round_up16(Rb);
    a = pad_fp8(a, Ra, C_pad);
    b = pad_fp8(b, Rb_pad, C_pad);
    if (rowwise && Rb_pad != Rb) inv_b = at::constant_pad_nd(inv_b, {0, Rb_pad - Rb}, 1.0);
  }
  if (rowwise) {
    inv_a = inv_a.view({Ra, 1});
    inv_b = inv_b.view({1, Rb_pad});
  } else {
    inv_a = inv_a.view(at::IntArrayRef{});  // 0-d (a bare {} would pick view(ScalarType))
    inv_b = inv_b.view(at::IntArrayRef{});
  }
  // The rowwise scaled GEMM writes bfloat16 (torchao's rowwise recipe; the only rowwise output type of the CUDA
  // scaled GEMM in earlier torch releases; the CPU follows it so both backends round alike); tensorwise writes the
  // output dtype (float32 for float64, which the scaled GEMM lacks). use_fast_accum=false: on sm_89/sm_90 the FP8
  // tensor cores still sum each step with a 13-bit truncating accumulator, but cuBLAS then moves the partial sum
  // to an fp32 register every 128 products (docs/ops/fp8.md: Numerics); fast accumulation never does.
  const at::ScalarType gemm_dtype =
      rowwise ? at::kBFloat16 : (out_dtype == at::kDouble ? at::kFloat : out_dtype);
  at::Tensor Y = at::_scaled_mm(a, b.t(), inv_a, inv_b, std::nullopt, std::nullopt, gemm_dtype,
                                /*use_fast_accum=*/false);
  if (Rb_pad == Rb) return Y.scalar_type() == out_dtype ? Y : Y.to(out_dtype);
  // the padded columns sliced off into a fresh [R_a, R_b] tensor with row-major strides (the Meta kernel's): a
  // .contiguous() of the slice would keep its stride R_b_pad where a dim has size 1
  at::Tensor out = at::empty({Ra, Rb}, opts);
  out.copy_(Y.narrow(1, 0, Rb));
  return out;
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_impl(const Backend& be, const at::Tensor& input,
                                                     std::optional<at::ScalarType> dtype,
                                                     c10::string_view granularity) {
  const auto [t, g] = check_quantize_fp8_args(input, dtype, granularity);
  const bool rowwise = g == Granularity::kRowwise;
  const int64_t K = input.dim() == 0 ? 1 : input.size(-1);
  Operand q = quantize_operand(be, input.reshape({rows_of(input), K}), t, rowwise);
  return {q.data.view(input.sizes()), q.scale.view_symint(scale_sym_sizes(input, g))};
}

at::Tensor fp8_linear_impl(const Backend& be, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view granularity,
                           std::optional<at::ScalarType> grad_dtype) {
  const bool rowwise = check_fp8_linear_args(input, weight, bias, granularity, grad_dtype) == Granularity::kRowwise;
  const int64_t M = rows_of(input), K = weight.size(1);
  // input per token, weight per output channel (rowwise), both in e4m3; the weight from its own precision
  const Operand x = quantize_operand(be, input.reshape({M, K}), at::kFloat8_e4m3fn, rowwise);
  const Operand w = quantize_operand(be, weight, at::kFloat8_e4m3fn, rowwise);
  at::Tensor Y = scaled_gemm(x, w, rowwise, input.scalar_type());
  if (bias.has_value() && bias->defined()) Y.add_(to_input_dtype(*bias, input.scalar_type()));
  return linear_op::as_output(Y, input, weight);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward_impl(
    const Backend& be, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask, c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    std::optional<at::ScalarType> bias_dtype) {
  const Granularity g =
      check_fp8_linear_backward_args(grad_output, input, weight, granularity, grad_dtype, bias_dtype);
  const bool rowwise = g == Granularity::kRowwise;
  const at::ScalarType gdt = grad_dtype_of("fp8_linear_backward", grad_dtype, g);
  const int64_t M = rows_of(input), K = weight.size(1), N = weight.size(0);
  const at::Tensor G = grad_output.reshape({M, N});
  // q(dY) [M, N] for dX and q(dYᵀ) [N, M] for dW: tensorwise, one scale serves both, so when both are needed one
  // pass writes both orientations; rowwise, the scales run along different axes (per row of dY, per column)
  Operand g_rows, g_cols;
  if (!rowwise && output_mask[0] && output_mask[1]) {
    std::tie(g_rows, g_cols) = quantize_operand_both(be, G, gdt);
  } else {
    if (output_mask[0]) g_rows = quantize_operand(be, G, gdt, rowwise);
    if (output_mask[1]) g_cols = quantize_operand_t(be, G, gdt, rowwise);
  }
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    // dX[M, K] = dY[M, N] · W[N, K]: contraction over N, so dY per row and W per column (Wᵀ per row, read from W)
    const Operand wq = quantize_operand_t(be, weight, at::kFloat8_e4m3fn, rowwise);
    grad_input = scaled_gemm(g_rows, wq, rowwise, input.scalar_type()).view(input.sizes());
  }
  if (output_mask[1]) {
    // dW[N, K] = dYᵀ[N, M] · X[M, K]: contraction over the tokens M, so dY and X per column (their transposes
    // per row, read from dY and X)
    const Operand xq = quantize_operand_t(be, input.reshape({M, K}), at::kFloat8_e4m3fn, rowwise);
    grad_weight = scaled_gemm(g_cols, xq, rowwise, weight.scalar_type());
  }
  if (output_mask[2]) grad_bias = linear_op::sum_rows(G, linear_op::grad_bias_dtype(input, bias_dtype));
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace fp8_op

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& input, std::optional<at::ScalarType> dtype,
                                                c10::string_view granularity) {
  static auto op = typed_op<decltype(quantize_fp8)>("opforge::quantize_fp8");
  return op.call(input, dtype, granularity);
}
at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      c10::string_view granularity, std::optional<at::ScalarType> grad_dtype) {
  static auto op = typed_op<decltype(fp8_linear)>("opforge::fp8_linear");
  return op.call(input, weight, bias, granularity, grad_dtype);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    std::optional<at::ScalarType> bias_dtype) {
  static auto op = typed_op<decltype(fp8_linear_backward)>("opforge::fp8_linear_backward");
  return op.call(grad_output, input, weight, output_mask, granularity, grad_dtype, bias_dtype);
}

namespace {
using namespace fp8_op;

// ---- Meta: the same checkers, then outputs with the real kernels' shapes, dtypes and strides -------

std::tuple<at::Tensor, at::Tensor> quantize_fp8_meta(const at::Tensor& input, std::optional<at::ScalarType> dtype,
                                                     c10::string_view granularity) {
  const auto [t, g] = check_quantize_fp8_args(input, dtype, granularity);
  return {at::empty_symint(input.sym_sizes(), input.options().dtype(t)),
          at::empty_symint(scale_sym_sizes(input, g), input.options().dtype(at::kFloat))};
}

at::Tensor fp8_linear_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::string_view granularity, std::optional<at::ScalarType> grad_dtype) {
  check_fp8_linear_args(input, weight, bias, granularity, grad_dtype);
  return at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    std::optional<at::ScalarType> bias_dtype) {
  check_fp8_linear_backward_args(grad_output, input, weight, granularity, grad_dtype, bias_dtype);
  return linear_op::empty_backward_outputs(input, weight, output_mask, bias_dtype);
}

// ---- Autograd ----------------------------------------------------------------------------------------

// Saved: 0 input, 1 weight (high precision: the backward quantizes each GEMM's operands along its own axes).
// Attributes: granularity (0 tensorwise, 1 rowwise), grad_dtype (-1 for the default), bias's dtype (-1 without
// bias). Edges: 0 input, 1 weight, 2 bias.
variable_list fp8_linear_backward_fn(const BackwardArgs& a) {
  const char* granularity = a.attrs[0].toInt() == 1 ? "rowwise" : "tensorwise";
  std::optional<at::ScalarType> gdt, bdt;
  if (a.attrs[1].toInt() >= 0) gdt = static_cast<at::ScalarType>(a.attrs[1].toInt());
  if (a.attrs[2].toInt() >= 0) bdt = static_cast<at::ScalarType>(a.attrs[2].toInt());
  auto [grad_input, grad_weight, grad_bias] = opforge::fp8_linear_backward(
      a.grads[0], a.saved[0], a.saved[1], {a.needs[0], a.needs[1], bdt && a.needs[2]}, granularity, gdt, bdt);
  return {grad_input, grad_weight, grad_bias};
}

at::Tensor fp8_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::string_view granularity,
                               std::optional<at::ScalarType> grad_dtype) {
  return autograd_op(
      {"fp8_linear", "opforge::Fp8LinearBackward", fp8_linear_backward_fn, nullptr}, {kDifferentiable},
      [&](bool) { return opforge::fp8_linear(input, weight, bias, granularity, grad_dtype); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(input);
        n.save(weight);
        n.attr(static_cast<int64_t>(parse_granularity("fp8_linear", granularity) == Granularity::kRowwise ? 1 : 0));
        n.attr(grad_dtype.has_value() ? static_cast<int64_t>(*grad_dtype) : int64_t{-1});
        n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
      },
      input, weight, bias);
}

// quantize_fp8 is not differentiable (its outputs carry no history; fp8_linear is the differentiable op): it
// runs below autograd.
std::tuple<at::Tensor, at::Tensor> quantize_fp8_autograd(const at::Tensor& input,
                                                         std::optional<at::ScalarType> dtype,
                                                         c10::string_view granularity) {
  check_no_forward_ad("quantize_fp8", input);
  at::AutoDispatchBelowADInplaceOrView guard;
  return opforge::quantize_fp8(input, dtype, granularity);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("quantize_fp8", &quantize_fp8_meta);
  m.impl("fp8_linear", &fp8_linear_meta);
  m.impl("fp8_linear_backward", &fp8_linear_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("quantize_fp8", &quantize_fp8_autograd);
  m.impl("fp8_linear", &fp8_linear_autograd);
  register_backward_op_autograd(m, "fp8_linear_backward");
}

// torch.autocast (core/autocast.h): input and bias to the autocast dtype, the weight left as it is (quantized to
// e4m3 from its own precision, e.g. float32 master weights, as torchao's Float8Linear does under autocast). The
// backward and the quantizer keep their dtypes.
OPFORGE_AUTOCAST(fp8, {{"fp8_linear", AutocastPolicy::kLowerPrecision, {"input", "bias"}},
                       {"fp8_linear_backward", AutocastPolicy::kInputDtype},
                       {"quantize_fp8", AutocastPolicy::kInputDtype}})

}  // namespace opforge
