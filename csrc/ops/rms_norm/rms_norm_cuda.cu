// CUDA kernels of the RMSNorm ops.
//
// Mapping: a row of N elements is handled by a group of TPR threads (TPR = blockDim.x, a multiple of
// 32): one warp per row for short rows (blockDim = (32, 4): 4 rows per block, warp-shuffle sums), one
// block per row for long rows (blockDim = (TPR, 1), TPR up to 512 (forward of 4-byte types: 1024),
// warp shuffles + shared memory, one barrier per row). TPR is chosen from N so that each thread owns
// at most MAXV = 2 vectors of the row, which it keeps in registers between the sum-of-squares pass and
// the scaling pass: x is read from memory once. Where measured faster, the next row's vectors are
// loaded before the current row's reduction (PIPE), keeping loads in flight across the barrier.
// Rows longer than 2 · TPR vectors take the streaming variant (MAXV = 0), which re-reads the row
// (from L2). Blocks loop over rows (grid-stride), so neither M nor N meets a grid or shared-memory
// ceiling; row offsets are 64-bit.
//
// Vector width: 16-byte accesses (VEC = 8 for float16/bfloat16, 4 for float32, 2 for float64) when
// every base pointer is 16-byte aligned and N % VEC == 0 (then every row is aligned); otherwise the
// same kernels run with VEC = 1 (any N, any alignment, still coalesced and register-cached).
//
// Backward: one pass computes dX and, per row group, a dweight partial row in fp32 registers over the
// rows the group visits; partials [G, N] (G = number of groups, from the caching allocator) are summed
// over G by at::sum in a second, small step.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <climits>
#include <type_traits>

#include "core/amax_cuda.cuh"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "core/knobs.h"
#include "core/row_cuda.cuh"
#include "ops/rms_norm/rms_norm.h"

namespace opforge {
namespace {

using cuda::RowMapping;
using cuda::RowSum;
using cuda::Vec;
using cuda::num_sms;

// MAXV of the register-cached kernels: vectors a thread keeps in registers (2 rather than 4: fewer registers, more
// resident blocks; 4 measured slower on 13 of 15 bf16 shapes on the H200)
constexpr int kMaxVecsPerThread = 2;
constexpr int kWarpRows = 4;          // rows per block in the warp-per-row mapping
constexpr int kMaxThreads = 512;      // backward: threads per row at most (launch bound: up to 128 registers)
constexpr int kMaxThreadsFwd = 1024;  // forward: threads per row at most (launch bound: up to 64 registers)

// Forward. Per row:  (FUSED: z = x + r, rounded to T and stored; x := z)
//   rstd = 1 / sqrt(Σ x² / N + eps);  y = x · rstd · w
// MAXV > 0: the thread's vectors v = tid + k·TPR (k < MAXV) stay in registers; with PIPE the next
// row's vectors are loaded before this row's reduction and stores, so loads stay in flight across the
// barrier. MAXV == 0: streaming.
// AMAX (the *_amax ops): each thread also folds the y it stores into a running max, and each warp atomicMax'es its max
// into *amax at the end (core/amax_cuda.cuh); without AMAX the kernel is the one the plain ops run.
template <typename T, int VEC, int MAXV, bool FUSED, bool PIPE, bool AMAX>
__global__ void __launch_bounds__(kMaxThreadsFwd)
    rms_norm_forward_kernel(const T* __restrict__ X,      // [M, N]
                            const T* __restrict__ R,      // [M, N] (FUSED)
                            const T* __restrict__ W,      // [N] or null
                            T* __restrict__ Y,            // [M, N]
                            T* __restrict__ Z,            // [M, N] (FUSED)
                            at::opmath_type<T>* __restrict__ rstd,  // [M]
                            int64_t M, int64_t N, at::opmath_type<T> eps,
                            typename cuda::AmaxBits<T>::bits_t* __restrict__ amax) {  // [1] (AMAX)
  using opmath_t = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  typename cuda::AmaxBits<T>::bits_t ymax = 0;
  __shared__ opmath_t smem[2][32];
  RowSum<opmath_t> row_sum{smem};
  const int tid = threadIdx.x, tpr = blockDim.x;
  const int64_t nvec = N / VEC;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const V* Wv = reinterpret_cast<const V*>(W);

  // x (or z) of vector v of the row at `base`, with z = x + r stored on the way when FUSED
  auto load = [&](int64_t base, int64_t v) -> V {
    V a = reinterpret_cast<const V*>(X + base)[v];
    if constexpr (FUSED) {
      const V b = reinterpret_cast<const V*>(R + base)[v];
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        a.val[j] = static_cast<T>(static_cast<opmath_t>(a.val[j]) + static_cast<opmath_t>(b.val[j]));
      reinterpret_cast<V*>(Z + base)[v] = a;
    }
    return a;
  };
  auto sumsq = [&](const V& a) {
    opmath_t s = 0;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const opmath_t t = static_cast<opmath_t>(a.val[j]);
      s += t * t;
    }
    return s;
  };
  // y = x · rstd · w
  auto scale_store = [&](int64_t base, int64_t v, const V& a, const V& w, opmath_t rs) {
    V y;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const opmath_t wj = W != nullptr ? static_cast<opmath_t>(w.val[j]) : opmath_t(1);
      y.val[j] = static_cast<T>(static_cast<opmath_t>(a.val[j]) * rs * wj);
      if constexpr (AMAX) cuda::amax_fold(ymax, y.val[j]);
    }
    reinterpret_cast<V*>(Y + base)[v] = y;
  };
  auto rstd_of = [&](opmath_t ss) { return opmath_t(1) / sqrt(ss / static_cast<opmath_t>(N) + eps); };

