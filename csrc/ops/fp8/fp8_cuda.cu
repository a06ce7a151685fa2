// CUDA kernels of quantize_fp8 (and the quantization inside fp8_linear), with fp8_math.h's scalar math, so CPU and
// CUDA give the same bits:
//   rowwise     one kernel, a block per row: amax of the row (16-byte loads, a block reduction), the row's scale,
//               then the saturated cast of the row (its second read hits L1/L2);
//   tensorwise  two kernels: a grid-stride amax into one device word (atomicMax), then the cast, each block
//               computing the scale from that word. No host synchronization.
// Xᵀ from X [R, C] (quantize_cols, quantize_both), with no high-precision transposed copy:
//   amax        rowwise, per column of X: a column-amax kernel (each block a band of rows of 32 column vectors,
//               16-byte loads along the rows, atomicMax into one word per column); tensorwise, the amax kernel;
//   cast        one cast-transpose kernel: each block casts a tile of 16·VEC rows x 64 columns of X (16-byte loads,
//               one per thread), packs each column's 4 consecutive FP8 bytes into a word of a shared-memory tile
//               holding the tile's transpose, then writes data_t's 64 rows of the tile with 16-byte stores;
//               quantize_both's variant also stores each row's bytes into data as it casts them.
// amax is reduced as the bit patterns of |x|: for non-negative IEEE values the unsigned order is the numeric order,
// and every NaN pattern is above inf's, so the integer max propagates NaN as the recipe asks.
// Tensorwise, an amax given by the caller (a [1] float32 tensor, float64 for float64 inputs: the same word as the
// amax pass's, read in place by the cast kernels) replaces the memset and the amax pass.
// The GEMMs: scaled_gemm_cuda (opforge's cuBLASLt engine, core/gemm.h gemm_fp8, where the test hook fp8_gemm sends
// tensorwise GEMMs) or at::_scaled_mm (fp8.cpp: scaled_gemm). Fusing this quantization into the producers' epilogues
// (rms_norm, swiglu, GEMM) removes the separate read of the high-precision tensor; the kernels here are the
// reference those fusions are checked against.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/amax_cuda.cuh"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "core/gemm.h"
#include "core/knobs.h"
#include "ops/fp8/fp8.h"
#include "ops/fp8/fp8_math.h"

