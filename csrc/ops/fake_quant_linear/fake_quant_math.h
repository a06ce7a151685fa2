// The scalar math of opforge's fake quantization, one copy for the CPU and the CUDA kernels (__host__ __device__),
// so that both produce the same bits. It reproduces torch.fake_quantize_per_tensor_affine /
// torch.fake_quantize_per_channel_affine (ATen's cachemask kernels) and the scale / zero-point choice of
// torch.ao.quantization's MinMaxObserver and torchao's choose_qparams_affine:
//
//   lo = min(min(x), 0), hi = max(max(x), 0)                                       (fp32)
//   symmetric:  scale = max(max(−lo, hi) / ((qmax − qmin) / 2), eps), zero_point = 0
//   asymmetric: scale = max((hi − lo) / (qmax − qmin), eps)   (where hi − lo overflows fp32:
//                       hi / (qmax − qmin) − lo / (qmax − qmin), finite where torch's is inf),
//               zero_point = clamp(qmin − round(lo / scale), qmin, qmax)
//   q   = round(x · inv_scale) + zero_point,  inv_scale = 1 / scale (fp32)          round half to even
//   y   = (clamp(q, qmin, qmax) − zero_point) · scale;  in_range = qmin ≤ q ≤ qmax
//   a group containing NaN: min/max propagate it, scale = NaN, zero_point = 0, every y NaN, in_range false
//   a group containing ±inf: scale = inf, inv_scale = 0, every y NaN (the clamp keeps the NaN q of an infinite x,
//                       where torch's integer conversion turns it into qmin and gives −inf); finite x keep in_range
//
// eps = float32's machine epsilon (2^−23). x · inv_scale is computed in C: float for float32/float16/bfloat16
// inputs (upcast before the product), double for float64 (as ATen multiplies a double by the float inv_scale).
// Every division, product and rounding is an explicitly IEEE round-to-nearest operation on the device
// (__fdiv_rn, __fmul_rn, rintf), so fast-math flags or fma contraction cannot change a bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__CUDACC__)
#define OPFORGE_HD __host__ __device__
#else
#define OPFORGE_HD
#endif

namespace opforge {
namespace fq {

/// float32's machine epsilon: the smallest scale (as torch's observers and torchao clamp it).
constexpr float kScaleEps = 1.1920928955078125e-07f;

/// Whether x is NaN (isnan of the device's math library, std::isnan on the host).
template <typename T>
OPFORGE_HD inline bool is_nan(T x) {
#if defined(__CUDA_ARCH__)
  return isnan(x);
#else
  return std::isnan(x);
#endif
}

/// Whether x is finite (x − x is 0 for a finite x, NaN for ±inf and NaN).
template <typename T>
OPFORGE_HD inline bool is_finite(T x) {
  return !is_nan(x - x);
}

/// One group's quantization parameters.
struct QParams {
  float scale;      // > 0
  float inv_scale;  // 1 / scale, rounded to fp32
  int32_t zero_point;
};

// Each helper below is one template for float and double: on the device the IEEE round-to-nearest intrinsic of
// the type (if constexpr), on the host the C++ operator or <cmath> function.

/// Defines `template <typename T> T NAME(T a, T b)`: on the device F32(a, b) for float and F64(a, b) for double,
/// on the host HOST(a, b).
#if defined(__CUDA_ARCH__)
#define OPFORGE_FQ_BINARY(NAME, F32, F64, HOST)                                  \
  template <typename T>                                                          \
  OPFORGE_HD inline T NAME(T a, T b) {                                           \
    if constexpr (std::is_same_v<T, float>) return F32(a, b); else return F64(a, b); \
  }
#else
#define OPFORGE_FQ_BINARY(NAME, F32, F64, HOST) \
  template <typename T>                         \
  OPFORGE_HD inline T NAME(T a, T b) {          \
    return HOST(a, b);                          \
  }
#endif

/// The host's a / b and a · b (the default rounding mode is round-to-nearest).
template <typename T>
inline T host_div(T a, T b) {
  return a / b;
}
template <typename T>
inline T host_mul(T a, T b) {
  return a * b;
}

/// min / max that ignore a NaN operand (C's fmin / fmax): the clamps of choose_qparams, as the observers'.
OPFORGE_FQ_BINARY(fmin_f, fminf, fmin, std::fmin)
OPFORGE_FQ_BINARY(fmax_f, fmaxf, fmax, std::fmax)
/// min / max that propagate NaN (a NaN operand wins, as torch.aminmax): the group reductions, so that a group
/// containing NaN gets NaN qparams instead of a finite scale computed from its other values.
template <typename T>
OPFORGE_HD inline T nan_min(T a, T b) {
  return (a < b || is_nan(a)) ? a : b;
}
template <typename T>
OPFORGE_HD inline T nan_max(T a, T b) {
  return (a > b || is_nan(a)) ? a : b;
}
/// One step of a group's NaN-propagating min/max reduction.
template <typename T>
OPFORGE_HD inline void minmax_update(T& mn, T& mx, T v) {
  mn = nan_min(mn, v);
  mx = nan_max(mx, v);
}
/// a / b and a · b, each rounded once to nearest.
OPFORGE_FQ_BINARY(div_rn, __fdiv_rn, __ddiv_rn, host_div)
OPFORGE_FQ_BINARY(mul_rn, __fmul_rn, __dmul_rn, host_mul)
#undef OPFORGE_FQ_BINARY
/// Round half to even (the default rounding mode's nearbyint, as ATen's fake_quantize kernels use).
template <typename T>
OPFORGE_HD inline T round_even(T v) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, float>) return rintf(v); else return rint(v);
#else
  return std::nearbyint(v);
#endif
}