  int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if constexpr (MAXV > 0) {
    // the thread's weight vectors (the same columns in every row) and row vectors stay in registers
    V wcache[MAXV], cur[MAXV], nxt[MAXV];
    auto load_row = [&](int64_t r, V* dst) {
#pragma unroll
      for (int k = 0; k < MAXV; ++k) {
        const int64_t v = tid + static_cast<int64_t>(k) * tpr;
        if (v < nvec) dst[k] = load(r * N, v);
      }
    };
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
      const int64_t v = tid + static_cast<int64_t>(k) * tpr;
      if (W != nullptr && v < nvec) wcache[k] = Wv[v];
    }
    if (PIPE && row < M) load_row(row, cur);
    for (; row < M; row += stride) {
      if constexpr (PIPE) {
        if (row + stride < M) load_row(row + stride, nxt);
      } else {
        load_row(row, cur);
      }
      opmath_t ss = 0;
#pragma unroll
      for (int k = 0; k < MAXV; ++k)
        if (tid + static_cast<int64_t>(k) * tpr < nvec) ss += sumsq(cur[k]);
      const opmath_t rs = rstd_of(row_sum(ss));
      if (tid == 0) rstd[row] = rs;
#pragma unroll
      for (int k = 0; k < MAXV; ++k) {
        const int64_t v = tid + static_cast<int64_t>(k) * tpr;
        if (v < nvec) scale_store(row * N, v, cur[k], wcache[k], rs);
      }
      if constexpr (PIPE) {
#pragma unroll
        for (int k = 0; k < MAXV; ++k) cur[k] = nxt[k];
      }
    }
  } else {
    for (; row < M; row += stride) {
      const int64_t base = row * N;
      opmath_t ss = 0;
      for (int64_t v = tid; v < nvec; v += tpr) ss += sumsq(load(base, v));
      const opmath_t rs = rstd_of(row_sum(ss));
      if (tid == 0) rstd[row] = rs;
      // re-read the row (FUSED: z, written above by this same thread)
      const V* Sv = reinterpret_cast<const V*>((FUSED ? Z : X) + base);
      for (int64_t v = tid; v < nvec; v += tpr) {
        V w;
        if (W != nullptr) w = Wv[v];
        scale_store(base, v, Sv[v], w, rs);
      }
    }
  }
  if constexpr (AMAX) cuda::warp_amax_atomic(ymax, amax);  // whole warps (blockDim.x % 32 == 0), no early exit
}

// ---- forward variants 1..4 (default_forward_variant picks them; variant 0 is the kernel above) --------------
//
// One CTA per row (rows of at most 32·NV vectors: one warp per row, 8 rows a block), a plain grid of
// row groups (no grid-stride loop: the block scheduler fills the SMs as blocks finish, as a Triton
// program per row does), each thread owning NV vectors of its row in registers. The weight is not
// kept in registers across rows: it is read after the row's reduction (L1/L2 hits, the same N values
// for every row; WEARLY: with the row's loads, before the reduction). Index: 32-bit offsets where
// M·N < 2^31, 64-bit otherwise. Fewer live registers than variant 0 (no weight cache, no next-row
// buffer), so more blocks are resident per SM and more row loads are in flight.
// AMAX: as rms_norm_forward_kernel's (a warp's atomicMax after its row; a warp past M exits before, as a whole).
template <typename T, int VEC, int NV, bool FUSED, bool WEARLY, typename Index, bool AMAX>
__global__ void __launch_bounds__(1024)
    rms_norm_forward_row_kernel(const T* __restrict__ X,      // [M, N]
                                const T* __restrict__ R,      // [M, N] (FUSED)
                                const T* __restrict__ W,      // [N] or null
                                T* __restrict__ Y,            // [M, N]
                                T* __restrict__ Z,            // [M, N] (FUSED)
                                at::opmath_type<T>* __restrict__ rstd,  // [M]
                                int64_t M, Index N, at::opmath_type<T> eps,
                                typename cuda::AmaxBits<T>::bits_t* __restrict__ amax) {  // [1] (AMAX)
  using opmath_t = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  __shared__ opmath_t smem[2][32];
  RowSum<opmath_t> row_sum{smem};
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= M) return;  // a whole warp (blockDim.x == 32) or the whole block (blockDim.y == 1)
  const Index tid = threadIdx.x, tpr = blockDim.x;
  const Index nvec = N / VEC;
  const Index base = static_cast<Index>(row) * N;
  const V* Xv = reinterpret_cast<const V*>(X + base);
  const V* Rv = reinterpret_cast<const V*>(R + base);
  const V* Wv = reinterpret_cast<const V*>(W);
  V a[NV], w[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const Index v = tid + k * tpr;
    if (v < nvec) {
      a[k] = Xv[v];
      if constexpr (FUSED) {
        const V b = Rv[v];
#pragma unroll
        for (int j = 0; j < VEC; ++j)
          a[k].val[j] = static_cast<T>(static_cast<opmath_t>(a[k].val[j]) + static_cast<opmath_t>(b.val[j]));
      }
      if (WEARLY && W != nullptr) w[k] = Wv[v];
    }
  }
  opmath_t ss = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (tid + k * tpr < nvec) {
      if constexpr (FUSED) reinterpret_cast<V*>(Z + base)[tid + k * tpr] = a[k];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const opmath_t t = static_cast<opmath_t>(a[k].val[j]);
        ss += t * t;
      }
    }
  }
  const opmath_t rs = opmath_t(1) / sqrt(row_sum(ss) / static_cast<opmath_t>(N) + eps);
  if (threadIdx.x == 0) rstd[row] = rs;
  V* Yv = reinterpret_cast<V*>(Y + base);
  typename cuda::AmaxBits<T>::bits_t ymax = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const Index v = tid + k * tpr;
    if (v < nvec) {
      if (!WEARLY && W != nullptr) w[k] = Wv[v];
      V y;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const opmath_t wj = W != nullptr ? static_cast<opmath_t>(w[k].val[j]) : opmath_t(1);
        y.val[j] = static_cast<T>(static_cast<opmath_t>(a[k].val[j]) * rs * wj);
        if constexpr (AMAX) cuda::amax_fold(ymax, y.val[j]);
      }
      Yv[v] = y;
    }
  }
  if constexpr (AMAX) cuda::warp_amax_atomic(ymax, amax);
}

constexpr int kRowKernelMaxThreads = 1024;

// The forward's variant per shape class (the test hook rms_norm_forward of core/knobs.h overrides it), from the
// H200 measurements of docs/performance/kernel_variants.md (GB/s at
// 32768x4096 / 16384x8192 / 4096x8192 / 65536x1024 / 4096x16384): 16-bit plain: variant 1 (3987 / 4046 / 3561 /
// 3836 / 3677; variant 0 3515 / 3289 / 2715 / 3600 / 2998), variant 4 for rows of 16384+ (3786); 16-bit fused:
// variant 2 (4087 / 4061 / 3755 / 4071 / 3854); fp32 plain: variant 4 (4063 / 4162 / 3826 / 4082 / 3653); fp32
// fused: variant 3 (4102 / 4113 / 3973 / 4126 / 3757). A handful of rows (8x4096) runs best on variant 0,
// whose grid-stride blocks start fastest.
inline int default_forward_variant(at::ScalarType dtype, int64_t M, int64_t N, bool fused) {
  if (dtype == at::kDouble) return 0;
  const bool fp32 = dtype == at::kFloat;
  if (fused) return fp32 ? 3 : 2;
  if (M < 64) return 0;
  if (fp32) return 4;
  return N >= 16384 ? 4 : 1;
}

