// CUDA kernels of indexed_linear. No host synchronisation anywhere (CUDA-graph capturable), 64-bit offsets.
//
// An index ≥ E or < −1 cannot be seen without a host synchronisation, so on CUDA such a row is treated as −1:
// its output row is zero and it gets (and gives) no gradient; no out-of-bounds read ever happens.
//
// Two regimes, chosen by shape (the test hook indexed_linear_path of core/knobs.h forces one):
//   gather-GEMV (T ≤ kGemvMaxTokens: decode, multi-LoRA shrink/expand): one block per (token, tile of outputs);
//     a team of L lanes computes one output from the selected expert's row of W with 16-byte loads of W and X
//     (element loads for odd K or unaligned views), L from the row length and the number of outputs: up to the
//     whole block (split-K inside the block, warps' partials summed in shared memory in a fixed order) for long
//     rows and few outputs (shrink: K 4096, T·N 128), one lane per output for short rows (expand: K 16); fp32
//     accumulation, deterministic, one kernel; bias and the −1 rule fused. The input gradient reads the bank
//     transposed: teams of G ≤ 32 lanes, element loads.
//   grouped (more tokens): tokens are sorted by expert on the device (at::sort of the key, −1 and out-of-range
//     keyed E so they sort last), group offsets by at::searchsorted of the sorted keys; then
//       - bfloat16 on sm_90 with 16-byte aligned rows: torch's at::_grouped_mm (CUTLASS) on the gathered rows
//         (a bank at an address not 16-byte aligned is copied first: _grouped_mm rejects it),
//         int32 offsets (T < 2³¹), then one kernel that adds the bias, zeroes the −1 rows and scatters back;
//         dW through _grouped_mm's 2-D × 2-D form, with experts that received no token zeroed afterwards
//         (some torch versions' _grouped_mm leave their output unwritten);
//       - otherwise our tiled grouped GEMM (64 × 64 tiles, shared memory, fp32 accumulation) that reads rows
//         through the permutation and the offsets from device memory; one kernel for forward and grad_input, one
//         for grad_weight (+ grad_bias) over each expert's rows.
//     With index_sorted (the caller's rows already in expert order, rows without an expert last) there is no
//     sort, no gather and no scatter: the groups come from at::searchsorted of the index itself, _grouped_mm
//     reads and writes the caller's rows in place, and one kernel (finish_rows_kernel) then adds the bias, zeroes
//     the rows without an expert and sets to NaN every row that breaks the order (never a silently wrong row).
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <tuple>

#include "core/check.h"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "core/knobs.h"
#include "ops/indexed_linear/indexed_linear.h"

