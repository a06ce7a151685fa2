// CUDA kernels of linear_cross_entropy and linear_log_probs: the chunked algorithm of linear_cross_entropy.h. One
// forward and one backward chunk loop serve both ops; linear_log_probs's row is the cross-entropy row without
// smoothing, class weights or z-loss (its value −log p), with the logits scaled by 1 / temperature and, on request,
// the entropy (a second pass over the row, after (m, r)).
//
// Per chunk of c tokens: logits [c, V] = X_c · Wᵀ + b through core/gemm.h (float32 output from inputs in their
// storage dtype, float32 accumulation, the bias fused as the GEMM's epilogue; float64 throughout for float64), then
// one row kernel (one block per token row, 16-byte loads where the row allows, online max/sum in fp32):
//   forward            the loss and (m, r);
//   forward with grad  the loss and (m, r), then, from the same row, the logit gradient of the loss (grad_output = 1,
//                      the reduction's scale folded in): the gradient-in-forward path, 3 GEMMs per chunk in all;
//   backward           the logit gradient from the saved (m, r) and the given grad_output (the recompute path).
// The logit gradient goes to the storage dtype for the two gradient GEMMs (dX_c = dZ_c · W and dW += dZ_cᵀ · X_c into
// a float32 accumulator, beta = 0 on the first chunk and 1 after, both once per chunk), and stays in fp32 in place
// only where it is read again (float32/float64 inputs, whose gradient GEMMs read it; the bias gradient's fp32 column
// sum). One dW GEMM per chunk re-reads and re-writes the V x H accumulator each chunk; gathering several chunks'
// gradients per dW GEMM measured no faster at equal memory (docs/performance/kernel_variants.md).
// With the knob OPFORGE_LCE_DW_ACCUM=1 and 16-bit parameters of input's dtype, dW and db are the 16-bit gradient
// buffers themselves (lce::Problem::dw_dtype / db_dtype): the same dW GEMM writes its 16-bit D with beta = 0 on the
// first chunk and adds with beta = 1 after (fp32 math inside cuBLAS, one rounding per GEMM), so no fp32 V x H
// accumulator exists and no final cast runs.
// Lean mode (lce::Problem::lean, knob OPFORGE_LCE_LEAN, on by default, 16-bit input, weight and bias of one dtype;
// linear_cross_entropy.h has its numerics): the logits GEMM writes the chunk in the storage dtype (fp32 accumulation
// and the bias epilogue inside the GEMM, one rounding), the row kernels read it 8 elements per 16-byte load and compute
// in fp32, and the logit gradient overwrites the same buffer in place, which the dX and dW GEMMs then read: one
// [chunk, V] 16-bit buffer instead of an fp32 one plus a 16-bit copy. dW accumulates in the 16-bit gradient (as
// OPFORGE_LCE_DW_ACCUM=1); db sums the 16-bit gradient with fp32 accumulation; the chunk size comes from
// kLeanChunkBudget.
// A target outside [0, V) that is not ignore_index is never read: its token gets a NaN loss and NaN gradients.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "core/check.h"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "core/gemm.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace opforge {
namespace {

using lce::Problem;

// Bytes of logits (the fp32 chunk plus, for 16-bit inputs, its storage-dtype gradient copy) one chunk may hold on
// CUDA: at V = 128256, 768 MiB gives 1024 rows for bf16. Chosen by measurement (H200, bf16, fwd+bwd,
// 8192x4096x128256 / 8192x2048x128256): 320 rows (a 256 MiB budget) 71.8 / 41.1 ms, 1024 rows 47.4 / 27.2 ms, 2048
// rows 48.6 / 24.8 ms, 8192 rows 42.8 / 22.8 ms; peak above the inputs 2.0 / 1.0, 2.0 / 1.25, 2.5 / 2.0, 7.0 / 6.5
// GiB (the fp32 dW accumulator, V x H x 4 bytes, sets the floor). Each chunk's fp32 dW accumulation re-reads and
// re-writes V x H, so fewer, larger chunks amortise it; 768 MiB keeps the peak near the floor.
constexpr int64_t kCudaChunkBudget = int64_t{768} << 20;
// Lean mode's budget for its one 16-bit [chunk, V] buffer (two with linear_jsd's teacher): 512 MiB gives 2048 rows
// at V = 128256 in bf16 (1024 for linear_jsd), half as many chunks as the 1024 rows of float32 chunks
// (OPFORGE_LCE_LEAN=0), so half as many passes of the dW GEMM over the V x H gradient. The bound on lean mode's memory
// above the inputs and the gradients' own storage: this buffer, plus per-token vectors, cuBLAS's workspace and the [V]
// fp32 bias-gradient sum.
constexpr int64_t kLeanChunkBudget = int64_t{512} << 20;
constexpr int kThreads = 512;

// ---- the row kernels -------------------------------------------------------------------------------------

// The bias is not here: the logits GEMM adds it (its epilogue), so the row kernels see l = x·w + b.
template <typename acc_t>
struct RowArgs {
  const acc_t* cw;    // [V] class weights or nullptr
  const acc_t* wsum;  // [1] Σ cw (device), or nullptr: V
  int64_t V, ignore_index;
  acc_t eps, z_loss, cap;  // cap 0: none
  acc_t scale;             // z = cap(l) · scale (1 / temperature; 1 for linear_cross_entropy)
};

template <typename acc_t>
__device__ __forceinline__ acc_t dev_exp(acc_t x) { return exp(x); }
template <>
__device__ __forceinline__ float dev_exp<float>(float x) { return expf(x); }

// (m, s) ⊕ (m2, s2): the running max and Σ exp(z − m) of two parts.
template <typename acc_t>
__device__ __forceinline__ void merge(acc_t& m, acc_t& s, acc_t m2, acc_t s2) {
  if (m2 > m) {
    s = (s == acc_t(0) ? acc_t(0) : s * dev_exp(m - m2)) + s2;
    m = m2;
  } else if (s2 != acc_t(0)) {
    s += s2 * dev_exp(m2 - m);
  }
}

// one element into the running (m, s); -inf adds nothing, NaN propagates
template <typename acc_t>
__device__ __forceinline__ void online(acc_t& m, acc_t& s, acc_t z) {
  if (z > m) {
    s = s * dev_exp(m - z) + acc_t(1);
    m = z;
  } else if (z != -INFINITY) {
    s += dev_exp(z - m);
  }
}

// Block-wide reduction of (m, s, a): merged (m, s) and Σ a; result in every thread. Contains __syncthreads:
// every thread's reads before the call happen before any thread's writes after it.
template <typename acc_t>
__device__ void block_reduce(acc_t& m, acc_t& s, acc_t& a) {
  __shared__ acc_t sm[32], ss[32], sa[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) {
    const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    a += __shfl_xor_sync(0xffffffffu, a, o);
    merge(m, s, m2, s2);
  }
  if (lane == 0) { sm[warp] = m; ss[warp] = s; sa[warp] = a; }
  __syncthreads();
  const int warps = blockDim.x / 32;
  m = lane < warps ? sm[lane] : acc_t(-INFINITY);
  s = lane < warps ? ss[lane] : acc_t(0);
  a = lane < warps ? sa[lane] : acc_t(0);
  for (int o = 16; o > 0; o /= 2) {
    const acc_t m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    a += __shfl_xor_sync(0xffffffffu, a, o);
    merge(m, s, m2, s2);
  }
}

// z = cap(l) · scale
template <typename acc_t>
__device__ __forceinline__ acc_t capped(acc_t x, const RowArgs<acc_t>& q) {
  return (q.cap > acc_t(0) ? q.cap * tanh(x / q.cap) : x) * q.scale;
}

// The logits chunk's element type lg_t: acc_t (float32 / float64), or in lean mode the 16-bit storage dtype, read
// into acc_t and computed in acc_t. VEC: rows read and written kVec elements (16 bytes) at a time.
template <typename lg_t>
constexpr int kVec = cuda::vec_size<lg_t>();
template <typename lg_t>
using LVec = cuda::Vec<lg_t, kVec<lg_t>>;

// f(a_j, b_j, j) for this thread's elements j of one row (b: a second row read alongside, or null), the elements
// read as acc_t, kVec per 16-byte load with VEC (V a multiple of kVec, rows 16-byte aligned).
template <typename acc_t, typename lg_t, bool VEC, typename F>
__device__ __forceinline__ void for_row(const lg_t* __restrict__ a, const lg_t* __restrict__ b, int64_t V, F&& f) {
  if constexpr (VEC) {
    constexpr int kN = kVec<lg_t>;
    const LVec<lg_t>* av = reinterpret_cast<const LVec<lg_t>*>(a);
    const LVec<lg_t>* bv = reinterpret_cast<const LVec<lg_t>*>(b);
    for (int64_t k = threadIdx.x; k < V / kN; k += blockDim.x) {
      const LVec<lg_t> x = av[k];
      LVec<lg_t> y;
      if (b) y = bv[k];
#pragma unroll
      for (int u = 0; u < kN; ++u) {
        f(static_cast<acc_t>(x.val[u]), b ? static_cast<acc_t>(y.val[u]) : acc_t(0), kN * k + u);
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      f(static_cast<acc_t>(a[j]), b ? static_cast<acc_t>(b[j]) : acc_t(0), j);
    }
  }
}

// Pass 1 of a row (no writes): m = max z, s = Σ exp(z − m), a = Σ_j w_j (z_j − z0) (label smoothing only), over
// z = cap(l).
template <typename acc_t, typename lg_t, bool VEC>
__device__ __forceinline__ void row_stats(const lg_t* __restrict__ l, const RowArgs<acc_t>& q, acc_t z0, acc_t& m,
                                          acc_t& s, acc_t& a) {
  const int64_t V = q.V;
  const bool smooth = q.eps > acc_t(0);
  m = -INFINITY;
  s = 0;
  a = 0;
  if constexpr (VEC) {
    constexpr int kN = kVec<lg_t>;
    const int64_t nv = V / kN;
    const LVec<lg_t>* lv = reinterpret_cast<const LVec<lg_t>*>(l);
    for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
      const LVec<lg_t> v = lv[k];
#pragma unroll
      for (int u = 0; u < kN; ++u) {
        const acc_t x = capped(static_cast<acc_t>(v.val[u]), q);
        online(m, s, x);
        if (smooth) a += (q.cw ? q.cw[kN * k + u] : acc_t(1)) * (x - z0);
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const acc_t x = capped(static_cast<acc_t>(l[j]), q);
      online(m, s, x);
      if (smooth) a += (q.cw ? q.cw[j] : acc_t(1)) * (x - z0);
    }
  }
  block_reduce(m, s, a);
}

// The loss of a row from its reduced (m, r, a), z0 and z_t:
//   loss = (1 − ε) w_t ((m − z_t) + r) + ε/V (W (m − z0) − Σ_j w_j (z_j − z0) + W r) + z_loss (m + r)².
template <typename acc_t>
__device__ __forceinline__ acc_t row_loss(const RowArgs<acc_t>& q, int64_t t, acc_t m, acc_t r, acc_t a, acc_t z0,
                                          acc_t zt) {
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  acc_t l = (acc_t(1) - q.eps) * wt * ((m - zt) + r);
  if (q.eps > acc_t(0)) {
    const acc_t W = q.wsum ? *q.wsum : static_cast<acc_t>(q.V);
    l += q.eps / static_cast<acc_t>(q.V) * (W * (m - z0) - a + W * r);
  }
  if (q.z_loss > acc_t(0)) l += q.z_loss * (m + r) * (m + r);
  return l;
}

// Fills a row's gradient with `fill` (0 for an ignored token, NaN for an out-of-range target): in place in l when
// write_l, and in o when given.
template <typename acc_t, typename lg_t, typename out_t>
__device__ __forceinline__ void fill_row(lg_t* l, out_t* o, bool write_l, int64_t V, acc_t fill) {
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    if (write_l) l[j] = static_cast<lg_t>(fill);
    if (o) o[j] = static_cast<out_t>(fill);
  }
}

// The entropy pass of a row (no writes), after (m, r): H = r + Σ_j p_j (m − z_j), p_j = exp(z_j − m − r) (both
// terms >= 0: no cancellation). Contains __syncthreads (block_reduce), result in every thread.
template <typename acc_t, typename lg_t, bool VEC>
__device__ __forceinline__ acc_t row_entropy(const lg_t* __restrict__ l, const RowArgs<acc_t>& q, acc_t m, acc_t r) {
  __syncthreads();  // every thread's reads of the previous block_reduce's shared memory before its reuse
  acc_t sm = -INFINITY, ss = 0, a = 0;
  for_row<acc_t, lg_t, VEC>(l, nullptr, q.V, [&](acc_t x, acc_t, int64_t) {
    const acc_t z = capped(x, q);
    a += dev_exp((z - m) - r) * (m - z);
  });
  block_reduce(sm, ss, a);
  return r + a;
}

// Pass 2 of a row: the logit gradient from l (in place, read before written by the same thread) and (m, r, g), with
// the entropy's gradient ge (0: none; em = r − H), lce::RowGrad's formula:
//   c = cap(l) (or l), z = c · scale, p = exp((z − m) − r),
//   dz_j = g ((1 − ε) w_t (p_j − [j = t]) + ε/V (W p_j − w_j) + 2 z_loss (m + r) p_j) − ge p_j ((z_j − m) − em),
//   dl_j = dz_j · scale · (1 − (c_j/cap)²) (without a softcap dz_j · scale),
// written in place (lg_t: fp32, or the storage dtype in lean mode) when write_l and, when o is given, in the storage
// dtype there.
template <typename acc_t, typename lg_t, typename out_t, bool VEC>
__device__ __forceinline__ void grad_row(lg_t* __restrict__ l, out_t* __restrict__ o, bool write_l, int64_t t,
                                         const RowArgs<acc_t>& q, acc_t m, acc_t r, acc_t g, acc_t ge = acc_t(0),
                                         acc_t em = acc_t(0)) {
  const int64_t V = q.V;
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  const acc_t W = q.wsum ? *q.wsum : static_cast<acc_t>(V);
  const acc_t c1 = g * ((acc_t(1) - q.eps) * wt + q.eps / static_cast<acc_t>(V) * W + acc_t(2) * q.z_loss * (m + r));
  const acc_t c2 = g * q.eps / static_cast<acc_t>(V);
  const acc_t ct = g * (acc_t(1) - q.eps) * wt;
  auto grad = [&](acc_t x, int64_t j) {
    acc_t gz = q.scale;
    if (q.cap > acc_t(0)) {
      x = q.cap * tanh(x / q.cap);
      const acc_t u = x / q.cap;
      gz *= acc_t(1) - u * u;
    }
    x *= q.scale;
    const acc_t p = dev_exp((x - m) - r);
    acc_t d = c1 * p - c2 * (q.cw ? q.cw[j] : acc_t(1));
    if (j == t) d -= ct;
    if (ge != acc_t(0)) d -= ge * p * ((x - m) - em);
    return d * gz;
  };
  if constexpr (VEC) {
    constexpr int kN = kVec<lg_t>;
    const int64_t nv = V / kN;
    LVec<lg_t>* lv = reinterpret_cast<LVec<lg_t>*>(l);
    for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
      const LVec<lg_t> v = lv[k];
      acc_t d[kN];
#pragma unroll
      for (int u = 0; u < kN; ++u) d[u] = grad(static_cast<acc_t>(v.val[u]), kN * k + u);
      if (write_l) {
        LVec<lg_t> w;
#pragma unroll
        for (int u = 0; u < kN; ++u) w.val[u] = static_cast<lg_t>(d[u]);
        lv[k] = w;
      }
      if (o) {
#pragma unroll
        for (int u = 0; u < kN; ++u) o[kN * k + u] = static_cast<out_t>(d[u]);
      }
    }
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const acc_t d = grad(static_cast<acc_t>(l[j]), j);
      if (write_l) l[j] = static_cast<lg_t>(d);
      if (o) o[j] = static_cast<out_t>(d);
    }
  }
}

