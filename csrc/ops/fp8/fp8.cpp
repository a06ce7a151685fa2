// quantize_fp8, fp8_linear and their private forms: checkers, the kernel bodies shared by the backends (the scaled GEMM, the
// quantized operands of each GEMM), the public C++ API, Meta kernels, autograd and autocast.
#include "ops/fp8/fp8.h"

#include <torch/library.h>

#include "core/amax.h"
#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/knobs.h"
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

Granularity check_quantize_fp8_weight_args(const at::Tensor& weight, c10::string_view granularity) {
  constexpr const char* op = "_quantize_fp8_weight";
  check_floating(op, "weight", weight);
  TORCH_CHECK_VALUE(weight.dim() == 2, "opforge::", op, ": expected a 2-D weight (out_features, in_features), but got ",
                    weight.dim(), " dimension(s)");
  return parse_granularity(op, granularity);
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

void check_weight_operand(const char* op, const char* data_name, const at::Tensor& data, const char* scale_name,
                          const at::Tensor& scale, const c10::SymInt& rows, const c10::SymInt& cols,
                          const c10::SymInt& scale_numel, const at::Tensor& like) {
  TORCH_CHECK_TYPE(data.scalar_type() == at::kFloat8_e4m3fn, "opforge::", op, ": expected ", data_name,
                   " to be torch.float8_e4m3fn, but got ", data.scalar_type());
  TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, "opforge::", op, ": expected ", scale_name,
                   " to be torch.float32, but got ", scale.scalar_type());
  check_same_device(op, data_name, data, "weight", like);
  check_same_device(op, scale_name, scale, "weight", like);
  TORCH_CHECK_VALUE(data.dim() == 2 && data.sym_size(0) == rows && data.sym_size(1) == cols, "opforge::", op,
                    ": expected ", data_name, " of shape [", num_str(rows), ", ", num_str(cols), "], but got ",
                    shape_str(data.sym_sizes()));
  TORCH_CHECK_VALUE(scale.sym_numel() == scale_numel, "opforge::", op, ": expected ", scale_name, " with ",
                    num_str(scale_numel), " element(s), but got shape ", shape_str(scale.sym_sizes()));
}

namespace {
/// M: the product of input's leading dims, symbolic.
c10::SymInt sym_rows_of(const at::Tensor& t) {
  c10::SymInt M = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) M = M * t.sym_size(d);
  return M;
}
bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }
/// The tensor of an optional argument, undefined when absent.
at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return given(t) ? *t : at::Tensor(); }
/// The optional argument of a tensor, None when undefined.
std::optional<at::Tensor> or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
}  // namespace

void check_input_amax(const char* op, const std::optional<at::Tensor>& input_amax, const at::Tensor& input,
                      Granularity g) {
  if (!given(input_amax)) return;
  const at::Tensor& a = *input_amax;
  TORCH_CHECK_VALUE(g == Granularity::kTensorwise, "opforge::", op,
                    ": expected input_amax only with granularity \"tensorwise\" (rowwise scales take each row's "
                    "amax), but got granularity \"rowwise\" with input_amax");
  const at::ScalarType expected = amax_dtype(input.scalar_type());
  TORCH_CHECK_TYPE(a.scalar_type() == expected, "opforge::", op, ": expected input_amax to be ", expected, " for a ",
                   input.scalar_type(), " input, but got ", a.scalar_type());
  TORCH_CHECK_VALUE(a.dim() == 1 && a.sym_size(0) == 1, "opforge::", op,
                    ": expected input_amax of shape [1] (max|input| over the whole tensor), but got ",
                    shape_str(a.sym_sizes()));
  check_same_device(op, "input_amax", a, "input", input);
}

void check_fp8_linear_forward_args(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& weight_data,
                                   const std::optional<at::Tensor>& weight_inv_scale, c10::string_view granularity,
                                   std::optional<at::ScalarType> grad_dtype,
                                   const std::optional<at::Tensor>& input_amax) {
  constexpr const char* op = "_fp8_linear_forward";
  linear_op::check_linear_args(op, input, weight, bias);
  const Granularity g = parse_granularity(op, granularity);
  grad_dtype_of(op, grad_dtype, g);
  check_input_amax(op, input_amax, input, g);
  TORCH_CHECK_VALUE(g == Granularity::kTensorwise, "opforge::", op,
                    ": expected granularity \"tensorwise\" (a rowwise q(inputᵀ) is scaled per column of input, "
                    "not the forward's per-row scales), but got \"rowwise\"");
  TORCH_CHECK_VALUE(given(weight_data) == given(weight_inv_scale), "opforge::", op,
                    ": expected weight_data and weight_inv_scale both given or both None, but got ",
                    given(weight_data) ? "weight_data alone" : "weight_inv_scale alone");
  if (given(weight_data)) {
    check_weight_operand(op, "weight_data", *weight_data, "weight_inv_scale", *weight_inv_scale, weight.sym_size(0),
                         weight.sym_size(1), 1, weight);
  }
}

