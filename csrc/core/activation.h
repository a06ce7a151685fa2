// One activation set for every opforge kernel: one enum, its schema names (parsed once, where the
// schema's string enters C++), and each activation's value and derivative as `__host__ __device__`
// templates over the math type T (fp32 opmath for float16/bfloat16, the storage type for float32 and
// float64). CPU scalar tails, CUDA functors (core/map_cuda.cuh), the GEMV kernel and the GEMM layer's
// fallback all call these, so each formula is written once.
//
//   none       y = z                                        y' = 1
//   relu       y = max(z, 0) (NaN stays NaN)                y' = [z > 0]  (z may be relu's output: same test)
//   gelu       y = z · Φ(z) = z/2 · (1 + erf(z/√2))          y' = Φ(z) + z · φ(z), φ(z) = exp(−z²/2)/√(2π)
//   gelu_tanh  y = z/2 · (1 + tanh(u)),                      y' = ½(1 + t) + ½z(1 − t²) · √(2/π)(1 + 3κz²),
//              u = √(2/π)(z + κz³), κ = 0.044715               t = tanh(u)
//   silu       y = z · σ(z) = z / (1 + exp(−z))              y' = σ(z) · (1 + z · (1 − σ(z)))
//   sigmoid    y = σ(z) = 1 / (1 + exp(−z))                  y' = σ(z) · (1 − σ(z))
//
// sigmoid is not one of linear's schema names (parse_activation rejects it); the elementwise sigmoid and
// swiglu use it through the same functions.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <cstdint>
#include <utility>

namespace opforge {

/// An activation, by its schema name (see the table above).
enum class Activation : int8_t {
  kNone,      // "none"
  kReLU,      // "relu"
  kGELU,      // "gelu"
  kGELUTanh,  // "gelu_tanh"
  kSiLU,      // "silu"
  kSigmoid,   // (no schema name: elementwise sigmoid, swiglu)
};

/// Parses a schema activation name (exact, lower case): none, relu, gelu, gelu_tanh or silu.
/// Raises: ValueError "opforge::<op>: expected activation to be one of "none", "relu", "gelu",
///         "gelu_tanh", "silu", but got "<name>"".
Activation parse_activation(const char* op, c10::string_view name);

/// Parses torch.nn.functional.gelu's `approximate` (exact, lower case): "none" (the erf form, kGELU) or "tanh"
/// (kGELUTanh). Raises: ValueError "opforge::<op>: expected approximate to be "none" or "tanh", but got "<name>"".
Activation parse_gelu_approximate(const char* op, c10::string_view approximate);

/// torch's `approximate` name of a gelu activation: "none" for kGELU, "tanh" for kGELUTanh.
const char* gelu_approximate_name(Activation act);

/// The schema name of an activation ("none", "relu", ...; "sigmoid" for kSigmoid).
const char* activation_name(Activation act);

namespace act {

// Math functions that resolve to CUDA's device overloads in device code and to <cmath> on the host,
// for float and double alike.
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
#define OPFORGE_MATH(f) ::f
#else
#define OPFORGE_MATH(f) std::f
#endif

constexpr double kSqrt1_2 = 0.70710678118654752440;     // 1/√2
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)
constexpr double kSqrt2OverPi = 0.79788456080286535588;  // √(2/π)
constexpr double kGeluTanhKappa = 0.044715;

/// σ(z) = 1 / (1 + exp(−z)): exp(−z) = inf gives exactly 0, exp(−z) = 0 exactly 1, never NaN.
template <typename T>
C10_HOST_DEVICE inline T sigmoid(T z) {
  return T(1) / (T(1) + OPFORGE_MATH(exp)(-z));
}

/// y = act(z).
template <Activation A, typename T>
C10_HOST_DEVICE inline T value(T z) {
  if constexpr (A == Activation::kNone) {
    return z;
  } else if constexpr (A == Activation::kReLU) {
    return z < T(0) ? T(0) : z;
  } else if constexpr (A == Activation::kGELU) {
    return T(0.5) * z * (T(1) + OPFORGE_MATH(erf)(z * T(kSqrt1_2)));
  } else if constexpr (A == Activation::kGELUTanh) {
    return T(0.5) * z * (T(1) + OPFORGE_MATH(tanh)(T(kSqrt2OverPi) * (z + T(kGeluTanhKappa) * z * z * z)));
  } else if constexpr (A == Activation::kSiLU) {
    return z / (T(1) + OPFORGE_MATH(exp)(-z));
  } else {
    return sigmoid(z);
  }
}

/// dz = dy · act'(z). For relu, z may be relu's output (the same sign test); for sigmoid, `z` is the
/// OUTPUT y = σ(x) (dx = dy · y · (1 − y)), as the elementwise sigmoid's backward saves it.
template <Activation A, typename T>
C10_HOST_DEVICE inline T backward(T dy, T z) {
  if constexpr (A == Activation::kNone) {
    return dy;
  } else if constexpr (A == Activation::kReLU) {
    return z <= T(0) ? T(0) : dy;
  } else if constexpr (A == Activation::kGELU) {
    const T cdf = T(0.5) * (T(1) + OPFORGE_MATH(erf)(z * T(kSqrt1_2)));
    const T pdf = T(kInvSqrt2Pi) * OPFORGE_MATH(exp)(T(-0.5) * z * z);
    return dy * (cdf + z * pdf);
  } else if constexpr (A == Activation::kGELUTanh) {
    const T z2 = z * z;
    const T t = OPFORGE_MATH(tanh)(T(kSqrt2OverPi) * (z + T(kGeluTanhKappa) * z2 * z));
    const T du = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluTanhKappa) * z2);
    return dy * (T(0.5) * (T(1) + t) + T(0.5) * z * (T(1) - t * t) * du);
  } else if constexpr (A == Activation::kSiLU) {
    const T s = sigmoid(z);
    return dy * s * (T(1) + z * (T(1) - s));
  } else {
    return dy * z * (T(1) - z);
  }
}

#undef OPFORGE_MATH

/// y = act(z) as a functor (for core/map_cuda.cuh's launchers and the GEMV kernel).
template <Activation A>
struct Value {
  template <typename T>
  C10_HOST_DEVICE T operator()(T z) const { return value<A>(z); }
};

/// dz = dy · act'(z) as a functor.
template <Activation A>
struct Backward {
  template <typename T>
  C10_HOST_DEVICE T operator()(T dy, T z) const { return backward<A>(dy, z); }
};

}  // namespace act

/// Calls f(std::integral_constant<Activation, A>{}) for the runtime `a`: one switch, so a kernel is
/// instantiated per activation without each caller writing its own switch.
template <typename F>
decltype(auto) with_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::kReLU: return f(std::integral_constant<Activation, Activation::kReLU>{});
    case Activation::kGELU: return f(std::integral_constant<Activation, Activation::kGELU>{});
    case Activation::kGELUTanh: return f(std::integral_constant<Activation, Activation::kGELUTanh>{});
    case Activation::kSiLU: return f(std::integral_constant<Activation, Activation::kSiLU>{});
    case Activation::kSigmoid: return f(std::integral_constant<Activation, Activation::kSigmoid>{});
    case Activation::kNone: break;
  }
  return f(std::integral_constant<Activation, Activation::kNone>{});
}

}  // namespace opforge