namespace opforge {
namespace {

constexpr int64_t kGemvMaxTokens = 16;

// The values of the test hook indexed_linear_path (core/knobs.h).
enum class Path { kAuto = 0, kGemv = 1, kGrouped = 2, kGroupedMM = 3 };

Path forced_path() {
  const int64_t v = knobs::get(knobs::Knob::kIndexedLinearPath);
  return v >= 1 && v <= 3 ? static_cast<Path>(v) : Path::kAuto;
}

// ---- gather-GEMV ---------------------------------------------------------------------------------------
// out[t, o] = Σ_r A[t, r] · B[e_t, o, r]  (+ bias[e_t, o]),  0 where e_t ∉ [0, E)
//   forward:    A = X [T, K],  B[e, o, r] = W[e, o, r]   (o < N, r < K): rows of B contiguous (gemv_rows_kernel)
//   grad_input: A = dY [T, N], B[e, o, r] = W[e, r, o]   (o < K, r < N): sBo = 1, sBr = K (gather_gemv_kernel)

constexpr int kRowThreads = 256;

/// VEC elements of T loaded and stored as one aligned unit (16 bytes: one LDG.128).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

/// A Pack of zeros.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> zero_pack() {
  Pack<T, VEC> p;
#pragma unroll
  for (int j = 0; j < VEC; ++j) p.v[j] = T(0);
  return p;
}

/// Chunks of a row loaded together by one lane of gemv_rows_kernel before it multiplies.
constexpr int kBatch = 4;

// Contiguous rows: B[e, o, r] = W[e·sWe + o·R + r], A rows of length R, R % VEC == 0, A and W 16-byte aligned
// when VEC > 1. A team of L lanes computes one output at a time: lane l reduces the VEC-wide chunks l, l + L, ...
// of the row (16-byte loads of W and of A), then the team sums its lanes: shuffles inside a warp (L ≤ 32), and for
// L = 32·team_warps (G == 32) the warps' sums through shared memory in warp order — split-K inside the block,
// a fixed summation order, so two calls give the same bits. The A loads do not wait for the index (always in
// bounds); the W loads are predicated on a valid index (no read at all for −1 or out of range), the bias is
// loaded before the reduction so its latency overlaps the W stream.
template <typename scalar_t, int VEC, int G>
__global__ void __launch_bounds__(kRowThreads)
    gemv_rows_kernel(const scalar_t* __restrict__ A,     // [T, R]
                     const scalar_t* __restrict__ W,     // [E, O, R] (expert stride sWe)
                     const scalar_t* __restrict__ bias,  // [E, O] or null
                     const int64_t* __restrict__ index,  // [T]
                     scalar_t* __restrict__ out,         // [T, O]
                     int64_t O, int64_t R, int64_t E, int64_t sWe, int team_warps) {
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G: a power of two ≤ 32");
  using acc_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, VEC>;
  __shared__ acc_t partial[kRowThreads / 32];
  const int64_t t = blockIdx.x;
  const int64_t e = index[t];
  const bool valid = e >= 0 && e < E;
  const int L = G < 32 ? G : 32 * team_warps;  // lanes per output
  const int teams = kRowThreads / L, team = threadIdx.x / L, lane = threadIdx.x % L;
  const int64_t chunks = R / VEC;
  const P* a = reinterpret_cast<const P*>(A + t * R);
  const scalar_t* w = W + (valid ? e : 0) * sWe;
  for (int64_t o0 = static_cast<int64_t>(blockIdx.y) * teams; o0 < O; o0 += static_cast<int64_t>(gridDim.y) * teams) {
    const int64_t o = o0 + team;
    const bool live = o < O;
    const acc_t b = (valid && live && lane == 0 && bias != nullptr) ? static_cast<acc_t>(bias[e * O + o]) : acc_t(0);
    acc_t acc = 0;
    if (live) {
      const P* wo = reinterpret_cast<const P*>(w + o * R);
      // kBatch chunks' loads issued before the first multiply: a lane's whole share of a decode row in flight at once
      for (int64_t c0 = lane; c0 < chunks; c0 += kBatch * static_cast<int64_t>(L)) {
        P xs[kBatch], ys[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int64_t c = c0 + static_cast<int64_t>(i) * L;
          xs[i] = c < chunks ? a[c] : zero_pack<scalar_t, VEC>();
          ys[i] = valid && c < chunks ? wo[c] : zero_pack<scalar_t, VEC>();
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc += static_cast<acc_t>(xs[i].v[j]) * static_cast<acc_t>(ys[i].v[j]);
      }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off, G);
    if (G == 32 && team_warps > 1) {  // block-uniform: every thread takes the same path and loop trip count
      const int warp = threadIdx.x / 32;
      if (threadIdx.x % 32 == 0) partial[warp] = acc;
      __syncthreads();
      if (lane == 0) {
        for (int i = 1; i < team_warps; ++i) acc += partial[warp + i];
      }
      __syncthreads();
    }
    if (lane == 0 && live) out[t * O + o] = static_cast<scalar_t>(valid ? acc + b : acc_t(0));
  }
}

/// Lanes per output and launch of gemv_rows_kernel (see there) for VEC and G fixed.
template <typename scalar_t, int VEC, int G>
void launch_gemv_rows(const scalar_t* A, const scalar_t* W, const scalar_t* bias, const int64_t* index, scalar_t* out,
                      int64_t T, int64_t O, int64_t R, int64_t E, int64_t sWe, int lanes) {
  const int team_warps = G < 32 ? 1 : lanes / 32;
  const int teams = kRowThreads / lanes;
  const int64_t tiles = std::min<int64_t>((O + teams - 1) / teams, 65535);
  dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(std::max<int64_t>(tiles, 1)));
  gemv_rows_kernel<scalar_t, VEC, G><<<grid, kRowThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      A, W, bias, index, out, O, R, E, sWe, team_warps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// Lanes per output of gemv_rows_kernel for `chunks` VEC-wide chunks per row, T·O outputs: about two chunks per
/// lane (every load of a row in flight at once: at decode sizes the kernel is bound by latency, not bandwidth),
/// at most the whole block (kRowThreads), and no more than 32 once T·O·lanes exceeds twice the threads the GPU
/// holds (then one warp per output loops over its row: no block barrier, the GPU still full).
int gemv_rows_lanes(int64_t chunks, int64_t outputs) {
  int lanes = 1;
  while (lanes < kRowThreads && int64_t{lanes} * 2 < chunks) lanes *= 2;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t resident = int64_t{prop->multiProcessorCount} * prop->maxThreadsPerMultiProcessor;
  while (lanes > 32 && outputs * lanes > 2 * resident) lanes /= 2;
  return lanes;
}

template <typename scalar_t, int VEC>
void gemv_rows_vec(const scalar_t* A, const scalar_t* W, const scalar_t* bias, const int64_t* index, scalar_t* out,
                   int64_t T, int64_t O, int64_t R, int64_t E, int64_t sWe) {
  const int lanes = gemv_rows_lanes(R / VEC, T * O);
  auto args = std::make_tuple(A, W, bias, index, out, T, O, R, E, sWe, lanes);
  switch (lanes) {
    case 1: std::apply(launch_gemv_rows<scalar_t, VEC, 1>, args); break;
    case 2: std::apply(launch_gemv_rows<scalar_t, VEC, 2>, args); break;
    case 4: std::apply(launch_gemv_rows<scalar_t, VEC, 4>, args); break;
    case 8: std::apply(launch_gemv_rows<scalar_t, VEC, 8>, args); break;
    case 16: std::apply(launch_gemv_rows<scalar_t, VEC, 16>, args); break;
    default: std::apply(launch_gemv_rows<scalar_t, VEC, 32>, args); break;  // 32 · team_warps lanes
  }
}

/// out [T, O] from A [T, R] (contiguous) and the contiguous bank W [E, O, R] (forward: O = N, R = K). 16-byte
/// loads where R·sizeof(scalar) is a multiple of 16 and A, W are 16-byte aligned, element loads otherwise (odd K,
/// views at an odd storage offset). T ≤ 2³¹ − 1 (grid x).
void gemv_rows(const at::Tensor& A, const at::Tensor& W, const at::Tensor& bias, const at::Tensor& index,
               at::Tensor& out, int64_t O, int64_t R, int64_t E) {
  const int64_t T = A.size(0);
  if (T == 0 || O == 0) return;
  OPFORGE_DISPATCH_FLOATING(A.scalar_type(), "indexed_linear_gemv", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const scalar_t* a = A.const_data_ptr<scalar_t>();
    const scalar_t* w = E > 0 ? W.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
    const bool vec = R % kVec == 0 && aligned(a) && (w == nullptr || aligned(w));
    if (vec) {
      gemv_rows_vec<scalar_t, kVec>(a, w, b, index.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), T,
                                    O, R, E, O * R);
    } else {
      gemv_rows_vec<scalar_t, 1>(a, w, b, index.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), T, O,
                                 R, E, O * R);
    }
  });
}