namespace opforge {
namespace fp8_op {
namespace {

constexpr int kThreads = 256;

/// The amax word of scalar_t inputs (core/amax_cuda.cuh's AmaxBits: the unsigned integer of |x|'s bit pattern, as
/// the producers' amax holds it) and its value. value_of rounds the amax to scalar_t first: the identity for an amax
/// of scalar_t values (the amax pass's), and for a given amax of the higher-precision tensor that X was rounded from
/// (under autocast), the amax of X (rounding is monotone).
template <typename scalar_t>
struct AmaxTraits : cuda::AmaxBits<scalar_t> {
  using bits_t = typename cuda::AmaxBits<scalar_t>::bits_t;
  __device__ static double value_of(bits_t b) {
    return static_cast<double>(static_cast<float>(static_cast<scalar_t>(__uint_as_float(b))));
  }
};
template <>
struct AmaxTraits<double> : cuda::AmaxBits<double> {
  __device__ static double value_of(bits_t b) { return __longlong_as_double(static_cast<long long>(b)); }
};

/// The block's max of v (every thread gets it). smem: kThreads / 32 words.
template <typename bits_t>
__device__ __forceinline__ bits_t block_max(bits_t v, bits_t* smem) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = cuda::warp_max_bits(v);
  __syncthreads();  // the previous row's readers of smem are done
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = smem[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) v = smem[w] > v ? smem[w] : v;
  return v;
}

/// scale[i] = s and, when inv_scale is non-null, inv_scale[i] = 1 / s (IEEE division: the bits of
/// scale.reciprocal(), the dequantization scale the scaled GEMM reads).
__device__ __forceinline__ void store_scale(float* scale, float* inv_scale, int64_t i, float s) {
  scale[i] = s;
  if (inv_scale != nullptr) inv_scale[i] = 1.0f / s;
}

template <typename scalar_t, typename fp8_t, int VEC>
__device__ __forceinline__ void cast_vec(const scalar_t* __restrict__ x, fp8_t* __restrict__ y, float scale) {
  const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(x);
  cuda::Vec<fp8_t, VEC> out;
#pragma unroll
  for (int j = 0; j < VEC; ++j) out.val[j] = fp8::saturate_cast<fp8_t>(static_cast<float>(in.val[j]), scale);
  *reinterpret_cast<cuda::Vec<fp8_t, VEC>*>(y) = out;
}

/// Rowwise: block b handles rows b, b + gridDim.x, ... of X [R, C]; VEC elements per access (C % VEC == 0).
template <typename scalar_t, typename fp8_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    quantize_rowwise_kernel(const scalar_t* __restrict__ X, fp8_t* __restrict__ Y, float* __restrict__ scale,
                            float* __restrict__ inv_scale, int64_t R, int64_t C) {
  using T = AmaxTraits<scalar_t>;
  using bits_t = typename T::bits_t;
  __shared__ bits_t smem[kThreads / 32];
  const int64_t nvec = C / VEC;
  for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {  // uniform per block: barriers are safe
    const scalar_t* x = X + r * C;  // 64-bit offsets
    fp8_t* y = Y + r * C;
    bits_t m = 0;
    for (int64_t v = threadIdx.x; v < nvec; v += kThreads) {
      const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(x + v * VEC);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const bits_t b = T::bits_of_abs(in.val[j]);
        m = b > m ? b : m;
      }
    }
    m = block_max(m, smem);
    const float s = fp8::scale_of(T::value_of(m), fp8::max_of<fp8_t>());
    if (threadIdx.x == 0) store_scale(scale, inv_scale, r, s);
    for (int64_t v = threadIdx.x; v < nvec; v += kThreads) cast_vec<scalar_t, fp8_t, VEC>(x + v * VEC, y + v * VEC, s);
  }
}

/// Tensorwise, pass 1: atomicMax of |x|'s bit patterns over X [n] into *amax (zeroed by zeroed_amax).
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const scalar_t* __restrict__ X, int64_t n, typename AmaxTraits<scalar_t>::bits_t* __restrict__ amax) {
  using T = AmaxTraits<scalar_t>;
  using bits_t = typename T::bits_t;
  __shared__ bits_t smem[kThreads / 32];
  bits_t m = 0;
  const int64_t nvec = n / VEC, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < nvec; v += stride) {
    const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(X + v * VEC);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const bits_t b = T::bits_of_abs(in.val[j]);
      m = b > m ? b : m;
    }
  }
  for (int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const bits_t b = T::bits_of_abs(X[i]);  // the tail after the last full vector
    m = b > m ? b : m;
  }
  m = block_max(m, smem);
  if (threadIdx.x == 0) atomicMax(amax, m);
}

/// Tensorwise, pass 2: the scale from *amax (each block computes it; block 0 stores it and its inverse), then the
/// cast.
template <typename scalar_t, typename fp8_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    cast_tensorwise_kernel(const scalar_t* __restrict__ X, fp8_t* __restrict__ Y, int64_t n,
                           const typename AmaxTraits<scalar_t>::bits_t* __restrict__ amax, float* __restrict__ scale,
                           float* __restrict__ inv_scale) {
  using T = AmaxTraits<scalar_t>;
  const float s = fp8::scale_of(T::value_of(*amax), fp8::max_of<fp8_t>());
  if (blockIdx.x == 0 && threadIdx.x == 0) store_scale(scale, inv_scale, 0, s);
  const int64_t nvec = n / VEC, stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; v < nvec; v += stride) {
    cast_vec<scalar_t, fp8_t, VEC>(X + v * VEC, Y + v * VEC, s);
  }
  for (int64_t i = nvec * VEC + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    Y[i] = fp8::saturate_cast<fp8_t>(static_cast<float>(X[i]), s);
  }
}

/// A buffer of `words` amax words of bits_t on X's device, zeroed on the current stream by a memset (no kernel
/// launch: the quantizers are on the host-bound path of small FP8 GEMMs).
template <typename bits_t>
at::Tensor zeroed_amax(const at::Tensor& X, int64_t words) {
  const int64_t bytes = words * static_cast<int64_t>(sizeof(bits_t));
  at::Tensor amax = at::empty({bytes}, X.options().dtype(at::kByte));
  C10_CUDA_CHECK(cudaMemsetAsync(amax.mutable_data_ptr(), 0, static_cast<size_t>(bytes),
                                 at::cuda::getCurrentCUDAStream()));
  return amax;
}

