// CPU kernels of rope: at::parallel_for over the (batch, seq) tokens; per token the table (C, S) is built once
// in opmath and reused by every head of q and k; rows with a contiguous last dim convert and compute with
// at::vec (Vectorized), others take the strided scalar loop.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/dispatch.h"
#include "ops/rope/rope.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

// base^(−2i/R) for i < R/2 (float64): the frequencies of rope_from_positions, the same for every token.
std::vector<double> inv_freq(const rotary::Problem& p) {
  std::vector<double> f(p.positions.defined() ? p.R / 2 : 0);
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = std::pow(p.base, -2.0 * static_cast<double>(i) / static_cast<double>(p.R));
  return f;
}

// Fills C, S [R] (opmath) for token (b, s): from the cos/sin tables, or from θ_i = pos · freq[i] in float64
// (freq: inv_freq(p); cos/sin through at::vec, Sleef's 1-ulp float64 functions on AVX2; work: R doubles).
template <typename opmath_t, typename trig_t>
void fill_table(const rotary::Problem& p, const double* freq, double* work, int64_t b, int64_t s, opmath_t* C,
                opmath_t* S) {
  const int64_t R = p.R;
  if (p.positions.defined()) {
    using Vd = Vectorized<double>;
    const int64_t* pos = p.positions.const_data_ptr<int64_t>();
    const int64_t pb = p.positions.size(0) == 1 ? 0 : b;
    const double position = static_cast<double>(pos[pb * p.positions.stride(0) + s * p.positions.stride(1)]);
    const int64_t h = R / 2;
    double *cw = work, *sw = work + h;
    for (int64_t i = 0; i < h; i += Vd::size()) {
      const int n = static_cast<int>(std::min<int64_t>(Vd::size(), h - i));  // a partial vector at the tail
      const Vd theta = Vd(position) * Vd::loadu(freq + i, n);
      theta.cos().store(cw + i, n);
      theta.sin().store(sw + i, n);
    }
    for (int64_t i = 0; i < h; ++i) {
      int64_t a, bb;
      rotary::pair_dims(i, R, p.interleaved, a, bb);
      const opmath_t c = static_cast<opmath_t>(cw[i]), sn = static_cast<opmath_t>(sw[i]);
      rotary::table_pair(c, sn, c, sn, p.backward, C[a], C[bb], S[a], S[bb]);
    }
    return;
  }
  const trig_t* cs = p.cos.const_data_ptr<trig_t>();
  const trig_t* sn = p.sin.const_data_ptr<trig_t>();
  const int64_t cb = p.cos.size(0) == 1 ? 0 : b;
  const int64_t c0 = cb * p.cos.stride(0) + s * p.cos.stride(1), cr = p.cos.stride(2);
  const int64_t s0 = cb * p.sin.stride(0) + s * p.sin.stride(1), sr = p.sin.stride(2);
  for (int64_t i = 0; i < R / 2; ++i) {
    int64_t a, bb;
    rotary::pair_dims(i, R, p.interleaved, a, bb);
    rotary::table_pair(static_cast<opmath_t>(cs[c0 + a * cr]), static_cast<opmath_t>(sn[s0 + a * sr]),
                     static_cast<opmath_t>(cs[c0 + bb * cr]), static_cast<opmath_t>(sn[s0 + bb * sr]), p.backward,
                     C[a], C[bb], S[a], S[bb]);
  }
}

