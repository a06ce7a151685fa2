// CUDA kernels of rope: one launch for q and k, by one of two kernels (run_cuda): the token kernel wherever its
// table fits in shared memory, else the rows kernel (the test hook rope_rows_kernel of core/knobs.h forces the rows
// kernel, so tests reach it at small sizes).
//
// token kernel: the grid is (tokens, head groups); a block takes a token (b, s), builds its table C, S [R] (opmath)
// in shared memory once, then every thread of the block walks the head rows of q and k of its group. On the vector
// path it is bound to kTokenMinBlocks blocks per SM (40 registers in bf16: 12 blocks of 128 threads per SM instead of
// 9 unbounded). What bounds it: two barriers per token and the table's global-memory latency before any
// q/k load keep few bytes in flight; on the H200 (bf16 4x4096x32/8x128) it runs forward+backward in 186 us, 3608
// GB/s, 0.85 of the 4269 GB/s copy ceiling; ncu: 75 % of DRAM peak, 66 % achieved occupancy, 12.7 of 24.4 cycles
// between a warp's instructions waiting on global loads. The other kernel shapes measured against it, all slower,
// are in docs/performance/kernel_variants.md.
//
// rows kernel: a flat grid over (token, group of up to kRows head rows, unit), unit fastest. A unit is
// V = 16/sizeof(scalar) dims of a row (a rotate-half unit: the V dims at j and their partners at j + R/2; an
// interleaved unit: V dims holding V/2 pairs; past R: V dims copied). A thread loads its unit's table entries once
// (from cos/sin, 16-byte loads where the table's last dim is contiguous and aligned, else strided; or sin/cos of
// the angles in float64), issues the 16-byte loads of all its rows at once, then computes and stores them: no
// shared memory, no barrier, 32-bit index arithmetic while the problem fits. It takes any rotary_dim (1.9x the token
// kernel's time at the shape above). Rows whose last dim is not contiguous and 16-byte aligned (transposed views,
// zero-stride gradients) take either kernel with V = 1 (strided scalars).
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "core/knobs.h"
#include "core/row_cuda.cuh"
#include "ops/rope/rope.h"

