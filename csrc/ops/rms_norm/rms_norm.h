// RMSNorm ops: rms_norm, fused_add_rms_norm, their rstd-returning forwards and rms_norm_backward.
//
//   rstd[m]  = 1 / sqrt(mean_n(x[m, n]²) + eps)
//   y[m, n]  = x[m, n] · rstd[m] · w[n]
//   fused:     z = input + residual;  y = rms_norm(z);  returns (y, z)
//
// The normalized dims (the trailing len(normalized_shape) dims of input) flatten to N, the leading
// dims to M: kernels see a contiguous [M, N] problem, produced by the checkers below.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "opforge/opforge.h"

namespace opforge {
namespace rmsnorm {

/// eps when the caller passes None: the machine epsilon of the compute type (float32 for
/// float32/float16/bfloat16, float64 for float64), which is what torch.nn.functional.rms_norm uses.
double default_eps(at::ScalarType input_dtype);

/// eps if given, else default_eps; raises ValueError "opforge::<op>: expected eps >= 0, but got ..." for
/// a negative or NaN eps. Used by the real kernels' checker and by Meta alike.
double resolve_eps(const char* op, std::optional<double> eps, at::ScalarType input_dtype);

/// Shape, dtype and device checks that also hold for symbolic shapes (shared with Meta).
/// `residual`: std::nullopt for rms_norm; for fused_add_rms_norm a tensor, which must be defined (not None).
/// Raises: ValueError when normalized_shape is empty or is not input's trailing dims, when weight's
/// shape is not normalized_shape, when residual's shape is not input's; TypeError for non-floating
/// dtypes; RuntimeError for tensors on different devices.
void check_args(const char* op, const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& residual = std::nullopt);

/// Checks of rms_norm_backward's arguments (symbolic-safe): grad_output of input's shape, rstd of
/// input's leading dims (normalized dims = input's dims after rstd's), weight of the normalized shape.
void check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& rstd,
                         const std::optional<at::Tensor>& weight);

/// The leading (batch) dims of input, given how many trailing dims are normalized: rstd's shape.
c10::SymIntArrayRef leading_sizes(const at::Tensor& input, int64_t normalized_ndim);

/// dtype of rstd: float32 for float32/float16/bfloat16 input, float64 for float64 input.
at::ScalarType rstd_dtype(at::ScalarType input_dtype);

/// The canonical forward problem. X, R: [M, N] contiguous in input's dtype (R only for the fused op);
/// W: [N] contiguous in input's dtype, or undefined (no weight). The mixed-dtype policy: weight and
/// residual are converted to input's dtype once on entry.
struct Problem {
  at::Tensor X;  // [M, N]
  at::Tensor R;  // [M, N] or undefined
  at::Tensor W;  // [N] or undefined
  int64_t M, N;
  double eps;
};
Problem check_forward(const char* op, const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight, std::optional<double> eps,
                      const std::optional<at::Tensor>& residual = std::nullopt);

/// The canonical backward problem: dY, X [M, N] contiguous in input's dtype (a zero-stride or
/// transposed grad_output is materialized once), rstd [M] contiguous, W [N] in input's dtype or undefined.
struct BackwardProblem {
  at::Tensor dY;    // [M, N]
  at::Tensor X;     // [M, N]
  at::Tensor rstd;  // [M]
  at::Tensor W;     // [N] or undefined
  int64_t M, N;
};
BackwardProblem check_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& rstd,
                               const std::optional<at::Tensor>& weight);

/// The canonical problem of _rms_norm_apply(input, rstd, weight): X [M, N] contiguous (input), rstd [M] contiguous,
/// W [N] in input's dtype or undefined (dY undefined); the checks of rms_norm_backward's input / rstd / weight
/// (normalized dims = input's dims after rstd's), errors naming _rms_norm_apply.
BackwardProblem check_apply(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight);

/// check_apply's checks alone (symbolic-safe, shared with Meta).
void check_apply_args(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight);

/// The forward ops' outputs as every backend returns them: Y (and, when `fused`, Z = residual_out) of
/// input's shape and dtype, contiguous; rstd of input's leading (un-normalized) dims in rstd_dtype.
struct ForwardOutputs {
  at::Tensor Y, Z, rstd;
};
ForwardOutputs empty_forward_outputs(const Problem& p, const at::Tensor& input, int64_t normalized_ndim, bool fused);

/// A backend's forward: fills Y (and Z where p.R is defined) and rstd, as allocated by empty_forward_outputs; when
/// `amax` is not null (the *_amax ops), also sets *amax to amax_of(Y): a new [1] tensor on Y's device, float32
/// (float64 for float64), max |y| over Y as stored (NaN if any y is NaN, else inf if any is inf; 0 when Y is empty).
using ForwardKernel = void (*)(const Problem& p, at::Tensor& Y, at::Tensor& Z, at::Tensor& rstd, at::Tensor* amax);

