// swiglu_linear: a Llama-style MLP's gate and up projections and their SwiGLU in one op, with the two projections
// interleaved in one weight.
//
//   swiglu_linear(X, W, b)   Z[M, 2I] = X[M, K] · W[2I, K]ᵀ + b[2I]        (row 2j of W: the gate's row j,
//                            Y[M, I]  = silu(Z[:, 2j]) · Z[:, 2j + 1]        row 2j + 1: the up projection's row j)
//   _swiglu_linear_forward   (Y, Z): the forward that also returns Z, for autograd
//   swiglu_linear_backward   dZ[:, 2j]     = dY[:, j] · Z[:, 2j + 1] · silu'(Z[:, 2j])     (fp32 math)
//                            dZ[:, 2j + 1] = dY[:, j] · silu(Z[:, 2j])
//                            then linear's backward: dX = dZ · W, dW = dZᵀ · X, db = Σ_rows dZ
//
// Why interleaved (not [gate | up] halves as swiglu_packed takes): a GEMM tile then holds both members of every
// pair, so the CUDA kernel computes Y in the GEMM's epilogue (core/gemm_sm90.cuh, Note [SwiGLU pairs in the
// accumulator]). input (*, K) is flattened to M = prod(*) rows.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "opforge/opforge.h"

namespace opforge {
namespace swiglu_linear_op {

/// swiglu_linear's canonical problem, every operand in input's dtype.
struct Problem {
  int64_t M, K, N;  // N = 2I
  at::Tensor X;     // [M, K] contiguous
  at::Tensor W;     // [N, K] contiguous
  at::Tensor b;     // [N] contiguous, or undefined
};

/// Shape, dtype and device checks that hold for symbolic shapes too (Meta). `op` names the op in errors.
/// Raises ValueError: input of rank 0, weight not 2-D or with an odd number of rows, input's last dim != weight's
/// in_features, bias not of shape [2I]; TypeError: a non-floating tensor; RuntimeError: tensors on two devices.
void check_args(const char* op, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

/// The output's shape (*, I): input's leading dims and half of weight's rows.
c10::SymDimVector output_sym_sizes(const at::Tensor& input, const at::Tensor& weight);

/// check_args, then the problem (a parameter of another floating dtype converted to input's, views made contiguous).
Problem check(const char* op, const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

/// Checks of swiglu_linear_backward (symbolic-shape safe): check_args on (input, weight), grad_output of shape
/// (*, I), pre_activation of shape (*, 2I), both floating and on input's device, bias_dtype floating if given.
void check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
                         const at::Tensor& pre_activation, std::optional<at::ScalarType> bias_dtype);

/// Y[M, I] = silu(Z[:, 0::2]) · Z[:, 1::2] through opforge's swiglu (any backend): the unfused second step.
at::Tensor swiglu_of_interleaved(const at::Tensor& Z);

/// swiglu_linear_backward on any backend: dZ by opforge's swiglu_backward on the interleaved columns, then
/// opforge's linear_backward (the backend's GEMMs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                        const at::Tensor& weight, const at::Tensor& pre_activation,
                                                        std::array<bool, 3> output_mask,
                                                        std::optional<at::ScalarType> bias_dtype);

}  // namespace swiglu_linear_op
}  // namespace opforge