Granularity check_fp8_linear_quantized_args(const at::Tensor& input, const at::Tensor& weight,
                                            const at::Tensor& weight_data, const at::Tensor& weight_inv_scale,
                                            const at::Tensor& weight_t_data, const at::Tensor& weight_t_inv_scale,
                                            const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                            std::optional<at::ScalarType> grad_dtype,
                                            const std::optional<at::Tensor>& input_amax) {
  constexpr const char* op = "_fp8_linear_quantized";
  linear_op::check_linear_args(op, input, weight, bias);
  const Granularity g = parse_granularity(op, granularity);
  grad_dtype_of(op, grad_dtype, g);
  check_input_amax(op, input_amax, input, g);
  const bool rowwise = g == Granularity::kRowwise;
  const c10::SymInt N = weight.sym_size(0), K = weight.sym_size(1);
  check_weight_operand(op, "weight_data", weight_data, "weight_inv_scale", weight_inv_scale, N, K,
                       rowwise ? N : c10::SymInt(1), weight);
  check_weight_operand(op, "weight_t_data", weight_t_data, "weight_t_inv_scale", weight_t_inv_scale, K, N,
                       rowwise ? K : c10::SymInt(1), weight);
  return g;
}

Granularity check_fp8_linear_quantized_backward_args(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask, c10::string_view granularity,
    std::optional<at::ScalarType> grad_dtype, std::optional<at::ScalarType> bias_dtype,
    const std::optional<at::Tensor>& input_amax) {
  constexpr const char* op = "_fp8_linear_quantized_backward";
  check_floating(op, "grad_output", grad_output);
  check_floating(op, "weight", weight);
  check_same_device(op, "grad_output", grad_output, "weight", weight);
  TORCH_CHECK_VALUE(weight.dim() == 2, "opforge::", op, ": expected weight to be 2-D (out_features, in_features), ",
                    "but got shape ", shape_str(weight.sym_sizes()));
  TORCH_CHECK_TYPE(!bias_dtype.has_value() || is_supported_floating(*bias_dtype), "opforge::", op,
                   ": expected bias_dtype to be a floating dtype (float64, float32, float16 or bfloat16), but got ",
                   *bias_dtype);
  TORCH_CHECK_VALUE(grad_output.dim() >= 1 && grad_output.sym_size(-1) == weight.sym_size(0), "opforge::", op,
                    ": expected grad_output of shape (*, ", num_str(weight.sym_size(0)),
                    ") (out_features last), but got ", shape_str(grad_output.sym_sizes()));
  if (given(input)) {
    linear_op::check_linear_args(op, *input, weight, std::nullopt);
    const auto expected = linear_op::output_sym_sizes(*input, weight);
    TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(expected), "opforge::", op, ": expected grad_output of shape ",
                      shape_str(expected), " (input's leading dims, out_features), but got ",
                      shape_str(grad_output.sym_sizes()));
  }
  const Granularity g = parse_granularity(op, granularity);
  grad_dtype_of(op, grad_dtype, g);
  const bool rowwise = g == Granularity::kRowwise;
  const c10::SymInt N = weight.sym_size(0), K = weight.sym_size(1);
  TORCH_CHECK_VALUE(given(input_t_data) == given(input_t_inv_scale) &&
                        given(weight_t_data) == given(weight_t_inv_scale),
                    "opforge::", op, ": expected each saved operand's data and scale both given or both None");
  if (given(input_t_data)) {
    check_weight_operand(op, "input_t_data", *input_t_data, "input_t_inv_scale", *input_t_inv_scale, K,
                         sym_rows_of(grad_output), rowwise ? K : c10::SymInt(1), weight);
  }
  if (given(weight_t_data)) {
    check_weight_operand(op, "weight_t_data", *weight_t_data, "weight_t_inv_scale", *weight_t_inv_scale, K, N,
                         rowwise ? K : c10::SymInt(1), weight);
  }
  TORCH_CHECK_VALUE(!output_mask[1] || given(input) || given(input_t_data), "opforge::", op,
                    ": expected input or input_t_data for grad_weight (output_mask[1]), but got neither");
  TORCH_CHECK_VALUE(!given(input_amax) || given(input), "opforge::", op,
                    ": expected input with input_amax (the amax of the input it quantizes), but got input None");
  if (given(input)) check_input_amax(op, input_amax, *input, g);
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