namespace opforge {
namespace {

constexpr int kThreads = 128;        // token kernel
constexpr int kTokenMinBlocks = 12;  // token kernel, vector path: blocks per SM its registers must allow (16: spills)
constexpr int kRowThreads = 256;     // rows kernel
constexpr int kRows = 8;             // rows kernel: most head rows per thread
constexpr int64_t kMaxTableBytes = 48 * 1024;  // static shared-memory limit without opt-in

template <typename scalar_t, typename trig_t>
struct Params {
  const scalar_t* x[2];  // q, k: [B, H_i, S, D]
  scalar_t* y[2];        // outputs: [B, H_i, S, D]
  int64_t xs[2][4], ys[2][4];
  int H[2];              // heads of q and k (0 when absent)
  int64_t S, T;          // seq, tokens = B·S
  int D, R;
  bool interleaved, backward;
  const trig_t* cos;     // [Bc, S, R]; cs[0] = 0 when Bc == 1
  const trig_t* sin;
  int64_t cs[3], ss[3];
  const int64_t* pos;    // [Bp, S]; ps[0] = 0 when Bp == 1
  int64_t ps[2];
  double base;
  // rows kernel only
  int U, Urot;           // units per row, of which rotated (the rest copied)
  int G, K;              // row groups per token, rows per group (the last group may have fewer)
  int64_t items;         // T · G · U
  bool table_vec;        // cos/sin rows contiguous and 16-byte aligned: 16-byte table loads
  double log2_base;
};

// The token kernel. kMinBlocks: blocks per SM the register budget must allow: kTokenMinBlocks on the vector path
// (ptxas, sm_90, bf16: 40 registers, no spill without positions, 8 bytes with them; unbounded it takes 56, 9 blocks
// per SM), 0 (no bound) on the strided path.
template <typename scalar_t, typename trig_t, bool kPositions, bool kVec, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) rope_token_kernel(const Params<scalar_t, trig_t> p) {
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int V = kVec ? cuda::vec_size<scalar_t>() : 1;
  using Vx = cuda::Vec<scalar_t, V>;
  using Vm = cuda::Vec<opmath_t, V>;
  extern __shared__ __align__(32) unsigned char smem_raw[];
  opmath_t* C = reinterpret_cast<opmath_t*>(smem_raw);  // [R]
  opmath_t* Sn = C + p.R;                               // [R]

  const int rows = p.H[0] + p.H[1];
  const int per = (rows + static_cast<int>(gridDim.y) - 1) / static_cast<int>(gridDim.y);
  const int r0 = static_cast<int>(blockIdx.y) * per;
  const int r1 = min(rows, r0 + per);
  if (r0 >= r1) return;  // the whole block: no barrier is skipped by part of it
  const int half = p.R / 2;
  const int rot_units = kVec ? (p.interleaved ? p.R / V : half / V) : half;  // per row
  const int U = rot_units + (p.D - p.R) / V;                                 // units per row
  const int64_t total = static_cast<int64_t>(r1 - r0) * U;

  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int64_t b = t / p.S, s = t % p.S;
    __syncthreads();  // the previous token's table is no longer read
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      int64_t a, bb;
      rotary::pair_dims(i, p.R, p.interleaved, a, bb);
      opmath_t ca, sa, cb, sb;
      if constexpr (kPositions) {
        const double position = static_cast<double>(p.pos[b * p.ps[0] + s * p.ps[1]]);
        const double theta = position * ::pow(p.base, -2.0 * static_cast<double>(i) / static_cast<double>(p.R));
        double sd, cd;
        ::sincos(theta, &sd, &cd);
        ca = cb = static_cast<opmath_t>(cd);
        sa = sb = static_cast<opmath_t>(sd);
      } else {
        const int64_t c0 = b * p.cs[0] + s * p.cs[1], s0 = b * p.ss[0] + s * p.ss[1];
        ca = static_cast<opmath_t>(p.cos[c0 + a * p.cs[2]]);
        cb = static_cast<opmath_t>(p.cos[c0 + bb * p.cs[2]]);
        sa = static_cast<opmath_t>(p.sin[s0 + a * p.ss[2]]);
        sb = static_cast<opmath_t>(p.sin[s0 + bb * p.ss[2]]);
      }
      rotary::table_pair(ca, sa, cb, sb, p.backward, C[a], C[bb], Sn[a], Sn[bb]);
    }
    __syncthreads();