// Vectors per thread of forward variant `variant` (1..4) for rows of nvec vectors, 0 where the
// variant does not apply (rows of more than 8 · 1024 vectors: variant 0 streams them).
inline int forward_vecs_per_thread(int variant, int64_t nvec) {
  const int first = variant == 2 ? 1 : variant == 4 ? 4 : 2;
  for (int nv = first; nv <= 8; nv *= 2)
    if (nvec <= static_cast<int64_t>(nv) * kRowKernelMaxThreads) return nv;
  return 0;
}

// The forward kernels' pointer and eps arguments for problem p (FUSED: with the residual R and the sum Z; w null
// without a weight), as both launchers pass them.
template <typename T, bool FUSED>
struct ForwardArgs {
  using opmath_t = at::opmath_type<T>;
  using bits_t = typename cuda::AmaxBits<T>::bits_t;
  const T* x;
  const T* r;
  const T* w;
  T* y;
  T* z;
  opmath_t* rs;
  opmath_t eps;
  bits_t* amax;  // the amax word (null without amax)
  ForwardArgs(const rmsnorm::Problem& p, at::Tensor& Y, at::Tensor& Z, at::Tensor& rstd, at::Tensor* amax_out)
      : x(p.X.const_data_ptr<T>()),
        r(FUSED ? p.R.const_data_ptr<T>() : nullptr),
        w(p.W.defined() ? p.W.const_data_ptr<T>() : nullptr),
        y(Y.mutable_data_ptr<T>()),
        z(FUSED ? Z.mutable_data_ptr<T>() : nullptr),
        rs(rstd.mutable_data_ptr<opmath_t>()),
        eps(static_cast<opmath_t>(p.eps)),
        amax(amax_out != nullptr ? reinterpret_cast<bits_t*>(amax_out->mutable_data_ptr()) : nullptr) {}
};

// Runs forward variant 1..4 (the chooser, or the test hook rms_norm_forward) for this problem; false, having
// launched nothing, when variant 0 is chosen or the chosen variant does not apply (float64, rows too
// long, more than 2^31 row groups).
template <typename T, bool FUSED, bool AMAX>
bool launch_forward_variant(const rmsnorm::Problem& p, const ForwardArgs<T, FUSED>& a, bool vec) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    const int64_t knob = knobs::get(knobs::Knob::kRmsForward);
    const int variant = knob >= 0 ? static_cast<int>(knob) : default_forward_variant(p.X.scalar_type(), p.M, p.N, FUSED);
    if (variant < 1 || variant > 4) return false;
    constexpr int VEC = cuda::vec_size<T>();
    const int64_t M = p.M, N = p.N, nvec = vec ? N / VEC : N;
    const int nv = forward_vecs_per_thread(variant, nvec);
    if (nv == 0) return false;
    const int tpr = static_cast<int>(std::max<int64_t>(32, ((nvec + nv - 1) / nv + 31) / 32 * 32));
    const int rows_per_block = tpr == 32 ? 8 : 1;
    const int64_t grid = (M + rows_per_block - 1) / rows_per_block;
    if (grid > INT_MAX) return false;
    const bool small = M * N <= INT_MAX;
    const dim3 block(tpr, rows_per_block);
    auto stream = at::cuda::getCurrentCUDAStream();
    auto go = [&](auto kernel, auto n) {
      kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(a.x, a.r, a.w, a.y, a.z, a.rs, M, n, a.eps, a.amax);
    };
    // NV_ and WEARLY_ as template arguments; Index from the problem's size (vector widths only: the
    // scalar fallback of unaligned or odd rows always takes 64-bit offsets)
    auto run = [&](auto nv_c, auto early_c) {
      constexpr int NV_ = decltype(nv_c)::value;
      constexpr bool E_ = decltype(early_c)::value;
      if (vec && small) go(rms_norm_forward_row_kernel<T, VEC, NV_, FUSED, E_, int32_t, AMAX>, static_cast<int32_t>(N));
      else if (vec) go(rms_norm_forward_row_kernel<T, VEC, NV_, FUSED, E_, int64_t, AMAX>, N);
      else go(rms_norm_forward_row_kernel<T, 1, NV_, FUSED, E_, int64_t, AMAX>, N);
    };
    using F = std::false_type;
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    if (variant == 3 && nv == 2) run(I2{}, std::true_type{});
    else if (nv == 1) run(I1{}, F{});
    else if (nv == 2) run(I2{}, F{});
    else if (nv == 4) run(I4{}, F{});
    else run(I8{}, F{});
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  }
}

// The backward kernels' shared per-thread row steps (variant 0's register path and variants 1, 2). A thread owns
// the NV vectors v = tid + k·tpr (k < NV) of a row that lie below nvec; O is opmath_t. Free functions of this shape
// compile to the same sm_90 SASS as the loops written inline in each kernel (a struct with lambdas does not, nor
// does one dx step taking the row pointer: so the dx step is two functions, the dot before the block sum and the
// store after it, and the store computes the row pointer itself).

// Row r's dy and x vectors into gd, xd and its rstd into rsd.
template <int NV, typename V, typename T, typename O>
__device__ __forceinline__ void backward_load_row(const T* dY, const T* X, const O* rstd, int64_t N, int64_t nvec,
                                                  int tid, int tpr, int64_t r, V* gd, V* xd, O& rsd) {
  const V* dYv = reinterpret_cast<const V*>(dY + r * N);
  const V* Xv = reinterpret_cast<const V*>(X + r * N);
  rsd = rstd[r];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * tpr;
    if (v < nvec) {
      gd[k] = dYv[v];
      xd[k] = Xv[v];
    }
  }
}

// PIPE: the next row (gn, xn, rsn) becomes this row (g, x, rs).
template <int NV, typename V, typename O>
__device__ __forceinline__ void backward_advance(V* g, V* x, const V* gn, const V* xn, O& rs, O rsn) {
  rs = rsn;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    g[k] = gn[k];
    x[k] = xn[k];
  }
}