Operand quantize_operand(const Backend& be, const at::Tensor& X, at::ScalarType dtype, bool rowwise,
                         const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(!amax.defined() || !rowwise);
  TORCH_INTERNAL_ASSERT(X.dim() == 2);
  const at::Tensor Xc = X.contiguous();
  Operand out;
  out.data = at::empty(Xc.sizes(), Xc.options().dtype(dtype));
  out.scale = at::empty({rowwise ? Xc.size(0) : 1}, Xc.options().dtype(at::kFloat));
  out.inv_scale = at::empty_like(out.scale);
  be.rows(Xc, out.data, out.scale, out.inv_scale, rowwise, amax);
  return out;
}

Operand quantize_operand_t(const Backend& be, const at::Tensor& X, at::ScalarType dtype, bool rowwise,
                           const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && (!amax.defined() || !rowwise));
  // (a tensorwise amax is that of X and of Xᵀ alike)
  if (!X.is_contiguous() && X.t().is_contiguous()) return quantize_operand(be, X.t(), dtype, rowwise, amax);
  const at::Tensor Xc = X.contiguous();
  Operand out;
  out.data = at::empty({Xc.size(1), Xc.size(0)}, Xc.options().dtype(dtype));
  out.scale = at::empty({rowwise ? Xc.size(1) : 1}, Xc.options().dtype(at::kFloat));
  out.inv_scale = at::empty_like(out.scale);
  be.cols(Xc, out.data, out.scale, out.inv_scale, rowwise, amax);
  return out;
}

std::pair<Operand, Operand> quantize_operand_both(const Backend& be, const at::Tensor& X, at::ScalarType dtype,
                                                  const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2);
  const at::Tensor Xc = X.contiguous();
  Operand q, qt;
  q.data = at::empty(Xc.sizes(), Xc.options().dtype(dtype));
  qt.data = at::empty({Xc.size(1), Xc.size(0)}, Xc.options().dtype(dtype));
  q.scale = at::empty({1}, Xc.options().dtype(at::kFloat));
  q.inv_scale = at::empty_like(q.scale);
  qt.scale = q.scale;
  qt.inv_scale = q.inv_scale;
  be.both(Xc, q.data, qt.data, q.scale, q.inv_scale, amax);
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

bool fast_accum_forward() { return knobs::get(knobs::Knob::kFp8FastAccum) >= 1; }
bool fast_accum_backward() { return knobs::get(knobs::Knob::kFp8FastAccum) >= 2; }