// Any strides of B (the input gradient reads the bank transposed): a team of G lanes computes one output,
// element loads, fp32 accumulation, shuffle reduction.
template <typename scalar_t, int G>
__global__ void gather_gemv_kernel(const scalar_t* __restrict__ A,  // [T, R]
                                   const scalar_t* __restrict__ W,  // [E, N, K]
                                   const scalar_t* __restrict__ bias,  // [E, O] or null
                                   const int64_t* __restrict__ index,  // [T]
                                   scalar_t* __restrict__ out,  // [T, O]
                                   int64_t O, int64_t R, int64_t E, int64_t sBe, int64_t sBo, int64_t sBr) {
  const int64_t t = blockIdx.x;
  const int teams = blockDim.x / G, team = threadIdx.x / G, lane = threadIdx.x % G;
  const int64_t e = index[t];
  const bool valid = e >= 0 && e < E;
  const scalar_t* a = A + t * R;
  const scalar_t* w = W + (valid ? e : 0) * sBe;
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t o0 = static_cast<int64_t>(blockIdx.y) * teams; o0 < O; o0 += static_cast<int64_t>(gridDim.y) * teams) {
    const int64_t o = o0 + team;
    acc_t acc = 0;
    if (valid && o < O) {
      const scalar_t* wo = w + o * sBo;
      for (int64_t r = lane; r < R; r += G) acc += static_cast<acc_t>(a[r]) * static_cast<acc_t>(wo[r * sBr]);
    }
#pragma unroll
    for (int off = G / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off, G);
    if (lane == 0 && o < O) {
      if (valid && bias != nullptr) acc += static_cast<acc_t>(bias[e * O + o]);
      out[t * O + o] = static_cast<scalar_t>(valid ? acc : acc_t(0));
    }
  }
}

template <typename scalar_t, int G>
void launch_gemv_g(const scalar_t* A, const scalar_t* W, const scalar_t* bias, const int64_t* index, scalar_t* out,
                   int64_t T, int64_t O, int64_t R, int64_t E, int64_t sBe, int64_t sBo, int64_t sBr) {
  constexpr int kThreads = 256;
  const int teams = kThreads / G;
  const int64_t tiles = std::min<int64_t>((O + teams - 1) / teams, 65535);
  dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(std::max<int64_t>(tiles, 1)));
  gather_gemv_kernel<scalar_t, G><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(A, W, bias, index, out, O,
                                                                                           R, E, sBe, sBo, sBr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// out [T, O] from A [T, R] (see gather_gemv_kernel). T ≤ 2³¹ − 1 (grid x).
void gather_gemv(const at::Tensor& A, const at::Tensor& W, const at::Tensor& bias, const at::Tensor& index,
                 at::Tensor& out, int64_t O, int64_t R, int64_t E, int64_t sBe, int64_t sBo, int64_t sBr) {
  const int64_t T = A.size(0);
  if (T == 0 || O == 0) return;
  OPFORGE_DISPATCH_FLOATING(A.scalar_type(), "indexed_linear_gemv", [&] {
    const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    auto args = std::make_tuple(A.const_data_ptr<scalar_t>(), W.const_data_ptr<scalar_t>(), b,
                                index.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), T, O, R, E, sBe,
                                sBo, sBr);
    // G lanes per output: about 8 reduction elements per lane, 1 ≤ G ≤ 32
    if (R >= 256) std::apply(launch_gemv_g<scalar_t, 32>, args);
    else if (R >= 128) std::apply(launch_gemv_g<scalar_t, 16>, args);
    else if (R >= 64) std::apply(launch_gemv_g<scalar_t, 8>, args);
    else if (R >= 32) std::apply(launch_gemv_g<scalar_t, 4>, args);
    else if (R >= 16) std::apply(launch_gemv_g<scalar_t, 2>, args);
    else std::apply(launch_gemv_g<scalar_t, 1>, args);
  });
}

// ---- sorting tokens by expert --------------------------------------------------------------------------------

/// Tokens sorted by expert, all on the device: perm [T] (token ids in expert order, invalid ones last; undefined:
/// the identity, the caller's rows already in order), key [T] (the expert of each position, E for invalid),
/// offsets [E + 1] (group e = [offsets[e], offsets[e + 1]), non-decreasing; offsets[E] = the number of valid
/// tokens).
struct Sorted {
  at::Tensor perm, key, offsets;
};

