// opforge's own sm90 (Hopper) GEMM kernels, built from CUTLASS 3.x's collective builders: the interface
// between core/gemm_cuda.cu (which chooses, per problem, between them and cuBLASLt) and the kernel files
// core/gemm_sm90_<kernel>.cu (one CUTLASS instantiation each, so each compiles on its own and in parallel).
// This header has no torch and no CUTLASS in it: the kernel files are compiled without ATen, for sm_90a only.
//
// ---- The problem, in row-major (torch) terms -----------------------------------------------------
//
//   Z[m, n] = Σ_k A[m, k] · B[n, k] + bias[n]       (a linear layer: A the activations, B the weight [N, K])
//
//   kLinear   D = Z
//   kSwiGLU   D = Z as well, and H[m, j] = silu(Z[m, 2j]) · Z[m, 2j + 1]: the gate and up projections
//             interleaved in B's rows (row 2j the gate's row j, row 2j + 1 the up projection's row j), so that
//             the pair a SwiGLU combines lies in adjacent accumulator columns, in one thread's registers
//             (see gemm_sm90.cuh, Note [SwiGLU pairs in the accumulator]).
//
//   A, B, D, H and bias share one 16-bit dtype (bfloat16 or float16); products accumulate in fp32 and the
//   epilogue (bias, silu, product) runs in fp32 before one rounding to the dtype. bias may be null.
//
// ---- What the kernels take (can_implement) -----------------------------------------------------------
//
//   TMA moves A, B and D: every base address 16-byte aligned, every row stride (lda, ldb, ldd) and K and N
//   multiples of 8 elements (16 bytes). M, N and K are otherwise free: tiles past the edges are zero-filled
//   on load and masked on store. bias: 16-byte aligned. kSwiGLUBF16PingPong(H): N even, H stored by TMA (base
//   and ldh 16-byte aligned, ldh a multiple of 8). Anything else is the caller's to route to cuBLASLt.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace opforge {
namespace gemm {
namespace sm90 {

/// The compiled kernels: (epilogue, dtype). One .cu file each.
/// kLinearBF16PingPong: kLinearBF16 in the ping-pong schedule, measured against it (test hook gemm_sm90 = 3).
/// kSwiGLUBF16PingPong: kSwiGLU in the ping-pong schedule with H through shared memory and a TMA store (H's row
/// stride and base 16-byte aligned); kSwiGLUBF16PingPongH: the same without D (D may be null: z is not stored).
enum class Kernel : int {
  kLinearBF16, kLinearFP16, kLinearBF16PingPong, kSwiGLUBF16PingPong, kSwiGLUBF16PingPongH
};

/// One call's operands and sizes (row-major, element strides).
struct Problem {
  int M = 0, N = 0, K = 0;
  const void* A = nullptr;  // [M, K], row stride lda
  int64_t lda = 0;
  const void* B = nullptr;  // [N, K], row stride ldb
  int64_t ldb = 0;
  void* D = nullptr;        // [M, N], row stride ldd
  int64_t ldd = 0;
  const void* bias = nullptr;  // [N] or null
  void* H = nullptr;        // kSwiGLU: [M, N / 2], row stride ldh
  int64_t ldh = 0;
  int device = 0;           // the CUDA device of the operands (the current one)
  int sm_count = 0;         // its multiprocessor count (the persistent grid's size)
};

/// The result of a call: kOk, or why the kernel did not run (nothing was written).
enum class Status : int { kOk = 0, kCannotImplement = 1, kError = 2 };

/// True when the build has these kernels (CUTLASS headers found and sm_90a built).
bool available();

/// The device workspace a call needs, in bytes (the caller allocates it from torch's caching allocator).
size_t workspace_size(Kernel kernel, const Problem& p);

/// Runs the kernel on `stream` (asynchronously; no host synchronization). `workspace` has workspace_size bytes.
Status run(Kernel kernel, const Problem& p, void* workspace, cudaStream_t stream);

// The kernel files' entry points (run() dispatches to them).
size_t workspace_linear_bf16(const Problem& p);
Status run_linear_bf16(const Problem& p, void* workspace, cudaStream_t stream);
size_t workspace_linear_fp16(const Problem& p);
Status run_linear_fp16(const Problem& p, void* workspace, cudaStream_t stream);
size_t workspace_linear_bf16_pingpong(const Problem& p);
Status run_linear_bf16_pingpong(const Problem& p, void* workspace, cudaStream_t stream);
size_t workspace_swiglu_bf16_pingpong(const Problem& p);
Status run_swiglu_bf16_pingpong(const Problem& p, void* workspace, cudaStream_t stream);
size_t workspace_swiglu_bf16_pingpong_h(const Problem& p);
Status run_swiglu_bf16_pingpong_h(const Problem& p, void* workspace, cudaStream_t stream);

}  // namespace sm90
}  // namespace gemm
}  // namespace opforge
