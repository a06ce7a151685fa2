// Run-time switches of opforge's kernels, kept in atomics so that no hot path reads the environment. Two kinds:
//
// User-facing modes (numerics or memory): each is an environment variable, read ONCE (at first use; this file is
// the only place opforge reads the environment), and changeable at run time with the private op
// `torch.ops.opforge._set_knob("<variable>", value) -> previous value`.
//   OPFORGE_LCE_GRAD_IN_FORWARD  1 (default, or any value but "0"): linear_cross_entropy with reduction "mean" /
//                        "sum" computes its gradients in the forward (3 GEMMs); 0: the recompute path (4 GEMMs)
//                        (ops/linear_cross_entropy/linear_cross_entropy.cpp; read when the forward runs, so a
//                        compiled graph keeps the path it was traced with).
//   OPFORGE_LCE_DW_ACCUM 0 (unset, default, or any value but 1): linear_cross_entropy accumulates dW (and db) across
//                        token chunks in float32 and casts to the parameter's dtype at the end; 1: where input and
//                        linear_weight (linear_bias) share one 16-bit dtype, it accumulates in that dtype directly
//                        (the chunk's GEMM adds into the returned 16-bit gradient with beta = 1, fp32 math inside the
//                        GEMM, one rounding per dW GEMM; no fp32 V x H buffer, no final cast; Liger-Kernel's default).
//                        Read when the chunk loop starts (the forward on the gradient-in-forward path, the backward on
//                        the recompute path) (ops/linear_cross_entropy/linear_cross_entropy.cpp, make_problem).
//   OPFORGE_LCE_CHUNK_SIZE  0 (unset or empty, default): linear_cross_entropy's token rows per chunk from its memory
//                        budget; N >= 1: N rows where the call passes no chunk_size (lce::resolve_chunk). Any other
//                        text is a ValueError at the first call that needs the chunk size.
//   OPFORGE_LCE_LEAN     1 (unset, default, or any value but 0): on CUDA, where input, linear_weight and
//                        linear_bias share one 16-bit dtype, the logits chunk of linear_cross_entropy,
//                        linear_log_probs and linear_jsd is in that dtype (the GEMM rounds its fp32 sums once, the
//                        logit gradient overwrites it in place), dW accumulates in the 16-bit gradient itself and the
//                        chunk size comes from a 512 MiB budget (2048 rows at V = 128256); 0: each chunk's logits in
//                        float32. The CPU path ignores it. Read when the chunk loop starts, as OPFORGE_LCE_DW_ACCUM
//                        (ops/linear_cross_entropy/linear_cross_entropy.h, "Lean mode").
//   OPFORGE_FP8_FAST_ACCUM  0 (unset, default): every FP8 GEMM of fp8_linear on CUDA with use_fast_accum=false
//                        (the tensor cores' partial sum moved to fp32 every 128 products); 1: the forward GEMM with
//                        fast accumulation (no such move: torchao's default Float8LinearConfig), the two backward
//                        GEMMs without; 2: all three with it (torchao's rowwise recipe). The CPU ignores it. Read
//                        when each GEMM runs (ops/fp8/fp8.cpp, scaled_gemm; docs/ops/fp8.md, Numerics).
//
// Test hooks: read from no environment variable. Tests, benchmarks and tests/cuda/sanitize_driver.py set them with
// `torch.ops.opforge._set_knob("<hook>", value)` to reach, on small inputs, every kernel that a chooser picks for some
// shape class; their default is the chooser's choice, and no user needs them.
//   linear_lt            1 (default): cuBLASLt GEMMs with fused epilogues; 0: every GEMM through cublasGemmEx plus
//                        separate passes, the path of whatever cuBLASLt declines (core/gemm.h).
//   gemm_sm90            -1 (default): opforge's sm90 GEMM kernels where the shape table picks them over cuBLASLt
//                        (sm90_choice in core/gemm_cuda.cu); 0: never; 1: wherever they take the problem; 2: as 1,
//                        and a problem they cannot take raises instead of falling back to cuBLASLt (the tests' proof
//                        that the kernel ran); 3: as 2 with bfloat16's ping-pong variant (kLinearBF16PingPong), for
//                        the benchmark that measures it against the chosen kernel.
//                        swiglu_linear's forward (gemm_swiglu) reads it too: -1 kSwiGLUTable's choice between the
//                        fused kernel and two passes; 0 two passes; 1 the ping-pong SwiGLU kernel wherever it takes
//                        the problem, else two passes; 2 and 3 the ping-pong SwiGLU kernel (kSwiGLUBF16PingPong, or
//                        kSwiGLUBF16PingPongH where z is not wanted) or raise. A build without CUTLASS, or a GPU
//                        other than sm_90, always falls back.
//   linear_gemv          -1 (default): linear's GEMV kernel where the bucket table picks it (gemv_choice in
//                        ops/linear/linear_cuda.cu); 1: for every 1 <= M <= 16; 0: never.
//   rms_norm_forward     -1 (default): rms_norm's forward chooser (default_forward_variant); 0: the register-cached
//                        grid-stride kernel; 1..4: the one-CTA-per-row kernels (ops/rms_norm/rms_norm_cuda.cu).
//   rms_norm_backward    -1 (default): rms_norm's backward chooser (default_backward_variant); 0: the register-cached
//                        grid-stride kernel; 1, 2: the long-row kernel with dweight partials in shared memory (2: the
//                        next row pipelined).
//   rope_rows_kernel     0 (default): rope's per-token table kernel where its table fits in shared memory, else the
//                        rows kernel; 1: the rows kernel always (ops/rope/rope_cuda.cu).
//   indexed_linear_path  0 (default): by shape; 1: the gather-GEMV; 2: the tiled grouped GEMM; 3: torch's
//                        _grouped_mm where it applies, else the tiled grouped GEMM
//                        (ops/indexed_linear/indexed_linear_cuda.cu).
//   fp8_gemm             -1 (default): fp8_linear's tensorwise scaled GEMMs on CUDA through the engine that
//                        kFp8GemmEngine (ops/fp8/fp8_cuda.cu) names; 0: at::_scaled_mm; 1: opforge's cuBLASLt
//                        engine (core/gemm.h, gemm_fp8: plans cached per shape, the scales read on the device),
//                        at::_scaled_mm where cuBLASLt declines; 2: as 1, and a declined problem raises (the tests'
//                        proof that the engine ran). Rowwise GEMMs always run at::_scaled_mm; the CPU ignores it.
//   fp8_transpose        -1 (default): the FP8 byte transpose (the backward's q(Wᵀ) from a cached q(W)) by the
//                        kernel kFp8Transpose4x4 (ops/fp8/fp8_cuda.cu) names; 0: the byte kernel; 1: the 4 x 4 block
//                        kernel where both sides are multiples of 16 (word loads, 16-byte stores), else the byte
//                        kernel. The CPU ignores it.
#pragma once

#include <cstdint>

namespace opforge {
namespace knobs {

enum class Knob : int {
  // user-facing modes (environment variables)
  kLceGradInForward, kLceDwAccum, kLceChunkSize, kLceLean, kFp8FastAccum,
  // test hooks
  kLinearLt, kGemmSm90, kLinearGemv, kRmsForward, kRmsBackward, kRopeRowsKernel, kIndexedLinearPath, kFp8Gemm,
  kFp8Transpose
};

/// The knob's current value. Throws ValueError for OPFORGE_LCE_CHUNK_SIZE set to text that is not a positive
/// integer (until _set_knob replaces it).
int64_t get(Knob k);

/// Sets the knob; returns its previous value.
int64_t set(Knob k, int64_t value);

}  // namespace knobs
}  // namespace opforge
