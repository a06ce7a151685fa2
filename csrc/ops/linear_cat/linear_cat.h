// linear_cat and linear_cat_backward: a linear layer over the concatenation of several inputs, without the
// concatenated buffer.
//
//   linear_cat(X_1..X_P, W, b)  Y[M, N]   = Σ_i X_i[M, K_i] · W[:, k_i : k_i + K_i]ᵀ + b[N]
//                                          = linear(cat(X_1..X_P, -1), W, b),  k_i = K_1 + ... + K_{i-1}
//   linear_cat_backward         dX_i[M, K_i]              = dY[M, N] · W[:, k_i : k_i + K_i]
//                               dW[:, k_i : k_i + K_i]    = dYᵀ[N, M] · X_i[M, K_i]   (slice by slice, one tensor)
//                               db[N]                     = Σ_rows dY                (fp32 accumulation)
//
// One rounding: the pieces' partial products are summed in fp32 (fp64 for fp64), the bias added, and only then
// rounded to the output's dtype. Pieces X_i (*, K_i) share their leading dims (*), flattened to M rows; a piece
// may have K_i = 0. Every backend (CPU, CUDA) and Meta runs the same checks.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace opforge {
namespace linear_cat_op {

/// Shape, dtype and device checks of linear_cat that hold for symbolic shapes too (used by Meta).
/// Raises:
///   ValueError: an empty list of inputs; a 0-dim piece; pieces whose leading dims differ; weight not 2-D;
///               Σ K_i != weight's in_features; bias not of shape [N].
///   TypeError:  any tensor of a non-floating dtype; pieces of different dtypes.
///   RuntimeError: tensors on different devices.
void check_linear_cat_args(const char* op, at::TensorList inputs, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias);

/// linear_cat's canonical problem.
struct LinearCatProblem {
  int64_t M, K, N;
  std::vector<int64_t> k0;  // [P] column offset of piece i in W (k_i above)
  std::vector<int64_t> Ki;  // [P] width of piece i
  std::vector<at::Tensor> X;  // [P] pieces as [M, K_i] (a view when reshape allows; contiguous when asked)
  at::Tensor W;  // [N, K], converted to the pieces' dtype (contiguous when asked)
  at::Tensor b;  // [N] in the pieces' dtype, or undefined
};

/// Validates (check_linear_cat_args) and returns the problem. With `contiguous`, every piece and W have a unit
/// last stride and a row stride a BLAS accepts (one copy only for a view that has none).
LinearCatProblem check_linear_cat(at::TensorList inputs, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias, bool contiguous);

/// Checks of linear_cat_backward (symbolic-safe): the linear_cat checks on (inputs, weight), grad_output
/// floating, on the inputs' device, of shape (*, N); bias_dtype floating.
void check_linear_cat_backward_args(const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight,
                                    std::optional<at::ScalarType> bias_dtype);

/// Output shape of linear_cat: the pieces' leading dims followed by N.
c10::SymDimVector output_sym_sizes(at::TensorList inputs, const at::Tensor& weight);

/// grad_output as [M, N] in the pieces' dtype (contiguous when asked).
at::Tensor grad_output_2d(const at::Tensor& grad_output, const LinearCatProblem& p, bool contiguous);

}  // namespace linear_cat_op
}  // namespace opforge