/// perm's pointer, or null for the identity (kernels read row r as perm ? perm[r] : r).
const int64_t* perm_ptr(const Sorted& s) { return s.perm.defined() ? s.perm.const_data_ptr<int64_t>() : nullptr; }

__device__ __forceinline__ int64_t row_of(const int64_t* perm, int64_t r) { return perm != nullptr ? perm[r] : r; }

Sorted sort_tokens(const at::Tensor& index, int64_t E) {
  const at::Tensor valid = index.ge(0).logical_and_(index.lt(E));
  const at::Tensor k = at::where(valid, index, at::scalar_tensor(E, index.options()));
  auto [key, perm] = at::sort(k, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor experts = at::arange(E + 1, index.options());
  const at::Tensor offsets = at::searchsorted(key, experts, /*out_int32=*/false, /*right=*/false);
  return {perm, key, offsets};
}

/// The groups of an index the caller sorted (index_sorted): key as sort_tokens's, no permutation, offsets by
/// at::searchsorted of the key itself, made non-decreasing by a running max so that they are groups whatever the
/// index holds (a row that breaks the order lies outside its expert's group: finish_rows_kernel catches it).
Sorted given_order(const at::Tensor& index, int64_t E) {
  const at::Tensor valid = index.ge(0).logical_and_(index.lt(E));
  const at::Tensor key = at::where(valid, index, at::scalar_tensor(E, index.options()));
  const at::Tensor experts = at::arange(E + 1, index.options());
  const at::Tensor found = at::searchsorted(key, experts, /*out_int32=*/false, /*right=*/false);
  return {at::Tensor(), key, std::get<0>(at::cummax(found, 0))};
}

/// The group holding sorted row r < offsets[E]: the last e with offsets[e] ≤ r (a binary search of the E + 1
/// non-decreasing offsets).
__device__ __forceinline__ int64_t group_of(const int64_t* __restrict__ offsets, int64_t E, int64_t r) {
  int64_t lo = 0, hi = E;  // offsets[lo] ≤ r < offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

// ---- tiled grouped GEMM --------------------------------------------------------------------------------------
constexpr int kBM = 64, kBN = 64, kBK = 16, kThreads = 256;  // each thread: 4 × 4 outputs

// out[perm[r], o] = Σ_q A[perm[r], q] · B[key[r], o, q] (+ bias[key[r], o]) for the sorted rows r of this block's
// tile, expert by expert; rows r ≥ offsets[E] (invalid index) get zeros. B[e, o, q] at W + e·sBe + o·sBo + q·sBq.
template <typename scalar_t>
__global__ void grouped_rows_kernel(const scalar_t* __restrict__ A,  // [T, Q]
                                    const scalar_t* __restrict__ W, const scalar_t* __restrict__ bias,  // [E, O]
                                    const int64_t* __restrict__ perm, const int64_t* __restrict__ key,
                                    const int64_t* __restrict__ offsets,  // [E + 1]
                                    scalar_t* __restrict__ out,  // [T, O]
                                    int64_t T, int64_t O, int64_t Q, int64_t E, int64_t sBe, int64_t sBo,
                                    int64_t sBq) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t As[kBK][kBM + 1];
  __shared__ acc_t Bs[kBK][kBN + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBM, o0 = static_cast<int64_t>(blockIdx.y) * kBN;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t nvalid = offsets[E];
  const int64_t r_end = min(r0 + kBM, T);
  // invalid rows of this tile: zeros
  for (int i = threadIdx.x; i < kBM * kBN; i += kThreads) {
    const int64_t r = r0 + i / kBN, o = o0 + i % kBN;
    if (r < r_end && r >= nvalid && o < O) out[row_of(perm, r) * O + o] = scalar_t(0);
  }
  const int64_t v_end = min(r_end, nvalid);
  if (r0 >= v_end) return;
  // the experts whose groups meet [r0, v_end): from the offsets (non-decreasing), so every row below nvalid is
  // written once whatever the keys hold
  const int64_t e_first = group_of(offsets, E, r0), e_last = group_of(offsets, E, v_end - 1);
  for (int64_t e = e_first; e <= e_last; ++e) {
    const int64_t g0 = max(r0, offsets[e]), g1 = min(v_end, offsets[e + 1]);
    if (g0 >= g1) continue;  // block-uniform
    const scalar_t* B = W + e * sBe;
    acc_t acc[4][4] = {};
    for (int64_t q0 = 0; q0 < Q; q0 += kBK) {
      // A tile: As[q][m] = A[perm[g0 + m], q0 + q]  (q fastest: coalesced along a row of A)
      for (int i = threadIdx.x; i < kBK * kBM; i += kThreads) {
        const int q = i % kBK, m = i / kBK;
        const int64_t r = g0 + m;
        As[q][m] = (r < g1 && q0 + q < Q) ? static_cast<acc_t>(A[row_of(perm, r) * Q + q0 + q]) : acc_t(0);
      }
      // B tile: Bs[q][n] = B[o0 + n, q0 + q], the faster index along the unit stride
      for (int i = threadIdx.x; i < kBK * kBN; i += kThreads) {
        int q, n;
        if (sBq == 1) { q = i % kBK; n = i / kBK; } else { n = i % kBN; q = i / kBN; }
        const int64_t o = o0 + n, qq = q0 + q;
        Bs[q][n] = (o < O && qq < Q) ? static_cast<acc_t>(B[o * sBo + qq * sBq]) : acc_t(0);
      }
      __syncthreads();
#pragma unroll
      for (int q = 0; q < kBK; ++q) {
        acc_t a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[q][ty * 4 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = Bs[q][tx * 4 + j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = g0 + ty * 4 + i;
      if (r >= g1) continue;
      const int64_t row = row_of(perm, r);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t o = o0 + tx * 4 + j;
        if (o >= O) continue;
        acc_t v = acc[i][j];
        if (bias != nullptr) v += static_cast<acc_t>(bias[e * O + o]);
        out[row * O + o] = static_cast<scalar_t>(v);
      }
    }
  }
}

// dW[e, n, k] = Σ_{r in group e} dY[perm[r], n] · X[perm[r], k];  db[e, n] = Σ_{r in group e} dY[perm[r], n]
// (blocks of the first k tile). An expert with no token gets zeros.
template <typename scalar_t>
__global__ void grouped_weight_grad_kernel(const scalar_t* __restrict__ dY,  // [T, N]
                                           const scalar_t* __restrict__ X,   // [T, K]
                                           const int64_t* __restrict__ perm, const int64_t* __restrict__ offsets,
                                           scalar_t* __restrict__ dW,  // [E, N, K] or null
                                           at::opmath_type<scalar_t>* __restrict__ db,     // [E, N] or null
                                           int64_t N, int64_t K) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t As[kBK][kBN + 1];  // dY rows: As[r][n]
  __shared__ acc_t Bs[kBK][kBM + 1];  // X rows:  Bs[r][k]
  const int64_t e = blockIdx.z;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBN, k0 = static_cast<int64_t>(blockIdx.y) * kBM;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t g0 = offsets[e], g1 = offsets[e + 1];
  const bool do_db = db != nullptr && blockIdx.y == 0;
  acc_t acc[4][4] = {};
  acc_t dbacc = 0;
  for (int64_t r0 = g0; r0 < g1; r0 += kBK) {
    for (int i = threadIdx.x; i < kBK * kBN; i += kThreads) {
      const int n = i % kBN, r = i / kBN;
      const int64_t rr = r0 + r;
      As[r][n] = (rr < g1 && n0 + n < N) ? static_cast<acc_t>(dY[row_of(perm, rr) * N + n0 + n]) : acc_t(0);
    }
    if (dW != nullptr) {
      for (int i = threadIdx.x; i < kBK * kBM; i += kThreads) {
        const int k = i % kBM, r = i / kBM;
        const int64_t rr = r0 + r;
        Bs[r][k] = (rr < g1 && k0 + k < K) ? static_cast<acc_t>(X[row_of(perm, rr) * K + k0 + k]) : acc_t(0);
      }
    }
    __syncthreads();
    if (do_db && threadIdx.x < kBN) {
#pragma unroll
      for (int r = 0; r < kBK; ++r) dbacc += As[r][threadIdx.x];
    }
    if (dW != nullptr) {
#pragma unroll
      for (int r = 0; r < kBK; ++r) {
        acc_t a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[r][ty * 4 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = Bs[r][tx * 4 + j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
      }
    }
    __syncthreads();
  }
  if (dW != nullptr) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t n = n0 + ty * 4 + i;
      if (n >= N) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t k = k0 + tx * 4 + j;
        if (k < K) dW[(e * N + n) * K + k] = static_cast<scalar_t>(acc[i][j]);
      }
    }
  }
  if (do_db && threadIdx.x < kBN && n0 + threadIdx.x < N) db[e * N + n0 + threadIdx.x] = dbacc;
}

// out[perm[r], o] = r < offsets[E] ? Ys[r, o] (+ bias[key[r], o]) : 0  (the _grouped_mm path's epilogue)
template <typename scalar_t>
__global__ void scatter_rows_kernel(const scalar_t* __restrict__ Ys, int64_t ld_ys,  // [T, O] (row stride ld_ys)
                                    const scalar_t* __restrict__ bias,            // [E, O] or null
                                    const int64_t* __restrict__ perm, const int64_t* __restrict__ key,
                                    const int64_t* __restrict__ offsets, scalar_t* __restrict__ out,  // [T, O]
                                    int64_t T, int64_t O, int64_t E) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t nvalid = offsets[E];
  const int64_t total = T * O;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / O, o = i % O;
    acc_t v = 0;
    if (r < nvalid) {
      v = static_cast<acc_t>(Ys[r * ld_ys + o]);
      if (bias != nullptr) v += static_cast<acc_t>(bias[key[r] * O + o]);
    }
    out[perm[r] * O + o] = static_cast<scalar_t>(v);
  }
}