/// Tensorwise pass 1 on the current stream: atomicMax of |x|'s bit patterns over X [n] into *amax (zeroed).
template <typename scalar_t, int VEC>
void launch_amax(const scalar_t* x, int64_t n, typename AmaxTraits<scalar_t>::bits_t* amax) {
  const int64_t blocks = cuda::grid_for((n + VEC - 1) / VEC, kThreads);
  amax_kernel<scalar_t, VEC><<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x, n, amax);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// The amax word of a tensorwise quantization of X: `given`'s (a caller's amax, read in place by the cast kernels),
/// else a word zeroed by a memset that the amax pass fills on the current stream (`buffer` holds it).
template <typename scalar_t>
const typename AmaxTraits<scalar_t>::bits_t* tensorwise_amax(const at::Tensor& X, const at::Tensor& given,
                                                             at::Tensor& buffer) {
  using bits_t = typename AmaxTraits<scalar_t>::bits_t;
  if (given.defined()) {
    TORCH_INTERNAL_ASSERT(given.numel() == 1 && given.element_size() == sizeof(bits_t) &&
                          given.device() == X.device());
    return static_cast<const bits_t*>(given.const_data_ptr());
  }
  buffer = zeroed_amax<bits_t>(X, 1);
  bits_t* a = reinterpret_cast<bits_t*>(buffer.mutable_data_ptr());
  const scalar_t* x = X.const_data_ptr<scalar_t>();
  if (cuda::is_aligned16(x)) {
    launch_amax<scalar_t, cuda::vec_size<scalar_t>()>(x, X.numel(), a);
  } else {
    launch_amax<scalar_t, 1>(x, X.numel(), a);
  }
  return a;
}

template <typename scalar_t, typename fp8_t, int VEC>
void launch(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, float* inv, bool rowwise,
            const at::Tensor& given_amax) {
  const int64_t R = X.size(0), C = X.size(1), n = R * C;
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* x = X.const_data_ptr<scalar_t>();
  fp8_t* y = reinterpret_cast<fp8_t*>(data.mutable_data_ptr());
  float* s = scale.mutable_data_ptr<float>();
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rowwise) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(R, sms * 16));
    quantize_rowwise_kernel<scalar_t, fp8_t, VEC>
        <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, y, s, inv, R, C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  at::Tensor buffer;
  const auto* a = tensorwise_amax<scalar_t>(X, given_amax, buffer);
  const int64_t blocks = cuda::grid_for((n + VEC - 1) / VEC, kThreads);
  cast_tensorwise_kernel<scalar_t, fp8_t, VEC>
      <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, y, n, a, s, inv);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename fp8_t>
void launch_vec(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, float* inv, bool rowwise,
                const at::Tensor& amax) {
  constexpr int kVec = cuda::vec_size<scalar_t>();
  // rows start on a vector boundary when C % VEC == 0 (rowwise); the flat tensorwise loop has a scalar tail
  const bool vectorized = cuda::is_aligned16(X.const_data_ptr()) && (!rowwise || X.size(1) % kVec == 0);
  if (vectorized) {
    launch<scalar_t, fp8_t, kVec>(X, data, scale, inv, rowwise, amax);
  } else {
    launch<scalar_t, fp8_t, 1>(X, data, scale, inv, rowwise, amax);
  }
}

// ---- Xᵀ from X [R, C]: the column amax and the cast-transpose -------------------------------------------------

/// Warps of a kThreads block.
constexpr int kWarps = kThreads / 32;

