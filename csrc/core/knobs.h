// Run-time switches of opforge's kernels, each read from its environment variable ONCE (at first use) and
// kept in an atomic, so no hot path reads the environment. Tests and benchmarks change them through the
// private op `torch.ops.opforge._set_knob(name, value) -> previous value`.
//
//   OPFORGE_LINEAR_LT    1 (default, or any value but "0"): cuBLASLt GEMMs with fused epilogues;
//                        0: every GEMM through cublasGemmEx plus separate passes (core/gemm.h).
//   OPFORGE_LINEAR_GEMV  -1 (unset, default): linear's GEMV kernel for M == 1 only; 1: for 1 ≤ M ≤ 16;
//                        0: never (ops/linear/linear_cuda.cu). The default chooser is a table per (M, N, K)
//                        bucket in linear_cuda.cu (gemv_choice).
//   OPFORGE_GEMV_VARIANT -1 (unset, default): the chooser's GEMV kernel; 0: the warp-per-rows kernel; 1..3: the
//                        tensor-core kernels of linear_gemv.cuh (1: 16 rows a warp; 2: 32 rows a warp; 3: 16 rows
//                        a warp, split-K over blocks where the grid is small).
//   OPFORGE_RMS_FWD      -1 (unset, default): rms_norm's forward chooser; 0: the register-cached grid-stride kernel;
//                        1..4: the one-CTA-per-row kernels (ops/rms_norm/rms_norm_cuda.cu, forward_variant).
//   OPFORGE_RMS_BWD      -1 (unset, default): rms_norm's backward chooser; 0: the current kernels; 1, 2: the
//                        register-cached kernel with dweight partials in shared memory (2: next row pipelined).
//   OPFORGE_LCE_GRAD_IN_FORWARD  1 (default, or any value but "0"): linear_cross_entropy with reduction "mean" /
//                        "sum" computes its gradients in the forward (3 GEMMs); 0: the recompute path (4 GEMMs)
//                        (ops/linear_cross_entropy/linear_cross_entropy.cpp; read when the forward runs, so a
//                        compiled graph keeps the path it was traced with).
//   OPFORGE_ROPE_KERNEL  -1 (unset, default): rope's per-token table kernel on CUDA where its table fits in
//                        shared memory (measured faster), with its 12-blocks-per-SM register bound on the vector
//                        path (as 4), else the rows kernel; 0: the per-token kernel without the bound;
//                        1: the rows kernel; 2: the heads kernel where it applies (16-byte vector path,
//                        32-bit offsets), else as unset; 3: the per-token kernel on a grid of whole waves
//                        (SMs x resident blocks, not SMs x 32); 4: the per-token kernel with a register bound
//                        for 12 blocks per SM on its vector path; 5: both 3 and 4 (ops/rope/rope_cuda.cu).
//   OPFORGE_LCE_DW_GROUP 1 (unset, default): linear_cross_entropy on CUDA with 16-bit inputs runs its dW GEMM once per
//                        this many token chunks (their logit-gradient copies side by side; clamped to 1..64), so
//                        the fp32 V x H accumulator is passed over N / (group x chunk) times; the chunk budget counts
//                        the group's copies (ops/linear_cross_entropy/linear_cross_entropy_cuda.cu). Measured on the
//                        H200 (benchmarks/lce_chunk_sweep.py, 8192x2048x128256 bf16): group 2 at the same memory
//                        (768-row chunks) 25.0-27.0 ms against group 1 (1024 rows) 23.7-25.1: no gain, so 1.
//   OPFORGE_LCE_DW_ACCUM 0 (unset, default, or any value but 1): linear_cross_entropy accumulates dW (and db) across
//                        token chunks in float32 and casts to the parameter's dtype at the end; 1: where input and
//                        linear_weight (linear_bias) share one 16-bit dtype, it accumulates in that dtype directly
//                        (the chunk's GEMM adds into the returned 16-bit gradient with beta = 1, fp32 math inside the
//                        GEMM, one rounding per dW GEMM; no fp32 V x H buffer, no final cast; Liger-Kernel's default).
//                        Read when the chunk loop starts (the forward on the gradient-in-forward path, the backward on
//                        the recompute path) (ops/linear_cross_entropy/linear_cross_entropy.cpp, make_problem).
#pragma once

#include <cstdint>

namespace opforge {
namespace knobs {

enum class Knob : int {
  kLinearLt, kLinearGemv, kLceGradInForward, kGemvVariant, kRmsForward, kRmsBackward, kRopeKernel, kLceDwGroup,
  kLceDwAccum
};

/// The knob's current value.
int64_t get(Knob k);

/// Sets the knob; returns its previous value.
int64_t set(Knob k, int64_t value);

}  // namespace knobs
}  // namespace opforge
