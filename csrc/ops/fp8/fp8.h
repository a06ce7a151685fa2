// quantize_fp8, fp8_linear and fp8_linear_backward: FP8 training with current (dynamic) scaling.
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
// Tensorwise scales do not depend on the axis; the same code path serves both (the transposed copies of a
// tensorwise quantization are the transposes of the forward's: fusing them into the forward's quantization, and
// the quantization into the producers' epilogues, removes those extra passes).
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

/// Shape of quantize_fp8's scale: [] tensorwise, input's shape with the last dim 1 rowwise.
c10::SymDimVector scale_sym_sizes(const at::Tensor& input, Granularity g);

/// Checks of fp8_linear (Meta too): linear's checks, the granularity, grad_dtype.
Granularity check_fp8_linear_args(const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, c10::string_view granularity,
                                  std::optional<at::ScalarType> grad_dtype);

/// Checks of fp8_linear_backward (Meta too): linear_backward's shape checks, the granularity, grad_dtype.
Granularity check_fp8_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& weight, c10::string_view granularity,
                                           std::optional<at::ScalarType> grad_dtype,
                                           std::optional<at::ScalarType> bias_dtype);

/// Backend kernel: quantizes X [R, C] (contiguous, floating) into data [R, C] (contiguous, of the FP8 dtype to
/// produce) and scale (float32, contiguous: 1 element tensorwise, R rowwise). Defined by each backend
/// (CPU: fp8_cpu.cpp, CUDA: fp8_cuda.cu).
void quantize_rows_cpu(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise);
void quantize_rows_cuda(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise);
using QuantizeRowsFn = void (*)(const at::Tensor&, at::Tensor&, at::Tensor&, bool);

/// One quantized GEMM operand: data [R, C] FP8 row-major, scale float32 [1] (tensorwise) or [R] (rowwise).
struct Operand {
  at::Tensor data;
  at::Tensor scale;
};

/// Quantizes X [R, C] (made contiguous) to `dtype` with the backend's kernel.
Operand quantize_operand(QuantizeRowsFn rows, const at::Tensor& X, at::ScalarType dtype, bool rowwise);

/// out[R_a, R_b] = (A · Bᵀ) / (s_a ⊗ s_b) in out_dtype by at::_scaled_mm (fp32 accumulation; the product in
/// bfloat16 for rowwise scales, float32 for a float64 out_dtype, else out_dtype; then converted). On CUDA, C and
/// R_b are padded with zeros to multiples of 16 (the scaled GEMM's requirement) and the first R_b columns copied
/// into a fresh row-major [R_a, R_b] tensor.
at::Tensor scaled_gemm(const Operand& A, const Operand& B, bool rowwise, at::ScalarType out_dtype);

/// quantize_fp8's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor> quantize_fp8_impl(QuantizeRowsFn rows, const at::Tensor& input,
                                                     std::optional<at::ScalarType> dtype,
                                                     c10::string_view granularity);

/// fp8_linear's kernel body shared by CPU and CUDA.
at::Tensor fp8_linear_impl(QuantizeRowsFn rows, const at::Tensor& input, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias, c10::string_view granularity,
                           std::optional<at::ScalarType> grad_dtype);

/// fp8_linear_backward's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward_impl(
    QuantizeRowsFn rows, const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    std::array<bool, 3> output_mask, c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
    std::optional<at::ScalarType> bias_dtype);

/// The backend kernels around one backend's quantize_rows (`Rows`), written once for the CPU and CUDA.
template <QuantizeRowsFn Rows>
struct Kernels {
  static std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& input,
                                                         std::optional<at::ScalarType> dtype,
                                                         c10::string_view granularity) {
    return quantize_fp8_impl(Rows, input, dtype, granularity);
  }
  static at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, c10::string_view granularity,
                               std::optional<at::ScalarType> grad_dtype) {
    return fp8_linear_impl(Rows, input, weight, bias, granularity, grad_dtype);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward(
      const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
      std::array<bool, 3> output_mask, c10::string_view granularity, std::optional<at::ScalarType> grad_dtype,
      std::optional<at::ScalarType> bias_dtype) {
    return fp8_linear_backward_impl(Rows, grad_output, input, weight, output_mask, granularity, grad_dtype,
                                    bias_dtype);
  }
  /// Registers the three kernels for the library's dispatch key.
  static void register_for(torch::Library& m) {
    m.impl("quantize_fp8", &Kernels::quantize_fp8);
    m.impl("fp8_linear", &Kernels::fp8_linear);
    m.impl("fp8_linear_backward", &Kernels::fp8_linear_backward);
  }
};

}  // namespace fp8_op
}  // namespace opforge