/// Rowwise pass 1 of Xᵀ: the amax of each column of X [R, C] (C % VEC == 0) as |x|'s bit patterns, atomicMax'ed into
/// amax[C] (zeroed by zeroed_amax). Block (bx, by) covers the 32·VEC columns from bx·32·VEC over the rows
/// [by·rows_per_band, (by + 1)·rows_per_band): lane l of warp w reads the VEC columns at l·VEC of rows w, w + 8, ...
/// (a warp reads 32 consecutive 16-byte vectors of one row); the 8 warps' maxima meet in shared memory.
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads)
    column_amax_kernel(const scalar_t* __restrict__ X, int64_t R, int64_t C, int64_t rows_per_band,
                       typename AmaxTraits<scalar_t>::bits_t* __restrict__ amax) {
  using T = AmaxTraits<scalar_t>;
  using bits_t = typename T::bits_t;
  constexpr int kCols = 32 * VEC;
  __shared__ bits_t part[kWarps][VEC][32];  // [warp][j][lane]: the warp's max of column lane·VEC + j
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kCols + lane * VEC;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_band;
  const int64_t r_end = r_begin + rows_per_band < R ? r_begin + rows_per_band : R;
  bits_t m[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) m[j] = 0;
  if (c < C) {  // the vector lies wholly inside the row (C % VEC == 0)
#pragma unroll 4
    for (int64_t r = r_begin + warp; r < r_end; r += kWarps) {  // unrolled: 4 loads in flight a thread
      const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(X + r * C + c);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const bits_t b = T::bits_of_abs(in.val[j]);
        m[j] = b > m[j] ? b : m[j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) part[warp][j][lane] = m[j];
  __syncthreads();
  for (int i = threadIdx.x; i < kCols; i += kThreads) {
    const int l = i / VEC, j = i % VEC;
    bits_t v = part[0][j][l];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) v = part[w][j][l] > v ? part[w][j][l] : v;
    const int64_t col = static_cast<int64_t>(blockIdx.x) * kCols + i;
    if (col < C && v != 0) atomicMax(amax + col, v);
  }
}

/// Columns of X in one cast-transpose tile (rows of data_t).
constexpr int kTileCols = 64;

/// Rows of X in one cast-transpose tile: each of the kThreads threads casts a block of 4 rows x VEC columns, so
/// 16·VEC rows (128 for 16-bit inputs, 64 for float32, 32 for float64, 16 unvectorized).
template <int VEC>
constexpr int tile_rows() {
  return 4 * kThreads * VEC / kTileCols;
}

/// Pass 2 of Xᵀ: data_t [C, R] = cast(Xᵀ) from X [R, C] (C % VEC == 0), with the scale of each column of X
/// (kRowwise: from amax[C], computed once per tile into shared memory and stored into scale[C] by the blocks of
/// the first row tile) or of the tensor (from amax[0], stored into scale[0] by block 0); kStraight (tensorwise) also writes data [R, C] = cast(X), the same
/// bytes. Block b casts the tile of rows [r0, r0 + 16·VEC) and columns [c0, c0 + 64) of X, b = (r0 / (16·VEC)) ·
/// col_tiles + c0 / 64. Thread t casts rows r0 + 4q .. r0 + 4q + 3 (q = t / (64 / VEC)) of the VEC columns from
/// c0 + (t % (64 / VEC))·VEC (16-byte loads along X's rows), and packs each column's 4 FP8 bytes into one word of
/// the tile's transpose in shared memory; the block then writes data_t's 64 rows of the tile in 16-byte stores
/// (byte stores in a tile cut by R's end, or when R % 16 != 0).
template <typename scalar_t, typename fp8_t, int VEC, bool kRowwise, bool kStraight>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_kernel(const scalar_t* __restrict__ X, fp8_t* __restrict__ Yt, fp8_t* __restrict__ Y, int64_t R,
                          int64_t C, int64_t col_tiles, const typename AmaxTraits<scalar_t>::bits_t* __restrict__ amax,
                          float* __restrict__ scale, float* __restrict__ inv_scale) {
  using T = AmaxTraits<scalar_t>;
  constexpr float hi = fp8::max_of<fp8_t>();
  constexpr int kRows = tile_rows<VEC>(), kVecs = kTileCols / VEC, kWords = kRows / 4, kPieces = kRows / 16;
  static_assert(kThreads * VEC == kTileCols * kWords, "one 4 x VEC block of the tile per thread");
  // tile_t[c][q]: X's bytes at column c0 + c of rows r0 + 4q + k in byte k, i.e. data_t's row c0 + c, columns
  // r0 + 4q .. r0 + 4q + 3; the padding word makes the row stride odd (fewer bank conflicts)
  __shared__ uint32_t tile_t[kTileCols][kWords + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) / col_tiles * kRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) % col_tiles * kTileCols;
  // the scales of the tile's columns (rowwise) or of the tensor, by fp8_math.h's scale_of as the row kernels
  __shared__ float tile_scale[kRowwise ? kTileCols : 1];
  const float s_tensor = kRowwise ? 0.0f : fp8::scale_of(T::value_of(amax[0]), hi);
  if constexpr (kRowwise) {
    if (threadIdx.x < kTileCols) {
      const int64_t col = c0 + threadIdx.x;
      const float s = col < C ? fp8::scale_of(T::value_of(amax[col]), hi) : 0.0f;
      tile_scale[threadIdx.x] = s;
      if (r0 == 0 && col < C) store_scale(scale, inv_scale, col, s);
    }
    __syncthreads();
  } else if (blockIdx.x == 0 && threadIdx.x == 0) {
    store_scale(scale, inv_scale, 0, s_tensor);
  }

  const int q = threadIdx.x / kVecs, cv = (threadIdx.x % kVecs) * VEC;
  const int64_t c = c0 + cv;
  uint32_t word[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) word[j] = 0;
  if (c < C) {  // the vector lies wholly inside the row (C % VEC == 0)
    float s[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[j] = kRowwise ? tile_scale[cv + j] : s_tensor;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t r = r0 + 4 * q + k;
      if (r < R) {
        const cuda::Vec<scalar_t, VEC> in = *reinterpret_cast<const cuda::Vec<scalar_t, VEC>*>(X + r * C + c);
        cuda::Vec<fp8_t, VEC> out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          out.val[j] = fp8::saturate_cast<fp8_t>(static_cast<float>(in.val[j]), s[j]);
          word[j] |= static_cast<uint32_t>(out.val[j].x) << (8 * k);
        }
        if constexpr (kStraight) *reinterpret_cast<cuda::Vec<fp8_t, VEC>*>(Y + r * C + c) = out;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) tile_t[cv + j][q] = word[j];
  __syncthreads();

  // data_t's rows c0 .. c0 + 63 of the tile: kRows bytes each, in kPieces pieces of 16 bytes (4 words)
  const bool full = r0 + kRows <= R && R % 16 == 0;  // every piece 16-byte aligned and inside the row
  for (int i = threadIdx.x; i < kTileCols * kPieces; i += kThreads) {
    const int cc = i / kPieces, p = i % kPieces;
    if (c0 + cc >= C) continue;
    const uint32_t* w = &tile_t[cc][4 * p];
    const int64_t r = r0 + 16 * p;  // data_t's first column of the piece
    fp8_t* out = Yt + (c0 + cc) * R + r;
    if (full) {
      *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      for (int b = 0; b < 16 && r + b < R; ++b) {
        out[b] = fp8_t(static_cast<uint8_t>(w[b / 4] >> (8 * (b % 4))), fp8_t::from_bits());
      }
    }
  }
}

/// Xᵀ's quantization on the current stream (quantize_cols; quantize_both when y, X's own data, is non-null,
/// tensorwise): the amax pass (per column rowwise, of the tensor else, where `given_amax` is undefined) into a zeroed
/// buffer of words, then the cast-transpose. X [R, C] non-empty, C % VEC == 0 and X 16-byte aligned when VEC > 1.
template <typename scalar_t, typename fp8_t, int VEC>
void launch_transposed(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, float* inv, bool rowwise,
                       fp8_t* y, const at::Tensor& given_amax) {
  using bits_t = typename AmaxTraits<scalar_t>::bits_t;
  const int64_t R = X.size(0), C = X.size(1);
  auto stream = at::cuda::getCurrentCUDAStream();
  const scalar_t* x = X.const_data_ptr<scalar_t>();
  fp8_t* yt = reinterpret_cast<fp8_t*>(data_t.mutable_data_ptr());
  float* s = scale.mutable_data_ptr<float>();
  at::Tensor buffer;
  const bits_t* a = nullptr;
  if (rowwise) {
    buffer = zeroed_amax<bits_t>(X, C);
    bits_t* col_amax = reinterpret_cast<bits_t*>(buffer.mutable_data_ptr());
    a = col_amax;
    // bands of at least 64 rows (few atomics), enough blocks to fill the device several times over
    const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const int64_t col_blocks = (C + 32 * VEC - 1) / (32 * VEC);
    const int64_t bands = std::max<int64_t>(
        1, std::min<int64_t>({sms * 8 / col_blocks, (R + 63) / 64, int64_t{65535}}));
    const int64_t rows_per_band = (R + bands - 1) / bands;
    TORCH_CHECK(col_blocks <= std::numeric_limits<int32_t>::max(), "opforge::fp8_linear_backward: ", C,
                " columns exceed one grid");
    column_amax_kernel<scalar_t, VEC>
        <<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>((R + rows_per_band - 1) / rows_per_band)),
           kThreads, 0, stream>>>(x, R, C, rows_per_band, col_amax);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    a = tensorwise_amax<scalar_t>(X, given_amax, buffer);
  }
  const int64_t col_tiles = (C + kTileCols - 1) / kTileCols;
  const int64_t tiles = col_tiles * ((R + tile_rows<VEC>() - 1) / tile_rows<VEC>());
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "opforge::fp8_linear_backward: a ", R, " x ", C,
              " operand exceeds one grid of transposition tiles");
  const auto grid = static_cast<unsigned>(tiles);
  if (rowwise) {
    cast_transpose_kernel<scalar_t, fp8_t, VEC, true, false>
        <<<grid, kThreads, 0, stream>>>(x, yt, nullptr, R, C, col_tiles, a, s, inv);
  } else if (y != nullptr) {
    cast_transpose_kernel<scalar_t, fp8_t, VEC, false, true>
        <<<grid, kThreads, 0, stream>>>(x, yt, y, R, C, col_tiles, a, s, inv);
  } else {
    cast_transpose_kernel<scalar_t, fp8_t, VEC, false, false>
        <<<grid, kThreads, 0, stream>>>(x, yt, nullptr, R, C, col_tiles, a, s, inv);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

/// launch_transposed with 16-byte accesses when X is aligned and its rows start on vector boundaries.
template <typename scalar_t, typename fp8_t>
void launch_transposed_vec(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, float* inv, bool rowwise,
                           fp8_t* y, const at::Tensor& amax) {
  constexpr int kVec = cuda::vec_size<scalar_t>();
  if (cuda::is_aligned16(X.const_data_ptr()) && X.size(1) % kVec == 0) {
    launch_transposed<scalar_t, fp8_t, kVec>(X, data_t, scale, inv, rowwise, y, amax);
  } else {
    launch_transposed<scalar_t, fp8_t, 1>(X, data_t, scale, inv, rowwise, y, amax);
  }
}

/// Fills scale with the scale of an empty group (amax 0: the floor's), for the FP8 dtype `fp8`, and inv_scale (when
/// defined) with its inverse.
void fill_empty_scale(at::ScalarType fp8, at::Tensor& scale, at::Tensor& inv_scale) {
  const float s = fp8 == at::kFloat8_e4m3fn ? fp8::scale_of(0.0, fp8::max_of<c10::Float8_e4m3fn>())
                                            : fp8::scale_of(0.0, fp8::max_of<c10::Float8_e5m2>());
  if (scale.numel() == 0) return;
  scale.fill_(s);
  if (inv_scale.defined()) inv_scale.fill_(1.0f / s);
}

/// inv_scale's data, or null when it is undefined (the kernels then write the scales alone).
float* inverse_ptr(at::Tensor& inv_scale) {
  return inv_scale.defined() ? inv_scale.mutable_data_ptr<float>() : nullptr;
}

}  // namespace