// Forward, one block per token row of the chunk: loss and (m, r) per row; with GRAD also the logit gradient of
// the loss scaled by G[0] (pass 2, after the block reduction has ordered every read of pass 1 before any write).
template <typename acc_t, typename lg_t, typename out_t, bool VEC, bool GRAD>
__global__ void __launch_bounds__(kThreads) lce_forward_rows(lg_t* __restrict__ logits,       // [c, V]
                                                             out_t* __restrict__ out_lp,      // [c, V] or null
                                                             bool write_l,
                                                             const int64_t* __restrict__ T,   // [c]
                                                             RowArgs<acc_t> q,
                                                             const acc_t* __restrict__ G,     // [1] (GRAD)
                                                             acc_t* __restrict__ loss,        // [c]
                                                             acc_t* __restrict__ stats,       // [c, 2]
                                                             acc_t* __restrict__ ent) {       // [c] or null
  const int64_t row = blockIdx.x;
  const int64_t t = T[row];
  const int64_t V = q.V;
  lg_t* l = logits + row * V;
  out_t* o = out_lp ? out_lp + row * V : nullptr;
  if (t == q.ignore_index) {
    if (threadIdx.x == 0) {
      loss[row] = acc_t(0);
      stats[2 * row] = acc_t(0);
      stats[2 * row + 1] = acc_t(0);
      if (ent) ent[row] = acc_t(0);
    }
    if constexpr (GRAD) fill_row(l, o, write_l, V, acc_t(0));
    return;
  }
  const bool valid = t >= 0 && t < V;
  const acc_t z0 = capped(static_cast<acc_t>(l[0]), q);
  const acc_t zt = valid && threadIdx.x == 0 ? capped(static_cast<acc_t>(l[t]), q) : acc_t(0);  // before any write
  acc_t m, s, a;
  row_stats<acc_t, lg_t, VEC>(l, q, z0, m, s, a);  // ends past a __syncthreads
  const acc_t r = log(s);
  if (threadIdx.x == 0) {
    stats[2 * row] = m;
    stats[2 * row + 1] = r;
    loss[row] = valid ? row_loss(q, t, m, r, a, z0, zt) : acc_t(NAN);  // an out-of-range target is never read
  }
  if (ent) {
    const acc_t h = row_entropy<acc_t, lg_t, VEC>(l, q, m, r);  // before pass 2 overwrites the row
    if (threadIdx.x == 0) ent[row] = h;
    __syncthreads();  // every thread's entropy pass reads the row before pass 2 writes it
  }
  if constexpr (GRAD) {
    if (!valid) {
      fill_row(l, o, write_l, V, acc_t(NAN));
    } else {
      grad_row<acc_t, lg_t, out_t, VEC>(l, o, write_l, t, q, m, r, G[0]);
    }
  }
}