// One row's dx, in two steps around the block sum: backward_dx_dot gives this thread's part of s = Σ w·dy·x,
// backward_dx_store writes dx = rs·w·dy − x·c (c = rs³·s/N) into row `row` of dX [M, N]. w_at(k, v) is the weight
// vector of slot k (vector v), wval(w, j) its element j in opmath (1 without a weight).
template <int NV, int VEC, typename V, typename O, typename WAt, typename WVal>
__device__ __forceinline__ O backward_dx_dot(const V* g, const V* x, int64_t nvec, int tid, int tpr, WAt&& w_at,
                                             WVal&& wval) {
  O s = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * tpr;
    if (v < nvec) {
      const V& w = w_at(k, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) s += wval(w, j) * static_cast<O>(g[k].val[j]) * static_cast<O>(x[k].val[j]);
    }
  }
  return s;
}

template <int NV, int VEC, typename T, typename V, typename O, typename WAt, typename WVal>
__device__ __forceinline__ void backward_dx_store(const V* g, const V* x, O rs, O c, int64_t nvec, int tid, int tpr,
                                                  T* dX, int64_t row, int64_t N, WAt&& w_at, WVal&& wval) {
  V* dXv = reinterpret_cast<V*>(dX + row * N);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * tpr;
    if (v < nvec) {
      const V& w = w_at(k, v);
      V d;
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        d.val[j] = static_cast<T>(rs * wval(w, j) * static_cast<O>(g[k].val[j]) - static_cast<O>(x[k].val[j]) * c);
      dXv[v] = d;
    }
  }
}

// One row's dweight partial: dw(k, v, j) += dy·x·rs.
template <int NV, int VEC, typename V, typename O, typename DwAt>
__device__ __forceinline__ void backward_accumulate_dw(const V* g, const V* x, O rs, int64_t nvec, int tid, int tpr,
                                                       DwAt&& dw) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * tpr;
    if (v < nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dw(k, v, j) += static_cast<O>(g[k].val[j]) * static_cast<O>(x[k].val[j]) * rs;
    }
  }
}

// The block's dweight partial dw(k, v, j) into its row `out` of the [gridDim.x, N] partials.
template <int NV, int VEC, typename O, typename DwAt>
__device__ __forceinline__ void backward_store_dw(O* out, int64_t nvec, int tid, int tpr, DwAt&& dw) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * tpr;
    if (v < nvec) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[v * VEC + j] = dw(k, v, j);
    }
  }
}

// One row group's whole pass over its rows (grid-stride from blockIdx.x), shared by variant 0's register path and
// variants 1, 2: each row's dy, x (and rstd) into g, x (PIPE: the next row's into gn, xn before this row's sum), its
// dx into dX (when dX), its dweight partial added through dw_at (when dW_partial); at the end the dweight partial
// into row blockIdx.x of dW_partial [gridDim.x, N]. w_at, wval, dw_at as above; dx_scale(row_sum, rs, dot) gives
// c = rs³·s/N from this thread's part of s, summing over the row with row_sum. row_sum is taken by value and
// dx_scale is the kernel's own (its sum before or after rs³): only so is the SASS byte-identical to the inline loops
// (with row_sum by reference, or one shared order of the sum, the zero-initialisations or the schedule changed).
template <int NV, int VEC, bool PIPE, typename T, typename V, typename O, typename Sum, typename WAt, typename WVal,
          typename DwAt, typename DxScale>
__device__ __forceinline__ void backward_rows(const T* dY, const T* X, const O* rstd, T* dX, O* dW_partial, int64_t M,
                                              int64_t N, int64_t nvec, int tid, int tpr, Sum row_sum, V* g, V* x,
                                              V* gn, V* xn, WAt&& w_at, WVal&& wval, DwAt&& dw_at,
                                              DxScale&& dx_scale) {
  O rs = 0, rsn = 0;
  auto load_row = [&](int64_t r, V* gd, V* xd, O& rsd) {
    backward_load_row<NV>(dY, X, rstd, N, nvec, tid, tpr, r, gd, xd, rsd);
  };
  int64_t row = blockIdx.x;
  if (PIPE && row < M) load_row(row, g, x, rs);
  for (; row < M; row += gridDim.x) {
    if constexpr (PIPE) {
      if (row + gridDim.x < M) load_row(row + gridDim.x, gn, xn, rsn);
    } else {
      load_row(row, g, x, rs);
    }
    if (dX != nullptr) {
      const O c = dx_scale(row_sum, rs, backward_dx_dot<NV, VEC, V, O>(g, x, nvec, tid, tpr, w_at, wval));
      backward_dx_store<NV, VEC, T>(g, x, rs, c, nvec, tid, tpr, dX, row, N, w_at, wval);
    }
    if (dW_partial != nullptr) backward_accumulate_dw<NV, VEC>(g, x, rs, nvec, tid, tpr, dw_at);
    if constexpr (PIPE) backward_advance<NV>(g, x, gn, xn, rs, rsn);
  }
  if (dW_partial != nullptr)
    backward_store_dw<NV, VEC>(dW_partial + static_cast<int64_t>(blockIdx.x) * N, nvec, tid, tpr, dw_at);
}

// A backward thread's view of its rows: thread tid of tpr, nvec vectors a row, the weight W as vectors, 1 / N.
template <typename T, int VEC>
struct BackwardThread {
  int tid, tpr;
  int64_t nvec;
  const Vec<T, VEC>* Wv;
  at::opmath_type<T> inv_n;
};

template <int VEC, typename T>
__device__ __forceinline__ BackwardThread<T, VEC> backward_thread(const T* W, int64_t N) {
  using opmath_t = at::opmath_type<T>;
  return {static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x), N / VEC,
          reinterpret_cast<const Vec<T, VEC>*>(W), opmath_t(1) / static_cast<opmath_t>(N)};
}

