// linear_cross_entropy: the language-model loss cross_entropy(input · linear_weightᵀ + linear_bias, target)
// without materialising the [N, V] logits (issue 10).
//
//   z[i, j]  = cap(input[i] · linear_weight[j] + linear_bias[j]),  cap(x) = softcap · tanh(x / softcap) (or x)
//   m[i]     = max_j z[i, j];  r[i] = log Σ_j exp(z[i, j] − m[i]);  lse[i] = m[i] + r[i]
//   loss[i]  = (1 − ε) · w[t_i] · (lse[i] − z[i, t_i]) + ε / V · Σ_j w[j] · (lse[i] − z[i, j]) + z_loss · lse[i]²
//              (0 where t_i == ignore_index; w = class weights, all ones when None; ε = label_smoothing)
//   mean     = Σ_i loss[i] / Σ_{i valid} w[t_i];   sum = Σ_i loss[i];   none = loss[i]
//
// Algorithm (CPU and CUDA alike): the N tokens are processed in chunks of `chunk` rows, so at most one chunk of
// logits [chunk, V] (fp32) exists at a time. Per chunk: logits = X_c · Wᵀ (a GEMM, fp32 out), then one row kernel
// computes (m, r) and the loss of every row (forward), or the logit gradient in place (backward, with the
// saved (m, r)), which then feeds dX_c = dZ_c · W and dW += dZ_cᵀ · X_c (fp32 accumulator across chunks) and
// db += Σ_rows dZ_c (fp32). Gradients are recomputed in backward with the given grad_output (so a per-token
// grad_output of reduction="none" is exact); the forward keeps only (m, r) per token.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>

namespace opforge {

/// Loss of the tokens' logits input · linear_weightᵀ + linear_bias against target, in chunks of tokens (see
/// the file comment). input (*, H), linear_weight (V, H), target (*) int64, linear_bias (V,) or none, weight
/// (V,) class weights or none. reduction "mean" | "sum" | "none"; label_smoothing in [0, 1]; z_loss >= 0;
/// softcap > 0 or none; chunk_size rows per chunk (none: from the memory budget / OPFORGE_LCE_CHUNK_SIZE).
/// Returns the loss: () for mean/sum, (*) for none, in input's dtype.
at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                const std::optional<at::Tensor>& linear_bias = std::nullopt,
                                const std::optional<at::Tensor>& weight = std::nullopt,
                                c10::string_view reduction = "mean", int64_t ignore_index = -100,
                                double label_smoothing = 0.0, double z_loss = 0.0,
                                std::optional<double> softcap = std::nullopt,
                                std::optional<int64_t> chunk_size = std::nullopt);

/// linear_cross_entropy's forward for autograd: (loss, stats); stats (*, 2) in float32 (float64 for float64
/// input) holds per token (m, r): the row max of the (capped) logits and log Σ exp(z − m), so lse = m + r
/// (kept apart: with large logit offsets m + r would round away r). Ignored tokens get (0, 0).
std::tuple<at::Tensor, at::Tensor> _linear_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size);

/// Gradients of linear_cross_entropy: (grad_input (*, H) input's dtype, grad_linear_weight (V, H) in
/// linear_weight's dtype, grad_linear_bias (V,) in linear_bias's dtype), entry k only when output_mask[k] (no
/// V × H buffer at all without grad_linear_weight). grad_output: () for mean/sum, (*) for none (a per-token
/// weight). stats: the forward's (m, r). The logits are recomputed chunk by chunk; dW and db accumulate in fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size = std::nullopt);

namespace lce {

enum class Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

/// "none" | "mean" | "sum"; raises ValueError "opforge::<op>: expected reduction to be one of ..." otherwise.
Reduction parse_reduction(const char* op, c10::string_view reduction);
const char* reduction_name(Reduction r);

/// Symbolic-safe checks shared by the real kernels and Meta. Raises ValueError for shapes (input rank 0,
/// linear_weight not 2-D or without rows, H mismatch, target not input's leading dims, bias/weight not (V,)),
/// label_smoothing outside [0, 1], z_loss < 0 or not finite, softcap <= 0, chunk_size < 1, unknown reduction;
/// TypeError for non-floating input/linear_weight/bias/weight or a target that is not int64; RuntimeError for
/// tensors on different devices.
Reduction check_args(const char* op, const at::Tensor& input, const at::Tensor& linear_weight,
                     const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                     const std::optional<at::Tensor>& weight, c10::string_view reduction, double label_smoothing,
                     double z_loss, std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// The backward's extra checks (grad_output of the loss's shape, stats (*, 2) in the stats dtype).
Reduction check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight,
                              const at::Tensor& target, const at::Tensor& stats,
                              const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                              c10::string_view reduction, double label_smoothing, double z_loss,
                              std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// dtype of stats, of the logits chunk and of every accumulator: float32 (float64 for float64 input).
at::ScalarType acc_dtype(at::ScalarType input_dtype);

/// Rows per chunk: chunk_size if given, else $OPFORGE_LCE_CHUNK_SIZE (read once per process) if set, else
/// budget_bytes / (V · bytes_per_logit) rounded down to a multiple of 64 (at least 1), at most N.
int64_t resolve_chunk(std::optional<int64_t> chunk_size, int64_t N, int64_t V, int64_t budget_bytes,
                      int64_t bytes_per_logit);

/// The canonical problem the kernels see.
struct Problem {
  at::Tensor X;   // [N, H] contiguous, input's dtype
  at::Tensor W;   // [V, H] contiguous, input's dtype
  at::Tensor b;   // [V] contiguous, acc dtype, or undefined
  at::Tensor T;   // [N] int64 contiguous
  at::Tensor cw;  // [V] contiguous, acc dtype, or undefined (class weights)
  int64_t N, H, V;
  Reduction reduction;
  int64_t ignore_index;
  double label_smoothing, z_loss, softcap;  // softcap 0: none
};
Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     Reduction reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                     std::optional<double> softcap);

/// Σ_{valid i} w[t_i] (the count of valid tokens without class weights), a 0-dim acc-dtype tensor on X's device
/// (no host sync). Out-of-range targets are clamped for the gather (the kernels flag them).
at::Tensor mean_denominator(const Problem& p);

/// The loss from the per-token losses [N] (acc dtype): reshaped to target's shape (none), summed, or summed and
/// divided by mean_denominator (mean: NaN when every target is ignored, as torch's cross_entropy); input's dtype.
at::Tensor reduce_loss(const Problem& p, const at::Tensor& token_loss, const at::Tensor& target);

/// The per-token gradient scale [N] or [1] (acc dtype) from grad_output: grad_output itself for none,
/// grad_output / mean_denominator for mean, grad_output for sum. `stride` is set to 1 ([N]) or 0 ([1]).
at::Tensor grad_scale(const Problem& p, const at::Tensor& grad_output, int64_t& stride);

}  // namespace lce
}  // namespace opforge