void quantize_rows_cuda(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, at::Tensor& inv_scale,
                        bool rowwise, const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data.is_contiguous() && !(rowwise && amax.defined()));
  const c10::cuda::CUDAGuard device_guard(X.device());
  if (X.numel() == 0) {  // empty groups: amax 0, the floor's scale (as the CPU kernel)
    fill_empty_scale(data.scalar_type(), scale, inv_scale);
    return;
  }
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      launch_vec<scalar_t, c10::Float8_e4m3fn>(X, data, scale, inverse_ptr(inv_scale), rowwise, amax);
    } else {
      launch_vec<scalar_t, c10::Float8_e5m2>(X, data, scale, inverse_ptr(inv_scale), rowwise, amax);
    }
  });
}

void quantize_cols_cuda(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, at::Tensor& inv_scale,
                        bool rowwise, const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data_t.is_contiguous() && !(rowwise && amax.defined()));
  const c10::cuda::CUDAGuard device_guard(X.device());
  if (X.numel() == 0) {
    fill_empty_scale(data_t.scalar_type(), scale, inv_scale);
    return;
  }
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data_t.scalar_type() == at::kFloat8_e4m3fn) {
      launch_transposed_vec<scalar_t, c10::Float8_e4m3fn>(X, data_t, scale, inverse_ptr(inv_scale), rowwise, nullptr,
                                                          amax);
    } else {
      launch_transposed_vec<scalar_t, c10::Float8_e5m2>(X, data_t, scale, inverse_ptr(inv_scale), rowwise, nullptr,
                                                        amax);
    }
  });
}

