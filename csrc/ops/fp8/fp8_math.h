// The scalar math of FP8 current scaling, shared by the CPU and CUDA kernels (so both give the same bits).
//
// The recipe is torchao's float8 training recipe (torchao/float8/float8_utils.py: amax_to_scale, to_fp8_saturated;
// float8_scaling_utils.py: hp_tensor_to_float8_dynamic), written here from its formulas:
//   amax  = max |x| over the group (the tensor, or one row), in the input's precision (exact), then float64
//   scale = float32(fp8_max / max(amax, 1e-12))                   (float64 division, one rounding to float32)
//   data  = fp8(clamp(float32(x) · scale, −fp8_max, fp8_max))     (fp32 product, round to nearest even)
// fp8(·) is c10's float → Float8 conversion, the one torch's `.to(torch.float8_e4m3fn)` uses on CPU and CUDA.
//
// Special values follow from the formulas, as in torchao: a NaN in a group makes amax and the scale NaN, so every
// element of the group quantizes to NaN; an inf makes amax inf and the scale 0, so finite elements quantize to 0 and
// the inf to NaN (inf · 0); an all-zero (or empty) group has amax 0, clamped to 1e-12: scale = fp8_max · 1e12, data 0.
// Every NaN is written as the format's positive NaN (bits 0x7F in e4m3fn and e5m2): the sign of a float NaN is not
// portable (inf · 0 is negative on x86 CPUs, positive on NVIDIA GPUs), so the CPU and CUDA give the same bits.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>
#include <limits>

namespace opforge {
namespace fp8 {

/// The clamp floor of amax (torchao's EPS): an all-zero group gets a finite scale.
constexpr double kAmaxFloor = 1e-12;

/// Largest finite value of the FP8 format (torch.finfo(dtype).max).
template <typename fp8_t>
constexpr float max_of();
template <>
constexpr float max_of<c10::Float8_e4m3fn>() { return 448.0f; }
template <>
constexpr float max_of<c10::Float8_e5m2>() { return 57344.0f; }

/// scale = float32(fp8_max / max(amax, 1e-12)) computed in float64; NaN for a NaN amax (torch.clamp keeps NaN),
/// 0 for an infinite one.
C10_HOST_DEVICE inline float scale_of(double amax, float fp8_max) {
  if (amax != amax) return std::numeric_limits<float>::quiet_NaN();
  const double a = amax < kAmaxFloor ? kAmaxFloor : amax;
  return static_cast<float>(static_cast<double>(fp8_max) / a);
}

/// fp8(clamp(x · scale, ±fp8_max)): the fp32 product saturated to the format's finite range, then rounded to
/// nearest even by c10's conversion; a NaN product (as torch.clamp leaves it) is the positive NaN 0x7F.
template <typename fp8_t>
C10_HOST_DEVICE inline fp8_t saturate_cast(float x, float scale) {
  constexpr float hi = max_of<fp8_t>();
  float v = x * scale;
  if (v != v) return fp8_t(0x7F, fp8_t::from_bits());
  v = v < -hi ? -hi : (v > hi ? hi : v);
  return fp8_t(v);
}

}  // namespace fp8
}  // namespace opforge