// Backward. Per row (rs = rstd[row]):
//   s = Σ w·dy·x;  dx = rs·w·dy − x·(rs³·s/N);  dw_partial[group] += dy·x·rs
// One row group per block (blockDim.y == 1); group g = blockIdx.x writes partial row g. PIPE: as in
// the forward, the next row's dy and x are loaded before this row's reduction and stores.
template <typename T, int VEC, int MAXV, bool PIPE>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_backward_kernel(const T* __restrict__ dY,                     // [M, N]
                             const T* __restrict__ X,                      // [M, N]
                             const at::opmath_type<T>* __restrict__ rstd,  // [M]
                             const T* __restrict__ W,                      // [N] or null
                             T* __restrict__ dX,                           // [M, N] or null
                             at::opmath_type<T>* __restrict__ dW_partial,  // [gridDim.x, N] or null
                             int64_t M, int64_t N) {
  using opmath_t = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  __shared__ opmath_t smem[2][32];
  RowSum<opmath_t> row_sum{smem};
  const auto [tid, tpr, nvec, Wv, inv_n] = backward_thread<VEC>(W, N);
  auto wval = [&](const V& w, int j) { return W != nullptr ? static_cast<opmath_t>(w.val[j]) : opmath_t(1); };

  if constexpr (MAXV > 0) {
    opmath_t dw[MAXV][VEC];
    V w[MAXV], g[MAXV], x[MAXV], gn[MAXV], xn[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
      const int64_t v = tid + static_cast<int64_t>(k) * tpr;
      if (W != nullptr && v < nvec) w[k] = Wv[v];
#pragma unroll
      for (int j = 0; j < VEC; ++j) dw[k][j] = 0;
    }
    auto w_at = [&](int k, int64_t) -> const V& { return w[k]; };
    auto dw_at = [&](int k, int64_t, int j) -> opmath_t& { return dw[k][j]; };
    backward_rows<MAXV, VEC, PIPE>(dY, X, rstd, dX, dW_partial, M, N, nvec, tid, tpr, row_sum, g, x, gn, xn, w_at, wval,
                                   dw_at, [&](RowSum<opmath_t>& sum, opmath_t r, opmath_t dot) {
                                     const opmath_t s = sum(dot);  // the sum first, then rs³
                                     return r * r * r * s * inv_n;
                                   });
  } else {
    // streaming: rows too long for registers; the dweight partial row accumulates in global memory
    // (this block's own row of dW_partial, zero-initialized by the launcher, L2-resident)
    opmath_t* part = dW_partial != nullptr ? dW_partial + static_cast<int64_t>(blockIdx.x) * N : nullptr;
    for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
      const int64_t base = row * N;
      const V* dYv = reinterpret_cast<const V*>(dY + base);
      const V* Xv = reinterpret_cast<const V*>(X + base);
      const opmath_t rs = rstd[row];
      opmath_t c = 0;
      if (dX != nullptr) {
        opmath_t s = 0;
        for (int64_t v = tid; v < nvec; v += tpr) {
          const V g = dYv[v], x = Xv[v];
          V w;
          if (W != nullptr) w = Wv[v];
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            s += wval(w, j) * static_cast<opmath_t>(g.val[j]) * static_cast<opmath_t>(x.val[j]);
        }
        s = row_sum(s);
        c = rs * rs * rs * s * inv_n;
      }
      for (int64_t v = tid; v < nvec; v += tpr) {
        const V g = dYv[v], x = Xv[v];
        if (dX != nullptr) {
          V w;
          if (W != nullptr) w = Wv[v];
          V d;
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            d.val[j] = static_cast<T>(rs * wval(w, j) * static_cast<opmath_t>(g.val[j]) -
                                      static_cast<opmath_t>(x.val[j]) * c);
          reinterpret_cast<V*>(dX + base)[v] = d;
        }
        if (part != nullptr) {
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            part[v * VEC + j] += static_cast<opmath_t>(g.val[j]) * static_cast<opmath_t>(x.val[j]) * rs;
        }
      }
    }
  }
}

// ---- backward variants 1, 2 (default_backward_variant picks them; variant 0 is the kernel above) -----------
//
// For rows too long for variant 0's registers (bf16 N >= 16384 streams there, re-reading the row from L2
// and adding its dweight partial into global memory row by row): up to 1024 threads per row, each thread
// keeping NV vectors of dy and x in registers (the weight is re-read where it is used: L1 hits), so each row is read from global
// memory once; the dweight partial of the block's rows accumulates in shared memory (fp32, laid out
// [VEC][nvec] so a warp's accesses are conflict-free; each thread owns its own entries, so no barrier),
// and is written once at the end to row blockIdx.x of the [gridDim.x, N] partials that the launcher
// sums over blocks (at::sum: deterministic). PIPE: the next row's dy and x are loaded before this row's
// reduction. Grid: the blocks resident at once (grid-stride over rows), each owning one partial row.
template <typename T, int VEC, int NV, bool PIPE>
__global__ void __launch_bounds__(1024)
    rms_norm_backward_rows_kernel(const T* __restrict__ dY,                     // [M, N]
                                  const T* __restrict__ X,                      // [M, N]
                                  const at::opmath_type<T>* __restrict__ rstd,  // [M]
                                  const T* __restrict__ W,                      // [N] or null
                                  T* __restrict__ dX,                           // [M, N] or null
                                  at::opmath_type<T>* __restrict__ dW_partial,  // [gridDim.x, N] or null
                                  int64_t M, int64_t N) {
  using opmath_t = at::opmath_type<T>;
  using V = Vec<T, VEC>;
  extern __shared__ unsigned char dyn_smem[];
  opmath_t* acc = reinterpret_cast<opmath_t*>(dyn_smem);  // [VEC][nvec] when dW_partial
  __shared__ opmath_t smem[2][32];
  RowSum<opmath_t> row_sum{smem};
  const auto [tid, tpr, nvec, Wv, inv_n] = backward_thread<VEC>(W, N);
  V g[NV], x[NV], gn[PIPE ? NV : 1], xn[PIPE ? NV : 1];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int64_t v = tid + static_cast<int64_t>(k) * tpr;
    if (v < nvec && dW_partial != nullptr) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) acc[j * nvec + v] = 0;
    }
  }
  // the weight vector v, read where it is used (L1 hits after the first row): no registers held across rows
  auto w_at = [&](int, int64_t v) {
    V w;
    if (W != nullptr) w = Wv[v];
    return w;
  };
  auto wval = [&](const V& w, int j) { return W != nullptr ? static_cast<opmath_t>(w.val[j]) : opmath_t(1); };
  auto dw_at = [&](int, int64_t v, int j) -> opmath_t& { return acc[j * nvec + v]; };
  backward_rows<NV, VEC, PIPE>(dY, X, rstd, dX, dW_partial, M, N, nvec, tid, tpr, row_sum, g, x, gn, xn, w_at, wval,
                               dw_at, [&](RowSum<opmath_t>& sum, opmath_t r, opmath_t dot) {
                                 return r * r * r * sum(dot) * inv_n;  // rs³ first, then the sum
                               });
}