    for (int64_t idx = threadIdx.x; idx < total; idx += blockDim.x) {
      const int row = r0 + static_cast<int>(idx / U);
      const int u = static_cast<int>(idx % U);
      const int w = row < p.H[0] ? 0 : 1;
      const int64_t h = w == 0 ? row : row - p.H[0];
      const scalar_t* x = p.x[w] + b * p.xs[w][0] + h * p.xs[w][1] + s * p.xs[w][2];
      scalar_t* y = p.y[w] + b * p.ys[w][0] + h * p.ys[w][1] + s * p.ys[w][2];
      if constexpr (kVec) {
        if (u < rot_units) {
          if (p.interleaved) {
            // y[2i] = x[2i]·C[2i] + x[2i+1]·S[2i]; y[2i+1] = x[2i+1]·C[2i+1] + x[2i]·S[2i+1]
            const int j = u * V;
            const Vx xv = *reinterpret_cast<const Vx*>(x + j);
            const Vm c = *reinterpret_cast<const Vm*>(C + j), sn = *reinterpret_cast<const Vm*>(Sn + j);
            Vx yv;
#pragma unroll
            for (int e = 0; e < V; e += 2) {
              const opmath_t x0 = static_cast<opmath_t>(xv.val[e]), x1 = static_cast<opmath_t>(xv.val[e + 1]);
              yv.val[e] = static_cast<scalar_t>(x0 * c.val[e] + x1 * sn.val[e]);
              yv.val[e + 1] = static_cast<scalar_t>(x1 * c.val[e + 1] + x0 * sn.val[e + 1]);
            }
            *reinterpret_cast<Vx*>(y + j) = yv;
          } else {
            // y[j] = x[j]·C[j] + x[j+h]·S[j]; y[j+h] = x[j+h]·C[j+h] + x[j]·S[j+h]   (h = R/2)
            const int j = u * V;
            const Vx xa = *reinterpret_cast<const Vx*>(x + j), xb = *reinterpret_cast<const Vx*>(x + j + half);
            const Vm ca = *reinterpret_cast<const Vm*>(C + j), cb = *reinterpret_cast<const Vm*>(C + j + half);
            const Vm sa = *reinterpret_cast<const Vm*>(Sn + j), sb = *reinterpret_cast<const Vm*>(Sn + j + half);
            Vx ya, yb;
#pragma unroll
            for (int e = 0; e < V; ++e) {
              const opmath_t a0 = static_cast<opmath_t>(xa.val[e]), b0 = static_cast<opmath_t>(xb.val[e]);
              ya.val[e] = static_cast<scalar_t>(a0 * ca.val[e] + b0 * sa.val[e]);
              yb.val[e] = static_cast<scalar_t>(b0 * cb.val[e] + a0 * sb.val[e]);
            }
            *reinterpret_cast<Vx*>(y + j) = ya;
            *reinterpret_cast<Vx*>(y + j + half) = yb;
          }
        } else {  // dims past R: copied bit-identical
          const int j = p.R + (u - rot_units) * V;
          *reinterpret_cast<Vx*>(y + j) = *reinterpret_cast<const Vx*>(x + j);
        }
      } else {
        const int64_t xd = p.xs[w][3], yd = p.ys[w][3];
        if (u < rot_units) {
          int64_t a, bb;
          rotary::pair_dims(u, p.R, p.interleaved, a, bb);
          const opmath_t xa = static_cast<opmath_t>(x[a * xd]), xb = static_cast<opmath_t>(x[bb * xd]);
          y[a * yd] = static_cast<scalar_t>(xa * C[a] + xb * Sn[a]);
          y[bb * yd] = static_cast<scalar_t>(xb * C[bb] + xa * Sn[bb]);
        } else {
          const int64_t j = p.R + (u - rot_units);
          y[j * yd] = x[j * xd];
        }
      }
    }
  }
}

// ---- rows kernel ---------------------------------------------------------------------------------------------

