// Small-M linear as a bandwidth-bound GEMV: Y[M, N] = act(X[M, K] · W[N, K]ᵀ + b[N]) for 1 ≤ M ≤ 16.
//
// At small M the weight is read once and every other cost is small, so the kernel is built to keep the
// memory system busy: each warp owns R consecutive rows of W and streams them with 16-byte loads
// (ld.global.cs: read once, not kept in L1), U loads per row in flight per lane before any arithmetic;
// X (a few KB) comes through the read-only cache and is reused across the R rows from registers; fp32
// accumulation, one warp-shuffle reduction per output, bias and activation fused into the store (the
// pre-activation stored too when autograd needs it).
//
// Selected for M == 1 by default (the H200 measured it ahead of cuBLAS there, behind at M = 8; see
// gemv_choice in linear_cuda.cu), for 1 ≤ M ≤ 16 with OPFORGE_LINEAR_GEMV=1, for float32/float16/
// bfloat16 with K a multiple of the 16-byte vector and X, W 16-byte aligned (linear_cuda.cu checks).
#pragma once

#include <ATen/OpMathType.h>

#include "core/cuda_utils.cuh"
#include "core/row_cuda.cuh"

#include <algorithm>
#include <climits>
#include <type_traits>

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

// ---- the tensor-core GEMV (OPFORGE_GEMV_VARIANT 1..3, float16/bfloat16) ------------------------------------
//
// Y[M, N] = act(X · Wᵀ + b) as Yᵀ = W · Xᵀ on mma.sync m16n8k16 (fp32 accumulation): W's rows are the
// MMA's M dimension (a warp owns RT tiles of 16 rows), X's rows its N dimension (8, or 2 x 8 for M > 8,
// rows past M zero), so the 16·M multiply-adds per weight element leave the CUDA cores (at M = 16 they
// alone would need all of an SM's FMA throughput at full bandwidth). The k order of a dot product is
// free, so each lane loads 16 contiguous bytes of a W row (8 elements) and the same 16 bytes of an X
// row, and feeds them to two MMAs: lane t = lane % 4 holds k slots {2t, 2t+1, 2t+8, 2t+9} of both the A
// (W) and B (X) fragment of an m16n8k16, so elements 0..3 of its chunk go to MMA 1 and 4..7 to MMA 2 —
// the same permutation for W and X, hence the same sums. A 32-k step of a warp reads, per tile, 16 rows
// x 64 bytes of W with 16-byte loads; U steps are issued before any MMA (U · 2 · RT loads in flight per
// lane). The KW warps of a block split K between them (contiguous ranges; KS blocks on grid.y split it
// further where the grid would be small) and their partial sums meet in shared memory, added in warp
// order (deterministic); with KS > 1 each block writes fp32 partials [KS, M, N] and gemv_splitk_finish
// adds them in split order, then bias and activation. X is read through the read-only cache: each X
// element is used by one warp of the block, reused across its RT tiles from registers.
constexpr int kMmaWarps = 8;  // warps per block of the tensor-core GEMV (they split K)
constexpr int kMmaSteps = 4;  // U: 32-k steps whose loads are issued together

template <typename scalar_t>
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the launcher takes this kernel on sm_80 and later only
#endif
}

/// The stored value of output (m, n) from its fp32 sum: z = sum + b[n] rounded to the storage dtype (as
/// the GEMM-then-activation paths round it), Z[m, n] = z when Z, Y[m, n] = act(z).
template <typename scalar_t, typename Act>
__device__ __forceinline__ void gemv_store(float sum, const scalar_t* __restrict__ b, scalar_t* __restrict__ Y,
                                           scalar_t* __restrict__ Z, int m, int64_t n, int64_t N, Act act) {
  const float bias = b != nullptr ? static_cast<float>(b[n]) : 0.f;
  const scalar_t z = static_cast<scalar_t>(sum + bias);
  if (Z != nullptr) Z[m * N + n] = z;
  Y[m * N + n] = static_cast<scalar_t>(act(static_cast<float>(z)));
}