// The backward's variant per shape class (the test hook rms_norm_backward overrides it), from the same H200
// measurements (forward + backward GB/s): 16-bit, variant 1 for rows of 16384+ (4096x16384: 2854 vs variant 0's 1275) and for many rows of
// 4096+ (16384x8192: 3281 vs 2822; 32768x4096: 3428 vs 3226), variant 0 elsewhere (65536x1024: 3470 vs 3325;
// 4096x8192: 1480 vs 1430); fp32, variant 1 for rows of 16384+ (3284 vs 2039) and 32768x4096 (3986 vs 3944),
// variant 2 for rows of 8192 up to 16384 (16384x8192: 3909 vs 2400; 4096x8192: 3579 vs 2195).
inline int default_backward_variant(at::ScalarType dtype, int64_t M, int64_t N) {
  if (dtype == at::kDouble) return 0;
  if (dtype == at::kFloat) {
    if (N >= 16384) return 1;
    if (N >= 8192) return 2;
    return (N >= 4096 && M >= 8192) ? 1 : 0;
  }
  return (N >= 16384 || (N >= 4096 && M >= 8192)) ? 1 : 0;
}

// The backward kernels' input pointers and dx for problem p (w null without a weight, dx null without dX), as both
// launchers pass them; the dweight partials pointer is each launcher's own.
template <typename T>
struct BackwardArgs {
  const T* dy;
  const T* x;
  const at::opmath_type<T>* rs;
  const T* w;
  T* dx;
  BackwardArgs(const rmsnorm::BackwardProblem& p, at::Tensor& dX)
      : dy(p.dY.const_data_ptr<T>()),
        x(p.X.const_data_ptr<T>()),
        rs(p.rstd.const_data_ptr<at::opmath_type<T>>()),
        w(p.W.defined() ? p.W.const_data_ptr<T>() : nullptr),
        dx(dX.defined() ? dX.mutable_data_ptr<T>() : nullptr) {}
};

// Backward variant 1/2 (the chooser, or the test hook rms_norm_backward) into dX and dW (dW: weight's shape and dtype,
// allocated here); false, having launched nothing, where variant 0 is chosen or this one does not apply
// (float64, more than 4 · 1024 vectors a row, dweight partial row beyond the SM's shared memory).
template <typename T>
bool launch_backward_variant(const rmsnorm::BackwardProblem& p, at::Tensor& dX, bool want_dw, bool vec,
                             const at::Tensor& weight, at::Tensor& dW) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    using opmath_t = at::opmath_type<T>;
    const int64_t knob = knobs::get(knobs::Knob::kRmsBackward);
    const int variant = knob >= 0 ? static_cast<int>(knob) : default_backward_variant(p.X.scalar_type(), p.M, p.N);
    if (variant != 1 && variant != 2) return false;
    const bool pipe = variant == 2;
    constexpr int VEC = cuda::vec_size<T>();
    const int64_t M = p.M, N = p.N, nvec = vec ? N / VEC : N;
    const int nv = nvec <= 2 * kRowKernelMaxThreads ? 2 : nvec <= 4 * kRowKernelMaxThreads ? 4 : 0;
    const auto* prop = at::cuda::getCurrentDeviceProperties();
    const size_t smem = want_dw ? static_cast<size_t>(N) * sizeof(opmath_t) : 0;
    constexpr size_t kStaticSmem = 2 * 32 * sizeof(opmath_t);  // the kernel's RowSum scratch
    if (nv == 0 || smem + kStaticSmem > prop->sharedMemPerBlockOptin) return false;
    const int tpr = static_cast<int>(std::max<int64_t>(32, ((nvec + nv - 1) / nv + 31) / 32 * 32));
    const BackwardArgs<T> a(p, dX);
    at::Tensor partials;
    auto stream = at::cuda::getCurrentCUDAStream();
    auto go = [&](auto kernel) {
      if (smem + kStaticSmem > 48 * 1024) {  // past the default limit, static scratch included (fp32 N = 12288)
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
      }
      int resident = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, tpr, smem));
      const int64_t grid = std::min<int64_t>(M, num_sms() * std::max(resident, 1));
      if (want_dw) partials = at::empty({grid, N}, p.X.options().dtype(rmsnorm::rstd_dtype(p.X.scalar_type())));
      opmath_t* part = want_dw ? partials.mutable_data_ptr<opmath_t>() : nullptr;
      kernel<<<static_cast<unsigned>(grid), tpr, smem, stream>>>(a.dy, a.x, a.rs, a.w, a.dx, part, M, N);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    auto run = [&](auto kernel_vec, auto kernel_scalar) { vec ? go(kernel_vec) : go(kernel_scalar); };
    if (nv == 2 && pipe) run(rms_norm_backward_rows_kernel<T, VEC, 2, true>, rms_norm_backward_rows_kernel<T, 1, 2, true>);
    else if (nv == 2) run(rms_norm_backward_rows_kernel<T, VEC, 2, false>, rms_norm_backward_rows_kernel<T, 1, 2, false>);
    else if (pipe) run(rms_norm_backward_rows_kernel<T, VEC, 4, true>, rms_norm_backward_rows_kernel<T, 1, 4, true>);
    else run(rms_norm_backward_rows_kernel<T, VEC, 4, false>, rms_norm_backward_rows_kernel<T, 1, 4, false>);
    if (want_dw) dW = partials.sum(0).view(weight.sizes()).to(weight.scalar_type());
    return true;
  }
}

// Threads per row for nvec vectors per row (core/row_cuda.cuh), each thread owning at most
// kMaxVecsPerThread vectors.
inline RowMapping choose_mapping(int64_t nvec, int max_tpr) {
  return cuda::choose_row_mapping(nvec, kMaxVecsPerThread, max_tpr);
}

// Blocks of `kernel` resident per SM of the current device (core/row_cuda.cuh, cached per device).
template <auto kernel>
int64_t resident_blocks(int threads) {
  return cuda::resident_blocks<kernel, kMaxThreadsFwd>(threads);
}

