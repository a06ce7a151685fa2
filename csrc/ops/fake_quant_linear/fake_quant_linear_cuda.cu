// CUDA kernels of fake_quant_linear: the group-wise fake quantization in one kernel (a team of threads per
// group: min/max with 16-byte loads, a team reduction, the group's scale and zero point, then the quantized
// values and the in-range mask, the second read hitting L1/L2), the GEMMs through opforge::linear /
// linear_backward (cuBLASLt with the bias epilogue, db fused into the dW GEMM). The scalar math is
// fake_quant_math.h's, shared with the CPU kernels: CPU and CUDA give the same bits.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "core/cuda_utils.cuh"
#include "core/dispatch.h"
#include "ops/fake_quant_linear/fake_quant_linear.h"
#include "ops/fake_quant_linear/fake_quant_math.h"

namespace opforge {
namespace fake_quant_linear_op {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

/// min and max (NaN propagating) over the TEAM threads of a team (TEAM a power of two ≤ 32, or kThreads: the whole block).
/// Every thread of the block calls it the same number of times (the caller's loop is uniform per block).
template <typename C, int TEAM>
__device__ __forceinline__ void team_minmax(C& mn, C& mx, C* smem /* [2 * kWarps] */) {
  constexpr int W = TEAM < 32 ? TEAM : 32;
#pragma unroll
  for (int off = W / 2; off > 0; off >>= 1) {
    mn = fq::nan_min(mn, __shfl_xor_sync(0xffffffffu, mn, off, W));
    mx = fq::nan_max(mx, __shfl_xor_sync(0xffffffffu, mx, off, W));
  }
  if constexpr (TEAM > 32) {
    static_assert(TEAM == kThreads, "a team wider than a warp is the whole block");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // the previous group's readers of smem are done
    if (lane == 0) {
      smem[warp] = mn;
      smem[kWarps + warp] = mx;
    }
    __syncthreads();
    mn = smem[0];
    mx = smem[kWarps];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      mn = fq::nan_min(mn, smem[w]);
      mx = fq::nan_max(mx, smem[kWarps + w]);
    }
  }
}

/// Fake-quantizes n_groups consecutive groups of L elements each (X and Y [n_groups, L] contiguous); with
/// tensor_min/tensor_max (device scalars, the whole tensor's min and max) one scale for all, written to
/// scale[0] / zero_point[0], else each group's own, written to scale[g] / zero_point[g].
template <typename scalar_t, int TEAM, int VEC>
__global__ void __launch_bounds__(kThreads)
    fake_quantize_groups_kernel(const scalar_t* __restrict__ X,  // [n_groups, L]
                                scalar_t* __restrict__ Y,        // [n_groups, L]
                                bool* __restrict__ mask,         // [n_groups, L] or nullptr
                                float* __restrict__ scale,       // [n_groups] (or [1])
                                int32_t* __restrict__ zero_point,  // [n_groups] (or [1])
                                int64_t n_groups, int64_t L, int qmin, int qmax, bool symmetric,
                                const scalar_t* __restrict__ tensor_min, const scalar_t* __restrict__ tensor_max) {
  using C = at::opmath_type<scalar_t>;
  using V = cuda::Vec<scalar_t, VEC>;
  struct alignas(VEC) MaskVec {
    bool val[VEC];
  };
  constexpr int kTeams = kThreads / TEAM;
  __shared__ C smem[2 * kWarps];
  const int team = threadIdx.x / TEAM, lane = threadIdx.x % TEAM;
  const int64_t nvec = L / VEC;
  const bool per_tensor = tensor_min != nullptr;
  fq::QParams tensor_qp{};
  if (per_tensor) {
    tensor_qp = fq::choose_qparams<C>(static_cast<C>(*tensor_min), static_cast<C>(*tensor_max), qmin, qmax, symmetric);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      scale[0] = tensor_qp.scale;
      zero_point[0] = tensor_qp.zero_point;
    }
  }
  // g0 is uniform across the block, so every thread runs the same iterations (shuffles and barriers are safe).
  for (int64_t g0 = static_cast<int64_t>(blockIdx.x) * kTeams; g0 < n_groups;
       g0 += static_cast<int64_t>(gridDim.x) * kTeams) {
    const int64_t g = g0 + team;
    const bool active = g < n_groups;
    const int64_t base = g * L;  // 64-bit element offset
    fq::QParams qp = tensor_qp;
    if (!per_tensor) {
      // lo, hi = min, max of the group (NaN propagates)
      C mn = static_cast<C>(INFINITY), mx = static_cast<C>(-INFINITY);
      if (active) {
        for (int64_t v = lane; v < nvec; v += TEAM) {
          const V in = *reinterpret_cast<const V*>(X + base + v * VEC);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            fq::minmax_update(mn, mx, static_cast<C>(in.val[j]));
          }
        }
      }
      team_minmax<C, TEAM>(mn, mx, smem);
      qp = fq::choose_qparams<C>(mn, mx, qmin, qmax, symmetric);
      if (active && lane == 0) {
        scale[g] = qp.scale;
        zero_point[g] = qp.zero_point;
      }
    }
    if (!active) continue;
    // y = (clamp(round(x · inv_scale) + zp, qmin, qmax) − zp) · scale; mask = in range before the clamp
    for (int64_t v = lane; v < nvec; v += TEAM) {
      const V in = *reinterpret_cast<const V*>(X + base + v * VEC);
      V out;
      MaskVec m;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        bool in_range;
        out.val[j] = static_cast<scalar_t>(fq::fake_quantize_value<C>(static_cast<C>(in.val[j]), qp, qmin, qmax, in_range));
        m.val[j] = in_range;
      }
      *reinterpret_cast<V*>(Y + base + v * VEC) = out;
      if (mask != nullptr) *reinterpret_cast<MaskVec*>(mask + base + v * VEC) = m;
    }
  }
}