// V table entries of T at p (element stride `stride`) as opmath: 16-byte loads when `vec` (then stride is 1 and p
// 16-byte aligned; V·sizeof(T) is a multiple of 16 since T is scalar_t or its wider opmath type), else strided.
template <int V, typename T, typename opmath_t>
__device__ __forceinline__ void load_entries(const T* p, int64_t stride, bool vec, opmath_t (&out)[V]) {
  if constexpr (V > 1) {
    constexpr int N = 16 / static_cast<int>(sizeof(T));
    static_assert(V % N == 0, "a unit's table entries are whole 16-byte vectors");
    if (vec) {
#pragma unroll
      for (int c = 0; c < V / N; ++c) {
        const cuda::Vec<T, N> v = *reinterpret_cast<const cuda::Vec<T, N>*>(p + c * N);
#pragma unroll
        for (int e = 0; e < N; ++e) out[c * N + e] = static_cast<opmath_t>(v.val[e]);
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) out[e] = static_cast<opmath_t>(p[e * stride]);
}

// cos θ, sin θ of pair i: θ = position · base^(−2i/R), in float64.
__device__ __forceinline__ void angle(double position, int i, int R, double log2_base, double& c, double& s) {
  const double theta = position * ::exp2(-2.0 * static_cast<double>(i) / static_cast<double>(R) * log2_base);
  ::sincos(theta, &s, &c);
}

// V elements of a row at element offset j (element stride d; 1 and 16-byte aligned when V > 1).
template <int V, typename T>
__device__ __forceinline__ cuda::Vec<T, V> load_row(const T* x, int64_t j, int64_t d) {
  if constexpr (V > 1) {
    return *reinterpret_cast<const cuda::Vec<T, V>*>(x + j);
  } else {
    return cuda::Vec<T, 1>{{x[j * d]}};
  }
}
template <int V, typename T>
__device__ __forceinline__ void store_row(T* y, int64_t j, int64_t d, const cuda::Vec<T, V>& v) {
  if constexpr (V > 1) {
    *reinterpret_cast<cuda::Vec<T, V>*>(y + j) = v;
  } else {
    y[j * d] = v.val[0];
  }
}

// The table of a pair unit (rotate-half with V > 1: dims ja + e paired with jb + e; V == 1: pair u of either
// convention at dims ja, jb): Ca, Cb, Sa, Sb [V] in opmath, from cos/sin rows cosr/sinr (strides p.cs[2], p.ss[2];
// 16-byte loads when p.table_vec) or, kPositions, from the angles of pairs u·V + e (u when V == 1) at `position`.
template <bool kPositions, int V, typename scalar_t, typename trig_t, typename opmath_t>
__device__ __forceinline__ void pair_table(const Params<scalar_t, trig_t>& p, const trig_t* cosr, const trig_t* sinr,
                                           double position, int u, int64_t ja, int64_t jb, opmath_t (&Ca)[V],
                                           opmath_t (&Cb)[V], opmath_t (&Sa)[V], opmath_t (&Sb)[V]) {
  if constexpr (kPositions) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      double c, sn;
      angle(position, V > 1 ? u * V + e : u, p.R, p.log2_base, c, sn);
      const opmath_t co = static_cast<opmath_t>(c), si = static_cast<opmath_t>(sn);
      rotary::table_pair(co, si, co, si, p.backward, Ca[e], Cb[e], Sa[e], Sb[e]);
    }
  } else {
    opmath_t ca[V], cb[V], sa[V], sb[V];
    load_entries<V>(cosr + ja * p.cs[2], p.cs[2], p.table_vec, ca);
    load_entries<V>(cosr + jb * p.cs[2], p.cs[2], p.table_vec, cb);
    load_entries<V>(sinr + ja * p.ss[2], p.ss[2], p.table_vec, sa);
    load_entries<V>(sinr + jb * p.ss[2], p.ss[2], p.table_vec, sb);
#pragma unroll
    for (int e = 0; e < V; ++e) rotary::table_pair(ca[e], sa[e], cb[e], sb[e], p.backward, Ca[e], Cb[e], Sa[e], Sb[e]);
  }
}

// The table of an interleaved unit (V > 1, even): the V dims from j = u·V hold pairs (j + e, j + e + 1), e even;
// C, Sn [V] in opmath, from cos/sin rows as in pair_table or, kPositions, from the angles of pairs u·V/2 + e/2.
template <bool kPositions, int V, typename scalar_t, typename trig_t, typename opmath_t>
__device__ __forceinline__ void interleaved_table(const Params<scalar_t, trig_t>& p, const trig_t* cosr,
                                                  const trig_t* sinr, double position, int u, int64_t j,
                                                  opmath_t (&C)[V], opmath_t (&Sn)[V]) {
  static_assert(V % 2 == 0, "an interleaved unit holds whole pairs");
  if constexpr (kPositions) {
#pragma unroll
    for (int e = 0; e < V; e += 2) {
      double c, sn;
      angle(position, u * (V / 2) + e / 2, p.R, p.log2_base, c, sn);
      const opmath_t co = static_cast<opmath_t>(c), si = static_cast<opmath_t>(sn);
      rotary::table_pair(co, si, co, si, p.backward, C[e], C[e + 1], Sn[e], Sn[e + 1]);
    }
  } else {
    opmath_t cv[V], sv[V];
    load_entries<V>(cosr + j * p.cs[2], p.cs[2], p.table_vec, cv);
    load_entries<V>(sinr + j * p.ss[2], p.ss[2], p.table_vec, sv);
#pragma unroll
    for (int e = 0; e < V; e += 2)
      rotary::table_pair(cv[e], sv[e], cv[e + 1], sv[e + 1], p.backward, C[e], C[e + 1], Sn[e], Sn[e + 1]);
  }
}