void quantize_both_cuda(const at::Tensor& X, at::Tensor& data, at::Tensor& data_t, at::Tensor& scale,
                        at::Tensor& inv_scale, const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data.is_contiguous() && data_t.is_contiguous());
  const c10::cuda::CUDAGuard device_guard(X.device());
  if (X.numel() == 0) {
    fill_empty_scale(data.scalar_type(), scale, inv_scale);
    return;
  }
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      using fp8_t = c10::Float8_e4m3fn;
      launch_transposed_vec<scalar_t, fp8_t>(X, data_t, scale, inverse_ptr(inv_scale), false,
                                             reinterpret_cast<fp8_t*>(data.mutable_data_ptr()), amax);
    } else {
      using fp8_t = c10::Float8_e5m2;
      launch_transposed_vec<scalar_t, fp8_t>(X, data_t, scale, inverse_ptr(inv_scale), false,
                                             reinterpret_cast<fp8_t*>(data.mutable_data_ptr()), amax);
    }
  });
}

namespace {

/// What runs the tensorwise scaled GEMMs when the test hook fp8_gemm is -1 (its default): false at::_scaled_mm, true
/// opforge's cuBLASLt engine (gemm::gemm_fp8). Not yet measured against at::_scaled_mm on the H200: at::_scaled_mm.
constexpr bool kFp8GemmEngine = false;

}  // namespace

