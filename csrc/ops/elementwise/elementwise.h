// Elementwise ops: sigmoid, square, square_add and their backward ops.
//
//   sigmoid(x)          = 1 / (1 + exp(-x))
//   square(x)           = x²
//   square_add(x, b)    = x² + b, b broadcastable to x
//
// Kernels see a flat, contiguous problem of n elements; the checkers below produce it.
#pragma once

#include <ATen/ATen.h>

#include "opforge/opforge.h"

namespace opforge {

namespace elementwise {

/// Validates a unary elementwise op's argument. Returns it contiguous (one copy for a strided view).
/// Raises (TypeError) for non-floating dtypes.
at::Tensor check_unary(const char* op, const at::Tensor& input);

/// Validates the pair (grad_output, saved) of a unary backward op: same shape, same device,
/// floating dtypes. Returns both contiguous, saved converted to grad_output's dtype.
std::pair<at::Tensor, at::Tensor> check_unary_backward(const char* op, const at::Tensor& grad_output,
                                                       const at::Tensor& saved, const char* saved_name);

/// square_add's problem: X contiguous [n]; B contiguous [period] in X's dtype, with
/// other broadcast to input as B[i % period]. period == n when other is not a trailing-dims broadcast
/// (then B is other expanded and materialized once). Raises when other does not broadcast to input
/// (shape named in the message), on device mismatch and for non-floating dtypes.
/// Shape, dtype and device checks of square_add that hold for symbolic shapes too (used by Meta).
void check_square_add_args(const at::Tensor& input, const at::Tensor& other);

struct SquareAddProblem {
  at::Tensor X;  // [n]
  at::Tensor B;  // [period]
  int64_t period;
};
SquareAddProblem check_square_add(const at::Tensor& input, const at::Tensor& other);

}  // namespace elementwise
}  // namespace opforge