// A pair unit rotated: ya[e] = xa[e]·Ca[e] + xb[e]·Sa[e], yb[e] = xb[e]·Cb[e] + xa[e]·Sb[e] (opmath, rounded once).
template <int V, typename scalar_t, typename opmath_t>
__device__ __forceinline__ void rotate_pair(const cuda::Vec<scalar_t, V>& xa, const cuda::Vec<scalar_t, V>& xb,
                                            const opmath_t (&Ca)[V], const opmath_t (&Cb)[V], const opmath_t (&Sa)[V],
                                            const opmath_t (&Sb)[V], cuda::Vec<scalar_t, V>& ya,
                                            cuda::Vec<scalar_t, V>& yb) {
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const opmath_t a = static_cast<opmath_t>(xa.val[e]), c = static_cast<opmath_t>(xb.val[e]);
    ya.val[e] = static_cast<scalar_t>(a * Ca[e] + c * Sa[e]);
    yb.val[e] = static_cast<scalar_t>(c * Cb[e] + a * Sb[e]);
  }
}

// An interleaved unit rotated: y[e] = x[e]·C[e] + x[e+1]·Sn[e], y[e+1] = x[e+1]·C[e+1] + x[e]·Sn[e+1], e even.
template <int V, typename scalar_t, typename opmath_t>
__device__ __forceinline__ cuda::Vec<scalar_t, V> rotate_interleaved(const cuda::Vec<scalar_t, V>& x,
                                                                     const opmath_t (&C)[V], const opmath_t (&Sn)[V]) {
  cuda::Vec<scalar_t, V> y;
#pragma unroll
  for (int e = 0; e < V; e += 2) {
    const opmath_t x0 = static_cast<opmath_t>(x.val[e]), x1 = static_cast<opmath_t>(x.val[e + 1]);
    y.val[e] = static_cast<scalar_t>(x0 * C[e] + x1 * Sn[e]);
    y.val[e + 1] = static_cast<scalar_t>(x1 * C[e + 1] + x0 * Sn[e + 1]);
  }
  return y;
}

