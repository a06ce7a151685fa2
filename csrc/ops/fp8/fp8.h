// quantize_fp8, fp8_linear, fp8_linear_backward and their private forms: FP8 training with current (dynamic) scaling.
//
//   quantize_fp8(X, dtype, granularity)   (data, scale): data = fp8(clamp(X · scale, ±max)), scale from max|X|
//                                         over the tensor or each row (fp8_math.h: the recipe and its special values)
//   fp8_linear(X, W, b)                   Y[M, N] = (q(X)[M, K] · q(W)ᵀ) / (s_X ⊗ s_W) + b[N]   q(X), q(W): e4m3
//   fp8_linear_backward                   dX[M, K] = (q(dY) · q(Wᵀ)ᵀ) / (s_dY ⊗ s_Wᵀ)   q(dY) per row of dY, q(Wᵀ) per column of W
//                                         dW[N, K] = (q(dYᵀ) · q(Xᵀ)ᵀ) / (s_dYᵀ ⊗ s_Xᵀ) per column of dY and of X
//                                         db[N]    = Σ_rows dY                  (fp32 accumulation)
//
// Every product is one scaled FP8 GEMM out[R_a, R_b] = (A[R_a, C] · B[R_b, C]ᵀ) / (s_a ⊗ s_b) of two operands
// quantized along their rows (the contraction runs along C): at::_scaled_mm, fp32 accumulation. For rowwise
// scales each operand's scale must be constant along the contraction, so each GEMM quantizes its operands with the
// contraction dim last: dY for dX (contraction N), dYᵀ and Xᵀ for dW (contraction M), Wᵀ for dX (per column of W).
// The transposes are never copied in high precision: the backend's transposed quantizer (quantize_cols) reads W,
// dY and X in their row-major layout and writes q(Wᵀ), q(dYᵀ), q(Xᵀ) row-major. Tensorwise scales do not depend on the axis, so
// when both gradients are needed q(dY) and q(dYᵀ) share one scale and come from one pass (quantize_both); rowwise,
// q(dY) is per row of dY and q(dYᵀ) per column, two quantizations. Tensorwise, q(Xᵀ) is the transpose of the
// forward's q(X) (one scale): when the weight needs a gradient the forward writes both from one pass
// (_fp8_linear_forward) and autograd saves q(Xᵀ) (FP8, half of a bf16 X) instead of X; rowwise scales of Xᵀ run
// per column of X, so the rowwise backward quantizes Xᵀ from the saved X. _fp8_linear_quantized takes q(W) and
// q(Wᵀ) precomputed (opforge's Python layers cache them per optimizer step) and skips both weight passes.
// input_amax (the private ops, tensorwise): max|X| handed in by the kernel that wrote X (rms_norm, fused_add_rms_norm,
// swiglu_packed compute it as they store X), so the quantizers of X and of Xᵀ skip their amax pass: the backends'
// quantizers take an `amax` tensor (undefined: computed from X as before) and read its bits as the amax pass's word.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "opforge/opforge.h"

