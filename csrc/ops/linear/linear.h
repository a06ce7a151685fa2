// linear, _linear_forward and linear_backward.
//
//   linear(X, W, b, act)  Z[M, N]  = X[M, K] · W[N, K]ᵀ + b[N]      (the pre-activation)
//                         Y[M, N]  = act(Z)                          act in none, relu, gelu, gelu_tanh, silu
//   _linear_forward       (Y, Z): the forward that also returns Z, for autograd
//   linear_backward       dZ[M, N] = dY[M, N] · act'(Z)              (fp32 math; dZ = dY for none)
//                         dX[M, K] = dZ[M, N] · W[N, K]
//                         dW[N, K] = dZ[M, N]ᵀ · X[M, K]
//                         db[N]    = Σ_rows dZ[M, N]                 (fp32 accumulation)
//
// input (*, K) is flattened to M = prod(*) rows. Kernels see only the 2-D contiguous problem the
// checkers below produce; every backend (CPU, CUDA) and Meta runs the same checks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include <array>
#include <optional>
#include <tuple>

#include "core/activation.h"
#include "opforge/opforge.h"

namespace opforge {
// (linear_op, not linear: opforge::linear is the public function.)
namespace linear_op {

// The activation after the GEMM (and bias) is core/activation.h's Activation (none, relu, gelu,
// gelu_tanh, silu), parsed once from the schema's string by the checkers below.

/// Shape, dtype and device checks of linear that hold for symbolic shapes too (used by Meta).
/// Raises:
///   ValueError: input of rank 0; weight not 2-D; input's last dim != weight's in_features K;
///               bias not of shape [N].
///   TypeError:  any tensor of a non-floating dtype (integer, bool, complex).
///   RuntimeError: tensors on different devices (the message names both devices).
void check_linear_args(const char* op, const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);

/// linear's canonical problem: Y[M, N] = act(X[M, K] · W[N, K]ᵀ + b[N]).
struct LinearProblem {
  int64_t M, K, N;
  Activation act;
  at::Tensor X;  // [M, K] contiguous (see check_linear), input's dtype
  at::Tensor W;  // [N, K] contiguous (see check_linear), converted to input's dtype
  at::Tensor b;  // [N] contiguous in input's dtype, or undefined (no bias)
};

/// Validates linear's arguments (check_linear_args, then the activation's name) and returns the
/// problem: one dtype conversion for a parameter of another floating dtype, and (when `contiguous`) one
/// copy for a strided view. With contiguous = false, X and W are 2-D but may be strided (X is
/// input.reshape, a view when possible): for backends whose GEMM takes any strides (ATen's on CPU),
/// which then skip the copies and make the same GEMM calls as torch.nn.functional.linear.
LinearProblem check_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           c10::string_view activation, bool contiguous = true);

/// Checks of linear_backward that hold for symbolic shapes (Meta): the linear checks on
/// (input, weight), grad_output floating, on input's device and of shape (*, N) with input's (*),
/// bias_dtype (if given) floating (TypeError otherwise), the activation's name; for an activation other
/// than none, pre_activation given (ValueError otherwise), floating, on input's device and of
/// grad_output's shape. Returns the parsed activation.
Activation check_linear_backward_args(const at::Tensor& grad_output, const at::Tensor& input,
                                      const at::Tensor& weight, std::optional<at::ScalarType> bias_dtype,
                                      c10::string_view activation, const std::optional<at::Tensor>& pre_activation);

/// linear_backward's canonical problem, all operands in input's dtype.
struct LinearBackwardProblem {
  int64_t M, K, N;
  Activation act;
  at::Tensor dY;  // [M, N] (strided only when check_linear_backward's contiguous = false, as X and W)
  at::Tensor X;   // [M, K]
  at::Tensor W;   // [N, K]
  at::Tensor Z;   // [M, N] pre-activation (or, for relu, the output), contiguous; undefined for none
};
LinearBackwardProblem check_linear_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                            const at::Tensor& weight, std::optional<at::ScalarType> bias_dtype,
                                            c10::string_view activation,
                                            const std::optional<at::Tensor>& pre_activation, bool contiguous = true);

/// dZ = dY · act'(Z) through ATen's activation backward functions (CPU kernel, double backward);
/// dY itself for none. Z may be relu's output for relu (the same sign test).
at::Tensor aten_activation_backward(const at::Tensor& dY, const at::Tensor& Z, Activation act);

/// Output shape of linear: input's leading dims followed by N (weight's out_features).
c10::SymDimVector output_sym_sizes(const at::Tensor& input, const at::Tensor& weight);

/// A kernel's [M, N] result viewed as linear's output shape (*, N) (Y itself for a 2-D input).
inline at::Tensor as_output(const at::Tensor& Y, const at::Tensor& input, const at::Tensor& weight) {
  return input.dim() == 2 ? Y : Y.view_symint(output_sym_sizes(input, weight));
}

/// The dtype grad_bias is returned in: bias_dtype, or input's dtype when none is given.
inline at::ScalarType grad_bias_dtype(const at::Tensor& input, std::optional<at::ScalarType> bias_dtype) {
  return bias_dtype.value_or(input.scalar_type());
}

/// Meta outputs of a linear-shaped backward, (grad_input, grad_weight, grad_bias): empty tensors of input's shape,
/// weight's shape [N, K] and [N] in grad_bias_dtype, each only where output_mask asks for it (undefined otherwise).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_backward_outputs(
    const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype) {
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) grad_weight = at::empty_symint(weight.sym_sizes(), weight.options());
  if (output_mask[2]) {
    grad_bias = at::empty_symint({weight.sym_size(0)}, input.options().dtype(grad_bias_dtype(input, bias_dtype)));
  }
  return {grad_input, grad_weight, grad_bias};
}

/// grad_bias[N] = Σ_rows dZ[M, N], accumulated in fp32 (fp64 for float64), rounded once to `dtype`;
/// zeros when M == 0. (CUDA computes it in the dW GEMM's epilogue where it can.)
inline at::Tensor sum_rows(const at::Tensor& dZ, at::ScalarType dtype) {
  return at::sum(dZ, {0}, /*keepdim=*/false, at::toOpMathType(dZ.scalar_type())).to(dtype);
}

}  // namespace linear_op
}  // namespace opforge