// Backward, one block per token row: the logit gradient from the raw logits (in place) and the saved (m, r),
// scaled by the token's G; ignored rows zeros, out-of-range targets NaN.
template <typename acc_t, typename lg_t, typename out_t, bool VEC>
__global__ void __launch_bounds__(kThreads) lce_backward_rows(lg_t* __restrict__ logits,        // [c, V]
                                                              out_t* __restrict__ out_lp,       // [c, V] or null
                                                              bool write_l,
                                                              const int64_t* __restrict__ T,    // [c]
                                                              RowArgs<acc_t> q,
                                                              const acc_t* __restrict__ stats,  // [c, 2]
                                                              const acc_t* __restrict__ G,      // [c] or [1]
                                                              int64_t g_stride,
                                                              const acc_t* __restrict__ GE,     // [c] or null
                                                              const acc_t* __restrict__ Em) {   // [c] (with GE)
  const int64_t row = blockIdx.x;
  const int64_t t = T[row];
  const int64_t V = q.V;
  lg_t* l = logits + row * V;
  out_t* o = out_lp ? out_lp + row * V : nullptr;
  if (t == q.ignore_index || t < 0 || t >= V) {
    fill_row(l, o, write_l, V, t == q.ignore_index ? acc_t(0) : acc_t(NAN));
    return;
  }
  grad_row<acc_t, lg_t, out_t, VEC>(l, o, write_l, t, q, stats[2 * row], stats[2 * row + 1], G[g_stride * row],
                              GE ? GE[row] : acc_t(0), GE ? Em[row] : acc_t(0));
}