// The operand list (X, W, b, Y, Z, ..., M, K, N, act) repeats gemv_kernel's on purpose: passing both kernels one
// struct of these operands drops __restrict__ from them (sm_90, bf16, measured: every gemv_kernel instantiation
// differs; MR = 1 and 16: same counts, but the bias loads leave the read-only path, LDG.E.U16.CONSTANT -> LDG.E.U16;
// MR = 2: +5..7 instructions, MR = 4: -23, MR = 8: +28..58). Kept until an H200 benchmark says it costs nothing.
// Block (kMmaWarps warps) = RT·16 rows of W from row blockIdx.x·RT·16, split s = blockIdx.y of gridDim.y
// over K. MT = 1 (M <= 8) or 2 (M <= 16) tiles of 8 rows of X. K % 8 == 0, X and W 16-byte aligned.
template <typename scalar_t, int MT, int RT, typename Act>
__global__ void __launch_bounds__(kMmaWarps * 32)
    gemv_mma_kernel(const scalar_t* __restrict__ X,  // [M, K]
                    const scalar_t* __restrict__ W,  // [N, K]
                    const scalar_t* __restrict__ b,  // [N] or nullptr
                    scalar_t* __restrict__ Y,        // [M, N]
                    scalar_t* __restrict__ Z,        // [M, N] or nullptr
                    float* __restrict__ partial,     // [gridDim.y, M, N] when gridDim.y > 1
                    int M, int64_t K, int64_t N, Act act) {
  constexpr int U = kMmaSteps;
  __shared__ float red[kMmaWarps][RT][MT][4][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * RT * 16;
  const int64_t chunks = K / 8;                 // 16-byte chunks per row
  const int64_t steps = (chunks + 3) / 4;       // 32-k steps per row
  const int64_t parts = static_cast<int64_t>(gridDim.y) * kMmaWarps;
  const int64_t part = static_cast<int64_t>(blockIdx.y) * kMmaWarps + warp;
  const int64_t per = (steps + parts - 1) / parts;
  const int64_t s_begin = part * per, s_end = std::min<int64_t>(steps, s_begin + per);
  const uint4* Wv = reinterpret_cast<const uint4*>(W);
  const uint4* Xv = reinterpret_cast<const uint4*>(X);
  const uint4 zero = make_uint4(0, 0, 0, 0);

  // the W rows of this lane (rows g and g + 8 of each tile) and X rows (g, g + 8), or -1 past the end
  int64_t wrow[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + rt * 16 + g + 8 * h;
      wrow[rt][h] = n < N ? n : -1;
    }
  float acc[RT][MT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][mt][i] = 0.f;

  for (int64_t s0 = s_begin; s0 < s_end; s0 += U) {
    uint4 wq[U][RT][2], xq[U][MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = (s0 + u) * 4 + t;  // this lane's chunk of step s0 + u
      const bool in = s0 + u < s_end && c < chunks;
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wq[u][rt][h] = (in && wrow[rt][h] >= 0) ? __ldcs(Wv + wrow[rt][h] * chunks + c) : zero;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int m = mt * 8 + g;
        xq[u][mt] = (in && m < M) ? __ldg(Xv + m * chunks + c) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint4 &lo = wq[u][rt][0], &hi = wq[u][rt][1], &x = xq[u][mt];
          mma_16816<scalar_t>(acc[rt][mt], lo.x, hi.x, lo.y, hi.y, x.x, x.y);  // elements 0..3 of the chunk
          mma_16816<scalar_t>(acc[rt][mt], lo.z, hi.z, lo.w, hi.w, x.z, x.w);  // elements 4..7
        }
  }
  // the warps' sums, added in warp order; C fragment: acc[i] = (W row g + 8·(i/2), X row 2t + i%2)
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][rt][mt][i][lane] = acc[rt][mt][i];
  __syncthreads();
  constexpr int kOutputs = RT * MT * 4 * 32;
  for (int o = threadIdx.x; o < kOutputs; o += kMmaWarps * 32) {
    const int l = o % 32, i = (o / 32) % 4, mt = (o / 128) % MT, rt = o / (128 * MT);
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) sum += red[w][rt][mt][i][l];
    const int64_t n = n0 + rt * 16 + l / 4 + 8 * (i / 2);
    const int m = mt * 8 + 2 * (l % 4) + i % 2;
    if (n >= N || m >= M) continue;
    if (gridDim.y > 1) {
      partial[(static_cast<int64_t>(blockIdx.y) * M + m) * N + n] = sum;
    } else {
      gemv_store(sum, b, Y, Z, m, n, N, act);
    }
  }
}

