// fake_quant_linear, _fake_quant_linear_forward, fake_quant_linear_backward and fake_quantize_weight.
//
//   fake_quant_linear(X, W, b)  Y[M, N] = fq_a(X)[M, K] · fq_w(W)[N, K]ᵀ + b[N]
//     fq_w: W fake-quantized to `weight_bits`-bit signed integers per tensor, per output channel or per group of
//           `group_size` consecutive columns (along K), symmetric or asymmetric (fake_quant_math.h);
//     fq_a: with act_quant, each row (token) of X fake-quantized to int8, asymmetric (dynamic, per token);
//           else the identity.
//   fake_quant_linear_backward (straight-through estimator with the in-range masks mX, mW):
//     dX[M, K] = (dY · fq_w(W)) ⊙ mX        (mX = 1 without act_quant)
//     dW[N, K] = (dYᵀ · fq_a(X)) ⊙ mW
//     db[N]    = Σ_rows dY                  (fp32 accumulation)
//
// input (*, K) is flattened to M = prod(*) rows. The GEMMs are opforge::linear / opforge::linear_backward (the
// project's GEMM layer: ATen's on the CPU, cuBLASLt on CUDA); the quantization is this folder's own kernel,
// one pass per group over W and one per row over X, sharing fake_quant_math.h between CPU and CUDA.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "opforge/opforge.h"

namespace opforge {
namespace fake_quant_linear_op {

/// The grouping of a weight fake-quantization.
struct Grouping {
  bool per_tensor;  // one scale for the whole tensor (group_size == 0)
  int64_t length;   // elements per group along K (K for per-channel and, row by row, per-tensor)
};

/// Checks weight_bits (2..8) and group_size (−1: per channel, 0: per tensor, g > 0 dividing K) against
/// in_features K (symbolic allowed). Raises ValueError with the op's name, the allowed values and the given one.
void check_quant_args(const char* op, int64_t weight_bits, int64_t group_size, const c10::SymInt& K);

/// Checks of fake_quant_linear / _fake_quant_linear_forward that hold for symbolic shapes (Meta): linear's
/// checks (ranks, K, bias shape, floating dtypes, one device) and check_quant_args.
void check_fake_quant_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size);

/// Checks of fake_quant_linear_backward (Meta too): linear_backward's shape checks, the masks' shapes and
/// bool dtype, the dtype arguments floating.
void check_fake_quant_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                           const at::Tensor& weight, const at::Tensor& weight_mask,
                                           const std::optional<at::Tensor>& input_mask,
                                           std::optional<at::ScalarType> weight_dtype,
                                           std::optional<at::ScalarType> bias_dtype);

/// Checks of fake_quantize_weight (Meta too): weight 2-D floating, check_quant_args.
void check_fake_quantize_weight_args(const at::Tensor& weight, int64_t bits, int64_t group_size);

/// Shape of the scale / zero_point tensors of a weight (N, K) fake-quantization: (1, 1) per tensor, (N, 1) per
/// channel, (N, K / group_size) per group.
c10::SymDimVector qparams_sym_sizes(const at::Tensor& weight, int64_t group_size);

/// Result of one fake-quantization of a [R, K] contiguous matrix.
struct FakeQuantized {
  at::Tensor output;      // [R, K], the input's dtype
  at::Tensor mask;        // [R, K] bool: q within [qmin, qmax] before clamping
  at::Tensor scale;       // float32, qparams_sym_sizes' shape ((R, 1) per row, (R, K / g) per group, (1, 1))
  at::Tensor zero_point;  // int32, scale's shape
};

/// The uninitialised outputs of a fake-quantization of X [R, K] (both backends): output like X, mask [R, K] bool
/// when `want_mask` (else undefined), scale float32 and zero_point int32 of (1, 1) per tensor, else (R, K / g.length)
/// ((R, 0) when g.length is 0).
FakeQuantized empty_fake_quantized(const at::Tensor& X, Grouping g, bool want_mask);