namespace opforge {
namespace fp8_op {

/// Where the scales of a quantization run: one for the tensor, or one per row of the last dim.
enum class Granularity { kTensorwise, kRowwise };

/// "tensorwise" or "rowwise"; else ValueError naming the op and the given string.
Granularity parse_granularity(const char* op, c10::string_view granularity);

/// float8_e4m3fn or float8_e5m2 (`fallback` when nullopt); else ValueError naming the op and the argument.
at::ScalarType fp8_dtype_of(const char* op, const char* name, std::optional<at::ScalarType> dtype,
                            at::ScalarType fallback);

/// grad_dtype of fp8_linear: nullopt gives float8_e5m2 for tensorwise, float8_e4m3fn for rowwise (torchao's
/// tensorwise and rowwise recipes).
at::ScalarType grad_dtype_of(const char* op, std::optional<at::ScalarType> grad_dtype, Granularity g);

/// Checks of quantize_fp8 (Meta too): input floating, rowwise needs at least one dim; returns the FP8 dtype and
/// the granularity.
std::pair<at::ScalarType, Granularity> check_quantize_fp8_args(const at::Tensor& input,
                                                              std::optional<at::ScalarType> dtype,
                                                              c10::string_view granularity);

/// Checks of _quantize_fp8_weight (Meta too): weight 2-D and floating, the granularity; returns the granularity.
Granularity check_quantize_fp8_weight_args(const at::Tensor& weight, c10::string_view granularity);
/// Shape of quantize_fp8's scale: [] tensorwise, input's shape with the last dim 1 rowwise.
c10::SymDimVector scale_sym_sizes(const at::Tensor& input, Granularity g);

/// Checks of the private ops' input_amax (Meta too), when given: tensorwise only (ValueError), dtype float32 for a
/// bfloat16/float16/float32 input and float64 for a float64 one (TypeError), shape [1] (ValueError), input's device
/// (RuntimeError), each message naming `op`.
void check_input_amax(const char* op, const std::optional<at::Tensor>& input_amax, const at::Tensor& input,
                      Granularity g);

/// Checks of fp8_linear (Meta too): linear's checks, the granularity, grad_dtype.
Granularity check_fp8_linear_args(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                  std::optional<at::ScalarType> grad_dtype);

/// Checks of _fp8_linear_forward (Meta too): fp8_linear's, tensorwise only, weight_data and weight_inv_scale given
/// together and each well formed (check_weight_operand), input_amax (check_input_amax).
void check_fp8_linear_forward_args(const at::Tensor& input, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& weight_data,
                                   const std::optional<at::Tensor>& weight_inv_scale, c10::string_view granularity,
                                   std::optional<at::ScalarType> grad_dtype,
                                   const std::optional<at::Tensor>& input_amax);

/// Checks of _fp8_linear_quantized (Meta too): fp8_linear's, then the four weight operands (check_weight_operand),
/// input_amax (check_input_amax).
Granularity check_fp8_linear_quantized_args(const at::Tensor& input, const at::Tensor& weight,
                                            const at::Tensor& weight_data, const at::Tensor& weight_inv_scale,
                                            const at::Tensor& weight_t_data, const at::Tensor& weight_t_inv_scale,
                                            const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                            std::optional<at::ScalarType> grad_dtype,
                                            const std::optional<at::Tensor>& input_amax);

/// One precomputed operand of `op`: `data` float8_e4m3fn of shape [rows, cols] on `like`'s device (TypeError for
/// another dtype, ValueError for another shape, RuntimeError for another device), `scale` float32 on that device
/// with `scale_numel` elements (1 tensorwise; rows rowwise).
void check_weight_operand(const char* op, const char* data_name, const at::Tensor& data, const char* scale_name,
                          const at::Tensor& scale, const c10::SymInt& rows, const c10::SymInt& cols,
                          const c10::SymInt& scale_numel, const at::Tensor& like);

/// Checks of _fp8_linear_quantized_backward (Meta too): grad_output floating of shape (*, N) (input's leading dims
/// when input is given, with linear's checks of input and weight), the saved operands' shapes (check_weight_operand:
/// q(inputᵀ) [K, M], q(weightᵀ) [K, N]), grad_weight needing input or q(inputᵀ), the granularity and grad_dtype,
/// input_amax (check_input_amax; given only with input).
Granularity check_fp8_linear_quantized_backward_args(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask, c10::string_view granularity,
    std::optional<at::ScalarType> grad_dtype, std::optional<at::ScalarType> bias_dtype,
    const std::optional<at::Tensor>& input_amax);

/// Checks of fp8_linear_backward (Meta too): linear_backward's shape checks, the granularity, grad_dtype.
Granularity check_fp8_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& weight, c10::string_view granularity,
                                           std::optional<at::ScalarType> grad_dtype,
                                           std::optional<at::ScalarType> bias_dtype);

/// Backend kernel: quantizes X [R, C] (contiguous, floating) into data [R, C] (contiguous, of the FP8 dtype to
/// produce) and scale (float32, contiguous: 1 element tensorwise, R rowwise); inv_scale, when defined (float32,
/// scale's size), gets 1 / scale (the dequantization scale the scaled GEMM reads, IEEE division: the bits of
/// scale.reciprocal()). amax, tensorwise only: undefined, or max|X| given (one element on X's device, float64 for a
/// float64 X, float32 otherwise; the amax pass's value, which its bits stand for): the scale comes from it and no
/// amax pass runs. A given amax is rounded to X's dtype first (the identity for X's own amax; for the amax of a
/// higher-precision tensor that X was rounded from, the amax of X: rounding is monotone). Defined by each backend
/// (CPU: fp8_cpu.cpp, CUDA: fp8_cuda.cu).
void quantize_rows_cpu(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, at::Tensor& inv_scale, bool rowwise,
                       const at::Tensor& amax);
void quantize_rows_cuda(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, at::Tensor& inv_scale,
                        bool rowwise, const at::Tensor& amax);
using QuantizeRowsFn = void (*)(const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, bool, const at::Tensor&);

/// Backend kernel: quantizes Xᵀ along its rows straight from X [R, C] (contiguous, floating), with no transposed
/// copy of X: data_t [C, R] (contiguous, of the FP8 dtype to produce) and scale (float32, contiguous: 1 element
/// tensorwise, C rowwise: one per row of Xᵀ, i.e. per column of X) get the bits that quantize_rows gives for
/// Xᵀ.contiguous(); inv_scale, when defined, 1 / scale (as quantize_rows); amax as quantize_rows'. Defined by each
/// backend.
void quantize_cols_cpu(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, at::Tensor& inv_scale,
                       bool rowwise, const at::Tensor& amax);
void quantize_cols_cuda(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, at::Tensor& inv_scale,
                        bool rowwise, const at::Tensor& amax);
using QuantizeColsFn = void (*)(const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, bool, const at::Tensor&);

/// Backend kernel, tensorwise only: quantizes X [R, C] (contiguous, floating) in both orientations with its one
/// scale, from one amax pass and one cast pass: data [R, C] and data_t [C, R] (contiguous, of the FP8 dtype to
/// produce) and scale (float32, 1 element) get the bits of quantize_rows of X and of Xᵀ.contiguous() (whose
/// tensorwise scales are equal); inv_scale, when defined, 1 / scale (as quantize_rows); amax as quantize_rows' (a
/// given one leaves the cast pass alone). Defined by each backend.
void quantize_both_cpu(const at::Tensor& X, at::Tensor& data, at::Tensor& data_t, at::Tensor& scale,
                       at::Tensor& inv_scale, const at::Tensor& amax);
void quantize_both_cuda(const at::Tensor& X, at::Tensor& data, at::Tensor& data_t, at::Tensor& scale,
                        at::Tensor& inv_scale, const at::Tensor& amax);
using QuantizeBothFn = void (*)(const at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&,
                                const at::Tensor&);

/// Backend GEMM, tensorwise: out [R_a, R_b] = (a · bᵀ) · inv_a · inv_b in out_dtype (bfloat16, float16 or float32)
/// for FP8 a [R_a, C] and b [R_b, C] row-major (on CUDA, C and R_b already padded to multiples of 16) and one-element
/// float32 dequantization scales inv_a, inv_b; fast_accum as scaled_gemm's. Returns an undefined tensor, having
/// written nothing, where the backend leaves the GEMM to at::_scaled_mm. CUDA: scaled_gemm_cuda (fp8_cuda.cu); the
/// CPU has none (nullptr).
at::Tensor scaled_gemm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inv_a,
                            const at::Tensor& inv_b, at::ScalarType out_dtype, bool fast_accum);
using ScaledGemmFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    at::ScalarType, bool);

/// Backend kernel: Xᵀ [C, R], contiguous, of X [R, C] (contiguous, an FP8 dtype): the bytes transposed. CPU:
/// transpose_fp8_cpu (fp8_cpu.cpp), CUDA: transpose_fp8_cuda (fp8_cuda.cu, a tiled shared-memory transpose).
at::Tensor transpose_fp8_cpu(const at::Tensor& X);
at::Tensor transpose_fp8_cuda(const at::Tensor& X);
using TransposeFn = at::Tensor (*)(const at::Tensor&);

/// One backend's kernels: the set that the kernel bodies shared by CPU and CUDA call.
struct Backend {
  QuantizeRowsFn rows;  ///< X along its rows
  QuantizeColsFn cols;  ///< Xᵀ along its rows, read from X
  QuantizeBothFn both;  ///< tensorwise: X and Xᵀ in one pass
  ScaledGemmFn gemm;    ///< tensorwise scaled GEMM of the backend's own, or nullptr (at::_scaled_mm)
  TransposeFn transpose;  ///< FP8 bytes transposed
};

/// One quantized GEMM operand: data [R, C] FP8 row-major, scale float32 [1] (tensorwise) or [R] (rowwise), and
/// inv_scale = 1 / scale (scale's shape), the dequantization scale scaled_gemm reads. The quantizers write both; an
/// operand given by a caller (the private ops' precomputed or saved operands) carries inv_scale alone.
struct Operand {
  at::Tensor data;
  at::Tensor scale;
  at::Tensor inv_scale;
};