// The rows of an index_sorted result, after the grouped GEMM (one block per row, grid-stride; block-uniform
// branches): a row in its expert's group gets bias[e] added (when bias is given); a row without an expert
// (key E) at or after offsets[E] is zeroed; any other row breaks the order the caller promised and is set to NaN.
// Only rows that need a change are written, so without a bias the kernel reads T keys and little else.
template <typename scalar_t>
__global__ void finish_rows_kernel(scalar_t* __restrict__ out, int64_t ld,      // [T, O] (row stride ld)
                                   const scalar_t* __restrict__ bias,            // [E, O] or null
                                   const int64_t* __restrict__ key, const int64_t* __restrict__ offsets,
                                   int64_t T, int64_t O, int64_t E) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t r = blockIdx.x; r < T; r += gridDim.x) {
    const int64_t e = key[r];
    scalar_t* row = out + r * ld;
    if (e < E && offsets[e] <= r && r < offsets[e + 1]) {
      if (bias == nullptr) continue;
      for (int64_t o = threadIdx.x; o < O; o += blockDim.x)
        row[o] = static_cast<scalar_t>(static_cast<acc_t>(row[o]) + static_cast<acc_t>(bias[e * O + o]));
      continue;
    }
    const scalar_t fill = (e >= E && r >= offsets[E]) ? scalar_t(0) : scalar_t(NAN);
    for (int64_t o = threadIdx.x; o < O; o += blockDim.x) row[o] = fill;
  }
}