// log(e^a + e^b)
template <typename acc_t>
__device__ __forceinline__ acc_t log_add_exp(acc_t a, acc_t b) {
  const acc_t mx = a > b ? a : b;
  return mx + log1p(dev_exp(-fabs(a - b)));
}

// linear_jsd, one block per token row: the generalised JSD of the student's logits ls and the teacher's lt (each
// [c, V], the biases added by their GEMMs), both scaled by q.scale; with GRAD the student's logit gradient of
// G[0] · value (linear_cross_entropy_cpu.cpp's jsd_row has the formulas), fp32 in place and/or in the storage dtype.
// Passes: (m, s) of each row; the sums A = Σ p_t (lt − lm) and K = Σ p_s (ls − lm); the gradient.
// β and what the JSD row needs of it, each rounded once from the double β on the host (log(0.3f) would carry the
// rounding of 0.3 itself into the divergence: ~1e-7 relative)
template <typename acc_t>
struct JsdBeta {
  acc_t beta, lb, l1b, one_m;  // β, log β, log(1 − β), 1 − β
};

template <typename acc_t, typename lg_t, typename out_t, bool VEC, bool GRAD>
__global__ void __launch_bounds__(kThreads) jsd_rows(lg_t* __restrict__ ls_buf,           // [c, V]
                                                     const lg_t* __restrict__ lt_buf,     // [c, V]
                                                     out_t* __restrict__ out_lp,          // [c, V] or null
                                                     bool write_l,
                                                     const int64_t* __restrict__ T,       // [c]
                                                     RowArgs<acc_t> q, JsdBeta<acc_t> jb,
                                                     const acc_t* __restrict__ G,         // [1] (GRAD)
                                                     acc_t* __restrict__ loss) {          // [c]
  const int64_t row = blockIdx.x;
  const int64_t V = q.V;
  lg_t* l = ls_buf + row * V;
  const lg_t* u = lt_buf + row * V;
  out_t* o = out_lp ? out_lp + row * V : nullptr;
  if (T[row] == q.ignore_index) {
    if (threadIdx.x == 0) loss[row] = acc_t(0);
    if constexpr (GRAD) fill_row(l, o, write_l, V, acc_t(0));
    return;
  }
  const acc_t sc = q.scale;
  acc_t ms = -INFINITY, ss = 0, a = 0;
  for_row<acc_t, lg_t, VEC>(l, nullptr, V, [&](acc_t x, acc_t, int64_t) { online(ms, ss, x * sc); });
  block_reduce(ms, ss, a);
  __syncthreads();  // the shared memory of block_reduce is reused
  acc_t mt = -INFINITY, st = 0;
  a = 0;
  for_row<acc_t, lg_t, VEC>(u, nullptr, V, [&](acc_t x, acc_t, int64_t) { online(mt, st, x * sc); });
  block_reduce(mt, st, a);
  // the log-softmax as (z − m) − log s: rounding m + log s would scale every exp(ls) by one common error factor,
  // which the gradient does not cancel
  const acc_t lss = log(ss), lst = log(st);
  const acc_t beta = jb.beta, lb = jb.lb, l1b = jb.l1b;
  const bool fwd_kl = beta == acc_t(0), rev_kl = beta == acc_t(1);
  acc_t A = 0, K = 0;
  for_row<acc_t, lg_t, VEC>(l, u, V, [&](acc_t xs, acc_t xt, int64_t) {
    const acc_t lsj = (xs * sc - ms) - lss, ltj = (xt * sc - mt) - lst;
    if (fwd_kl) {
      A += dev_exp(ltj) * (ltj - lsj);
    } else if (rev_kl) {
      K += dev_exp(lsj) * (lsj - ltj);
    } else {
      const acc_t lm = log_add_exp(ltj + lb, lsj + l1b);
      A += dev_exp(ltj) * (ltj - lm);
      K += dev_exp(lsj) * (lsj - lm);
    }
  });
  acc_t dm = -INFINITY, ds = 0;
  __syncthreads();
  block_reduce(dm, ds, A);
  __syncthreads();
  dm = -INFINITY;
  ds = 0;
  block_reduce(dm, ds, K);
  if (threadIdx.x == 0) loss[row] = fwd_kl ? A : rev_kl ? K : beta * A + jb.one_m * K;
  if constexpr (GRAD) {
    const acc_t gs = G[0] * sc;
    auto grad = [&](acc_t xs, acc_t xt) {
      const acc_t lsj = (xs * sc - ms) - lss, ltj = (xt * sc - mt) - lst, ps = dev_exp(lsj);
      acc_t d;
      if (fwd_kl) {
        d = ps - dev_exp(ltj);
      } else if (rev_kl) {
        d = ps * ((lsj - ltj) - K);
      } else {
        d = jb.one_m * ps * ((lsj - log_add_exp(ltj + lb, lsj + l1b)) - K);
      }
      return d * gs;
    };
    if constexpr (VEC) {  // in place, kVec per 16-byte load and store
      constexpr int kN = kVec<lg_t>;
      LVec<lg_t>* lv = reinterpret_cast<LVec<lg_t>*>(l);
      const LVec<lg_t>* uv = reinterpret_cast<const LVec<lg_t>*>(u);
      for (int64_t k = threadIdx.x; k < V / kN; k += blockDim.x) {
        const LVec<lg_t> xs = lv[k], xt = uv[k];
        LVec<lg_t> w;
#pragma unroll
        for (int e = 0; e < kN; ++e) {
          const acc_t d = grad(static_cast<acc_t>(xs.val[e]), static_cast<acc_t>(xt.val[e]));
          w.val[e] = static_cast<lg_t>(d);
          if (o) o[kN * k + e] = static_cast<out_t>(d);
        }
        if (write_l) lv[k] = w;
      }
    } else {
      for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const acc_t d = grad(static_cast<acc_t>(l[j]), static_cast<acc_t>(u[j]));
        if (write_l) l[j] = static_cast<lg_t>(d);
        if (o) o[j] = static_cast<out_t>(d);
      }
    }
  }
}