/// Backend kernel: fake-quantizes X [R, K] (contiguous, floating) to `bits`-bit signed integers with the grouping
/// `g`, symmetric or asymmetric. Defined by each backend (CPU: fake_quant_linear_cpu.cpp, CUDA: *_cuda.cu).
/// `want_mask` = false leaves `mask` undefined (and writes none).
FakeQuantized fake_quantize_rows_cpu(const at::Tensor& X, int64_t bits, Grouping g, bool symmetric, bool want_mask);
FakeQuantized fake_quantize_rows_cuda(const at::Tensor& X, int64_t bits, Grouping g, bool symmetric,
                                      bool want_mask);

/// The grouping for group_size (−1, 0 or a divisor of K).
inline Grouping grouping_of(int64_t group_size, int64_t K) {
  if (group_size == 0) return {true, K};
  if (group_size < 0) return {false, K};
  return {false, group_size};
}

/// The forward shared by the CPU and CUDA kernels of _fake_quant_linear_forward, given the backend's
/// fake_quantize_rows: (output, weight_fq in input's dtype, weight_mask, input_fq (*, K) or an empty [0] tensor
/// without act_quant, input_mask likewise). want_masks = false (the public op's kernel, no autograd): only
/// the output is defined.
using FakeQuantizeRowsFn = FakeQuantized (*)(const at::Tensor&, int64_t, Grouping, bool, bool);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_forward_impl(
    FakeQuantizeRowsFn fq_rows, const at::Tensor& input, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size, bool symmetric, bool act_quant,
    bool want_masks);

/// The backward shared by the CPU and CUDA kernels (linear_backward, then the masks).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_backward_impl(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_mask,
    const std::optional<at::Tensor>& input_mask, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> weight_dtype, std::optional<at::ScalarType> bias_dtype);

/// fake_quantize_weight's kernel body shared by CPU and CUDA.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight_impl(FakeQuantizeRowsFn fq_rows,
                                                                                    const at::Tensor& weight,
                                                                                    int64_t bits, int64_t group_size,
                                                                                    bool symmetric);

/// The backend kernels of _fake_quant_linear_forward, fake_quant_linear and fake_quantize_weight around one
/// backend's fake_quantize_rows (`Rows`), written once for the CPU and CUDA.
template <FakeQuantizeRowsFn Rows>
struct Kernels {
  /// fake_quant_linear: the output only (no masks, no saved tensors).
  static at::Tensor fake_quant_linear(const at::Tensor& input, const at::Tensor& weight,
                                      const std::optional<at::Tensor>& bias, int64_t weight_bits, int64_t group_size,
                                      bool symmetric, bool act_quant) {
    return std::get<0>(fake_quant_linear_forward_impl(Rows, input, weight, bias, weight_bits, group_size, symmetric,
                                                      act_quant, /*want_masks=*/false));
  }
  /// _fake_quant_linear_forward: the output and what backward needs.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
      const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t weight_bits,
      int64_t group_size, bool symmetric, bool act_quant) {
    return fake_quant_linear_forward_impl(Rows, input, weight, bias, weight_bits, group_size, symmetric, act_quant,
                                          /*want_masks=*/true);
  }
  /// fake_quantize_weight: (fq_w, mask, scale, zero_point).
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight(const at::Tensor& weight,
                                                                                        int64_t bits,
                                                                                        int64_t group_size,
                                                                                        bool symmetric) {
    return fake_quantize_weight_impl(Rows, weight, bits, group_size, symmetric);
  }
  /// Registers the four kernels (the backward is backend-independent) for the library's dispatch key.
  static void register_for(torch::Library& m) {
    m.impl("_fake_quant_linear_forward", &Kernels::forward);
    m.impl("fake_quant_linear", &Kernels::fake_quant_linear);
    m.impl("fake_quant_linear_backward", &fake_quant_linear_backward_impl);
    m.impl("fake_quantize_weight", &Kernels::fake_quantize_weight);
  }
};

}  // namespace fake_quant_linear_op
}  // namespace opforge