at::Tensor scaled_gemm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& inv_a,
                            const at::Tensor& inv_b, at::ScalarType out_dtype, bool fast_accum) {
  const int64_t mode = knobs::get(knobs::Knob::kFp8Gemm);
  if (mode == 0 || (mode < 0 && !kFp8GemmEngine)) return at::Tensor();
  const c10::cuda::CUDAGuard device_guard(a.device());
  at::Tensor out = at::empty({a.size(0), b.size(0)}, a.options().dtype(out_dtype));
  // the scales as cuBLASLt reads them: one float from a 16-byte boundary (a slice's scale may sit at an offset)
  const bool ran = gemm::gemm_fp8(out, a, b, cuda::aligned16_or_copy(inv_a.reshape({1})),
                                  cuda::aligned16_or_copy(inv_b.reshape({1})), fast_accum);
  TORCH_CHECK(ran || mode < 2, "opforge::fp8_linear: cuBLASLt declined the FP8 GEMM of [", a.size(0), ", ", a.size(1),
              "] x [", b.size(0), ", ", b.size(1), "]ᵀ (", a.scalar_type(), " x ", b.scalar_type(), " -> ", out_dtype,
              "; test hook fp8_gemm = 2)");
  return ran ? out : at::Tensor();
}

namespace {

constexpr int kTransposeTile = 64;  // a block transposes a 64 x 64 tile of bytes
/// The transpose kernel without the test hook fp8_transpose: the 4 x 4 block kernel once the H100/H200 has run its
/// tests (test_fp8_cache.py's transposed-view cases with the hook at 1, the sanitizer driver); the byte kernel until
/// then.
constexpr bool kFp8Transpose4x4 = false;

/// Y [C, R] = Xᵀ of bytes X [R, C]: each block stages a 64 x 64 tile in shared memory, read along X's rows and
/// written along Y's (both coalesced); the tile's row stride of 68 bytes (17 words) spreads the column reads over
/// the banks.
__global__ void __launch_bounds__(kThreads) transpose_bytes_kernel(const uint8_t* __restrict__ X,
                                                                   uint8_t* __restrict__ Y, int64_t R, int64_t C,
                                                                   int64_t col_tiles) {
  constexpr int kT = kTransposeTile, kStep = kThreads / kT;
  __shared__ uint8_t tile[kT][kT + 4];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) / col_tiles * kT;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) % col_tiles * kT;
  const int tx = threadIdx.x % kT, ty = threadIdx.x / kT;
  for (int i = ty; i < kT; i += kStep) {
    const int64_t r = r0 + i, c = c0 + tx;
    if (r < R && c < C) tile[i][tx] = X[r * C + c];
  }
  __syncthreads();
  for (int i = ty; i < kT; i += kStep) {
    const int64_t c = c0 + i, r = r0 + tx;  // Y's row c, column r
    if (c < C && r < R) Y[c * R + r] = tile[tx][i];
  }
}

/// The 4 x 4 byte block of rows a[0..3] (4 bytes each, column j in byte j) transposed: b[k] holds column k's bytes of
/// rows 0..3, row q in byte q.
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&a)[4], uint32_t (&b)[4]) {
  // __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x
  const uint32_t lo01 = __byte_perm(a[0], a[1], 0x5140), hi01 = __byte_perm(a[0], a[1], 0x7362);
  const uint32_t lo23 = __byte_perm(a[2], a[3], 0x5140), hi23 = __byte_perm(a[2], a[3], 0x7362);
  b[0] = __byte_perm(lo01, lo23, 0x5410);
  b[1] = __byte_perm(lo01, lo23, 0x7632);
  b[2] = __byte_perm(hi01, hi23, 0x5410);
  b[3] = __byte_perm(hi01, hi23, 0x7632);
}