template <typename acc_t>
RowArgs<acc_t> row_args(const Problem& p, const at::Tensor& wsum) {
  RowArgs<acc_t> q;
  q.cw = p.cw.defined() ? p.cw.const_data_ptr<acc_t>() : nullptr;
  q.wsum = wsum.defined() ? wsum.const_data_ptr<acc_t>() : nullptr;
  lce::set_row_scalars(q, p);
  return q;
}

// 16-byte row access is possible: fp32 (4 per access) or, in lean mode, 16-bit (8 per access) logits with V a
// multiple of that count, and 16-byte aligned class weights (the chunk buffer itself comes aligned from the
// allocator, and each row then starts at a multiple of 16 bytes). float64 rows are read one element at a time.
template <typename acc_t, typename lg_t>
bool row_vec(const Problem& p) {
  if (!std::is_same_v<acc_t, float> || p.V % kVec<lg_t> != 0) return false;
  return !p.cw.defined() || cuda::is_aligned16(p.cw.const_data_ptr());
}

void check_cuda_dims(const Problem& p, int64_t chunk) {
  TORCH_CHECK(p.V <= INT_MAX && p.H <= INT_MAX && chunk <= INT_MAX, "opforge::", p.op, ": expected V and H at most ",
              num_str(int64_t{INT_MAX}), " (cuBLAS takes int dimensions), but got V = ", num_str(p.V), ", H = ",
              num_str(p.H));
}

// The bias in the dtype of the logits chunk (the GEMM's epilogue takes its D's dtype): p.b itself (acc dtype), or
// in lean mode p.b in the storage dtype (exact for linear_cross_entropy's own bias, which lean mode requires in that
// dtype; linear_jsd's teacher bias of another dtype is rounded once); undefined without a bias.
at::Tensor chunk_bias(const Problem& p, at::ScalarType logits_dtype) {
  return p.b.defined() ? p.b.to(logits_dtype) : at::Tensor();
}

// The chunk's logits [c, V] = X_c · Wᵀ + b, the bias (chunk_bias, L's dtype) fused into the GEMM: fp32 (float64 for
// float64), or in lean mode the storage dtype (fp32 accumulation inside the GEMM, one rounding).
void logits_gemm(const at::Tensor& L, const at::Tensor& Xc, const Problem& p, const at::Tensor& bias) {
  gemm::GemmArgs args;
  args.trans_b = true;
  if (bias.defined()) args.bias = bias;  // [V] in L's dtype
  gemm::gemm(L, Xc, p.W, args);
}

// The chunk's own gradient work from its logit gradient D [c, V] (the storage dtype): dX_c = D · W (written once);
// db += Σ_rows of the gradient L, summed in the acc dtype (L: the fp32 gradient, or in lean mode D itself).
void chunk_grads(const at::Tensor& D, const at::Tensor& L, const Problem& p, int64_t s0, const at::Tensor& dX,
                 const at::Tensor& db) {
  if (dX.defined()) gemm::gemm(dX.narrow(0, s0, D.size(0)), D, p.W);
  if (db.defined()) db.add_(at::sum(L, {0}, /*keepdim=*/false, lce::acc_dtype(p.X.scalar_type())));
}

// dW (+)= D_cᵀ · X_c for the chunk [s0, s0 + c) from its logit gradient D [c, V] (beta = 0 for the first chunk: dW
// need not be zeroed).
void chunk_dw(const at::Tensor& D, const Problem& p, int64_t s0, const at::Tensor& dW) {
  if (!dW.defined()) return;
  gemm::GemmArgs args;
  args.trans_a = true;
  args.beta = s0 == 0 ? 0.0 : 1.0;
  gemm::gemm(dW, D, p.X.narrow(0, s0, D.size(0)), args);
}