// Y, Z from the fp32 partials [splits, M, N] of gemv_mma_kernel, added in split order, then bias and act.
template <typename scalar_t, typename Act>
__global__ void gemv_splitk_finish(const float* __restrict__ partial, int splits, const scalar_t* __restrict__ b,
                                   scalar_t* __restrict__ Y, scalar_t* __restrict__ Z, int M, int64_t N, Act act) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * N) return;
  float sum = 0.f;
  for (int s = 0; s < splits; ++s) sum += partial[s * M * N + i];
  gemv_store(sum, b, Y, Z, static_cast<int>(i / N), i % N, N, act);
}

/// Splits over K (grid.y) for the tensor-core GEMV of variant `variant` with `tiles` blocks along N: 1
/// for variants 1 and 2; variant 3 splits until the grid has about 2 blocks per SM, keeping at least 4
/// 32-k steps of K per warp.
inline int gemv_mma_splits(int variant, int64_t tiles, int64_t K) {
  if (variant != 3) return 1;
  const int64_t want = (2 * num_sms() + tiles - 1) / tiles;
  const int64_t most = std::max<int64_t>(1, K / (32 * 4 * kMmaWarps));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({want, most, 64})));
}

/// Launches the tensor-core GEMV (float16/bfloat16; 1 <= M <= 16; K % 8 == 0; X, W 16-byte aligned; an
/// sm_80+ device), variant 1 (16 rows of W a warp), 2 (32 rows) or 3 (16 rows, split-K over blocks).
template <typename scalar_t, typename Act>
void launch_gemv_mma(int variant, const scalar_t* X, const scalar_t* W, const scalar_t* b, scalar_t* Y, scalar_t* Z,
                     int M, int64_t K, int64_t N, Act act) {
  auto stream = at::cuda::getCurrentCUDAStream();
  auto go = [&](auto mt_c, auto rt_c) {
    constexpr int MT = decltype(mt_c)::value, RT = decltype(rt_c)::value;
    const int64_t tiles = (N + RT * 16 - 1) / (RT * 16);
    TORCH_INTERNAL_ASSERT(tiles <= INT_MAX, "opforge::linear: N too large for the GEMV grid");
    const int splits = gemv_mma_splits(variant, tiles, K);
    at::Tensor partial;
    float* part = nullptr;
    if (splits > 1) {
      partial = at::empty({splits, M, N}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA));
      part = partial.mutable_data_ptr<float>();
    }
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(splits));
    gemv_mma_kernel<scalar_t, MT, RT><<<grid, kMmaWarps * 32, 0, stream>>>(X, W, b, Y, Z, part, M, K, N, act);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (splits > 1) {
      const int64_t outputs = static_cast<int64_t>(M) * N;
      gemv_splitk_finish<scalar_t><<<static_cast<unsigned>((outputs + 255) / 256), 256, 0, stream>>>(
          part, splits, b, Y, Z, M, N, act);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (M <= 8) {
    variant == 2 ? go(One{}, Two{}) : go(One{}, One{});
  } else {
    variant == 2 ? go(Two{}, Two{}) : go(Two{}, One{});
  }
}

}  // namespace cuda
}  // namespace opforge
