// CPU kernels of quantize_fp8 (and the quantization inside fp8_linear): per row (rowwise) or over the whole tensor
// (tensorwise, a parallel reduction), amax then the saturated cast, with fp8_math.h's scalar math. The GEMMs are
// at::_scaled_mm's CPU kernel (fp8.cpp: scaled_gemm).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "core/dispatch.h"
#include "ops/fp8/fp8.h"
#include "ops/fp8/fp8_math.h"

namespace opforge {
namespace fp8_op {
namespace {

/// max |x| over n elements, NaN if any is NaN: a plain max (which a vectorizing compiler keeps branch-free) beside
/// a NaN flag, since max() alone drops NaNs by operand order.
template <typename scalar_t, typename acc_t>
acc_t amax_of(const scalar_t* x, int64_t n) {
  acc_t m = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const acc_t a = std::abs(static_cast<acc_t>(x[i]));
    m = a > m ? a : m;
    nan |= a != a;
  }
  return nan ? std::numeric_limits<acc_t>::quiet_NaN() : m;
}

template <typename acc_t>
acc_t nan_max(acc_t a, acc_t b) {
  if (a != a || b != b) return std::numeric_limits<acc_t>::quiet_NaN();
  return a > b ? a : b;
}

template <typename scalar_t, typename fp8_t>
void cast_of(const scalar_t* x, fp8_t* y, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) y[i] = fp8::saturate_cast<fp8_t>(static_cast<float>(x[i]), scale);
}

template <typename scalar_t, typename fp8_t>
void quantize_rows_typed(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise) {
  // amax in the input's precision (exact for every dtype), then float64 for the scale, as the recipe computes it
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  constexpr float hi = fp8::max_of<fp8_t>();
  const int64_t R = X.size(0), C = X.size(1);
  const scalar_t* x = X.const_data_ptr<scalar_t>();
  fp8_t* y = data.mutable_data_ptr<fp8_t>();
  float* s = scale.mutable_data_ptr<float>();
  if (rowwise) {
    const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, C));
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float sr = fp8::scale_of(static_cast<double>(amax_of<scalar_t, acc_t>(x + r * C, C)), hi);
        s[r] = sr;
        cast_of(x + r * C, y + r * C, C, sr);
      }
    });
    return;
  }
  const int64_t n = R * C;
  const acc_t amax = at::parallel_reduce(
      0, n, at::internal::GRAIN_SIZE, acc_t(0),
      [&](int64_t begin, int64_t end, acc_t ident) {
        return nan_max(ident, amax_of<scalar_t, acc_t>(x + begin, end - begin));
      },
      [](acc_t a, acc_t b) { return nan_max(a, b); });
  const float st = fp8::scale_of(static_cast<double>(amax), hi);
  s[0] = st;
  at::parallel_for(0, n, at::internal::GRAIN_SIZE,
                   [&](int64_t begin, int64_t end) { cast_of(x + begin, y + begin, end - begin, st); });
}

}  // namespace

void quantize_rows_cpu(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data.is_contiguous());
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      quantize_rows_typed<scalar_t, c10::Float8_e4m3fn>(X, data, scale, rowwise);
    } else {
      quantize_rows_typed<scalar_t, c10::Float8_e5m2>(X, data, scale, rowwise);
    }
  });
}

}  // namespace fp8_op

TORCH_LIBRARY_IMPL(opforge, CPU, m) { fp8_op::Kernels<&fp8_op::quantize_rows_cpu>::register_for(m); }

}  // namespace opforge
