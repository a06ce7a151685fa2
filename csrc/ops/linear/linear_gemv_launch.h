// The GEMV path of linear's CUDA forward, compiled as one translation unit per dtype (linear_gemv_<dtype>.cu): the
// GEMV kernel's instantiations (every activation and tile) would be most of linear_cuda.cu's compile time; split,
// they compile in parallel.
#pragma once

#include <ATen/ATen.h>

#include "ops/linear/linear.h"

namespace opforge {
namespace linear_op {

/// Y[M, N] = act(X · Wᵀ + b), and Z[M, N] = X · Wᵀ + b when Z is given, of problem p through the GEMV kernel of
/// linear_gemv.cuh (linear_cuda.cu's use_gemv decides where). scalar_t is p.X's type: float, c10::Half or
/// c10::BFloat16 (the explicit instantiations of linear_gemv_fp32.cu / _fp16.cu / _bf16.cu). X, W 16-byte aligned,
/// K a multiple of the 16-byte vector, 1 <= M <= 16. Runs on the current stream; no host synchronisation.
template <typename scalar_t>
void gemv_linear_typed(const LinearProblem& p, at::Tensor& Y, at::Tensor* Z);

}  // namespace linear_op
}  // namespace opforge
