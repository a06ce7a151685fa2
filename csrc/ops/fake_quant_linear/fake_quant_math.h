// The scalar math of opforge's fake quantization, one copy for the CPU and the CUDA kernels (__host__ __device__),
// so that both produce the same bits. It reproduces torch.fake_quantize_per_tensor_affine /
// torch.fake_quantize_per_channel_affine (ATen's cachemask kernels) and the scale / zero-point choice of
// torch.ao.quantization's MinMaxObserver and torchao's choose_qparams_affine:
//
//   lo = min(min(x), 0), hi = max(max(x), 0)                                       (fp32)
//   symmetric:  scale = max(max(−lo, hi) / ((qmax − qmin) / 2), eps), zero_point = 0
//   asymmetric: scale = max((hi − lo) / (qmax − qmin), eps),
//               zero_point = clamp(qmin − round(lo / scale), qmin, qmax)
//   q   = round(x · inv_scale) + zero_point,  inv_scale = 1 / scale (fp32)          round half to even
//   y   = (clamp(q, qmin, qmax) − zero_point) · scale;  in_range = qmin ≤ q ≤ qmax
//
// eps = float32's machine epsilon (2^−23). x · inv_scale is computed in C: float for float32/float16/bfloat16
// inputs (upcast before the product), double for float64 (as ATen multiplies a double by the float inv_scale).
// Every division, product and rounding is an explicitly IEEE round-to-nearest operation on the device
// (__fdiv_rn, __fmul_rn, rintf), so fast-math flags or fma contraction cannot change a bit.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define OPFORGE_HD __host__ __device__
#else
#include <cmath>
#define OPFORGE_HD
#endif

namespace opforge {
namespace fq {

/// float32's machine epsilon: the smallest scale (as torch's observers and torchao clamp it).
constexpr float kScaleEps = 1.1920928955078125e-07f;

/// One group's quantization parameters.
struct QParams {
  float scale;      // > 0
  float inv_scale;  // 1 / scale, rounded to fp32
  int32_t zero_point;
};

OPFORGE_HD inline float fmin_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return std::fmin(a, b);
#endif
}
OPFORGE_HD inline float fmax_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}
OPFORGE_HD inline double fmin_f(double a, double b) {
#if defined(__CUDA_ARCH__)
  return fmin(a, b);
#else
  return std::fmin(a, b);
#endif
}
OPFORGE_HD inline double fmax_f(double a, double b) {
#if defined(__CUDA_ARCH__)
  return fmax(a, b);
#else
  return std::fmax(a, b);
#endif
}
OPFORGE_HD inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
OPFORGE_HD inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
OPFORGE_HD inline double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
/// Round half to even (the default rounding mode's nearbyint, as ATen's fake_quantize kernels use).
OPFORGE_HD inline float round_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}
OPFORGE_HD inline double round_even(double v) {
#if defined(__CUDA_ARCH__)
  return rint(v);
#else
  return std::nearbyint(v);
#endif
}

/// The quantized range of `bits`-bit signed integers: [−2^(bits−1), 2^(bits−1) − 1] (bits in 2..8).
OPFORGE_HD inline int qmin_of(int bits) { return -(1 << (bits - 1)); }
OPFORGE_HD inline int qmax_of(int bits) { return (1 << (bits - 1)) - 1; }

/// Scale and zero point of a group whose smallest and largest values are `mn` and `mx` (any floating type,
/// rounded to fp32 first). A group of zeros, or of values below eps · (qmax − qmin), gets scale = eps.
template <typename C>
OPFORGE_HD inline QParams choose_qparams(C mn, C mx, int qmin, int qmax, bool symmetric) {
  const float lo = fmin_f(static_cast<float>(mn), 0.0f);
  const float hi = fmax_f(static_cast<float>(mx), 0.0f);
  QParams p;
  if (symmetric) {
    const float half_range = static_cast<float>(qmax - qmin) / 2.0f;  // exact: (2^bits − 1) / 2
    p.scale = fmax_f(div_rn(fmax_f(-lo, hi), half_range), kScaleEps);
    p.zero_point = 0;
  } else {
    p.scale = fmax_f(div_rn(hi - lo, static_cast<float>(qmax - qmin)), kScaleEps);
    float z = static_cast<float>(qmin) - round_even(div_rn(lo, p.scale));
    z = fmin_f(fmax_f(z, static_cast<float>(qmin)), static_cast<float>(qmax));
    p.zero_point = static_cast<int32_t>(z);
  }
  p.inv_scale = div_rn(1.0f, p.scale);
  return p;
}

/// The fake-quantized value of x (compute type C: float, or double for float64) and whether its integer
/// q = round(x · inv_scale) + zero_point lies in [qmin, qmax] (the straight-through estimator's mask).
/// A NaN x gives (qmin − zero_point) · scale and in_range = false (as ATen's CPU kernel on x86).
template <typename C>
OPFORGE_HD inline C fake_quantize_value(C x, const QParams& p, int qmin, int qmax, bool& in_range) {
  const C q = round_even(mul_rn(x, static_cast<C>(p.inv_scale))) + static_cast<C>(p.zero_point);
  in_range = q >= static_cast<C>(qmin) && q <= static_cast<C>(qmax);
  const C qc = fmin_f(fmax_f(q, static_cast<C>(qmin)), static_cast<C>(qmax));
  return mul_rn(qc - static_cast<C>(p.zero_point), static_cast<C>(p.scale));
}

}  // namespace fq
}  // namespace opforge
