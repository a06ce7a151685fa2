// Small-M linear as a bandwidth-bound GEMV: Y[M, N] = act(X[M, K] · W[N, K]ᵀ + b[N]) for 1 ≤ M ≤ 16.
//
// At small M the weight is read once and every other cost is small, so the kernel is built to keep the
// memory system busy: each warp owns R consecutive rows of W and streams them with 16-byte loads
// (ld.global.cs: read once, not kept in L1), U loads per row in flight per lane before any arithmetic;
// X (a few KB) comes through the read-only cache and is reused across the R rows from registers; fp32
// accumulation, one warp-shuffle reduction per output, bias and activation fused into the store (the
// pre-activation stored too when autograd needs it).
//
// Selected where linear_cuda.cu's bucket table (kGemvTable) measured it ahead of cuBLAS(Lt) on the H200: M == 1
// for most weights, float32 up to M = 8 for some (use_gemv), for float32/float16/bfloat16 with K a multiple of the
// 16-byte vector and X, W 16-byte aligned (linear_cuda.cu checks). At 4096x4096 it streams the weight at 2907 GB/s
// in bf16 (0.68 of the 4274 GB/s copy ceiling; cuBLASLt 2541): ramp-up and tail dominate a ~10 us transfer.
#pragma once

#include <ATen/OpMathType.h>

#include "core/cuda_utils.cuh"
#include "core/row_cuda.cuh"

#include <climits>

namespace opforge {
namespace cuda {

constexpr int kGemvWarps = 8;  // warps per block

// R rows of W per warp and U 16-byte loads per row in flight per lane, by MR (rows of X): R · U = 8 loads
// in flight per lane either way. Each X chunk (one read-only-cache load per row of X) serves R rows of W,
// so a larger M takes a larger R to keep X's cache traffic (M/R times W's) within L1 bandwidth.
template <int MR>
struct GemvTile {
  static constexpr int R = MR >= 8 ? 4 : 2;
  static constexpr int U = 8 / R;
};

// One 16-byte chunk as fp32 values (VEC of them).
template <typename scalar_t, int VEC>
__device__ __forceinline__ void chunk_to_float(const uint4& raw, float (&out)[VEC]) {
  const scalar_t* v = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = static_cast<float>(v[i]);
}

// Y[m, n] = act(Σ_k X[m, k] · W[n, k] + b[n]) for m < M (M ≤ MR), n in this warp's R rows; Z (optional)
// gets the value before the activation. K % VEC == 0; X and W 16-byte aligned.
template <typename scalar_t, int MR, typename Act>
__global__ void __launch_bounds__(kGemvWarps * 32)
    gemv_kernel(const scalar_t* __restrict__ X,  // [M, K]
                const scalar_t* __restrict__ W,  // [N, K]
                const scalar_t* __restrict__ b,  // [N] or nullptr
                scalar_t* __restrict__ Y,        // [M, N]
                scalar_t* __restrict__ Z,        // [M, N] or nullptr
                int M, int64_t K, int64_t N, Act act) {
  constexpr int VEC = 16 / sizeof(scalar_t);
  constexpr int R = GemvTile<MR>::R, U = GemvTile<MR>::U;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp) * R;
  if (n0 >= N) return;
  const int64_t chunks = K / VEC;
  const uint4* Wv = reinterpret_cast<const uint4*>(W);
  const uint4* Xv = reinterpret_cast<const uint4*>(X);

  float acc[R][MR];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = 0.f;

  for (int64_t c0 = lane; c0 < chunks; c0 += 32 * U) {
    // issue every weight load of this step first: R·U 16-byte loads in flight per lane
    uint4 w[R][U];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t c = c0 + 32 * u;
        w[r][u] = (c < chunks && n0 + r < N) ? __ldcs(Wv + (n0 + r) * chunks + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + 32 * u;
      if (c >= chunks) break;
      float wf[R][VEC];
#pragma unroll
      for (int r = 0; r < R; ++r) chunk_to_float<scalar_t, VEC>(w[r][u], wf[r]);
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m >= M) break;
        float xf[VEC];
        chunk_to_float<scalar_t, VEC>(__ldg(Xv + m * chunks + c), xf);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[r][m] = fmaf(xf[i], wf[r][i], acc[r][m]);
      }
    }
  }
  // warp reduction of each output; lane 0 stores
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MR; ++m) acc[r][m] = warp_sum(acc[r][m]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      if (n >= N) break;
      const float bias = b != nullptr ? static_cast<float>(b[n]) : 0.f;
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m >= M) break;
        // z rounded to the storage dtype first, as the GEMM-then-activation paths round it
        const scalar_t z = static_cast<scalar_t>(acc[r][m] + bias);
        if (Z != nullptr) Z[m * N + n] = z;
        Y[m * N + n] = static_cast<scalar_t>(act(static_cast<float>(z)));
      }
    }
  }
}

template <typename scalar_t, int MR, typename Act>
void launch_gemv_tile(const scalar_t* X, const scalar_t* W, const scalar_t* b, scalar_t* Y, scalar_t* Z, int M,
                      int64_t K, int64_t N, Act act) {
  const int64_t rows_per_block = static_cast<int64_t>(kGemvWarps) * GemvTile<MR>::R;
  const int64_t blocks = (N + rows_per_block - 1) / rows_per_block;
  TORCH_INTERNAL_ASSERT(blocks <= INT_MAX, "opforge::linear: N too large for the GEMV grid");
  gemv_kernel<scalar_t, MR><<<static_cast<unsigned>(blocks), kGemvWarps * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      X, W, b, Y, Z, M, K, N, act);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// Launches gemv_kernel for 1 ≤ M ≤ 16 (the caller checked dtype, M, K % VEC, alignment; K, N > 0), with
/// MR = M rounded up to a power of two.
template <typename scalar_t, typename Act>
void launch_gemv(const scalar_t* X, const scalar_t* W, const scalar_t* b, scalar_t* Y, scalar_t* Z, int M, int64_t K,
                 int64_t N, Act act) {
  if (M <= 1) {
    launch_gemv_tile<scalar_t, 1>(X, W, b, Y, Z, M, K, N, act);
  } else if (M <= 2) {
    launch_gemv_tile<scalar_t, 2>(X, W, b, Y, Z, M, K, N, act);
  } else if (M <= 4) {
    launch_gemv_tile<scalar_t, 4>(X, W, b, Y, Z, M, K, N, act);
  } else if (M <= 8) {
    launch_gemv_tile<scalar_t, 8>(X, W, b, Y, Z, M, K, N, act);
  } else {
    launch_gemv_tile<scalar_t, 16>(X, W, b, Y, Z, M, K, N, act);
  }
}

}  // namespace cuda
}  // namespace opforge
