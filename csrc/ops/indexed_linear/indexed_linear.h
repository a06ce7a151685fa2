// indexed_linear and indexed_linear_backward: each token picks its weight (and bias) from a bank.
//
//   indexed_linear         Y[t, :] = X[t, :] · W[e_t]ᵀ + b[e_t],   e_t = index[t];  Y[t, :] = 0 where e_t = −1
//   indexed_linear_backward dX[t, :] = dY[t, :] · W[e_t]                      (0 where e_t = −1)
//                           dW[e]    = Σ_{t: e_t = e} dY[t, :]ᵀ · X[t, :]     (0 for an expert with no token)
//                           db[e]    = Σ_{t: e_t = e} dY[t, :]                (fp32 accumulation)
//
// Shapes: X [T, K], W [E, N, K], index [T] int64, b [E, N], Y [T, N]. CPU rejects an index ≥ E or < −1; CUDA (which
// cannot look at the indices without a host synchronisation) treats such a row as −1. Every backend and Meta
// runs the same shape checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace opforge {
namespace indexed_linear_op {

/// Shape, dtype and device checks that hold for symbolic shapes (Meta).
/// Raises:
///   ValueError: input not 2-D; weight not 3-D; index not 1-D; index's length != input's rows; input's K !=
///               weight's K; bias not of shape [E, N].
///   TypeError:  input, weight or bias not floating; index not int64.
///   RuntimeError: tensors on different devices.
void check_indexed_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                               const at::Tensor& index, const std::optional<at::Tensor>& bias);

/// The canonical problem: every tensor contiguous, W and b in input's dtype.
struct IndexedLinearProblem {
  int64_t T, K, N, E;
  at::Tensor X;      // [T, K]
  at::Tensor W;      // [E, N, K]
  at::Tensor index;  // [T] int64
  at::Tensor b;      // [E, N] or undefined
};
IndexedLinearProblem check_indexed_linear(const char* op, const at::Tensor& input, const at::Tensor& weight,
                                          const at::Tensor& index, const std::optional<at::Tensor>& bias);

/// CPU only: raises IndexError "opforge::<op>: expected every index in [-1, E), but got <v> at position <t>".
void check_index_values_cpu(const char* op, const at::Tensor& index, int64_t E);

/// CPU only, for index_sorted: raises ValueError "opforge::<op>: expected index sorted by expert (...) as
/// index_sorted=True promises, but ..." naming the first position that breaks the order (an expert below the
/// previous row's, or an expert after a row of −1).
void check_index_sorted_cpu(const char* op, const at::Tensor& index);

/// Checks of indexed_linear_backward (symbolic-safe): the forward checks, grad_output floating, on input's device,
/// of shape [T, N]; bias_dtype floating.
void check_indexed_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                        const at::Tensor& weight, const at::Tensor& index,
                                        std::optional<at::ScalarType> bias_dtype);

/// The backward kernels' entry: check_indexed_linear_backward_args, then the canonical problem (no bias).
IndexedLinearProblem check_indexed_linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                   const at::Tensor& weight, const at::Tensor& index,
                                                   std::optional<at::ScalarType> bias_dtype);

}  // namespace indexed_linear_op
}  // namespace opforge