// One head row: x, y [D] with element strides xs, ys; X, Y [R] opmath scratch.
// y[j] = x[j]·C[j] + x[partner(j)]·S[j] for j < R; y[j] = x[j] (bit-identical) for j ≥ R.
template <typename scalar_t, typename opmath_t>
void rope_row(const scalar_t* x, int64_t xs, scalar_t* y, int64_t ys, int64_t D, int64_t R, bool interleaved,
              const opmath_t* C, const opmath_t* S, opmath_t* X, opmath_t* Y) {
  using V = Vectorized<opmath_t>;
  if (xs == 1) {
    at::vec::convert(x, X, R);
  } else {
    for (int64_t j = 0; j < R; ++j) X[j] = static_cast<opmath_t>(x[j * xs]);
  }
  if (interleaved) {
    for (int64_t j = 0; j < R; j += 2) {
      Y[j] = X[j] * C[j] + X[j + 1] * S[j];
      Y[j + 1] = X[j + 1] * C[j + 1] + X[j] * S[j + 1];
    }
  } else {
    const int64_t h = R / 2;
    // Y[j] = X[j]·C[j] + X[j + h]·S[j] (j < h);  Y[j + h] = X[j + h]·C[j + h] + X[j]·S[j + h]
    int64_t j = 0;
    for (; j + V::size() <= h; j += V::size()) {
      const V xa = V::loadu(X + j), xb = V::loadu(X + j + h);
      at::vec::fmadd(xa, V::loadu(C + j), xb * V::loadu(S + j)).store(Y + j);
      at::vec::fmadd(xb, V::loadu(C + j + h), xa * V::loadu(S + j + h)).store(Y + j + h);
    }
    for (; j < h; ++j) {
      Y[j] = X[j] * C[j] + X[j + h] * S[j];
      Y[j + h] = X[j + h] * C[j + h] + X[j] * S[j + h];
    }
  }
  if (ys == 1) {
    at::vec::convert(Y, y, R);
  } else {
    for (int64_t j = 0; j < R; ++j) y[j * ys] = static_cast<scalar_t>(Y[j]);
  }
  if (xs == 1 && ys == 1) {
    std::copy(x + R, x + D, y + R);
  } else {
    for (int64_t j = R; j < D; ++j) y[j * ys] = x[j * xs];
  }
}

template <typename scalar_t, typename trig_t>
void rope_cpu_kernel(const rotary::Problem& p) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t T = p.B * p.S, D = p.D, R = p.R;
  int64_t rows = 0;
  for (int i = 0; i < 2; ++i) rows += p.x[i].defined() ? p.x[i].size(1) : 0;
  if (T == 0 || rows == 0) return;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, rows * D));
  const std::vector<double> freq = inv_freq(p);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    std::vector<opmath_t> buf(4 * R);
    std::vector<double> work(freq.empty() ? 0 : R);
    opmath_t *C = buf.data(), *S = C + R, *X = S + R, *Y = X + R;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / p.S, s = t % p.S;
      fill_table<opmath_t, trig_t>(p, freq.data(), work.data(), b, s, C, S);
      for (int i = 0; i < 2; ++i) {
        if (!p.x[i].defined()) continue;
        const at::Tensor &x = p.x[i], &y = p.y[i];
        const scalar_t* xp = x.const_data_ptr<scalar_t>() + b * x.stride(0) + s * x.stride(2);
        scalar_t* yp = y.mutable_data_ptr<scalar_t>() + b * y.stride(0) + s * y.stride(2);
        for (int64_t h = 0; h < x.size(1); ++h)
          rope_row(xp + h * x.stride(1), x.stride(3), yp + h * y.stride(1), y.stride(3), D, R, p.interleaved, C, S,
                   X, Y);
      }
    }
  });
}

void run_cpu(const rotary::Problem& p) {
  const at::Tensor& ref = p.x[0].defined() ? p.x[0] : p.x[1];
  const bool table_in_opmath = p.cos.defined() && p.cos.scalar_type() != ref.scalar_type();
  OPFORGE_DISPATCH_FLOATING(ref.scalar_type(), "opforge::rope", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    if (table_in_opmath) {
      rope_cpu_kernel<scalar_t, opmath_t>(p);
    } else {
      rope_cpu_kernel<scalar_t, scalar_t>(p);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("rope", &rotary::Kernels<&run_cpu>::rope);
  m.impl("rope_backward", &rotary::Kernels<&run_cpu>::rope_backward);
  m.impl("rope_from_positions", &rotary::Kernels<&run_cpu>::rope_from_positions);
  m.impl("rope_from_positions_backward", &rotary::Kernels<&run_cpu>::rope_from_positions_backward);
}

}  // namespace opforge