template <typename scalar_t, int TEAM, int VEC>
void launch_groups(const at::Tensor& X, FakeQuantized& out, int64_t n_groups, int64_t L, int qmin, int qmax,
                   bool symmetric, const at::Tensor& tmin, const at::Tensor& tmax) {
  constexpr int kTeams = kThreads / TEAM;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n_groups + kTeams - 1) / kTeams, sms * 8));
  auto stream = at::cuda::getCurrentCUDAStream();
  fake_quantize_groups_kernel<scalar_t, TEAM, VEC><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      X.const_data_ptr<scalar_t>(), out.output.mutable_data_ptr<scalar_t>(),
      out.mask.defined() ? out.mask.mutable_data_ptr<bool>() : nullptr, out.scale.mutable_data_ptr<float>(),
      out.zero_point.mutable_data_ptr<int32_t>(), n_groups, L, qmin, qmax, symmetric,
      tmin.defined() ? tmin.const_data_ptr<scalar_t>() : nullptr,
      tmax.defined() ? tmax.const_data_ptr<scalar_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int VEC>
void launch_groups_team(const at::Tensor& X, FakeQuantized& out, int64_t n_groups, int64_t L, int qmin, int qmax,
                        bool symmetric, const at::Tensor& tmin, const at::Tensor& tmax) {
  // The team: enough threads for the group's vectors, from 8 up to the whole block.
  const int64_t nvec = L / VEC;
  if (nvec <= 8) {
    launch_groups<scalar_t, 8, VEC>(X, out, n_groups, L, qmin, qmax, symmetric, tmin, tmax);
  } else if (nvec <= 256) {
    launch_groups<scalar_t, 32, VEC>(X, out, n_groups, L, qmin, qmax, symmetric, tmin, tmax);
  } else {
    launch_groups<scalar_t, kThreads, VEC>(X, out, n_groups, L, qmin, qmax, symmetric, tmin, tmax);
  }
}

}  // namespace

FakeQuantized fake_quantize_rows_cuda(const at::Tensor& X, int64_t bits, Grouping g, bool symmetric,
                                      bool want_mask) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous());
  const c10::cuda::CUDAGuard device_guard(X.device());
  const int64_t R = X.size(0), K = X.size(1);
  const int64_t L = g.length;
  const int64_t n_groups = L > 0 ? R * (K / L) : 0;
  const int qmin = fq::qmin_of(static_cast<int>(bits)), qmax = fq::qmax_of(static_cast<int>(bits));
  FakeQuantized out = empty_fake_quantized(X, g, want_mask);
  if (X.numel() == 0 || n_groups == 0) {
    if (g.per_tensor) {  // an empty tensor's qparams, as the CPU kernel computes them
      const fq::QParams qp = fq::choose_qparams<float>(INFINITY, -INFINITY, qmin, qmax, symmetric);
      out.scale.fill_(qp.scale);
      out.zero_point.fill_(qp.zero_point);
    }
    return out;
  }
  at::Tensor tmin, tmax;
  if (g.per_tensor) std::tie(tmin, tmax) = at::aminmax(X);  // device scalars: no host synchronization
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::fake_quantize_rows", [&] {
    constexpr int kVec = cuda::vec_size<scalar_t>();
    // the mask's MaskVec stores need VEC-byte alignment too (a fresh allocation: always; checked, not assumed)
    const bool vectorized = L % kVec == 0 && cuda::is_aligned16(X.const_data_ptr()) &&
                            cuda::is_aligned16(out.output.const_data_ptr()) &&
                            (!out.mask.defined() || cuda::is_aligned16(out.mask.const_data_ptr()));
    if (vectorized) {
      launch_groups_team<scalar_t, kVec>(X, out, n_groups, L, qmin, qmax, symmetric, tmin, tmax);
    } else {
      launch_groups_team<scalar_t, 1>(X, out, n_groups, L, qmin, qmax, symmetric, tmin, tmax);
    }
  });
  return out;
}

}  // namespace fake_quant_linear_op

TORCH_LIBRARY_IMPL(opforge, CUDA, m) {
  fake_quant_linear_op::Kernels<&fake_quant_linear_op::fake_quantize_rows_cuda>::register_for(m);
}

}  // namespace opforge
