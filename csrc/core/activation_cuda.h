// Elementwise activation passes on CUDA (core/activation.h's math on core/map_cuda.cuh's vectorized
// kernels, fp32 opmath for float16/bfloat16): what linear, the GEMM layer's fallback and the elementwise
// sigmoid run when no fused epilogue computes the activation.
#pragma once

#include <ATen/ATen.h>

#include "core/activation.h"

namespace opforge {
namespace cuda {

/// Y = act(Z) elementwise. Z and Y contiguous, of one dtype and numel (Y may be Z: in place).
void activation_forward(const at::Tensor& Z, const at::Tensor& Y, Activation act);

/// dZ = dY · act'(Z) elementwise (for kSigmoid, Z is the output σ(x)). All contiguous, one dtype and numel.
void activation_backward(const at::Tensor& dY, const at::Tensor& Z, const at::Tensor& dZ, Activation act);

}  // namespace cuda
}  // namespace opforge