// Launcher: device guard, current stream, launch, launch check. M == 0 or N == 0 launch nothing.
template <typename T, bool FUSED, bool AMAX>
void launch_forward(const rmsnorm::Problem& p, at::Tensor& Y, at::Tensor& Z, at::Tensor& rstd, at::Tensor* amax) {
  const int64_t M = p.M, N = p.N;
  const ForwardArgs<T, FUSED> a(p, Y, Z, rstd, amax);
  constexpr int VEC = cuda::vec_size<T>();
  const bool vec = N % VEC == 0 && cuda::is_aligned16(a.x) && cuda::is_aligned16(a.y) &&
                   (a.w == nullptr || cuda::is_aligned16(a.w)) &&
                   (!FUSED || (cuda::is_aligned16(a.r) && cuda::is_aligned16(a.z)));
  if (launch_forward_variant<T, FUSED, AMAX>(p, a, vec)) return;
  const int64_t nvec = vec ? N / VEC : N;
  // For 4-byte and wider types, rows pipelined and up to 1024 threads per row (H200, fp32 32768x4096: 3895 against
  // 3495 GB/s without; 16384x8192: 3886 against 3427); 2-byte types run neither (bf16 32768x4096: 3518 against 3396
  // with both).
  constexpr bool kWide = sizeof(T) >= 4;
  const RowMapping map = choose_mapping(nvec, kWide ? kMaxThreadsFwd : kMaxThreads);
  const int rows_per_block = map.tpr == 32 ? kWarpRows : 1;
  const dim3 block(map.tpr, rows_per_block);
  const int64_t row_groups = (M + rows_per_block - 1) / rows_per_block;
  auto stream = at::cuda::getCurrentCUDAStream();
#define OPFORGE_RMS_FORWARD_LAUNCH(V_, MAXV_, PIPE_)                                                     \
  do {                                                                                                   \
    constexpr auto kernel = rms_norm_forward_kernel<T, V_, MAXV_, FUSED, PIPE_, AMAX>;                   \
    const int64_t grid =                                                                                 \
        std::min<int64_t>(row_groups, num_sms() * resident_blocks<kernel>(map.tpr * rows_per_block));    \
    kernel<<<grid, block, 0, stream>>>(a.x, a.r, a.w, a.y, a.z, a.rs, M, N, a.eps, a.amax);              \
  } while (0)
  if (vec) {
    if (map.cached) OPFORGE_RMS_FORWARD_LAUNCH(VEC, kMaxVecsPerThread, kWide);
    else OPFORGE_RMS_FORWARD_LAUNCH(VEC, 0, false);
  } else {
    if (map.cached) OPFORGE_RMS_FORWARD_LAUNCH(1, kMaxVecsPerThread, kWide);
    else OPFORGE_RMS_FORWARD_LAUNCH(1, 0, false);
  }
#undef OPFORGE_RMS_FORWARD_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// amax (the *_amax ops): a memset-zeroed word that the forward kernel raises as it stores Y (the AMAX instantiations:
// the same variant, mapping and per-row arithmetic as without amax, so Y, Z and rstd are bitwise the plain op's).
void forward_cuda(const rmsnorm::Problem& p, at::Tensor& Y, at::Tensor& Z, at::Tensor& rstd, at::Tensor* amax) {
  c10::cuda::CUDAGuard guard(p.X.device());
  if (amax != nullptr) *amax = cuda::zeroed_amax_tensor(Y);
  if (p.M == 0) return;
  if (p.N == 0) {
    rstd.fill_(1.0 / std::sqrt(p.eps));
    return;
  }
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::rms_norm", [&] {
    if (amax != nullptr) {
      if (p.R.defined()) launch_forward<scalar_t, true, true>(p, Y, Z, rstd, amax);
      else launch_forward<scalar_t, false, true>(p, Y, Z, rstd, amax);
    } else {
      if (p.R.defined()) launch_forward<scalar_t, true, false>(p, Y, Z, rstd, nullptr);
      else launch_forward<scalar_t, false, false>(p, Y, Z, rstd, nullptr);
    }
  });
}

// _rms_norm_apply: y = x · rstd[row] · w (w null: · 1), the forward kernels' last step with the operations and order of
// their scale_store (written here per element), so bitwise their output for the same x, rstd and w. One block per row
// (grid-stride), VEC elements per access: 16 bytes where X, W and Y are 16-byte aligned and N is a multiple of it,
// else 1 (not measured alone: it runs once per layer in backward).
template <typename T, int VEC>
__global__ void __launch_bounds__(256) rms_norm_apply_kernel(const T* __restrict__ X,                       // [M, N]
                                                             const at::opmath_type<T>* __restrict__ rstd,  // [M]
                                                             const T* __restrict__ W,                      // [N]/null
                                                             T* __restrict__ Y, int64_t M, int64_t N) {
  using opmath_t = at::opmath_type<T>;
  using Vx = cuda::Vec<T, VEC>;
  const int64_t nvec = N / VEC;
  for (int64_t m = blockIdx.x; m < M; m += gridDim.x) {
    const opmath_t rs = rstd[m];
    const Vx* x = reinterpret_cast<const Vx*>(X + m * N);
    Vx* y = reinterpret_cast<Vx*>(Y + m * N);
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      const Vx a = x[v];
      Vx w;
      if (W != nullptr) w = reinterpret_cast<const Vx*>(W)[v];
      Vx o;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const opmath_t wj = W != nullptr ? static_cast<opmath_t>(w.val[j]) : opmath_t(1);
        o.val[j] = static_cast<T>(static_cast<opmath_t>(a.val[j]) * rs * wj);
      }
      y[v] = o;
    }
  }
}

