// Small-M linear on tensor cores: Y[M, N] = X[M, K] · W[N, K]ᵀ (+ bias[N]) for M ≤ 16, float16/bfloat16.
//
// At decode sizes (M ≤ 16) linear is a stream over the weight: N·K elements read once, 2·M·N·K FLOPs.
// Each block owns 8 rows of W (one n8 tile) and splits K across its WARPS warps; each warp issues
// mma.sync m16n8k16 (fp32 accumulation) on X padded to 16 rows with zeros. Every thread loads 16 bytes
// (8 consecutive k) of one W row and of X's rows per 32-wide K chunk: the dot product does not depend on
// the order of k, so logical k of the mma fragment is mapped to physical k such that both the A (X)
// and B (W) fragments of a thread come from one 16-byte load each. The warps' partial tiles are summed
// in shared memory, bias is added, and Y is written in X's dtype.
//
// Requirements (checked by gemv_supported): M ≤ 16, K % 8 == 0, X and W contiguous rows with 16-byte
// aligned base pointers, dtype float16 or bfloat16.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/cuda_utils.cuh"

namespace opforge {
namespace gemv {

constexpr int kMaxM = 16;

/// True when the tensor-core GEMV path applies: X [M, K] and W [N, K] contiguous, M ≤ 16,
/// K % 8 == 0, 16-byte aligned, float16 or bfloat16, and a device of compute capability ≥ 8.0.
inline bool gemv_supported(const at::Tensor& X, const at::Tensor& W) {
  const auto t = X.scalar_type();
  if (t != at::kHalf && t != at::kBFloat16) return false;
  if (X.size(0) > kMaxM || X.size(0) == 0 || X.size(1) % 8 != 0 || X.size(1) == 0 || W.size(0) == 0) return false;
  if (!X.is_contiguous() || !W.is_contiguous()) return false;
  if (!cuda::is_aligned16(X.const_data_ptr()) || !cuda::is_aligned16(W.const_data_ptr())) return false;
  return at::cuda::getCurrentDeviceProperties()->major >= 8;
}

template <typename T>
struct MmaType;
template <>
struct MmaType<c10::BFloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
  }
};
template <>
struct MmaType<c10::Half> {
  static __device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
  }
};

// Streaming 16-byte load of the weight (read once: do not keep it in L1).
__device__ __forceinline__ uint4 load_stream(const void* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 load_cached(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// Y[M, N] = X[M, K] · W[N, K]ᵀ + bias. Grid: ceil(N / 8) blocks of WARPS warps; U chunks of 32 k per step.
template <typename T, int WARPS, int U>
__global__ void __launch_bounds__(WARPS * 32) gemv_mma_kernel(const T* __restrict__ X,     // [M, K]
                                                              const T* __restrict__ W,     // [N, K]
                                                              const T* __restrict__ bias,  // [N] or nullptr
                                                              T* __restrict__ Y,           // [M, N]
                                                              int M, int64_t K, int64_t N) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // row of the fragment: W row n0 + g, X rows g and g + 8
  const int q = lane & 3;   // 8-element piece of the 32-wide K chunk
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * 8;
  const int64_t n = n0 + g;
  const bool n_ok = n < N;
  const bool m0_ok = g < M, m1_ok = g + 8 < M;
  const T* w_row = W + (n_ok ? n : 0) * K;
  const T* x_row0 = X + (m0_ok ? g : 0) * K;
  const T* x_row1 = X + (m1_ok ? g + 8 : 0) * K;
  const int64_t nchunks = (K + 31) / 32;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int64_t base = static_cast<int64_t>(warp) * U; base < nchunks; base += static_cast<int64_t>(WARPS) * U) {
    uint4 wv[U], xa[U], xb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k = (base + u) * 32 + q * 8;
      const bool k_ok = (base + u) < nchunks && k < K;
      wv[u] = (k_ok && n_ok) ? load_stream(w_row + k) : zero;
      xa[u] = (k_ok && m0_ok) ? load_cached(x_row0 + k) : zero;
      xb[u] = (k_ok && m1_ok) ? load_cached(x_row1 + k) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      // physical k (q*8 + 0..3): logical k 2q, 2q+1 (regs .x) and 2q+8, 2q+9 (regs .y)
      MmaType<T>::mma(acc, xa[u].x, xb[u].x, xa[u].y, xb[u].y, wv[u].x, wv[u].y);
      // physical k (q*8 + 4..7): the second k16 step
      MmaType<T>::mma(acc, xa[u].z, xb[u].z, xa[u].w, xb[u].w, wv[u].z, wv[u].w);
    }
  }

  // acc: (row g, cols 2q, 2q+1) and (row g + 8, cols 2q, 2q+1) of the 16 x 8 tile.
  __shared__ float partial[WARPS][32][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) s += partial[w][lane][i];
    acc[i] = s;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = g + (i >= 2 ? 8 : 0);
    const int64_t col = n0 + 2 * q + (i & 1);
    if (m < M && col < N) {
      float v = acc[i];
      if (bias != nullptr) v += static_cast<float>(bias[col]);
      Y[static_cast<int64_t>(m) * N + col] = static_cast<T>(v);
    }
  }
}

/// Y = X · Wᵀ + bias on the current stream. X [M, K], W [N, K], bias [N] or undefined, Y [M, N]
/// contiguous, all of one dtype; requires gemv_supported(X, W).
inline void gemv(const at::Tensor& X, const at::Tensor& W, const at::Tensor& bias, at::Tensor& Y) {
  const int M = static_cast<int>(X.size(0));
  const int64_t K = X.size(1), N = W.size(0);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = (N + 7) / 8;
  AT_DISPATCH_REDUCED_FLOATING_TYPES(X.scalar_type(), "opforge::gemv", [&] {
    const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    constexpr int kWarps = 8, kUnroll = 4;
    gemv_mma_kernel<scalar_t, kWarps, kUnroll><<<blocks, kWarps * 32, 0, stream>>>(
        X.const_data_ptr<scalar_t>(), W.const_data_ptr<scalar_t>(), b, Y.mutable_data_ptr<scalar_t>(), M, K, N);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace gemv
}  // namespace opforge