/// The quantized range of `bits`-bit signed integers: [−2^(bits−1), 2^(bits−1) − 1] (bits in 2..8).
OPFORGE_HD inline int qmin_of(int bits) { return -(1 << (bits - 1)); }
OPFORGE_HD inline int qmax_of(int bits) { return (1 << (bits - 1)) - 1; }

/// Scale and zero point of a group whose smallest and largest values are `mn` and `mx` (any floating type,
/// rounded to fp32 first). A group of zeros, or of values below eps · (qmax − qmin), gets scale = eps.
///
/// NaN: a group containing NaN has mn or mx NaN (the reductions use nan_min / nan_max); it gets scale = NaN,
/// inv_scale = NaN and zero_point = 0, so every fake-quantized value of the group is NaN and its mask false, as
/// torch's PerChannelMinMaxObserver + fake_quantize_per_channel_affine give.
///
/// Overflow: the asymmetric (hi − lo) / (qmax − qmin) is torch's formula, kept bit for bit; only where hi − lo
/// overflows fp32 (finite hi and lo of opposite signs summing past 3.4e38, where torch's scale is inf and its
/// output NaN) the scale is hi / (qmax − qmin) − lo / (qmax − qmin), finite since qmax − qmin ≥ 3.
template <typename C>
OPFORGE_HD inline QParams choose_qparams(C mn, C mx, int qmin, int qmax, bool symmetric) {
  QParams p;
  const float fmn = static_cast<float>(mn), fmx = static_cast<float>(mx);
  if (is_nan(fmn) || is_nan(fmx)) {
    p.scale = p.inv_scale = std::numeric_limits<float>::quiet_NaN();
    p.zero_point = 0;
    return p;
  }
  const float lo = fmin_f(fmn, 0.0f);
  const float hi = fmax_f(fmx, 0.0f);
  if (symmetric) {
    const float half_range = static_cast<float>(qmax - qmin) / 2.0f;  // exact: (2^bits − 1) / 2
    p.scale = fmax_f(div_rn(fmax_f(-lo, hi), half_range), kScaleEps);
    p.zero_point = 0;
  } else {
    const float range = static_cast<float>(qmax - qmin);
    float span = hi - lo;  // exact or rounded once, as torch's
    float scale = div_rn(span, range);
    if (!is_finite(span) && is_finite(hi) && is_finite(lo)) scale = div_rn(hi, range) - div_rn(lo, range);
    p.scale = fmax_f(scale, kScaleEps);
    float z = static_cast<float>(qmin) - round_even(div_rn(lo, p.scale));
    z = fmin_f(fmax_f(z, static_cast<float>(qmin)), static_cast<float>(qmax));
    p.zero_point = static_cast<int32_t>(z);
  }
  p.inv_scale = div_rn(1.0f, p.scale);
  return p;
}

/// The fake-quantized value of x (compute type C: float, or double for float64) and whether its integer
/// q = round(x · inv_scale) + zero_point lies in [qmin, qmax] (the straight-through estimator's mask).
///
/// The clamp keeps a NaN q (a comparison with NaN is false, so neither bound replaces it): q is NaN only for a
/// group whose scale is NaN (it holds a NaN) or inf (it holds ±inf, inv_scale = 0, and inf · 0 is NaN), and such
/// a group's every y is then NaN with in_range false for the NaN q. ATen's kernels convert q to an integer first,
/// which turns a NaN into qmin, so torch gives (qmin − zero_point) · inf = −inf for an infinite x of a symmetric
/// group (and of an asymmetric group holding −inf, whose zero point torch's observer makes qmax). For a finite q this clamp is exactly fmin(fmax(q, qmin), qmax): no finite y changes.
template <typename C>
OPFORGE_HD inline C fake_quantize_value(C x, const QParams& p, int qmin, int qmax, bool& in_range) {
  const C q = round_even(mul_rn(x, static_cast<C>(p.inv_scale))) + static_cast<C>(p.zero_point);
  const C lo = static_cast<C>(qmin), hi = static_cast<C>(qmax);
  in_range = q >= lo && q <= hi;
  const C qc = q < lo ? lo : (q > hi ? hi : q);
  return mul_rn(qc - static_cast<C>(p.zero_point), static_cast<C>(p.scale));
}

}  // namespace fq
}  // namespace opforge
