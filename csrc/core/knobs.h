// Run-time switches of opforge's kernels, each read from its environment variable ONCE (at first use) and
// kept in an atomic, so no hot path reads the environment. Tests and benchmarks change them through the
// private op `torch.ops.opforge._set_knob(name, value) -> previous value`.
//
//   OPFORGE_LINEAR_LT    1 (default, or any value but "0"): cuBLASLt GEMMs with fused epilogues;
//                        0: every GEMM through cublasGemmEx plus separate passes (core/gemm.h).
//   OPFORGE_LINEAR_GEMV  -1 (unset, default): linear's GEMV kernel for M == 1 only; 1: for 1 ≤ M ≤ 16;
//                        0: never (ops/linear/linear_cuda.cu).
//   OPFORGE_LCE_GRAD_IN_FORWARD  1 (default, or any value but "0"): linear_cross_entropy with reduction "mean" /
//                        "sum" computes its gradients in the forward (3 GEMMs); 0: the recompute path (4 GEMMs)
//                        (ops/linear_cross_entropy/linear_cross_entropy.cpp; read when the forward runs, so a
//                        compiled graph keeps the path it was traced with).
//   OPFORGE_ROPE_KERNEL  1 (default, or any value but "0"): rope's rows kernel on CUDA; 0: the per-token table
//                        kernel it replaced, kept for comparison (ops/rope/rope_cuda.cu).
#pragma once

#include <cstdint>

namespace opforge {
namespace knobs {

enum class Knob : int { kLinearLt, kLinearGemv, kLceGradInForward, kRopeKernel };

/// The knob's current value.
int64_t get(Knob k);

/// Sets the knob; returns its previous value.
int64_t set(Knob k, int64_t value);

}  // namespace knobs
}  // namespace opforge