at::Tensor rms_norm_apply_cuda(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  const rmsnorm::BackwardProblem p = rmsnorm::check_apply(input, rstd, weight);
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor Y = at::empty(input.sizes(), p.X.options());
  if (p.M == 0 || p.N == 0) return Y;
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::_rms_norm_apply", [&] {
    constexpr int VEC = cuda::vec_size<scalar_t>();
    const scalar_t* x = p.X.const_data_ptr<scalar_t>();
    const scalar_t* w = p.W.defined() ? p.W.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    const bool vec = p.N % VEC == 0 && cuda::is_aligned16(x) && cuda::is_aligned16(y) &&
                     (w == nullptr || cuda::is_aligned16(w));
    const int64_t grid = std::min<int64_t>(p.M, 65535);
    const auto* rs = p.rstd.const_data_ptr<at::opmath_type<scalar_t>>();
    auto stream = at::cuda::getCurrentCUDAStream();
    if (vec) {
      rms_norm_apply_kernel<scalar_t, VEC><<<grid, 256, 0, stream>>>(x, rs, w, y, p.M, p.N);
    } else {
      rms_norm_apply_kernel<scalar_t, 1><<<grid, 256, 0, stream>>>(x, rs, w, y, p.M, p.N);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return Y;
}

// The backward's launch plan: the kernel variant and the blocks resident per SM. Pipelining (PIPE) is
// chosen when only one block of the plain kernel fits on an SM: then nothing else hides the load
// latency across the row's barrier (H200, bf16 4096x8192 forward+backward: 2303 against 1048 GB/s
// without); with more resident blocks the extra registers cost more than they gain (bf16 65536x1024:
// 3207 with against 3467 GB/s without).
struct BackwardPlan {
  bool pipe;
  int64_t resident;
};

template <typename T>
BackwardPlan backward_plan_t(const RowMapping& map, bool vec) {
  constexpr int VEC = cuda::vec_size<T>();
  constexpr int MV = kMaxVecsPerThread;
  if (!map.cached) {
    return {false, vec ? resident_blocks<rms_norm_backward_kernel<T, VEC, 0, false>>(map.tpr)
                       : resident_blocks<rms_norm_backward_kernel<T, 1, 0, false>>(map.tpr)};
  }
  const int64_t plain = vec ? resident_blocks<rms_norm_backward_kernel<T, VEC, MV, false>>(map.tpr)
                            : resident_blocks<rms_norm_backward_kernel<T, 1, MV, false>>(map.tpr);
  if (plain > 1) return {false, plain};
  return {true, vec ? resident_blocks<rms_norm_backward_kernel<T, VEC, MV, true>>(map.tpr)
                    : resident_blocks<rms_norm_backward_kernel<T, 1, MV, true>>(map.tpr)};
}

BackwardPlan backward_plan(at::ScalarType dtype, const RowMapping& map, bool vec) {
  BackwardPlan plan{false, 1};
  OPFORGE_DISPATCH_FLOATING(dtype, "opforge::rms_norm_backward", [&] { plan = backward_plan_t<scalar_t>(map, vec); });
  return plan;
}

template <typename T>
void launch_backward(const rmsnorm::BackwardProblem& p, at::Tensor& dX, at::Tensor& partials, int64_t grid,
                     const RowMapping& map, bool vec, bool pipe) {
  using opmath_t = at::opmath_type<T>;
  const BackwardArgs<T> a(p, dX);
  opmath_t* part = partials.defined() ? partials.mutable_data_ptr<opmath_t>() : nullptr;
  constexpr int VEC = cuda::vec_size<T>();
  auto stream = at::cuda::getCurrentCUDAStream();
#define OPFORGE_RMS_BACKWARD_LAUNCH(V_, MAXV_, PIPE_)                                                           \
  rms_norm_backward_kernel<T, V_, MAXV_, PIPE_><<<grid, map.tpr, 0, stream>>>(a.dy, a.x, a.rs, a.w, a.dx, part, \
                                                                           p.M, p.N)
  if (vec) {
    if (map.cached && pipe) OPFORGE_RMS_BACKWARD_LAUNCH(VEC, kMaxVecsPerThread, true);
    else if (map.cached) OPFORGE_RMS_BACKWARD_LAUNCH(VEC, kMaxVecsPerThread, false);
    else OPFORGE_RMS_BACKWARD_LAUNCH(VEC, 0, false);
  } else {
    if (map.cached && pipe) OPFORGE_RMS_BACKWARD_LAUNCH(1, kMaxVecsPerThread, true);
    else if (map.cached) OPFORGE_RMS_BACKWARD_LAUNCH(1, kMaxVecsPerThread, false);
    else OPFORGE_RMS_BACKWARD_LAUNCH(1, 0, false);
  }
#undef OPFORGE_RMS_BACKWARD_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor backward_cuda(rmsnorm::BackwardSetup& s, const at::Tensor& weight) {
  const rmsnorm::BackwardProblem& p = s.p;
  const int64_t M = p.M, N = p.N;
  c10::cuda::CUDAGuard guard(p.X.device());
  at::Tensor dW;
  if (M == 0 || N == 0) {
    if (s.want_dw) dW = at::zeros(weight.sizes(), weight.options());
    return dW;
  }
  const int64_t elem = p.X.element_size();
  const int64_t VEC = 16 / elem;
  const bool vec = N % VEC == 0 && cuda::is_aligned16(p.dY.const_data_ptr()) && cuda::is_aligned16(p.X.const_data_ptr()) &&
                   (!p.W.defined() || cuda::is_aligned16(p.W.const_data_ptr())) &&
                   (!s.want_dx || cuda::is_aligned16(s.dX.const_data_ptr()));
  bool done = false;
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::rms_norm_backward", [&] {
    done = launch_backward_variant<scalar_t>(p, s.dX, s.want_dw, vec, weight, dW);
  });
  if (done) return dW;
  const RowMapping map = choose_mapping(vec ? N / VEC : N, kMaxThreads);
  // one row group per block, as many blocks as are resident at once: the partials are then
  // (resident blocks) rows of N floats, a few percent of the traffic of dY, X and dX
  const BackwardPlan plan = backward_plan(p.X.scalar_type(), map, vec);
  const int64_t grid = std::min<int64_t>(M, num_sms() * plan.resident);
  at::Tensor partials;  // [grid, N]
  if (s.want_dw) {
    auto opts = p.X.options().dtype(s.acc_dtype);
    partials = map.cached ? at::empty({grid, N}, opts) : at::zeros({grid, N}, opts);
  }
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::rms_norm_backward",
                            [&] { launch_backward<scalar_t>(p, s.dX, partials, grid, map, vec, plan.pipe); });
  if (s.want_dw) dW = rmsnorm::as_weight_grad(partials.sum(0), weight);
  return dW;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                                          const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask) {
  return rmsnorm::rms_norm_backward(backward_cuda, grad_output, input, rstd, weight, output_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("_rms_norm_apply", &rms_norm_apply_cuda);
  rmsnorm::ForwardOps<forward_cuda>::register_for(m);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}

}  // namespace opforge
