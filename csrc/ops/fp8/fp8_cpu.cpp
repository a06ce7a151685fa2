// CPU kernels of quantize_fp8 (and the quantization inside fp8_linear), with fp8_math.h's scalar math:
//   rows   per row (rowwise) or over the whole tensor (tensorwise, a parallel reduction): amax, then the saturated
//          cast;
//   cols   Xᵀ from X [R, C]: the amax of each column (rowwise; blocks of columns in parallel, each reading its
//          columns row by row) or of the tensor, then the cast in 64 x 64 tiles written transposed (a tile's
//          reads and writes stay in the cache);
//   both   tensorwise X and Xᵀ: the tiled cast writes each element to both outputs.
// Tensorwise, an amax given by the caller (fp8.h: quantize_rows_cpu) replaces the reduction.
// The GEMMs are at::_scaled_mm's CPU kernel (fp8.cpp: scaled_gemm).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

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

/// inv_scale = 1 / scale element by element (IEEE division, the bits of scale.reciprocal()), when inv_scale is
/// defined.
void write_inverse(const at::Tensor& scale, at::Tensor& inv_scale) {
  if (!inv_scale.defined()) return;
  const float* s = scale.const_data_ptr<float>();
  float* inv = inv_scale.mutable_data_ptr<float>();
  for (int64_t i = 0; i < scale.numel(); ++i) inv[i] = 1.0f / s[i];
}

/// max |x| over x[0, n) as a parallel reduction, NaN if any is NaN.
template <typename scalar_t, typename acc_t>
acc_t tensor_amax(const scalar_t* x, int64_t n) {
  return at::parallel_reduce(
      0, n, at::internal::GRAIN_SIZE, acc_t(0),
      [&](int64_t begin, int64_t end, acc_t ident) {
        return nan_max(ident, amax_of<scalar_t, acc_t>(x + begin, end - begin));
      },
      [](acc_t a, acc_t b) { return nan_max(a, b); });
}

/// The tensorwise amax of X [R, C] (contiguous) as a float64: the given `amax` (float64 for a float64 X, else
/// float32) rounded to scalar_t (the identity for X's own amax; see quantize_rows_cpu in fp8.h), or computed.
template <typename scalar_t, typename acc_t>
double tensorwise_amax(const at::Tensor& X, const at::Tensor& amax) {
  if (!amax.defined()) {
    return static_cast<double>(tensor_amax<scalar_t, acc_t>(X.const_data_ptr<scalar_t>(), X.numel()));
  }
  TORCH_INTERNAL_ASSERT(amax.numel() == 1 && amax.scalar_type() == c10::CppTypeToScalarType<acc_t>::value);
  return static_cast<double>(static_cast<acc_t>(static_cast<scalar_t>(*amax.const_data_ptr<acc_t>())));
}

template <typename scalar_t, typename fp8_t>
void quantize_rows_typed(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, bool rowwise,
                         const at::Tensor& amax) {
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
  const float st = fp8::scale_of(tensorwise_amax<scalar_t, acc_t>(X, amax), hi);
  s[0] = st;
  at::parallel_for(0, R * C, at::internal::GRAIN_SIZE,
                   [&](int64_t begin, int64_t end) { cast_of(x + begin, y + begin, end - begin, st); });
}

/// Side of the square tiles of the transposed cast.
constexpr int64_t kTile = 64;

/// Rowwise scales of Xᵀ: s[c] from the amax of column c of X [R, C] (a NaN flag beside a plain max, as amax_of).
template <typename scalar_t, typename acc_t>
void column_scales(const scalar_t* x, int64_t R, int64_t C, float fp8_max, float* s) {
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, R * kTile));
  at::parallel_for(0, (C + kTile - 1) / kTile, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t c0 = b * kTile, w = std::min(kTile, C - c0);
      acc_t m[kTile] = {};
      bool nan[kTile] = {};
      for (int64_t r = 0; r < R; ++r) {
        const scalar_t* row = x + r * C + c0;
        for (int64_t j = 0; j < w; ++j) {
          const acc_t a = std::abs(static_cast<acc_t>(row[j]));
          m[j] = a > m[j] ? a : m[j];
          nan[j] |= a != a;
        }
      }
      for (int64_t j = 0; j < w; ++j) {
        s[c0 + j] = fp8::scale_of(nan[j] ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(m[j]),
                                  fp8_max);
      }
    }
  });
}