/// transpose_bytes_kernel for R and C multiples of 16 with X and Y 16-byte aligned (the GEMM operands' usual shapes):
/// thread t loads the 4 x 4 byte block at rows r0 + 4·(t / 16), columns c0 + 4·(t % 16) of the 64 x 64 tile as four
/// 4-byte words (a warp reads two 64-byte row segments per word), transposes it in registers and stores its four
/// columns as words of the transposed tile in shared memory (row stride 17 words); then thread t writes 16 bytes of
/// Y's row c0 + t / 4 (columns r0 + 16·(t % 4) ..) with one 16-byte store: a quarter of the byte kernel's memory
/// instructions. Tiles cut by R or C keep their whole 16-row / 4-column groups (R % 16 == C % 16 == 0).
__global__ void __launch_bounds__(kThreads) transpose_bytes_4x4_kernel(const uint8_t* __restrict__ X,
                                                                       uint8_t* __restrict__ Y, int64_t R, int64_t C,
                                                                       int64_t col_tiles) {
  constexpr int kT = kTransposeTile, kWords = kT / 4;
  static_assert(kThreads == kWords * kWords && kThreads == kT * 4, "one 4 x 4 block and one 16-byte store a thread");
  __shared__ uint32_t tile_t[kT][kWords + 1];  // tile_t[c][w]: X's column c0 + c at rows r0 + 4w .. r0 + 4w + 3
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) / col_tiles * kT;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) % col_tiles * kT;
  const int br = threadIdx.x / kWords, bc = threadIdx.x % kWords;
  const int64_t r = r0 + 4 * br, c = c0 + 4 * bc;
  uint32_t a[4] = {0u, 0u, 0u, 0u}, b[4];
  if (r < R && c < C) {  // rows r .. r + 3 and columns c .. c + 3 all inside (R % 4 == C % 4 == 0)
#pragma unroll
    for (int q = 0; q < 4; ++q) a[q] = *reinterpret_cast<const uint32_t*>(X + (r + q) * C + c);
  }
  transpose_4x4_bytes(a, b);
#pragma unroll
  for (int k = 0; k < 4; ++k) tile_t[4 * bc + k][br] = b[k];
  __syncthreads();
  const int k = threadIdx.x / 4, j = threadIdx.x % 4;
  const int64_t yc = c0 + k, yr = r0 + 16 * j;  // Y's row yc, bytes yr .. yr + 15 (inside: R % 16 == 0)
  if (yc < C && yr < R) {
    const uint4 v{tile_t[k][4 * j], tile_t[k][4 * j + 1], tile_t[k][4 * j + 2], tile_t[k][4 * j + 3]};
    *reinterpret_cast<uint4*>(Y + yc * R + yr) = v;
  }
}

}  // namespace

at::Tensor transpose_fp8_cuda(const at::Tensor& X) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && X.element_size() == 1);
  const c10::cuda::CUDAGuard device_guard(X.device());
  const int64_t R = X.size(0), C = X.size(1);
  at::Tensor Y = at::empty({C, R}, X.options());
  if (X.numel() == 0) return Y;
  const int64_t col_tiles = (C + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles = col_tiles * ((R + kTransposeTile - 1) / kTransposeTile);
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), "opforge::fp8_linear: a ", R, " x ", C,
              " FP8 operand exceeds one grid of transposition tiles");
  const auto* x = static_cast<const uint8_t*>(X.const_data_ptr());
  auto* y = static_cast<uint8_t*>(Y.mutable_data_ptr());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t mode = knobs::get(knobs::Knob::kFp8Transpose);
  const bool blocks4 = mode == 1 || (mode == -1 && kFp8Transpose4x4);
  if (blocks4 && R % 16 == 0 && C % 16 == 0 && cuda::is_aligned16(x) && cuda::is_aligned16(y)) {
    transpose_bytes_4x4_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(x, y, R, C, col_tiles);
  } else {
    transpose_bytes_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(x, y, R, C, col_tiles);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return Y;
}

/// The CUDA kernels.
constexpr Backend kCudaBackend{&quantize_rows_cuda, &quantize_cols_cuda, &quantize_both_cuda, &scaled_gemm_cuda,
                               &transpose_fp8_cuda};

}  // namespace fp8_op

TORCH_LIBRARY_IMPL(opforge, CUDA, m) { fp8_op::Kernels<fp8_op::kCudaBackend>::register_for(m); }

}  // namespace opforge