// The forward chunk loop of the three ops: per token the row value (token_value [N]), (m, r) (stats [N, 2]) and,
// where `entropy` [N] is defined, the entropy; with a gradient in `need`, also the gradients of Σ token_value · G
// (the reduction's unit scale) in the same loop. grads: dX [N, H]; dW [V, H] fp32 or p.dw_dtype (the first chunk's
// GEMM writes it); db [V] fp32 or p.db_dtype. With a `teacher` (linear_jsd), each chunk also gets the teacher's
// logits (a second GEMM, bias fused) and the row kernel is jsd_rows (no stats, no entropy). With `groups`
// (linear_preference_loss), chunks of whole groups and the gradient scale from the groups' values
// (lce::GroupedRows): the forward rows without a gradient (they leave the logits as they are), the reference head's
// logits and forward rows, then the backward rows on the same logits with the rows' G. In lean mode (p.lean) the
// logits chunks are in the storage dtype and the logit gradient overwrites the student's in place.
void forward_chunks(const Problem& p, const lce::GradNeeds& need, std::optional<int64_t> chunk_size,
                    const at::Tensor& token_value, const at::Tensor& stats, const at::Tensor& entropy,
                    const lce::GradBuffers& grads, const Problem* teacher = nullptr, double beta = 0.0,
                    lce::GroupedRows* groups = nullptr) {
  const auto dtype = p.X.scalar_type();
  const auto acc = lce::acc_dtype(dtype);
  const bool lean = p.lean;
  const auto lg_dtype = lean ? dtype : acc;  // the logits chunk's dtype
  // float16 / bfloat16 outside lean mode: the gradient GEMMs read a storage-dtype copy of dZ
  const bool low = dtype != acc && !lean;
  const bool need_grad = need.any();
  // the gradient in place in the logits chunk: fp32 where it is read again (fp32 GEMMs, the bias column sum); always
  // in lean mode (the 16-bit chunk is what the gradient GEMMs read)
  const bool write_l = lean || !low || need.db;
  const Problem* second = teacher ? teacher : groups ? groups->ref : nullptr;  // a second head's logits per chunk
  int64_t chunk =
      lean ? lce::resolve_chunk(chunk_size, p.N, p.V, kLeanChunkBudget, at::elementSize(dtype) * (second ? 2 : 1))
           : lce::resolve_chunk(chunk_size, p.N, p.V, kCudaChunkBudget,
                                at::elementSize(acc) * (second ? 2 : 1) +
                                    (need_grad && low ? at::elementSize(dtype) : 0));
  // lce::GroupedRows: the gradient here when a chunk may hold whole groups
  const bool fused_groups = groups && need_grad && (!chunk_size.has_value() || chunk >= groups->group_rows);
  if (groups) groups->fused = fused_groups;
  if (fused_groups) chunk = std::max(groups->group_rows, chunk - chunk % groups->group_rows);
  check_cuda_dims(p, chunk);
  if (second) check_cuda_dims(*second, chunk);
  if (need.dw && p.N == 0) grads.dW.zero_();
  if (p.N == 0) return;
  const at::Tensor wsum = p.cw.defined() && p.label_smoothing > 0 ? p.cw.sum().reshape({1}) : at::Tensor();
  const at::Tensor G = need_grad ? lce::unit_grad_scale(p) : at::Tensor();  // [1] on the device: no sync
  const int64_t rows = std::min(chunk, p.N);
  at::Tensor logits = at::empty({rows, p.V}, p.X.options().dtype(lg_dtype));  // [chunk, V]
  // the logit gradient in the storage dtype [chunk, V] (outside lean mode; none where lce::GroupedRows leaves the
  // gradient to a second sweep)
  const bool grad_here = need_grad && (!groups || fused_groups);
  at::Tensor dlow = grad_here && low ? at::empty({rows, p.V}, p.X.options()) : at::Tensor();
  at::Tensor tlogits = second ? at::empty({rows, p.V}, p.X.options().dtype(lg_dtype)) : at::Tensor();  // [chunk, V]
  // the reference head's stats [chunk, 2] (written by its forward rows, not kept)
  at::Tensor rstats = groups && second ? at::empty({rows, 2}, p.X.options().dtype(acc)) : at::Tensor();
  const at::Tensor bias = chunk_bias(p, lg_dtype);
  const at::Tensor tbias = second ? chunk_bias(*second, lg_dtype) : at::Tensor();
  auto stream = at::cuda::getCurrentCUDAStream();
  OPFORGE_DISPATCH_FLOATING(dtype, "opforge::linear_cross_entropy", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using out_t = scalar_t;
    const auto q = row_args<acc_t>(p, wsum);
    const acc_t* gp = need_grad ? G.const_data_ptr<acc_t>() : nullptr;
    // the loop for logits of element type lg_t (acc_t, or scalar_t in lean mode)
    auto run = [&](auto tag) {
      using lg_t = decltype(tag);
      const bool vec = row_vec<acc_t, lg_t>(p);
      for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
        const int64_t c = std::min(chunk, p.N - s0);
        const at::Tensor Xc = p.X.narrow(0, s0, c);  // [c, H]
        at::Tensor L = logits.narrow(0, 0, c);       // [c, V]
        logits_gemm(L, Xc, p, bias);
        const int64_t* T = p.T.const_data_ptr<int64_t>() + s0;
        acc_t* lp = token_value.mutable_data_ptr<acc_t>() + s0;
        acc_t* sp = stats.defined() ? stats.mutable_data_ptr<acc_t>() + 2 * s0 : nullptr;
        acc_t* ep = entropy.defined() ? entropy.mutable_data_ptr<acc_t>() + s0 : nullptr;
        lg_t* Lp = static_cast<lg_t*>(L.mutable_data_ptr());
        // dZ_c in the storage dtype: the copy outside lean mode (16-bit), else L itself
        at::Tensor D = grad_here && low ? dlow.narrow(0, 0, c) : L;
        out_t* op = grad_here && low ? static_cast<out_t*>(D.mutable_data_ptr()) : nullptr;
        if (groups) {
          const auto fwd = vec ? lce_forward_rows<acc_t, lg_t, out_t, true, false>
                               : lce_forward_rows<acc_t, lg_t, out_t, false, false>;
          fwd<<<c, kThreads, 0, stream>>>(Lp, nullptr, false, T, q, nullptr, lp, sp, nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          if (second) {
            at::Tensor Lt = tlogits.narrow(0, 0, c);
            logits_gemm(Lt, second->X.narrow(0, s0, c), *second, tbias);
            fwd<<<c, kThreads, 0, stream>>>(static_cast<lg_t*>(Lt.mutable_data_ptr()), nullptr, false, T, q, nullptr,
                                            groups->ref_value.mutable_data_ptr<acc_t>() + s0,
                                            rstats.mutable_data_ptr<acc_t>(), nullptr);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
          if (!fused_groups) continue;
          const at::Tensor Gc = groups->scale(s0, c);  // [c], on the stream after the rows' values
          const auto bwd =
              vec ? lce_backward_rows<acc_t, lg_t, out_t, true> : lce_backward_rows<acc_t, lg_t, out_t, false>;
          bwd<<<c, kThreads, 0, stream>>>(Lp, op, write_l, T, q, sp, Gc.const_data_ptr<acc_t>(), 1, nullptr, nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          chunk_grads(D, L, p, s0, grads.dX, grads.db);
          chunk_dw(D, p, s0, grads.dW);
          continue;
        }
        if (teacher) {
          at::Tensor Lt = tlogits.narrow(0, 0, c);
          logits_gemm(Lt, teacher->X.narrow(0, s0, c), *teacher, tbias);
          const lg_t* Tp = static_cast<const lg_t*>(Lt.const_data_ptr());
          const JsdBeta<acc_t> b{static_cast<acc_t>(beta), static_cast<acc_t>(std::log(beta)),
                                 static_cast<acc_t>(std::log1p(-beta)), static_cast<acc_t>(1.0 - beta)};
          if (need_grad && vec) {
            jsd_rows<acc_t, lg_t, out_t, true, true>
                <<<c, kThreads, 0, stream>>>(Lp, Tp, op, write_l, T, q, b, gp, lp);
          } else if (need_grad) {
            jsd_rows<acc_t, lg_t, out_t, false, true>
                <<<c, kThreads, 0, stream>>>(Lp, Tp, op, write_l, T, q, b, gp, lp);
          } else if (vec) {
            jsd_rows<acc_t, lg_t, out_t, true, false>
                <<<c, kThreads, 0, stream>>>(Lp, Tp, nullptr, false, T, q, b, nullptr, lp);
          } else {
            jsd_rows<acc_t, lg_t, out_t, false, false>
                <<<c, kThreads, 0, stream>>>(Lp, Tp, nullptr, false, T, q, b, nullptr, lp);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          if (!need_grad) continue;
          chunk_grads(D, L, p, s0, grads.dX, grads.db);
          chunk_dw(D, p, s0, grads.dW);
          continue;
        }
        if (!need_grad) {
          if (vec) {
            lce_forward_rows<acc_t, lg_t, out_t, true, false>
                <<<c, kThreads, 0, stream>>>(Lp, nullptr, false, T, q, nullptr, lp, sp, ep);
          } else {
            lce_forward_rows<acc_t, lg_t, out_t, false, false>
                <<<c, kThreads, 0, stream>>>(Lp, nullptr, false, T, q, nullptr, lp, sp, ep);
          }
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          continue;
        }
        if (vec) {
          lce_forward_rows<acc_t, lg_t, out_t, true, true>
              <<<c, kThreads, 0, stream>>>(Lp, op, write_l, T, q, gp, lp, sp, ep);
        } else {
          lce_forward_rows<acc_t, lg_t, out_t, false, true>
              <<<c, kThreads, 0, stream>>>(Lp, op, write_l, T, q, gp, lp, sp, ep);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        chunk_grads(D, L, p, s0, grads.dX, grads.db);
        chunk_dw(D, p, s0, grads.dW);
      }
    };
    if (lean) {
      run(scalar_t{});
    } else {
      run(acc_t{});
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lce_forward_cuda(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  c10::cuda::CUDAGuard guard(input.device());
  const Problem p = lce::forward_problem(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                         label_smoothing, z_loss, softcap, chunk_size);
  const auto opts = p.X.options().dtype(lce::acc_dtype(input.scalar_type()));
  at::Tensor token_loss = at::empty({p.N}, opts);  // [N]
  at::Tensor stats = at::empty({p.N, 2}, opts);    // [N, 2]
  const lce::GradBuffers grads(p, grad_mask, /*zero_dw=*/false);
  forward_chunks(p, lce::GradNeeds(p, grad_mask), chunk_size, token_loss, stats, at::Tensor(), grads);
  return lce::forward_outputs(p, token_loss, stats, grads, input, linear_weight, target, linear_bias);
}

// The backward chunk loop of both ops (lce::BackwardKernel). grads: dX [N, H]; dW: float32 accumulator [V, H] (the
// gradient buffer itself for float32/float64 weights, and for 16-bit ones with OPFORGE_LCE_DW_ACCUM=1 or in lean
// mode), not zeroed; db [V]. In lean mode (p.lean) the logits chunk is in the storage dtype and the gradient
// overwrites it in place.
void backward_cuda(const Problem& p, const lce::RowGrad& rg, const at::Tensor& stats, const lce::GradNeeds& need,
                   std::optional<int64_t> chunk_size, const lce::GradBuffers& grads) {
  const auto dtype = p.X.scalar_type();
  const auto acc = lce::acc_dtype(dtype);
  const bool lean = p.lean;
  const auto lg_dtype = lean ? dtype : acc;  // the logits chunk's dtype
  // float16 / bfloat16 outside lean mode: the gradient GEMMs read a storage-dtype copy of dZ
  const bool low = dtype != acc && !lean;
  const bool write_l = lean || !low || need.db;
  const int64_t chunk =
      lean ? lce::resolve_chunk(chunk_size, p.N, p.V, kLeanChunkBudget, at::elementSize(dtype))
           : lce::resolve_chunk(chunk_size, p.N, p.V, kCudaChunkBudget,
                                at::elementSize(acc) + (low ? at::elementSize(dtype) : 0));
  check_cuda_dims(p, chunk);
  if (need.dw && p.N == 0) grads.dW.zero_();
  if (!need.any() || p.N == 0) return;
  const at::Tensor S = stats.reshape({p.N, 2}).contiguous();
  const at::Tensor wsum = p.cw.defined() && p.label_smoothing > 0 ? p.cw.sum().reshape({1}) : at::Tensor();
  const int64_t rows = std::min(chunk, p.N);
  at::Tensor logits = at::empty({rows, p.V}, p.X.options().dtype(lg_dtype));   // [chunk, V]
  at::Tensor dlow = low ? at::empty({rows, p.V}, p.X.options()) : at::Tensor();  // [chunk, V]
  const at::Tensor bias = chunk_bias(p, lg_dtype);
  auto stream = at::cuda::getCurrentCUDAStream();
  OPFORGE_DISPATCH_FLOATING(dtype, "opforge::linear_cross_entropy_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using out_t = scalar_t;
    const auto q = row_args<acc_t>(p, wsum);
    // the loop for logits of element type lg_t (acc_t, or scalar_t in lean mode)
    auto run = [&](auto tag) {
      using lg_t = decltype(tag);
      const bool vec = row_vec<acc_t, lg_t>(p);
      for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
        const int64_t c = std::min(chunk, p.N - s0);
        const at::Tensor Xc = p.X.narrow(0, s0, c);  // [c, H]
        at::Tensor L = logits.narrow(0, 0, c);       // [c, V]
        logits_gemm(L, Xc, p, bias);
        at::Tensor D = low ? dlow.narrow(0, 0, c) : L;  // dZ_c in the storage dtype
        out_t* op = low ? static_cast<out_t*>(D.mutable_data_ptr()) : nullptr;
        lg_t* Lp = static_cast<lg_t*>(L.mutable_data_ptr());
        const int64_t* T = p.T.const_data_ptr<int64_t>() + s0;
        const acc_t* sp = S.const_data_ptr<acc_t>() + 2 * s0;
        const acc_t* gp = rg.G.const_data_ptr<acc_t>() + rg.g_stride * s0;
        const acc_t* gep = rg.GE.defined() ? rg.GE.const_data_ptr<acc_t>() + s0 : nullptr;
        const acc_t* emp = rg.GE.defined() ? rg.Em.const_data_ptr<acc_t>() + s0 : nullptr;
        if (vec) {
          lce_backward_rows<acc_t, lg_t, out_t, true>
              <<<c, kThreads, 0, stream>>>(Lp, op, write_l, T, q, sp, gp, rg.g_stride, gep, emp);
        } else {
          lce_backward_rows<acc_t, lg_t, out_t, false>
              <<<c, kThreads, 0, stream>>>(Lp, op, write_l, T, q, sp, gp, rg.g_stride, gep, emp);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        chunk_grads(D, L, p, s0, grads.dX, grads.db);
        chunk_dw(D, p, s0, grads.dW);
      }
    };
    if (lean) {
      run(scalar_t{});
    } else {
      run(acc_t{});
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  c10::cuda::CUDAGuard guard(input.device());
  return lce::backward(backward_cuda, /*zero_dw=*/false, grad_output, input, linear_weight, target, stats, linear_bias,
                       weight, reduction, ignore_index, label_smoothing, z_loss, softcap, output_mask, chunk_size);
}

// ---- linear_jsd: the forward loop with the teacher's logits and the JSD row ---------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> jsd_forward_cuda(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
    const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& teacher_linear_bias, double beta,
    double temperature, int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask) {
  c10::cuda::CUDAGuard guard(input.device());
  const jsd::Problems pp = jsd::forward_problems(input, linear_weight, teacher_input, teacher_linear_weight, target,
                                                 linear_bias, teacher_linear_bias, beta, temperature, ignore_index,
                                                 reduction, chunk_size);
  at::Tensor value = at::empty({pp.s.N}, pp.s.X.options().dtype(lce::acc_dtype(input.scalar_type())));  // [N]
  const lce::GradBuffers grads(pp.s, grad_mask, /*zero_dw=*/false);
  forward_chunks(pp.s, lce::GradNeeds(pp.s, grad_mask), chunk_size, value, at::Tensor(), at::Tensor(), grads, &pp.t,
                 pp.beta);
  return jsd::forward_outputs(pp, value, grads, input, linear_weight, linear_bias);
}

// ---- linear_preference_loss: the forward loop over whole pairs, the pair losses' gradient scale ---------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pref_forward_cuda(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  c10::cuda::CUDAGuard guard(input.device());
  const pref::Problems pp = pref::forward_problems(input, linear_weight, target, linear_bias, ref_input,
                                                   ref_linear_weight, ref_linear_bias, ref_chosen_logps,
                                                   ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma,
                                                   cpo_alpha, temperature, ignore_index, chunk_size);
  const auto loop = [&](const Problem& p, const lce::GradNeeds& need, const at::Tensor& value, const at::Tensor& stats,
                        const lce::GradBuffers& grads, lce::GroupedRows* groups) {
    forward_chunks(p, need, chunk_size, value, stats, at::Tensor(), grads, nullptr, 0.0, groups);
  };
  return pref::forward(pp, loop, backward_cuda, /*zero_dw=*/false, input, linear_weight, linear_bias, chunk_size,
                       grad_mask);
}

// ---- linear_log_probs: the same loops, the row value −log p(target) and the entropy -------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_forward_cuda(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, bool return_entropy, std::optional<int64_t> chunk_size) {
  c10::cuda::CUDAGuard guard(input.device());
  const Problem p = llp::forward_problem(input, linear_weight, target, linear_bias, temperature, ignore_index,
                                         softcap, chunk_size);
  const auto opts = p.X.options().dtype(lce::acc_dtype(input.scalar_type()));
  at::Tensor value = at::empty({p.N}, opts);                                    // [N]
  at::Tensor stats = at::empty({p.N, 2}, opts);                                 // [N, 2]
  at::Tensor entropy = return_entropy ? at::empty({p.N}, opts) : at::Tensor();  // [N]
  const std::array<bool, 3> none = {false, false, false};
  forward_chunks(p, lce::GradNeeds(p, none), chunk_size, value, stats, entropy,
                 lce::GradBuffers(p, none, /*zero_dw=*/false));
  return llp::forward_outputs(p, value, entropy, stats, target);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_backward_cuda(
    const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& linear_bias, double temperature,
    int64_t ignore_index, std::optional<double> softcap, std::array<bool, 3> output_mask,
    std::optional<int64_t> chunk_size) {
  c10::cuda::CUDAGuard guard(input.device());
  return llp::backward(backward_cuda, /*zero_dw=*/false, grad_log_probs, grad_entropy, input, linear_weight, target,
                       stats, entropy, linear_bias, temperature, ignore_index, softcap, output_mask, chunk_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("_linear_cross_entropy_forward", &lce_forward_cuda);
  m.impl("linear_cross_entropy_backward", &lce_backward_cuda);
  m.impl("_linear_log_probs_forward", &llp_forward_cuda);
  m.impl("linear_log_probs_backward", &llp_backward_cuda);
  m.impl("_linear_jsd_forward", &jsd_forward_cuda);
  m.impl("_linear_preference_forward", &pref_forward_cuda);
}

}  // namespace opforge
