// CPU kernels of fake_quant_linear: the group-wise fake quantization (one pass per group: min/max, then the
// quantized values and masks while the group is in cache; at::parallel_for over groups), the GEMMs through
// opforge::linear / linear_backward (ATen's at::addmm / at::mm). Scalar loops on purpose: the math is
// fake_quant_math.h's, shared with CUDA, so both produce the same bits.
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <limits>

#include "core/dispatch.h"
#include "ops/fake_quant_linear/fake_quant_linear.h"
#include "ops/fake_quant_linear/fake_quant_math.h"

namespace opforge {
namespace fake_quant_linear_op {

FakeQuantized fake_quantize_rows_cpu(const at::Tensor& X, int64_t bits, Grouping g, bool symmetric, bool want_mask) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous());
  const int64_t R = X.size(0), K = X.size(1);
  const int64_t L = g.length;  // elements per group
  const int64_t n_groups = L > 0 ? R * (K / L) : 0;
  const int qmin = fq::qmin_of(static_cast<int>(bits)), qmax = fq::qmax_of(static_cast<int>(bits));
  FakeQuantized out = empty_fake_quantized(X, g, want_mask);
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::fake_quantize_rows", [&] {
    using C = at::opmath_type<scalar_t>;  // float, or double for float64
    const scalar_t* x = X.const_data_ptr<scalar_t>();
    scalar_t* y = out.output.mutable_data_ptr<scalar_t>();
    bool* mask = want_mask ? out.mask.mutable_data_ptr<bool>() : nullptr;
    float* scale = out.scale.mutable_data_ptr<float>();
    int32_t* zp = out.zero_point.mutable_data_ptr<int32_t>();
    fq::QParams tensor_qp{};
    if (g.per_tensor) {
      // min and max of the whole tensor (exact in any order; a NaN makes every value NaN, on CUDA too)
      C mn = std::numeric_limits<C>::infinity(), mx = -std::numeric_limits<C>::infinity();
      if (X.numel() > 0) {
        auto [tmin, tmax] = at::aminmax(X);
        mn = static_cast<C>(tmin.item<scalar_t>());
        mx = static_cast<C>(tmax.item<scalar_t>());
      }
      tensor_qp = fq::choose_qparams<C>(mn, mx, qmin, qmax, symmetric);
      scale[0] = tensor_qp.scale;
      zp[0] = tensor_qp.zero_point;
    }
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(L, 1));
    at::parallel_for(0, n_groups, grain, [&](int64_t begin, int64_t end) {
      for (int64_t gi = begin; gi < end; ++gi) {
        const scalar_t* xg = x + gi * L;
        fq::QParams qp = tensor_qp;
        if (!g.per_tensor) {
          // lo, hi = min, max of the group (NaN propagates); then its scale and zero point
          C mn = std::numeric_limits<C>::infinity(), mx = -std::numeric_limits<C>::infinity();
          for (int64_t i = 0; i < L; ++i) fq::minmax_update(mn, mx, static_cast<C>(xg[i]));
          qp = fq::choose_qparams<C>(mn, mx, qmin, qmax, symmetric);
          scale[gi] = qp.scale;
          zp[gi] = qp.zero_point;
        }
        // y = (clamp(round(x · inv_scale) + zp, qmin, qmax) − zp) · scale; mask = in range before the clamp
        scalar_t* yg = y + gi * L;
        bool* mg = mask ? mask + gi * L : nullptr;
        for (int64_t i = 0; i < L; ++i) {
          bool in_range;
          yg[i] = static_cast<scalar_t>(fq::fake_quantize_value<C>(static_cast<C>(xg[i]), qp, qmin, qmax, in_range));
          if (mg) mg[i] = in_range;
        }
      }
    });
  });
  return out;
}

}  // namespace fake_quant_linear_op

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  fake_quant_linear_op::Kernels<&fake_quant_linear_op::fake_quantize_rows_cpu>::register_for(m);
}

}  // namespace opforge