template <typename scalar_t, typename trig_t, bool kPositions, int V>
__global__ void __launch_bounds__(kRowThreads) rope_rows_kernel(const Params<scalar_t, trig_t> p) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vx = cuda::Vec<scalar_t, V>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.items; i += step) {
    // (token t, group g, unit u), u fastest: 32-bit divisions while the problem fits (always, in practice)
    int u, g;
    int64_t t, b, s;
    if (p.items <= static_cast<int64_t>(UINT32_MAX)) {
      const uint32_t ii = static_cast<uint32_t>(i), q = ii / static_cast<uint32_t>(p.U);
      u = static_cast<int>(ii - q * static_cast<uint32_t>(p.U));
      const uint32_t tt = q / static_cast<uint32_t>(p.G);
      g = static_cast<int>(q - tt * static_cast<uint32_t>(p.G));
      const uint32_t bb = tt / static_cast<uint32_t>(p.S);
      t = tt;
      b = bb;
      s = tt - bb * static_cast<uint32_t>(p.S);
    } else {
      const int64_t q = i / p.U;
      u = static_cast<int>(i - q * p.U);
      t = q / p.G;
      g = static_cast<int>(q - t * p.G);
      b = t / p.S;
      s = t - b * p.S;
    }
    (void)t;
    const int r0 = g * p.K, n = min(p.K, p.H[0] + p.H[1] - r0);
    if (n <= 0) continue;
    // row r of this token: q's head r, or k's head r − Hq
    const scalar_t* xq = p.x[0] + b * p.xs[0][0] + s * p.xs[0][2];
    const scalar_t* xk = p.x[1] + b * p.xs[1][0] + s * p.xs[1][2];
    scalar_t* yq = p.y[0] + b * p.ys[0][0] + s * p.ys[0][2];
    scalar_t* yk = p.y[1] + b * p.ys[1][0] + s * p.ys[1][2];
    const int64_t xdq = p.xs[0][3], xdk = p.xs[1][3], ydq = p.ys[0][3], ydk = p.ys[1][3];
    auto xrow = [&](int r) { return r < p.H[0] ? xq + r * p.xs[0][1] : xk + (r - p.H[0]) * p.xs[1][1]; };
    auto yrow = [&](int r) { return r < p.H[0] ? yq + r * p.ys[0][1] : yk + (r - p.H[0]) * p.ys[1][1]; };
    auto xd = [&](int r) { return r < p.H[0] ? xdq : xdk; };
    auto yd = [&](int r) { return r < p.H[0] ? ydq : ydk; };

    if (u >= p.Urot) {  // dims past R: copied bit-identical
      const int64_t j = p.R + static_cast<int64_t>(u - p.Urot) * V;
      Vx xv[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < n) xv[r] = load_row<V>(xrow(r0 + r), j, xd(r0 + r));
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < n) store_row<V>(yrow(r0 + r), j, yd(r0 + r), xv[r]);
      continue;
    }

    double position = 0.0;
    if constexpr (kPositions) position = static_cast<double>(p.pos[b * p.ps[0] + s * p.ps[1]]);
    const trig_t* cosr = nullptr;
    const trig_t* sinr = nullptr;
    if constexpr (!kPositions) {
      cosr = p.cos + b * p.cs[0] + s * p.cs[1];
      sinr = p.sin + b * p.ss[0] + s * p.ss[1];
    }

    if (V == 1 || !p.interleaved) {
      // pair units: V dims at ja, each paired with the same element of the V dims at jb
      int64_t ja, jb;
      if constexpr (V > 1) {
        ja = static_cast<int64_t>(u) * V;
        jb = ja + p.R / 2;
      } else {
        rotary::pair_dims(u, p.R, p.interleaved, ja, jb);
      }
      opmath_t Ca[V], Cb[V], Sa[V], Sb[V];
      pair_table<kPositions, V>(p, cosr, sinr, position, u, ja, jb, Ca, Cb, Sa, Sb);
      Vx xa[kRows], xb[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < n) {
          const scalar_t* x = xrow(r0 + r);
          const int64_t d = xd(r0 + r);
          xa[r] = load_row<V>(x, ja, d);
          xb[r] = load_row<V>(x, jb, d);
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < n) {
          Vx ya, yb;
          rotate_pair(xa[r], xb[r], Ca, Cb, Sa, Sb, ya, yb);
          scalar_t* y = yrow(r0 + r);
          const int64_t d = yd(r0 + r);
          store_row<V>(y, ja, d, ya);
          store_row<V>(y, jb, d, yb);
        }
      }
    } else if constexpr (V > 1) {
      // interleaved units: V dims from j = u·V, pairs (j + 2e, j + 2e + 1)
      const int64_t j = static_cast<int64_t>(u) * V;
      opmath_t C[V], Sn[V];
      interleaved_table<kPositions, V>(p, cosr, sinr, position, u, j, C, Sn);
      Vx xv[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
        if (r < n) xv[r] = load_row<V>(xrow(r0 + r), j, 1);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < n) {
          store_row<V>(yrow(r0 + r), j, 1, rotate_interleaved(xv[r], C, Sn));
        }
      }
    }
  }
}

// ---- launch ----------------------------------------------------------------------------------------------------

// True when every defined row of x and y can move as aligned V-element vectors.
bool vectorizable(const rotary::Problem& p, int V) {
  if (p.D % V != 0 || (p.interleaved ? p.R % V != 0 : (p.R / 2) % V != 0)) return false;
  for (int i = 0; i < 2; ++i) {
    if (!p.x[i].defined()) continue;
    for (const at::Tensor* t : {&p.x[i], &p.y[i]}) {
      if (t->stride(3) != 1 || !cuda::is_aligned16(t->const_data_ptr())) return false;
      for (int d = 0; d < 3; ++d)
        if (t->stride(d) % V != 0) return false;
    }
  }
  return true;
}

