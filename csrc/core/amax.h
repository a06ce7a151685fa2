// The amax that opforge's FP8 path passes between kernels (tensorwise current scaling): max|x| over a whole tensor x,
// held in a [1] tensor whose dtype represents every |x| exactly. The producers' *_amax ops write it (core/amax_cpu.h,
// core/amax_cuda.cuh: the reduction) and the FP8 GEMMs read it (ops/fp8: input_amax).
#pragma once

#include <ATen/ATen.h>

namespace opforge {

/// The dtype of the amax of `dtype`'s values: float64 for float64, float32 for float32, float16 and bfloat16.
inline at::ScalarType amax_dtype(at::ScalarType dtype) { return dtype == at::kDouble ? at::kDouble : at::kFloat; }

/// An uninitialized amax tensor for the values of `like`: shape [1], amax_dtype(like's dtype), like's device (Meta
/// included).
inline at::Tensor empty_amax(const at::Tensor& like) {
  return at::empty({1}, like.options().dtype(amax_dtype(like.scalar_type())));
}

}  // namespace opforge
