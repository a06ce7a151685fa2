// CPU helpers over ATen's at::vec::Vectorized and at::parallel_for.
//
// Every map helper evaluates its Vectorized `vop` on full vectors and on the tail through partial loads and
// stores (Vectorized::loadu(ptr, count), store(ptr, count)), so each output element is the same lane math of its
// own inputs wherever it falls: its value depends on those inputs only, not on chunking, the thread count,
// alignment or offset (a view equals its contiguous copy bitwise, one thread equals many).
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <array>
#include <tuple>
#include <type_traits>

#include "core/activation.h"

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

/// gelu(x) = x · Φ(x) on Vectorized (core/activation.h's act::value<kGELU>, vectorized), Φ(x) as ½ · erfc(−x/√2):
/// 1 + erf(x/√2) cancels for x < 0 (Vectorized's erf to ~1e-7 absolute: 1e-5 relative at x = −3, worse beyond),
/// erfc keeps the tail's relative accuracy.
template <typename V>
inline V vec_gelu(const V& x) {
  return V(0.5) * x * (x * V(-act::kSqrt1_2)).erfc();
}

/// gelu_tanh(x) = x/2 · (1 + tanh(√(2/π)(x + κx³))) on Vectorized (core/activation.h's act::value<kGELUTanh>).
template <typename V>
inline V vec_gelu_tanh(const V& x) {
  return V(0.5) * x * (V(1) + (V(act::kSqrt2OverPi) * (x + V(act::kGeluTanhKappa) * x * x * x)).tanh());
}

/// Grain size for at::parallel_for over elementwise work: below this many elements, one thread.
constexpr int64_t kElementwiseGrain = 32768;

namespace detail {

/// Vectorized<opmath_t> values per Vectorized<scalar_t>: 1 for float32/float64, 2 for float16/bfloat16.
template <typename scalar_t>
inline constexpr size_t kParts = std::is_same_v<scalar_t, at::opmath_type<scalar_t>> ? 1 : 2;

/// One Vectorized<scalar_t> worth of elements in opmath vectors.
template <typename scalar_t>
using Parts = std::array<at::vec::Vectorized<at::opmath_type<scalar_t>>, kParts<scalar_t>>;

/// The first k (<= Vectorized<scalar_t>::size()) elements at p in opmath; lanes past k are zero.
template <typename scalar_t>
inline Parts<scalar_t> load(const scalar_t* p, int64_t k) {
  using Vec = at::vec::Vectorized<scalar_t>;
  const Vec v = k == Vec::size() ? Vec::loadu(p) : Vec::loadu(p, k);
  if constexpr (kParts<scalar_t> == 1) {
    return {v};
  } else {
    auto [lo, hi] = at::vec::convert_to_float<scalar_t>(v);
    return {lo, hi};
  }
}

/// Stores the first k (<= Vectorized<scalar_t>::size()) elements of v at p, rounded to scalar_t.
template <typename scalar_t>
inline void store(scalar_t* p, int64_t k, const Parts<scalar_t>& v) {
  using Vec = at::vec::Vectorized<scalar_t>;
  Vec out;
  if constexpr (kParts<scalar_t> == 1) {
    out = v[0];
  } else {
    out = at::vec::convert_from_float<scalar_t>(v[0], v[1]);
  }
  if (k == Vec::size()) {
    out.store(p);
  } else {
    out.store(p, k);
  }
}

/// out[o][i] = vop(in[i]...)[o] for i in [begin, end) on the calling thread: `vop` maps Vectorized<opmath_t>
/// inputs to std::array<Vectorized<opmath_t>, NOut>; full vectors, then one partial vector for the tail.
template <typename scalar_t, size_t NOut, typename VOp, typename... In>
inline void map_range(int64_t begin, int64_t end, const std::array<scalar_t*, NOut>& out, const VOp& vop,
                      const In*... in) {
  static_assert((std::is_same_v<In, scalar_t> && ...), "opforge::cpu::map_range: inputs of the outputs' dtype");
  constexpr int64_t W = at::vec::Vectorized<scalar_t>::size();
  const auto step = [&](int64_t i, int64_t k) {
    const auto x = std::make_tuple(load(in + i, k)...);
    std::array<Parts<scalar_t>, NOut> y;
    for (size_t p = 0; p < kParts<scalar_t>; ++p) {
      const auto r = std::apply([&](const auto&... xs) { return vop(xs[p]...); }, x);
      for (size_t o = 0; o < NOut; ++o) y[o][p] = r[o];
    }
    for (size_t o = 0; o < NOut; ++o) store(out[o] + i, k, y[o]);
  };
  int64_t i = begin;
  for (; i + W <= end; i += W) step(i, W);
  if (i < end) step(i, end - i);
}

}  // namespace detail

/// out[i] = vop(a[i]) for i in [0, n), parallel over chunks. `vop` maps Vectorized<opmath_t> to itself:
/// fp32 opmath for float16/bfloat16, the storage type for float32/float64.
template <typename scalar_t, typename VOp>
void map_unary(const scalar_t* a, scalar_t* out, int64_t n, const VOp& vop) {
  at::parallel_for(0, n, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    detail::map_range<scalar_t, 1>(
        begin, end, {out}, [&](const auto& x) { return std::array{vop(x)}; }, a);
  });
}

/// out[i] = vop(a[i], b[i]) for i in [begin, end) on the calling thread, with map_unary's conventions.
template <typename scalar_t, typename VOp>
void map_binary_range(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t begin, int64_t end,
                      const VOp& vop) {
  detail::map_range<scalar_t, 1>(
      begin, end, {out}, [&](const auto& x, const auto& y) { return std::array{vop(x, y)}; }, a, b);
}

/// out[i] = vop(a[i], b[i]) for i in [0, n), parallel over chunks.
template <typename scalar_t, typename VOp>
void map_binary(const scalar_t* a, const scalar_t* b, scalar_t* out, int64_t n, const VOp& vop) {
  at::parallel_for(0, n, kElementwiseGrain,
                   [&](int64_t begin, int64_t end) { map_binary_range(a, b, out, begin, end, vop); });
}

/// (out0[i], out1[i]) = vop(a[i], b[i], c[i]) for i in [begin, end) on the calling thread:
/// `vop(a, b, c, o0&, o1&)` on Vectorized<opmath_t>, map_unary's conventions.
template <typename scalar_t, typename VOp>
void map3_to2_range(const scalar_t* a, const scalar_t* b, const scalar_t* c, scalar_t* out0, scalar_t* out1,
                    int64_t begin, int64_t end, const VOp& vop) {
  detail::map_range<scalar_t, 2>(
      begin, end, {out0, out1},
      [&](const auto& x, const auto& y, const auto& z) {
        std::array<std::decay_t<decltype(x)>, 2> o;
        vop(x, y, z, o[0], o[1]);
        return o;
      },
      a, b, c);
}

/// f(r, c0, c1) over the row segments [c0, c1) of a rows × cols index space, parallel over chunks of
/// rows · cols (a chunk may begin or end inside a row): for kernels that read or write rows through strides.
template <typename F>
void parallel_rows(int64_t rows, int64_t cols, const F& f) {
  if (rows <= 0 || cols <= 0) return;
  at::parallel_for(0, rows * cols, kElementwiseGrain, [&](int64_t begin, int64_t end) {
    int64_t r = begin / cols, c = begin - r * cols;
    while (begin < end) {
      const int64_t c1 = std::min(cols, c + (end - begin));
      f(r, c, c1);
      begin += c1 - c;
      ++r;
      c = 0;
    }
  });
}

}  // namespace cpu
}  // namespace opforge