/// Quantizes X [R, C] (made contiguous) along its rows to `dtype` with the backend's row kernel. amax: undefined,
/// or max|X| given (tensorwise; see quantize_rows_cpu).
Operand quantize_operand(const Backend& be, const at::Tensor& X, at::ScalarType dtype, bool rowwise,
                         const at::Tensor& amax = at::Tensor());

/// Quantizes Xᵀ [C, R] along its rows (X's columns) to `dtype`, from X [R, C]: the backend's transposed kernel on
/// X made contiguous (no transposed copy), or its row kernel on Xᵀ in place when Xᵀ is the row-major one (X a
/// transposed view). The bits of quantize_operand(be, X.t(), dtype, rowwise). amax as quantize_operand's.
Operand quantize_operand_t(const Backend& be, const at::Tensor& X, at::ScalarType dtype, bool rowwise,
                           const at::Tensor& amax = at::Tensor());

/// Tensorwise: (q(X) [R, C], q(Xᵀ) [C, R]) in `dtype` from X [R, C] (made contiguous), one amax pass and one cast
/// pass; both operands hold the same one-element scale tensor. The bits of quantize_operand of X and of X.t().
/// amax as quantize_operand's (given: the cast pass alone).
std::pair<Operand, Operand> quantize_operand_both(const Backend& be, const at::Tensor& X, at::ScalarType dtype,
                                                  const at::Tensor& amax = at::Tensor());

/// out[R_a, R_b] = (A · Bᵀ) / (s_a ⊗ s_b) in out_dtype by the backend's GEMM (be.gemm, tensorwise, where it takes
/// the problem) or at::_scaled_mm (fp32 accumulation; the product in bfloat16 for rowwise scales, float32 for a
/// float64 out_dtype, else out_dtype; then converted). On CUDA, C and R_b are padded with zeros to multiples of 16
/// (the scaled GEMM's requirement) and the first R_b columns copied into a fresh row-major [R_a, R_b] tensor.
/// fast_accum: CUDA's use_fast_accum (the tensor cores' partial sum never moved to fp32; the CPU ignores it).
at::Tensor scaled_gemm(const Backend& be, const Operand& A, const Operand& B, bool rowwise, at::ScalarType out_dtype,
                       bool fast_accum = false);

/// Which of fp8_linear's GEMMs run with fast accumulation (the knob OPFORGE_FP8_FAST_ACCUM: 1 the forward's, 2
/// all three; 0, the default, none).
bool fast_accum_forward();
bool fast_accum_backward();

/// quantize_fp8's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor> quantize_fp8_impl(const Backend& be, const at::Tensor& input,
                                                     std::optional<at::ScalarType> dtype,
                                                     c10::string_view granularity);

/// _quantize_fp8_weight's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight_impl(const Backend& be,
                                                                                    const at::Tensor& weight,
                                                                                    c10::string_view granularity);
/// fp8_linear's kernel body shared by CPU and CUDA.
at::Tensor fp8_linear_impl(const Backend& be, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view granularity,
                           std::optional<at::ScalarType> grad_dtype);

/// _fp8_linear_forward's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_forward_impl(
    const Backend& be, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& weight_data, const std::optional<at::Tensor>& weight_inv_scale,
    c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    const std::optional<at::Tensor>& input_amax);

