// CUDA kernels of rope: one launch for q and k. The grid is (tokens, head groups): a block takes a token (b, s),
// builds its table C, S [R] (opmath) in shared memory once (from cos/sin, any strides, or from the position in
// float64), then every thread of the block walks the head rows of q and k of its group. Rows whose last dim is
// contiguous and 16-byte aligned move 16-byte vectors (a rotate-half thread loads the vector at j and its partner
// at j + R/2); any other layout (transposed, zero-stride gradients) takes the strided scalar loop. 64-bit offsets.
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "core/check.h"
#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "ops/rope/rope.h"

namespace opforge {
namespace {

constexpr int kThreads = 128;
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
};

template <typename scalar_t, typename trig_t, bool kPositions, bool kVec>
__global__ void __launch_bounds__(kThreads) rope_kernel(const Params<scalar_t, trig_t> p) {
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

template <typename scalar_t, typename trig_t>
void launch(const rotary::Problem& p, int rows, int64_t T) {
  using opmath_t = at::opmath_type<scalar_t>;
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
  const bool positions = p.positions.defined();
  if (positions) {
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

  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks_x = std::min<int64_t>(T, sms * 32);
  int64_t groups = 1;
  if (T < sms * 4) groups = std::min<int64_t>({static_cast<int64_t>(rows), (sms * 4 + T - 1) / T, 65535});
  const dim3 grid(static_cast<unsigned>(blocks_x), static_cast<unsigned>(groups));
  const size_t smem = 2 * static_cast<size_t>(p.R) * sizeof(opmath_t);
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool vec = vectorizable(p, cuda::vec_size<scalar_t>());
  if (positions) {
    if (vec) {
      rope_kernel<scalar_t, trig_t, true, true><<<grid, kThreads, smem, stream>>>(P);
    } else {
      rope_kernel<scalar_t, trig_t, true, false><<<grid, kThreads, smem, stream>>>(P);
    }
  } else {
    if (vec) {
      rope_kernel<scalar_t, trig_t, false, true><<<grid, kThreads, smem, stream>>>(P);
    } else {
      rope_kernel<scalar_t, trig_t, false, false><<<grid, kThreads, smem, stream>>>(P);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const int64_t opmath_bytes = ref.scalar_type() == at::kDouble ? 8 : 4;
  TORCH_CHECK(2 * p.R * opmath_bytes <= kMaxTableBytes, "opforge::rope: expected rotary_dim of at most ",
              num_str(kMaxTableBytes / (2 * opmath_bytes)), " on CUDA for ", ref.scalar_type(),
              " (its per-token table lives in shared memory), but got ", num_str(p.R),
              "; run this size on the CPU or split head_dim");
  const bool table_in_opmath = p.cos.defined() && p.cos.scalar_type() != ref.scalar_type();
  OPFORGE_DISPATCH_FLOATING(ref.scalar_type(), "opforge::rope", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    if (table_in_opmath) {
      launch<scalar_t, opmath_t>(p, static_cast<int>(rows), T);
    } else {
      launch<scalar_t, scalar_t>(p, static_cast<int>(rows), T);
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