at::Tensor scaled_gemm(const Backend& be, const Operand& A, const Operand& B, bool rowwise, at::ScalarType out_dtype,
                       bool fast_accum) {
  const int64_t Ra = A.data.size(0), Rb = B.data.size(0), C = A.data.size(1);
  TORCH_INTERNAL_ASSERT(B.data.size(1) == C);
  const auto opts = A.data.options().dtype(out_dtype);
  if (Ra == 0 || Rb == 0 || C == 0) return at::zeros({Ra, Rb}, opts);
  // _scaled_mm takes the dequantization scales (1 / scale, in fp32 as torchao computes them): (R_a, 1) and
  // (1, R_b) for rowwise, one element each for tensorwise. The quantizers write them beside the scales, and the
  // operands given by a caller carry them (no reciprocal launched per GEMM).
  TORCH_INTERNAL_ASSERT(A.inv_scale.defined() && B.inv_scale.defined());
  at::Tensor inv_a = A.inv_scale, inv_b = B.inv_scale;
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
  // output dtype (float32 for float64, which the scaled GEMM lacks). use_fast_accum=false (the default): on
  // sm_89/sm_90 the FP8 tensor cores still sum each step with a 13-bit truncating accumulator, but cuBLAS then
  // moves the partial sum to an fp32 register every 128 products (docs/ops/fp8.md: Numerics); fast accumulation
  // (OPFORGE_FP8_FAST_ACCUM) never does.
  const at::ScalarType gemm_dtype =
      rowwise ? at::kBFloat16 : (out_dtype == at::kDouble ? at::kFloat : out_dtype);
  at::Tensor Y;
  if (!rowwise && be.gemm != nullptr) Y = be.gemm(a, b, inv_a, inv_b, gemm_dtype, fast_accum);
  if (!Y.defined()) {
    Y = at::_scaled_mm(a, b.t(), inv_a, inv_b, std::nullopt, std::nullopt, gemm_dtype, /*use_fast_accum=*/fast_accum);
  }
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
  // a transposed 2-D view (weight.t()): its rows are the columns of the row-major tensor under it, quantized by
  // the transposed kernel with no high-precision copy (the bits of quantizing a contiguous copy)
  const bool transposed = input.dim() == 2 && !input.is_contiguous() && input.t().is_contiguous();
  Operand q = transposed ? quantize_operand_t(be, input.t(), t, rowwise)
                         : quantize_operand(be, input.reshape({rows_of(input), K}), t, rowwise);
  return {q.data.view(input.sizes()), q.scale.view_symint(scale_sym_sizes(input, g))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight_impl(const Backend& be,
                                                                                    const at::Tensor& weight,
                                                                                    c10::string_view granularity) {
  const bool rowwise = check_quantize_fp8_weight_args(weight, granularity) == Granularity::kRowwise;
  // the dequantization scales (1 / scale, written by the quantizers), which the scaled GEMMs read
  if (rowwise) {
    const Operand q = quantize_operand(be, weight, at::kFloat8_e4m3fn, true);
    const Operand qt = quantize_operand_t(be, weight, at::kFloat8_e4m3fn, true);
    return {q.data, q.inv_scale, qt.data, qt.inv_scale};
  }
  // tensorwise: both orientations from one amax pass and one cast pass; the transposed operand's scale is the same
  // value in a tensor of its own (outputs never alias)
  const auto [q, qt] = quantize_operand_both(be, weight, at::kFloat8_e4m3fn);
  return {q.data, q.inv_scale, qt.data, q.inv_scale.clone()};
}

namespace {

/// A precomputed operand as scaled_gemm reads it: data row-major, its dequantization scale (1 / scale) flat. Data
/// given as the transposed view of a row-major tensor (the layers' cache passes q(W).t() for q(Wᵀ) under tensorwise
/// scales, which are equal) is made row-major by the backend's transpose kernel.
Operand as_operand(const Backend& be, const at::Tensor& data, const at::Tensor& inv_scale) {
  const bool transposed = data.dim() == 2 && !data.is_contiguous() && data.t().is_contiguous();
  return {transposed ? be.transpose(data.t()) : data.contiguous(), at::Tensor(), inv_scale.reshape({-1}).contiguous()};
}

/// The forward GEMM and bias of fp8_linear from its quantized operands: Y (*, N) in input's dtype.
at::Tensor forward_gemm(const Backend& be, const Operand& x, const Operand& w, const at::Tensor& input,
                        const at::Tensor& weight, const std::optional<at::Tensor>& bias, bool rowwise) {
  at::Tensor Y = scaled_gemm(be, x, w, rowwise, input.scalar_type(), fast_accum_forward());
  if (bias.has_value() && bias->defined()) Y.add_(to_input_dtype(*bias, input.scalar_type()));
  return linear_op::as_output(Y, input, weight);
}

/// The gradients of fp8_linear from grad_output and whichever operands were kept: q(Xᵀ) (`xt`) or X [M, K]
/// (`X`, quantized here; `x_amax`: its amax given, or undefined), q(Wᵀ) (`wt`) or the weight (quantized here).
/// grad_input [M, K] in `x_dtype`.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_gemms(
    const Backend& be, const at::Tensor& grad_output, const at::Tensor& X, const Operand* xt, const at::Tensor& weight,
    const Operand* wt, std::array<bool, 3> output_mask, bool rowwise, at::ScalarType gdt, at::ScalarType x_dtype,
    at::ScalarType bias_dtype, const at::Tensor& x_amax = at::Tensor()) {
  const int64_t K = weight.size(1), N = weight.size(0), M = rows_of(grad_output);
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
    const Operand wq = wt != nullptr ? *wt : quantize_operand_t(be, weight, at::kFloat8_e4m3fn, rowwise);
    grad_input = scaled_gemm(be, g_rows, wq, rowwise, x_dtype, fast_accum_backward());
  }
  if (output_mask[1]) {
    // dW[N, K] = dYᵀ[N, M] · X[M, K]: contraction over the tokens M, so dY and X per column (their transposes
    // per row, read from dY and X, or q(Xᵀ) as the forward wrote it)
    const Operand xq =
        xt != nullptr ? *xt : quantize_operand_t(be, X.reshape({M, K}), at::kFloat8_e4m3fn, rowwise, x_amax);
    grad_weight = scaled_gemm(be, g_cols, xq, rowwise, weight.scalar_type(), fast_accum_backward());
  }
  if (output_mask[2]) grad_bias = linear_op::sum_rows(G, bias_dtype);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_forward_impl(
    const Backend& be, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& weight_data, const std::optional<at::Tensor>& weight_inv_scale,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& input_amax) {
  check_fp8_linear_forward_args(input, weight, bias, weight_data, weight_inv_scale, granularity, grad_dtype,
                                input_amax);
  const int64_t M = rows_of(input), K = weight.size(1);
  // q(X) for the forward GEMM and q(Xᵀ) for the backward's dW from one amax pass (none with input_amax) and one cast
  // pass
  auto [x, xt] = quantize_operand_both(be, input.reshape({M, K}), at::kFloat8_e4m3fn, or_undefined(input_amax));
  const Operand w = weight_data.has_value() && weight_data->defined()
                        ? as_operand(be, *weight_data, *weight_inv_scale)
                        : quantize_operand(be, weight, at::kFloat8_e4m3fn, /*rowwise=*/false);
  return {forward_gemm(be, x, w, input, weight, bias, /*rowwise=*/false), xt.data, xt.inv_scale};
}

at::Tensor fp8_linear_quantized_impl(const Backend& be, const at::Tensor& input, const at::Tensor& weight,
                                     const at::Tensor& weight_data, const at::Tensor& weight_inv_scale,
                                     const at::Tensor& weight_t_data, const at::Tensor& weight_t_inv_scale,
                                     const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                     std::optional<at::ScalarType> grad_dtype,
                                     const std::optional<at::Tensor>& input_amax) {
  const bool rowwise = check_fp8_linear_quantized_args(input, weight, weight_data, weight_inv_scale, weight_t_data,
                                                       weight_t_inv_scale, bias, granularity, grad_dtype,
                                                       input_amax) == Granularity::kRowwise;
  const int64_t M = rows_of(input), K = weight.size(1);
  const Operand x =
      quantize_operand(be, input.reshape({M, K}), at::kFloat8_e4m3fn, rowwise, or_undefined(input_amax));
  return forward_gemm(be, x, as_operand(be, weight_data, weight_inv_scale), input, weight, bias, rowwise);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_quantized_backward_impl(
    const Backend& be, const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask, c10::string_view granularity,
    std::optional<at::ScalarType> grad_dtype, std::optional<at::ScalarType> bias_dtype,
    const std::optional<at::Tensor>& input_amax) {
  const Granularity g = check_fp8_linear_quantized_backward_args(grad_output, input, input_t_data, input_t_inv_scale,
                                                                 weight, weight_t_data, weight_t_inv_scale, output_mask,
                                                                 granularity, grad_dtype, bias_dtype, input_amax);
  const at::ScalarType gdt = grad_dtype_of("_fp8_linear_quantized_backward", grad_dtype, g);
  std::optional<Operand> xt, wt;
  if (given(input_t_data)) xt = as_operand(be, *input_t_data, *input_t_inv_scale);
  if (given(weight_t_data)) wt = as_operand(be, *weight_t_data, *weight_t_inv_scale);
  const bool has_input = given(input);
  const at::ScalarType x_dtype = has_input ? input->scalar_type() : grad_output.scalar_type();
  auto [gi, gw, gb] = backward_gemms(be, grad_output, has_input ? *input : at::Tensor(), xt ? &*xt : nullptr, weight,
                                     wt ? &*wt : nullptr, output_mask, g == Granularity::kRowwise, gdt, x_dtype,
                                     bias_dtype.value_or(x_dtype), or_undefined(input_amax));
  if (gi.defined()) {
    if (has_input) {
      gi = gi.view(input->sizes());
    } else {
      std::vector<int64_t> sizes(grad_output.sizes().begin(), grad_output.sizes().end());
      sizes.back() = weight.size(1);
      gi = gi.view(sizes);
    }
  }
  return {gi, gw, gb};
}

at::Tensor fp8_linear_impl(const Backend& be, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view granularity,
                           std::optional<at::ScalarType> grad_dtype) {
  const bool rowwise = check_fp8_linear_args(input, weight, bias, granularity, grad_dtype) == Granularity::kRowwise;
  const int64_t M = rows_of(input), K = weight.size(1);
  // input per token, weight per output channel (rowwise), both in e4m3; the weight from its own precision
  const Operand x = quantize_operand(be, input.reshape({M, K}), at::kFloat8_e4m3fn, rowwise);
  const Operand w = quantize_operand(be, weight, at::kFloat8_e4m3fn, rowwise);
  return forward_gemm(be, x, w, input, weight, bias, rowwise);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward_impl(
    const Backend& be, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask, c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    std::optional<at::ScalarType> bias_dtype) {
  const Granularity g =
      check_fp8_linear_backward_args(grad_output, input, weight, granularity, grad_dtype, bias_dtype);
  const at::ScalarType gdt = grad_dtype_of("fp8_linear_backward", grad_dtype, g);
  auto [gi, gw, gb] = backward_gemms(be, grad_output, input, nullptr, weight, nullptr, output_mask,
                                     g == Granularity::kRowwise, gdt, input.scalar_type(),
                                     linear_op::grad_bias_dtype(input, bias_dtype));
  if (gi.defined()) gi = gi.view(input.sizes());
  return {gi, gw, gb};
}

}  // namespace fp8_op

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& input, std::optional<at::ScalarType> dtype,
                                                c10::string_view granularity) {
  static auto op = typed_op<decltype(quantize_fp8)>("opforge::quantize_fp8");
  return op.call(input, dtype, granularity);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _quantize_fp8_weight(const at::Tensor& weight,
                                                                                c10::string_view granularity) {
  static auto op = typed_op<decltype(_quantize_fp8_weight)>("opforge::_quantize_fp8_weight");
  return op.call(weight, granularity);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> _fp8_linear_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& weight_data, const std::optional<at::Tensor>& weight_inv_scale,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& input_amax) {
  static auto op = typed_op<decltype(_fp8_linear_forward)>("opforge::_fp8_linear_forward");
  return op.call(input, weight, bias, weight_data, weight_inv_scale, granularity, grad_dtype, input_amax);
}
at::Tensor _fp8_linear_quantized(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_data,
                                 const at::Tensor& weight_inv_scale, const at::Tensor& weight_t_data,
                                 const at::Tensor& weight_t_inv_scale, const std::optional<at::Tensor>& bias,
                                 c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
                                 bool save_input, const std::optional<at::Tensor>& input_amax) {
  static auto op = typed_op<decltype(_fp8_linear_quantized)>("opforge::_fp8_linear_quantized");
  return op.call(input, weight, weight_data, weight_inv_scale, weight_t_data, weight_t_inv_scale, bias, granularity,
                 grad_dtype, save_input, input_amax);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> _fp8_linear_quantized_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask, c10::string_view granularity,
    std::optional<at::ScalarType> grad_dtype, std::optional<at::ScalarType> bias_dtype,
    const std::optional<at::Tensor>& input_amax) {
  static auto op = typed_op<decltype(_fp8_linear_quantized_backward)>("opforge::_fp8_linear_quantized_backward");
  return op.call(grad_output, input, input_t_data, input_t_inv_scale, weight, weight_t_data, weight_t_inv_scale,
                 output_mask, granularity, grad_dtype, bias_dtype, input_amax);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight_meta(const at::Tensor& weight,
                                                                                    c10::string_view granularity) {
  const bool rowwise = check_quantize_fp8_weight_args(weight, granularity) == Granularity::kRowwise;
  const auto fp8 = weight.options().dtype(at::kFloat8_e4m3fn), f32 = weight.options().dtype(at::kFloat);
  const c10::SymInt N = weight.sym_size(0), K = weight.sym_size(1);
  return {at::empty_symint({N, K}, fp8), at::empty_symint({rowwise ? N : c10::SymInt(1)}, f32),
          at::empty_symint({K, N}, fp8), at::empty_symint({rowwise ? K : c10::SymInt(1)}, f32)};
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_forward_meta(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& weight_data, const std::optional<at::Tensor>& weight_inv_scale,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& input_amax) {
  check_fp8_linear_forward_args(input, weight, bias, weight_data, weight_inv_scale, granularity, grad_dtype,
                                input_amax);
  c10::SymInt M = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d) M = M * input.sym_size(d);
  return {at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options()),
          at::empty_symint({weight.sym_size(1), M}, input.options().dtype(at::kFloat8_e4m3fn)),
          at::empty({1}, input.options().dtype(at::kFloat))};
}

at::Tensor fp8_linear_quantized_meta(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_data,
                                     const at::Tensor& weight_inv_scale, const at::Tensor& weight_t_data,
                                     const at::Tensor& weight_t_inv_scale, const std::optional<at::Tensor>& bias,
                                     c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
                                     bool /*save_input*/, const std::optional<at::Tensor>& input_amax) {
  check_fp8_linear_quantized_args(input, weight, weight_data, weight_inv_scale, weight_t_data, weight_t_inv_scale, bias,
                                  granularity, grad_dtype, input_amax);
  return at::empty_symint(linear_op::output_sym_sizes(input, weight), input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_quantized_backward_meta(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask, c10::string_view granularity,
    std::optional<at::ScalarType> grad_dtype, std::optional<at::ScalarType> bias_dtype,
    const std::optional<at::Tensor>& input_amax) {
  check_fp8_linear_quantized_backward_args(grad_output, input, input_t_data, input_t_inv_scale, weight, weight_t_data,
                                           weight_t_inv_scale, output_mask, granularity, grad_dtype, bias_dtype,
                                           input_amax);
  if (input.has_value() && input->defined()) {
    return linear_op::empty_backward_outputs(*input, weight, output_mask, bias_dtype);
  }
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    c10::SymDimVector sizes(grad_output.sym_sizes().begin(), grad_output.sym_sizes().end());
    sizes.back() = weight.sym_size(1);
    grad_input = at::empty_symint(sizes, grad_output.options());
  }
  if (output_mask[1]) grad_weight = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2]) {
    grad_bias = at::empty_symint({weight.sym_size(0)},
                                 grad_output.options().dtype(bias_dtype.value_or(grad_output.scalar_type())));
  }
  return {grad_input, grad_weight, grad_bias};
}

// ---- Autograd ----------------------------------------------------------------------------------------

// Saved: 0 input (undefined when q(inputᵀ) was kept instead), 1 weight, 2 input_t_data, 3 input_t_inv_scale
// (q(inputᵀ) and its dequantization scale from the forward: tensorwise with a weight gradient to compute),
// 4 weight_t_data, 5 weight_t_inv_scale (q(weightᵀ) given to _fp8_linear_quantized), 6 input_amax (given to
// _fp8_linear_quantized, kept beside a saved input for the backward's q(inputᵀ)). Attributes: granularity
// (0 tensorwise, 1 rowwise), grad_dtype (-1 for the default), bias's dtype (-1 without bias). Edges: 0 input,
// 1 weight, 2 bias. With only high-precision tensors saved the public fp8_linear_backward runs; else its private form
// reading the saved FP8 operands.
variable_list fp8_linear_backward_fn(const BackwardArgs& a) {
  const char* granularity = a.attrs[0].toInt() == 1 ? "rowwise" : "tensorwise";
  std::optional<at::ScalarType> gdt, bdt;
  if (a.attrs[1].toInt() >= 0) gdt = static_cast<at::ScalarType>(a.attrs[1].toInt());
  if (a.attrs[2].toInt() >= 0) bdt = static_cast<at::ScalarType>(a.attrs[2].toInt());
  const std::array<bool, 3> mask{a.needs[0], a.needs[1], bdt && a.needs[2]};
  if (!a.saved[2].defined() && !a.saved[4].defined()) {
    auto [gi, gw, gb] = opforge::fp8_linear_backward(a.grads[0], a.saved[0], a.saved[1], mask, granularity, gdt, bdt);
    return {gi, gw, gb};
  }
  auto [gi, gw, gb] = opforge::_fp8_linear_quantized_backward(a.grads[0], or_none(a.saved[0]), or_none(a.saved[2]),
                                                              or_none(a.saved[3]), a.saved[1], or_none(a.saved[4]),
                                                              or_none(a.saved[5]), mask, granularity, gdt, bdt,
                                                              or_none(a.saved[6]));
  return {gi, gw, gb};
}

/// The forward of both differentiable ops' Autograd kernels: (output, q(inputᵀ) data, its scale), the last two
/// defined only when they are to be saved (a node is recorded, tensorwise, the weight needs a gradient, and the
/// caller did not ask for the input to be saved instead: `save_input`).
/// `weight_q`: q(weight) and q(weightᵀ) precomputed (_fp8_linear_quantized), else null (fp8_linear).
/// `input_amax`: max|input| given (_fp8_linear_quantized), else undefined.
struct Fp8LinearCall {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  c10::string_view granularity;
  std::optional<at::ScalarType> grad_dtype;
  const std::array<at::Tensor, 4>* weight_q;
  bool save_input;
  at::Tensor input_amax;

  bool keeps_input_t(bool grad) const {
    return grad && !save_input && weight.requires_grad() &&
           parse_granularity("fp8_linear", granularity) == Granularity::kTensorwise;
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(bool grad) const {
    if (keeps_input_t(grad)) {
      std::optional<at::Tensor> wd, ws;
      if (weight_q != nullptr) wd = (*weight_q)[0], ws = (*weight_q)[1];
      return opforge::_fp8_linear_forward(input, weight, bias, wd, ws, granularity, grad_dtype, or_none(input_amax));
    }
    if (weight_q == nullptr) return {opforge::fp8_linear(input, weight, bias, granularity, grad_dtype), {}, {}};
    const auto& q = *weight_q;
    return {opforge::_fp8_linear_quantized(input, weight, q[0], q[1], q[2], q[3], bias, granularity, grad_dtype,
                                           save_input, or_none(input_amax)),
            {}, {}};
  }

  void save(OpNode& n, const std::tuple<at::Tensor, at::Tensor, at::Tensor>& r) const {
    const bool kept = std::get<1>(r).defined();
    n.save(kept ? at::Tensor() : input);
    n.save(weight);
    n.save(std::get<1>(r));
    n.save(std::get<2>(r));
    n.save(weight_q != nullptr ? (*weight_q)[2] : at::Tensor());
    n.save(weight_q != nullptr ? (*weight_q)[3] : at::Tensor());
    // the amax goes with the input it describes (the backward quantizes inputᵀ from a saved input alone)
    n.save(kept ? at::Tensor() : input_amax);
    n.attr(static_cast<int64_t>(parse_granularity("fp8_linear", granularity) == Granularity::kRowwise ? 1 : 0));
    n.attr(grad_dtype.has_value() ? static_cast<int64_t>(*grad_dtype) : int64_t{-1});
    n.attr(bias.has_value() && bias->defined() ? static_cast<int64_t>(bias->scalar_type()) : int64_t{-1});
  }
};

constexpr Differentiability kFp8LinearOutputs[3] = {kDifferentiable, kNotDifferentiable, kNotDifferentiable};

at::Tensor fp8_linear_autograd(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::string_view granularity,
                               std::optional<at::ScalarType> grad_dtype) {
  const Fp8LinearCall call{input, weight, bias, granularity, grad_dtype, nullptr, false, at::Tensor()};
  return std::get<0>(autograd_op(
      {"fp8_linear", "opforge::Fp8LinearBackward", fp8_linear_backward_fn, nullptr}, kFp8LinearOutputs,
      [&](bool grad) { return call.forward(grad); },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor, at::Tensor>& r) { call.save(n, r); }, input, weight,
      bias));
}

at::Tensor fp8_linear_quantized_autograd(const at::Tensor& input, const at::Tensor& weight,
                                         const at::Tensor& weight_data, const at::Tensor& weight_inv_scale,
                                         const at::Tensor& weight_t_data, const at::Tensor& weight_t_inv_scale,
                                         const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                         std::optional<at::ScalarType> grad_dtype, bool save_input,
                                         const std::optional<at::Tensor>& input_amax) {
  // the operands' checks before anything runs (the forward's op checks them again): a malformed operand is
  // reported by this op's name
  check_fp8_linear_quantized_args(input, weight, weight_data, weight_inv_scale, weight_t_data, weight_t_inv_scale, bias,
                                  granularity, grad_dtype, input_amax);
  const std::array<at::Tensor, 4> q{weight_data, weight_inv_scale, weight_t_data, weight_t_inv_scale};
  // the amax carries no gradient: detached, it is saved (when it is) as a plain tensor
  const Fp8LinearCall call{input, weight, bias, granularity, grad_dtype, &q, save_input,
                           given(input_amax) ? input_amax->detach() : at::Tensor()};
  return std::get<0>(autograd_op(
      {"_fp8_linear_quantized", "opforge::Fp8LinearBackward", fp8_linear_backward_fn, nullptr}, kFp8LinearOutputs,
      [&](bool grad) { return call.forward(grad); },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor, at::Tensor>& r) { call.save(n, r); }, input, weight,
      bias));
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

// _quantize_fp8_weight, like quantize_fp8, runs below autograd (its outputs carry no history).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight_autograd(const at::Tensor& weight,
                                                                                        c10::string_view granularity) {
  check_no_forward_ad("_quantize_fp8_weight", weight);
  at::AutoDispatchBelowADInplaceOrView guard;
  return opforge::_quantize_fp8_weight(weight, granularity);
}

// _fp8_linear_forward is what the Autograd kernels above call below autograd; called directly its outputs carry
// no history (as quantize_fp8's: fp8_linear and _fp8_linear_quantized are the differentiable ops).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_forward_autograd(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& weight_data, const std::optional<at::Tensor>& weight_inv_scale,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& input_amax) {
  check_no_forward_ad("_fp8_linear_forward", input, weight, bias);
  at::AutoDispatchBelowADInplaceOrView guard;
  return opforge::_fp8_linear_forward(input, weight, bias, weight_data, weight_inv_scale, granularity, grad_dtype,
                                      input_amax);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("quantize_fp8", &quantize_fp8_meta);
  m.impl("_quantize_fp8_weight", &quantize_fp8_weight_meta);
  m.impl("fp8_linear", &fp8_linear_meta);
  m.impl("fp8_linear_backward", &fp8_linear_backward_meta);
  m.impl("_fp8_linear_forward", &fp8_linear_forward_meta);
  m.impl("_fp8_linear_quantized", &fp8_linear_quantized_meta);
  m.impl("_fp8_linear_quantized_backward", &fp8_linear_quantized_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("quantize_fp8", &quantize_fp8_autograd);
  m.impl("_quantize_fp8_weight", &quantize_fp8_weight_autograd);
  m.impl("fp8_linear", &fp8_linear_autograd);
  register_backward_op_autograd(m, "fp8_linear_backward");
  m.impl("_fp8_linear_quantized", &fp8_linear_quantized_autograd);
  m.impl("_fp8_linear_forward", &fp8_linear_forward_autograd);
  register_backward_op_autograd(m, "_fp8_linear_quantized_backward");
}

// torch.autocast (core/autocast.h): input and bias to the autocast dtype, the weight left as it is (quantized to
// e4m3 from its own precision, e.g. float32 master weights, as torchao's Float8Linear does under autocast). The
// backward and the quantizer keep their dtypes.
OPFORGE_AUTOCAST(fp8, {{"fp8_linear", AutocastPolicy::kLowerPrecision, {"input", "bias"}},
                       {"_fp8_linear_forward", AutocastPolicy::kLowerPrecision, {"input", "bias"}},
                       {"_fp8_linear_quantized", AutocastPolicy::kLowerPrecision, {"input", "bias"}},
                       {"fp8_linear_backward", AutocastPolicy::kInputDtype},
                       {"_fp8_linear_quantized_backward", AutocastPolicy::kInputDtype},
                       {"quantize_fp8", AutocastPolicy::kInputDtype},
                       {"_quantize_fp8_weight", AutocastPolicy::kInputDtype}})

}  // namespace opforge