// dW [E, NK] of the _grouped_mm path: the slices of experts that received no row are zeroed (some torch
// versions' _grouped_mm leave them unwritten); with a `poison` flag set (an index_sorted call whose index broke
// the order) every slice is set to NaN. Blocks skip the experts with rows at once: no pass over the whole dW.
// Experts e = blockIdx.y, blockIdx.y + gridDim.y, ... (any E with gridDim.y ≤ 65535).
template <typename scalar_t>
__global__ void fix_weight_grad_kernel(scalar_t* __restrict__ dW, int64_t E, int64_t NK,
                                       const int64_t* __restrict__ offsets,  // [E + 1]
                                       const bool* __restrict__ poison) {
  const bool bad = poison != nullptr && *poison;
  const scalar_t fill = bad ? scalar_t(NAN) : scalar_t(0);
  for (int64_t e = blockIdx.y; e < E; e += gridDim.y) {
    if (!bad && offsets[e + 1] > offsets[e]) continue;
    scalar_t* slice = dW + e * NK;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < NK;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      slice[i] = fill;
  }
}

unsigned blocks_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(b, int64_t{1} << 20)));
}

void check_grid(int64_t T, int64_t tiles_o) {
  TORCH_CHECK((T + kBM - 1) / kBM <= INT_MAX && tiles_o <= 65535, "opforge::indexed_linear: expected at most ",
              num_str(int64_t{INT_MAX} * kBM), " tokens and ", num_str(int64_t{65535} * kBN),
              " output features on CUDA, but got T = ", num_str(T), " and ", num_str(tiles_o * kBN));
}