/// _rms_norm_forward on one backend: checks, allocates the outputs and runs `kernel`; returns (Y, rstd).
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(ForwardKernel kernel, const at::Tensor& input,
                                                    c10::SymIntArrayRef normalized_shape,
                                                    const std::optional<at::Tensor>& weight, std::optional<double> eps);

/// _rms_norm_forward_amax on one backend: rms_norm_forward's outputs and amax of Y; returns (Y, rstd, amax).
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward_amax(ForwardKernel kernel, const at::Tensor& input,
                                                                     c10::SymIntArrayRef normalized_shape,
                                                                     const std::optional<at::Tensor>& weight,
                                                                     std::optional<double> eps);

/// _fused_add_rms_norm_forward_amax on one backend: fused_add_rms_norm_forward's outputs and amax of Y (the normed
/// output, not Z); returns (Y, Z, rstd, amax).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_amax(
    ForwardKernel kernel, const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps);

/// _fused_add_rms_norm_forward on one backend: as rms_norm_forward with a residual; returns (Y, Z, rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward(ForwardKernel kernel, const at::Tensor& input,
                                                                          const at::Tensor& residual,
                                                                          c10::SymIntArrayRef normalized_shape,
                                                                          const std::optional<at::Tensor>& weight,
                                                                          std::optional<double> eps);

/// What every backend's rms_norm_backward starts from: the checked problem, which gradients are wanted
/// (want_dw: output_mask[1] and a weight), dX (input's shape and dtype, empty) when want_dx, and the dtype
/// in which the dweight partials accumulate (rstd_dtype).
struct BackwardSetup {
  BackwardProblem p;
  bool want_dx, want_dw;
  at::Tensor dX;
  at::ScalarType acc_dtype;
};
BackwardSetup begin_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& rstd,
                             const std::optional<at::Tensor>& weight, std::array<bool, 2> output_mask);

/// A backend's backward, called when a gradient is wanted: fills s.dX when s.want_dx; returns dweight in weight's
/// shape and dtype when s.want_dw (`weight` is then the weight; undefined otherwise), else an undefined tensor.
using BackwardKernel = at::Tensor (*)(BackwardSetup& s, const at::Tensor& weight);

/// rms_norm_backward on one backend: begin_backward, then `kernel` unless no gradient is wanted; returns (dX, dW).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(BackwardKernel kernel, const at::Tensor& grad_output,
                                                     const at::Tensor& input, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& weight,
                                                     std::array<bool, 2> output_mask);

/// dweight from its [N] sum in the accumulation dtype: viewed as weight and converted to weight's dtype.
inline at::Tensor as_weight_grad(const at::Tensor& sum, const at::Tensor& weight) {
  return sum.view(weight.sizes()).to(weight.scalar_type());
}

/// The forward ops' kernels of one backend's ForwardKernel `K` (the four private forward ops above bound to it),
/// written once for the CPU and CUDA.
template <ForwardKernel K>
struct ForwardOps {
  static std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                     const std::optional<at::Tensor>& weight,
                                                     std::optional<double> eps) {
    return rms_norm_forward(K, input, normalized_shape, weight, eps);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_amax(const at::Tensor& input,
                                                                      c10::SymIntArrayRef normalized_shape,
                                                                      const std::optional<at::Tensor>& weight,
                                                                      std::optional<double> eps) {
    return rms_norm_forward_amax(K, input, normalized_shape, weight, eps);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add(const at::Tensor& input, const at::Tensor& residual,
                                                                  c10::SymIntArrayRef normalized_shape,
                                                                  const std::optional<at::Tensor>& weight,
                                                                  std::optional<double> eps) {
    return fused_add_rms_norm_forward(K, input, residual, normalized_shape, weight, eps);
  }
  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_add_amax(
      const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
      const std::optional<at::Tensor>& weight, std::optional<double> eps) {
    return fused_add_rms_norm_forward_amax(K, input, residual, normalized_shape, weight, eps);
  }
  /// Registers _rms_norm_forward, _fused_add_rms_norm_forward and their *_amax forms for the library's dispatch key.
  static void register_for(torch::Library& m) {
    m.impl("_rms_norm_forward", &ForwardOps::rms_norm);
    m.impl("_fused_add_rms_norm_forward", &ForwardOps::fused_add);
    m.impl("_rms_norm_forward_amax", &ForwardOps::rms_norm_amax);
    m.impl("_fused_add_rms_norm_forward_amax", &ForwardOps::fused_add_amax);
  }
};

}  // namespace rmsnorm
}  // namespace opforge