/// _fp8_linear_quantized's kernel body shared by CPU and CUDA.
at::Tensor fp8_linear_quantized_impl(const Backend& be, const at::Tensor& input, const at::Tensor& weight,
                                     const at::Tensor& weight_data, const at::Tensor& weight_inv_scale,
                                     const at::Tensor& weight_t_data, const at::Tensor& weight_t_inv_scale,
                                     const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                     std::optional<at::ScalarType> grad_dtype,
                                     const std::optional<at::Tensor>& input_amax);

/// _fp8_linear_quantized_backward's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_quantized_backward_impl(
    const Backend& be, const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask, c10::string_view granularity,
    std::optional<at::ScalarType> grad_dtype, std::optional<at::ScalarType> bias_dtype,
    const std::optional<at::Tensor>& input_amax);

/// fp8_linear_backward's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward_impl(
    const Backend& be, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask, c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    std::optional<at::ScalarType> bias_dtype);

/// The op kernels around one backend's quantization kernels (`B`), written once for the CPU and CUDA.
template <const Backend& B>
struct Kernels {
  static std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& input,
                                                         std::optional<at::ScalarType> dtype,
                                                         c10::string_view granularity) {
    return quantize_fp8_impl(B, input, dtype, granularity);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_weight(
      const at::Tensor& weight, c10::string_view granularity) {
    return quantize_fp8_weight_impl(B, weight, granularity);
  }
  static at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::string_view granularity,
                               std::optional<at::ScalarType> grad_dtype) {
    return fp8_linear_impl(B, input, weight, bias, granularity, grad_dtype);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward(
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
      std::array<bool, 3> output_mask, c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
      std::optional<at::ScalarType> bias_dtype) {
    return fp8_linear_backward_impl(B, grad_output, input, weight, output_mask, granularity, grad_dtype,
                                    bias_dtype);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_forward(
      const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
      const std::optional<at::Tensor>& weight_data, const std::optional<at::Tensor>& weight_inv_scale,
      c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
      const std::optional<at::Tensor>& input_amax) {
    return fp8_linear_forward_impl(B, input, weight, bias, weight_data, weight_inv_scale, granularity, grad_dtype,
                                   input_amax);
  }
  static at::Tensor fp8_linear_quantized(const at::Tensor& input, const at::Tensor& weight,
                                         const at::Tensor& weight_data, const at::Tensor& weight_inv_scale,
                                         const at::Tensor& weight_t_data, const at::Tensor& weight_t_inv_scale,
                                         const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                         std::optional<at::ScalarType> grad_dtype, bool /*save_input*/,
                                         const std::optional<at::Tensor>& input_amax) {
    // save_input chooses what autograd saves: the kernel's output is the same either way
    return fp8_linear_quantized_impl(B, input, weight, weight_data, weight_inv_scale, weight_t_data, weight_t_inv_scale,
                                     bias, granularity, grad_dtype, input_amax);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_quantized_backward(
      const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
      const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
      const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
      const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask,
      c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
      std::optional<at::ScalarType> bias_dtype, const std::optional<at::Tensor>& input_amax) {
    return fp8_linear_quantized_backward_impl(B, grad_output, input, input_t_data, input_t_inv_scale, weight,
                                              weight_t_data, weight_t_inv_scale, output_mask, granularity, grad_dtype,
                                              bias_dtype, input_amax);
  }
  /// Registers the kernels for the library's dispatch key.
  static void register_for(torch::Library& m) {
    m.impl("quantize_fp8", &Kernels::quantize_fp8);
    m.impl("_quantize_fp8_weight", &Kernels::quantize_fp8_weight);
    m.impl("fp8_linear", &Kernels::fp8_linear);
    m.impl("fp8_linear_backward", &Kernels::fp8_linear_backward);
    m.impl("_fp8_linear_forward", &Kernels::fp8_linear_forward);
    m.impl("_fp8_linear_quantized", &Kernels::fp8_linear_quantized);
    m.impl("_fp8_linear_quantized_backward", &Kernels::fp8_linear_quantized_backward);
  }
};

}  // namespace fp8_op
}  // namespace opforge