/// out [T, O] = rows GEMM over the sorted groups (see grouped_rows_kernel).
void grouped_rows(const at::Tensor& A, const at::Tensor& W, const at::Tensor& bias, const Sorted& s, at::Tensor& out,
                  int64_t O, int64_t Q, int64_t E, int64_t sBe, int64_t sBo, int64_t sBq) {
  const int64_t T = A.size(0);
  if (T == 0 || O == 0) return;
  const int64_t tiles_o = (O + kBN - 1) / kBN;
  check_grid(T, tiles_o);
  dim3 grid(static_cast<unsigned>((T + kBM - 1) / kBM), static_cast<unsigned>(tiles_o));
  OPFORGE_DISPATCH_FLOATING(A.scalar_type(), "indexed_linear_grouped", [&] {
    grouped_rows_kernel<scalar_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        A.const_data_ptr<scalar_t>(), W.const_data_ptr<scalar_t>(),
        bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr, perm_ptr(s), s.key.const_data_ptr<int64_t>(),
        s.offsets.const_data_ptr<int64_t>(), out.mutable_data_ptr<scalar_t>(), T, O, Q, E, sBe, sBo, sBq);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

/// out [T, O] from the sorted product Ys (see scatter_rows_kernel).
void scatter_rows(const at::Tensor& Ys, const at::Tensor& bias, const Sorted& s, at::Tensor& out, int64_t E) {
  const int64_t T = out.size(0), O = out.size(1);
  if (T == 0 || O == 0) return;
  OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "indexed_linear_scatter", [&] {
    scatter_rows_kernel<scalar_t><<<blocks_for(T * O, 256), 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        Ys.const_data_ptr<scalar_t>(), Ys.stride(0), bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
        s.perm.const_data_ptr<int64_t>(), s.key.const_data_ptr<int64_t>(), s.offsets.const_data_ptr<int64_t>(),
        out.mutable_data_ptr<scalar_t>(), T, O, E);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

/// Runs finish_rows_kernel over out [T, O] (row stride out.stride(0)); bias undefined for none.
void finish_rows(at::Tensor& out, const at::Tensor& bias, const Sorted& s, int64_t E) {
  const int64_t T = out.size(0), O = out.size(1);
  if (T == 0 || O == 0) return;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(T, sms * 32)));
  OPFORGE_DISPATCH_FLOATING(out.scalar_type(), "indexed_linear_finish", [&] {
    finish_rows_kernel<scalar_t><<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        out.mutable_data_ptr<scalar_t>(), out.stride(0), bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
        s.key.const_data_ptr<int64_t>(), s.offsets.const_data_ptr<int64_t>(), T, O, E);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

/// Whether an index_sorted index broke its promise, as a 0-d bool on the device (no host synchronisation): some
/// row with an expert lies outside that expert's group, or a row without one lies before offsets[E].
at::Tensor order_broken(const Sorted& s, int64_t E) {
  const int64_t T = s.key.size(0);
  const at::Tensor r = at::arange(T, s.key.options());
  const at::Tensor lo = s.offsets.index_select(0, s.key);
  const at::Tensor hi = s.offsets.index_select(0, (s.key + 1).clamp_max_(E));
  const at::Tensor with_expert = s.key.lt(E);
  const at::Tensor in_group = with_expert.logical_and(lo.le(r)).logical_and_(r.lt(hi));
  const at::Tensor tail = with_expert.logical_not().logical_and_(r.ge(s.offsets[E]));
  return in_group.logical_or_(tail).logical_not_().any();
}

/// fix_weight_grad_kernel over dW [E, N, K] (contiguous); poison undefined for none.
void fix_weight_grad(at::Tensor& dW, const Sorted& s, const at::Tensor& poison) {
  const int64_t E = dW.size(0), NK = dW.numel() / std::max<int64_t>(E, 1);
  if (E == 0 || NK == 0) return;
  const dim3 grid(std::min<unsigned>(blocks_for(NK, 256), 1024u),
                  static_cast<unsigned>(std::min<int64_t>(E, 65535)));
  OPFORGE_DISPATCH_FLOATING(dW.scalar_type(), "indexed_linear_fix_weight_grad", [&] {
    fix_weight_grad_kernel<scalar_t><<<grid, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
        dW.mutable_data_ptr<scalar_t>(), E, NK, s.offsets.const_data_ptr<int64_t>(),
        poison.defined() ? poison.const_data_ptr<bool>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

/// True when torch's _grouped_mm serves this problem: bfloat16, sm_90, rows 16-byte aligned, T < 2³¹ (its
/// offsets are int32), and the path is not forced to another kernel.
bool grouped_mm_eligible(const indexed_linear_op::IndexedLinearProblem& p, Path path) {
  if (path == Path::kGrouped || path == Path::kGemv) return false;
  if (p.X.scalar_type() != at::kBFloat16) return false;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  if (prop->major != 9) return false;
  return p.K % 8 == 0 && p.N % 8 == 0 && p.K > 0 && p.N > 0 && p.T < INT_MAX && p.E > 0;
}

bool use_gemv(const indexed_linear_op::IndexedLinearProblem& p, Path path) {
  if (path == Path::kGemv) return p.T <= INT_MAX;
  if (path != Path::kAuto) return false;
  return p.T <= kGemvMaxTokens;
}

at::Tensor indexed_linear_cuda(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                               const std::optional<at::Tensor>& bias, bool index_sorted) {
  const auto p = indexed_linear_op::check_indexed_linear("indexed_linear", input, weight, index, bias);
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor Y = at::empty({p.T, p.N}, input.options());
  if (p.T == 0 || p.N == 0) return Y;
  const Path path = forced_path();
  if (use_gemv(p, path)) {
    gemv_rows(p.X, p.W, p.b, p.index, Y, p.N, p.K, p.E);
    return Y;
  }
  const Sorted s = index_sorted ? given_order(p.index, p.E) : sort_tokens(p.index, p.E);
  if (grouped_mm_eligible(p, path) && index_sorted) {
    // the caller's rows in place: no gather, no scatter (_grouped_mm rejects an unaligned operand: an input at
    // an odd storage offset is copied, as the bank)
    const at::Tensor offs = s.offsets.narrow(0, 1, p.E).to(at::kInt);
    at::Tensor Ys =
        at::_grouped_mm(cuda::aligned16_or_copy(p.X), cuda::aligned16_or_copy(p.W).transpose(1, 2), offs);  // [T, N]
    finish_rows(Ys, p.b, s, p.E);
    return Ys.is_contiguous() ? Ys : Ys.contiguous();
  }
  if (grouped_mm_eligible(p, path)) {
    const at::Tensor offs = s.offsets.narrow(0, 1, p.E).to(at::kInt);  // group ends
    const at::Tensor Xs = p.X.index_select(0, s.perm);
    // _grouped_mm rejects an unaligned operand: the bank may be a view at an odd offset (copied then); the
    // gathered operands are fresh allocations
    const at::Tensor Ys = at::_grouped_mm(Xs, cuda::aligned16_or_copy(p.W).transpose(1, 2), offs);  // [T, N]
    scatter_rows(Ys, p.b, s, Y, p.E);
    return Y;
  }
  grouped_rows(p.X, p.W, p.b, s, Y, p.N, p.K, p.E, p.N * p.K, p.K, 1);
  if (index_sorted) finish_rows(Y, at::Tensor(), s, p.E);  // rows that break the order: NaN
  return Y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> indexed_linear_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype, bool index_sorted) {
  const auto p = indexed_linear_op::check_indexed_linear_backward(grad_output, input, weight, index, bias_dtype);
  c10::cuda::CUDAGuard guard(input.device());
  const auto dtype = input.scalar_type();
  const at::Tensor dY = to_input_dtype(grad_output, dtype).contiguous();  // [T, N]
  at::Tensor gi, gw, gb;
  if (!(output_mask[0] || output_mask[1] || output_mask[2])) return {gi, gw, gb};
  const Path path = forced_path();
  if (output_mask[0]) {
    gi = at::empty({p.T, p.K}, input.options());
    if (p.N == 0) gi.zero_();
  }
  const bool gemv = use_gemv(p, path);
  if (output_mask[0] && gemv) gather_gemv(dY, p.W, at::Tensor(), p.index, gi, p.K, p.N, p.E, p.N * p.K, 1, p.K);
  const bool need_sorted = (output_mask[0] && !gemv && p.N > 0) || output_mask[1] || output_mask[2];
  if (!need_sorted || p.E == 0) {
    // no expert (E = 0): every row is treated as −1, so the grouped path's input gradient is zero
    if (output_mask[0] && !gemv && p.E == 0) gi.zero_();
    if (output_mask[1]) gw = at::zeros(weight.sizes(), weight.options().memory_format(at::MemoryFormat::Contiguous));
    if (output_mask[2]) gb = at::zeros({p.E, p.N}, input.options().dtype(bias_dtype.value_or(dtype)));
    return {gi, gw, gb};
  }
  const Sorted s = index_sorted ? given_order(p.index, p.E) : sort_tokens(p.index, p.E);
  // an index_sorted index that broke the order poisons the weight gradients (the rows' own are NaN already)
  const at::Tensor poison =
      index_sorted && (output_mask[1] || output_mask[2]) ? order_broken(s, p.E) : at::Tensor();
  const bool gmm = grouped_mm_eligible(p, path) && !gemv;
  // _grouped_mm on the caller's rows (index_sorted) rejects an operand at an odd storage offset: copied then
  const at::Tensor dYg = gmm && index_sorted ? cuda::aligned16_or_copy(dY) : dY;
  const at::Tensor Xg = gmm && index_sorted && output_mask[1] ? cuda::aligned16_or_copy(p.X) : p.X;
  if (output_mask[0] && !gemv && p.N > 0) {
    if (gmm && index_sorted) {
      const at::Tensor offs = s.offsets.narrow(0, 1, p.E).to(at::kInt);
      at::Tensor dX = at::_grouped_mm(dYg, cuda::aligned16_or_copy(p.W), offs);  // [T, K], the rows in place
      finish_rows(dX, at::Tensor(), s, p.E);
      gi = dX.is_contiguous() ? dX : dX.contiguous();
    } else if (gmm) {
      const at::Tensor offs = s.offsets.narrow(0, 1, p.E).to(at::kInt);
      const at::Tensor dXs =
          at::_grouped_mm(dY.index_select(0, s.perm), cuda::aligned16_or_copy(p.W), offs);  // [T, K]
      scatter_rows(dXs, at::Tensor(), s, gi, p.E);
    } else {
      grouped_rows(dY, p.W, at::Tensor(), s, gi, p.K, p.N, p.E, p.N * p.K, 1, p.K);
      if (index_sorted) finish_rows(gi, at::Tensor(), s, p.E);
    }
  }
  at::Tensor dW, db;
  if (output_mask[1] && gmm && p.T > 0) {
    // dW[e] = dY_eᵀ · X_e through _grouped_mm's 2-D × 2-D form; experts without tokens zeroed after
    const at::Tensor offs = s.offsets.narrow(0, 1, p.E).to(at::kInt);
    if (index_sorted) {
      dW = at::_grouped_mm(dYg.t(), Xg, offs);  // [E, N, K]
    } else {
      dW = at::_grouped_mm(dY.index_select(0, s.perm).t(), p.X.index_select(0, s.perm), offs);
    }
    if (!dW.is_contiguous()) dW = dW.contiguous();
    fix_weight_grad(dW, s, poison);
  }
  const bool dw_kernel = output_mask[1] && !dW.defined();
  if (dw_kernel) dW = at::empty({p.E, p.N, p.K}, input.options());
  if (output_mask[2]) db = at::empty({p.E, p.N}, input.options().dtype(dtype == at::kDouble ? at::kDouble : at::kFloat));
  if ((dw_kernel || output_mask[2]) && p.N > 0) {
    const int64_t tiles_n = (p.N + kBN - 1) / kBN, tiles_k = std::max<int64_t>(1, (p.K + kBM - 1) / kBM);
    TORCH_CHECK(tiles_n <= INT_MAX && tiles_k <= 65535 && p.E <= 65535,
                "opforge::indexed_linear_backward: expected at most 65535 experts and ", num_str(int64_t{65535} * kBM),
                " in_features on CUDA, but got E = ", num_str(p.E), ", K = ", num_str(p.K));
    dim3 grid(static_cast<unsigned>(tiles_n), static_cast<unsigned>(dw_kernel ? tiles_k : 1),
              static_cast<unsigned>(p.E));
    OPFORGE_DISPATCH_FLOATING(dtype, "indexed_linear_weight_grad", [&] {
      grouped_weight_grad_kernel<scalar_t><<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          dY.const_data_ptr<scalar_t>(), p.X.const_data_ptr<scalar_t>(), perm_ptr(s),
          s.offsets.const_data_ptr<int64_t>(), dw_kernel ? dW.mutable_data_ptr<scalar_t>() : nullptr,
          output_mask[2] ? db.mutable_data_ptr<at::opmath_type<scalar_t>>() : nullptr, p.N, p.K);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (dw_kernel && poison.defined()) fix_weight_grad(dW, s, poison);  // empty experts are zero already
  if (output_mask[2] && poison.defined()) db.masked_fill_(poison, NAN);
  if (output_mask[1]) gw = dW.to(weight.scalar_type());
  if (output_mask[2]) gb = db.to(bias_dtype.value_or(dtype));
  return {gi, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("indexed_linear", &indexed_linear_cuda);
  m.impl("indexed_linear_backward", &indexed_linear_backward_cuda);
}

}  // namespace opforge