// True when the cos/sin rows of a table of `elem` bytes per entry can be read as 16-byte vectors.
bool table_vectorizable(const rotary::Problem& p, int64_t elem) {
  const int64_t N = 16 / elem;
  for (const at::Tensor* t : {&p.cos, &p.sin}) {
    if (t->stride(2) != 1 || !cuda::is_aligned16(t->const_data_ptr())) return false;
    if ((t->size(0) != 1 && t->stride(0) % N != 0) || t->stride(1) % N != 0) return false;
  }
  return true;
}

template <typename scalar_t, typename trig_t>
Params<scalar_t, trig_t> make_params(const rotary::Problem& p, int64_t T) {
  Params<scalar_t, trig_t> P{};
  for (int i = 0; i < 2; ++i) {
    P.H[i] = 0;
    if (!p.x[i].defined()) continue;
    P.x[i] = p.x[i].const_data_ptr<scalar_t>();
    P.y[i] = p.y[i].mutable_data_ptr<scalar_t>();
    P.H[i] = static_cast<int>(p.x[i].size(1));
    for (int d = 0; d < 4; ++d) {
      P.xs[i][d] = p.x[i].stride(d);
      P.ys[i][d] = p.y[i].stride(d);
    }
  }
  P.S = p.S;
  P.T = T;
  P.D = static_cast<int>(p.D);
  P.R = static_cast<int>(p.R);
  P.interleaved = p.interleaved;
  P.backward = p.backward;
  P.base = p.base;
  P.log2_base = std::log2(p.base);
  if (p.positions.defined()) {
    P.pos = p.positions.const_data_ptr<int64_t>();
    P.ps[0] = p.positions.size(0) == 1 ? 0 : p.positions.stride(0);
    P.ps[1] = p.positions.stride(1);
  } else {
    P.cos = p.cos.const_data_ptr<trig_t>();
    P.sin = p.sin.const_data_ptr<trig_t>();
    for (int d = 0; d < 3; ++d) {
      P.cs[d] = p.cos.stride(d);
      P.ss[d] = p.sin.stride(d);
    }
    if (p.cos.size(0) == 1) P.cs[0] = P.ss[0] = 0;
  }
  return P;
}

// One token-kernel launch. Grid: SMs x 32 blocks along tokens (each loops over tokens), times `groups` along rows
// where there are few tokens.
template <typename scalar_t, typename trig_t, bool kPositions, bool kVec, int kMinBlocks>
void launch_token_kernel(const Params<scalar_t, trig_t>& P, int rows, int64_t T, size_t smem) {
  constexpr auto kernel = rope_token_kernel<scalar_t, trig_t, kPositions, kVec, kMinBlocks>;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks_x = std::min<int64_t>(T, sms * 32);
  int64_t groups = 1;
  if (T < sms * 4) groups = std::min<int64_t>({static_cast<int64_t>(rows), (sms * 4 + T - 1) / T, 65535});
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(groups));
  kernel<<<grid, kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename trig_t>
void launch_token(const rotary::Problem& p, int rows, int64_t T) {
  using opmath_t = at::opmath_type<scalar_t>;
  const Params<scalar_t, trig_t> P = make_params<scalar_t, trig_t>(p, T);
  const size_t smem = 2 * static_cast<size_t>(p.R) * sizeof(opmath_t);
  const bool vec = vectorizable(p, cuda::vec_size<scalar_t>());
  if (p.positions.defined()) {
    vec ? launch_token_kernel<scalar_t, trig_t, true, true, kTokenMinBlocks>(P, rows, T, smem)
        : launch_token_kernel<scalar_t, trig_t, true, false, 0>(P, rows, T, smem);
  } else {
    vec ? launch_token_kernel<scalar_t, trig_t, false, true, kTokenMinBlocks>(P, rows, T, smem)
        : launch_token_kernel<scalar_t, trig_t, false, false, 0>(P, rows, T, smem);
  }
}

