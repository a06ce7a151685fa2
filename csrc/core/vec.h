// CPU helpers over ATen's at::vec::Vectorized and at::parallel_for.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/irange.h>

namespace opforge {
namespace cpu {

/// σ(x) = 1 / (1 + exp(−x)) on Vectorized (core/activation.h's act::sigmoid, vectorized).
template <typename V>
inline V vec_sigmoid(const V& x) {
  return (V(1) + x.neg().exp()).reciprocal();
}

/// silu(x) = x / (1 + exp(−x)) on Vectorized (core/activation.h's act::value<kSiLU>, vectorized).
template <typename V>
inline V vec_silu(const V& x) {
  return x / (V(1) + x.neg().exp());
}

/// Grain size for at::parallel_for over elementwise work: below this many elements, one thread.
constexpr int64_t kElementwiseGrain = 32768;

/// out[i] = op(a[i]) for i in [0, n): `op` is evaluated in float (fp32 opmath) for float16/bfloat16
/// and in the storage type for float32/float64. `vop` is the same math on at::vec::Vectorized.
/// Vectorized over the body, scalar over the tail, parallel over chunks.
template <typename scalar_t, typename Op, typename VOp>
void map_unary(const scalar_t* a, scalar_t* out, int64_t n, const Op& op, const VOp& vop) {
  using Vec = at::vec::Vectorized<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      for (; i + Vec::size() <= end; i += Vec::size()) vop(Vec::loadu(a + i)).store(out + i);
    } else {
      for (; i + Vec::size() <= end; i += Vec::size()) {
        auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vec::loadu(a + i));
        at::vec::convert_from_float<scalar_t>(vop(lo), vop(hi)).store(out + i);
      }
    }
    for (; i < end; ++i) out[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i])));
  });
}

/// out[i] = op(a[i], b[i]) for i in [begin, end) on the calling thread, with map_unary's conventions.
template <typename scalar_t, typename Op, typename VOp>
void map_binary_range(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t begin, int64_t end,
                      const Op& op, const VOp& vop) {
  using Vec = at::vec::Vectorized<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  int64_t i = begin;
  if constexpr (std::is_same_v<scalar_t, opmath_t>) {
    for (; i + Vec::size() <= end; i += Vec::size()) vop(Vec::loadu(a + i), Vec::loadu(b + i)).store(out + i);
  } else {
    for (; i + Vec::size() <= end; i += Vec::size()) {
      auto [a0, a1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(a + i));
      auto [b0, b1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(b + i));
      at::vec::convert_from_float<scalar_t>(vop(a0, b0), vop(a1, b1)).store(out + i);
    }
  }
  for (; i < end; ++i) out[i] = static_cast<scalar_t>(op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i])));
}

/// out[i] = op(a[i], b[i]) for i in [0, n), parallel over chunks.
template <typename scalar_t, typename Op, typename VOp>
void map_binary(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t n, const Op& op, const VOp& vop) {
  at::parallel_for(0, n, kElementwiseGrain,
                   [&](int64_t begin, int64_t end) { map_binary_range(a, b, out, begin, end, op, vop); });
}

/// (out0[i], out1[i]) = op(a[i], b[i], c[i]) for i in [0, n), parallel over chunks. `op(a, b, c, o0&, o1&)`
/// is scalar opmath; `vop` the same on Vectorized<opmath_t>.
template <typename scalar_t, typename Op, typename VOp>
void map3_to2(const scalar_t* a, const scalar_t* b, const scalar_t* c, scalar_t* out0, scalar_t* out1, int64_t n,
              const Op& op, const VOp& vop) {
  using Vec = at::vec::Vectorized<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      for (; i + Vec::size() <= end; i += Vec::size()) {
        Vec o0, o1;
        vop(Vec::loadu(a + i), Vec::loadu(b + i), Vec::loadu(c + i), o0, o1);
        o0.store(out0 + i);
        o1.store(out1 + i);
      }
    } else {
      using FVec = at::vec::Vectorized<opmath_t>;
      for (; i + Vec::size() <= end; i += Vec::size()) {
        auto [a0, a1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(a + i));
        auto [b0, b1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(b + i));
        auto [c0, c1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(c + i));
        FVec p0, p1, q0, q1;
        vop(a0, b0, c0, p0, p1);
        vop(a1, b1, c1, q0, q1);
        at::vec::convert_from_float<scalar_t>(p0, q0).store(out0 + i);
        at::vec::convert_from_float<scalar_t>(p1, q1).store(out1 + i);
      }
    }
    for (; i < end; ++i) {
      opmath_t o0, o1;
      op(static_cast<opmath_t>(a[i]), static_cast<opmath_t>(b[i]), static_cast<opmath_t>(c[i]), o0, o1);
      out0[i] = static_cast<scalar_t>(o0);
      out1[i] = static_cast<scalar_t>(o1);
    }
  });
}

}  // namespace cpu
}  // namespace opforge