/// The transposed cast of X [R, C] in kTile x kTile tiles: y_t[c, r] = cast(x[r, c], scale of column c) (`s`
/// holds C scales, or one when `rowwise` is false), and y[r, c] the same byte when y is non-null.
template <typename scalar_t, typename fp8_t>
void cast_transposed(const scalar_t* x, int64_t R, int64_t C, const float* s, bool rowwise, fp8_t* y_t, fp8_t* y) {
  const int64_t row_tiles = (R + kTile - 1) / kTile, col_tiles = (C + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / (kTile * kTile));
  at::parallel_for(0, row_tiles * col_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t / col_tiles * kTile, c0 = t % col_tiles * kTile;
      const int64_t r1 = std::min(R, r0 + kTile), c1 = std::min(C, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const fp8_t v = fp8::saturate_cast<fp8_t>(static_cast<float>(x[r * C + c]), s[rowwise ? c : 0]);
          y_t[c * R + r] = v;
          if (y != nullptr) y[r * C + c] = v;
        }
      }
    }
  });
}

/// quantize_cols (y == nullptr) and quantize_both (y: X's own data, tensorwise) for one input and FP8 dtype.
template <typename scalar_t, typename fp8_t>
void quantize_cols_typed(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, bool rowwise, fp8_t* y,
                         const at::Tensor& amax) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  constexpr float hi = fp8::max_of<fp8_t>();
  const int64_t R = X.size(0), C = X.size(1);
  const scalar_t* x = X.const_data_ptr<scalar_t>();
  float* s = scale.mutable_data_ptr<float>();
  if (rowwise) {
    column_scales<scalar_t, acc_t>(x, R, C, hi, s);
  } else {
    s[0] = fp8::scale_of(tensorwise_amax<scalar_t, acc_t>(X, amax), hi);
  }
  cast_transposed<scalar_t, fp8_t>(x, R, C, s, rowwise, data_t.mutable_data_ptr<fp8_t>(), y);
}

}  // namespace

void quantize_rows_cpu(const at::Tensor& X, at::Tensor& data, at::Tensor& scale, at::Tensor& inv_scale,
                       bool rowwise, const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data.is_contiguous() && !(rowwise && amax.defined()));
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      quantize_rows_typed<scalar_t, c10::Float8_e4m3fn>(X, data, scale, rowwise, amax);
    } else {
      quantize_rows_typed<scalar_t, c10::Float8_e5m2>(X, data, scale, rowwise, amax);
    }
  });
  write_inverse(scale, inv_scale);
}

void quantize_cols_cpu(const at::Tensor& X, at::Tensor& data_t, at::Tensor& scale, at::Tensor& inv_scale,
                       bool rowwise, const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data_t.is_contiguous() && !(rowwise && amax.defined()));
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data_t.scalar_type() == at::kFloat8_e4m3fn) {
      quantize_cols_typed<scalar_t, c10::Float8_e4m3fn>(X, data_t, scale, rowwise, nullptr, amax);
    } else {
      quantize_cols_typed<scalar_t, c10::Float8_e5m2>(X, data_t, scale, rowwise, nullptr, amax);
    }
  });
  write_inverse(scale, inv_scale);
}

void quantize_both_cpu(const at::Tensor& X, at::Tensor& data, at::Tensor& data_t, at::Tensor& scale,
                       at::Tensor& inv_scale, const at::Tensor& amax) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous() && data.is_contiguous() && data_t.is_contiguous());
  OPFORGE_DISPATCH_FLOATING(X.scalar_type(), "opforge::quantize_fp8", [&] {
    if (data.scalar_type() == at::kFloat8_e4m3fn) {
      quantize_cols_typed<scalar_t, c10::Float8_e4m3fn>(X, data_t, scale, false,
                                                          data.mutable_data_ptr<c10::Float8_e4m3fn>(), amax);
    } else {
      quantize_cols_typed<scalar_t, c10::Float8_e5m2>(X, data_t, scale, false,
                                                        data.mutable_data_ptr<c10::Float8_e5m2>(), amax);
    }
  });
  write_inverse(scale, inv_scale);
}

/// The CPU's quantization kernels.
at::Tensor transpose_fp8_cpu(const at::Tensor& X) {
  TORCH_INTERNAL_ASSERT(X.dim() == 2 && X.is_contiguous());
  return X.t().contiguous();  // ATen's copy (a transposed source takes its blocked path)
}

constexpr Backend kCpuBackend{&quantize_rows_cpu, &quantize_cols_cpu, &quantize_both_cpu, nullptr, &transpose_fp8_cpu};

}  // namespace fp8_op

TORCH_LIBRARY_IMPL(opforge, CPU, m) { fp8_op::Kernels<fp8_op::kCpuBackend>::register_for(m); }

}  // namespace opforge