template <typename scalar_t, typename trig_t, int V>
void launch_rows_v(const rotary::Problem& p, int rows, int64_t T) {
  Params<scalar_t, trig_t> P = make_params<scalar_t, trig_t>(p, T);
  const int64_t half = p.R / 2;
  P.Urot = static_cast<int>(V > 1 ? (p.interleaved ? p.R / V : half / V) : half);
  P.U = P.Urot + static_cast<int>((p.D - p.R) / V);
  P.G = (rows + kRows - 1) / kRows;
  P.K = (rows + P.G - 1) / P.G;  // balanced groups: K ≤ kRows
  P.items = T * P.G * P.U;
  P.table_vec = V > 1 && p.cos.defined() && table_vectorizable(p, p.cos.element_size());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((P.items + kRowThreads - 1) / kRowThreads, sms * 64));
  auto stream = at::cuda::getCurrentCUDAStream();
  if (p.positions.defined()) {
    rope_rows_kernel<scalar_t, trig_t, true, V><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(P);
  } else {
    rope_rows_kernel<scalar_t, trig_t, false, V><<<static_cast<unsigned>(blocks), kRowThreads, 0, stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename trig_t>
void launch_rows(const rotary::Problem& p, int rows, int64_t T) {
  constexpr int V = cuda::vec_size<scalar_t>();
  if (vectorizable(p, V)) {
    launch_rows_v<scalar_t, trig_t, V>(p, rows, T);
  } else {
    launch_rows_v<scalar_t, trig_t, 1>(p, rows, T);
  }
}

void run_cuda(const rotary::Problem& p) {
  const at::Tensor& ref = p.x[0].defined() ? p.x[0] : p.x[1];
  c10::cuda::CUDAGuard guard(ref.device());
  int64_t rows = 0;
  for (int i = 0; i < 2; ++i) rows += p.x[i].defined() ? p.x[i].size(1) : 0;
  const int64_t T = p.B * p.S;
  if (T == 0 || rows == 0) return;
  TORCH_CHECK(rows <= std::numeric_limits<int>::max() / 2 && p.D <= std::numeric_limits<int>::max() / 2,
              "opforge::rope: expected fewer than 2^30 heads and head_dim below 2^30 on CUDA, but got ",
              num_str(rows), " heads and head_dim ", num_str(p.D));
  // The token kernel wherever its table fits in shared memory (H200, bf16 4x4096x32/8x128: forward+backward 182 us
  // against the rows kernel's 348), else the rows kernel, which takes any rotary_dim.
  const int64_t opmath_bytes = ref.scalar_type() == at::kDouble ? 8 : 4;
  const bool table_fits = 2 * p.R * opmath_bytes <= kMaxTableBytes;
  const bool rows_kernel = !table_fits || knobs::get(knobs::Knob::kRopeRowsKernel) != 0;
  const bool table_in_opmath = p.cos.defined() && p.cos.scalar_type() != ref.scalar_type();
  OPFORGE_DISPATCH_FLOATING(ref.scalar_type(), "opforge::rope", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    auto launch = [&](auto trig) {
      using trig_t = decltype(trig);
      rows_kernel ? launch_rows<scalar_t, trig_t>(p, static_cast<int>(rows), T)
                  : launch_token<scalar_t, trig_t>(p, static_cast<int>(rows), T);
    };
    if (table_in_opmath) {
      launch(opmath_t{});
    } else {
      launch(scalar_t{});
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  m.impl("rope", &rotary::Kernels<&run_cuda>::rope);
  m.impl("rope_backward", &rotary::Kernels<&run_cuda>::rope_backward);
  m.impl("rope_from_positions", &rotary::Kernels<&run_cuda>::rope_from_positions);
  m.impl("rope_from_positions_backward", &rotary::Kernels<&run_cuda>::rope_from_positions_backward);
}

}  // namespace opforge
