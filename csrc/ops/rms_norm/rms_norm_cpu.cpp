// CPU kernels of the RMSNorm ops: one row per task step, at::vec::Vectorized bodies with fp32
// (opmath) accumulation and scalar tails, at::parallel_for over rows. dweight: fp32 partial rows over fixed
// blocks of rows, summed once at the end in block order; the blocks depend on the problem's shape only, never
// on the thread count, so dweight is bitwise the same for any torch.set_num_threads (deterministic).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>

#include "core/amax_cpu.h"
#include "core/dispatch.h"
#include "ops/rms_norm/rms_norm.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

// Loads and stores of kWidth storage elements as kParts opmath vectors (kParts = 2 for float16/bfloat16,
// whose Vectorized holds twice as many elements as Vectorized<float>; 1 for float32/float64).
template <typename scalar_t>
struct VecIO {
  using opmath_t = at::opmath_type<scalar_t>;
  using fVec = Vectorized<opmath_t>;
  static constexpr int64_t kWidth = Vectorized<scalar_t>::size();
  static constexpr int kParts = static_cast<int>(kWidth / fVec::size());

  static inline void load(const scalar_t* p, fVec* out) {
    if constexpr (kParts == 1) {
      out[0] = fVec::loadu(p);
    } else {
      auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vectorized<scalar_t>::loadu(p));
      out[0] = lo;
      out[1] = hi;
    }
  }
  static inline void store(scalar_t* p, const fVec* v) {
    if constexpr (kParts == 1) {
      v[0].store(p);
    } else {
      at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p);
    }
  }
};

// Grain of at::parallel_for over rows: at least ~16K elements per task.
inline int64_t row_grain(int64_t N) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)); }

// y = x · rstd · w for one row (the forward's last step; also _rms_norm_apply's whole work, so the two agree bitwise)
template <typename scalar_t>
void apply_row(const scalar_t* x, at::opmath_type<scalar_t> rs, const scalar_t* w, scalar_t* y, int64_t N) {
  using IO = VecIO<scalar_t>;
  const typename IO::fVec rv(rs);
  int64_t i = 0;
  for (; i + IO::kWidth <= N; i += IO::kWidth) {
    typename IO::fVec a[IO::kParts], b[IO::kParts];
    IO::load(x + i, a);
    IO::load(w + i, b);
    for (int k = 0; k < IO::kParts; ++k) a[k] = a[k] * rv * b[k];
    IO::store(y + i, a);
  }
  for (; i < N; ++i) y[i] = static_cast<scalar_t>(static_cast<at::opmath_type<scalar_t>>(x[i]) * rs *
                                                  static_cast<at::opmath_type<scalar_t>>(w[i]));
}

// One forward row. With r (fused): z = x + r rounded to scalar_t and stored, then normalized.
//   rstd = 1 / sqrt(Σ z² / N + eps);  y = z · rstd · w
template <typename scalar_t>
void forward_row(const scalar_t* x, const scalar_t* r, const scalar_t* w, scalar_t* y, scalar_t* z,
                 at::opmath_type<scalar_t>* rstd, int64_t N, double eps) {
  using IO = VecIO<scalar_t>;
  using opmath_t = typename IO::opmath_t;
  using fVec = typename IO::fVec;
  constexpr int64_t W = IO::kWidth;
  constexpr int P = IO::kParts;
  if (r != nullptr) {
    // z = x + r
    int64_t i = 0;
    for (; i + W <= N; i += W) {
      fVec a[P], b[P];
      IO::load(x + i, a);
      IO::load(r + i, b);
      for (int k = 0; k < P; ++k) a[k] = a[k] + b[k];
      IO::store(z + i, a);
    }
    for (; i < N; ++i) z[i] = static_cast<scalar_t>(static_cast<opmath_t>(x[i]) + static_cast<opmath_t>(r[i]));
    x = z;
  }
  // ss = Σ x², two steps per iteration for independent accumulators
  fVec acc[2 * P];
  for (int k = 0; k < 2 * P; ++k) acc[k] = fVec(opmath_t(0));
  int64_t i = 0;
  for (; i + 2 * W <= N; i += 2 * W) {
    fVec a[P], b[P];
    IO::load(x + i, a);
    IO::load(x + i + W, b);
    for (int k = 0; k < P; ++k) {
      acc[k] = at::vec::fmadd(a[k], a[k], acc[k]);
      acc[P + k] = at::vec::fmadd(b[k], b[k], acc[P + k]);
    }
  }
  for (; i + W <= N; i += W) {
    fVec a[P];
    IO::load(x + i, a);
    for (int k = 0; k < P; ++k) acc[k] = at::vec::fmadd(a[k], a[k], acc[k]);
  }
  for (int k = 1; k < 2 * P; ++k) acc[0] = acc[0] + acc[k];
  opmath_t ss = at::vec::vec_reduce_all<opmath_t>([](fVec& u, fVec& v) { return u + v; }, acc[0]);
  for (; i < N; ++i) {
    const opmath_t v = static_cast<opmath_t>(x[i]);
    ss += v * v;
  }
  const opmath_t rs = opmath_t(1) / std::sqrt(ss / static_cast<opmath_t>(N) + static_cast<opmath_t>(eps));
  *rstd = rs;
  apply_row(x, rs, w, y, N);
}

// Shared by _rms_norm_forward and _fused_add_rms_norm_forward (and their *_amax forms): fills Y, Z (fused only) and
// rstd; with amax, each task folds the rows of Y it has just written (core/amax_cpu.h) into *amax.
void forward_cpu(const rmsnorm::Problem& p, at::Tensor& Y, at::Tensor& Z, at::Tensor& rstd, at::Tensor* amax) {
  const int64_t M = p.M, N = p.N;
  if (amax != nullptr) *amax = cpu::zeroed_amax_tensor(Y);
  if (M == 0) return;
  if (N == 0) {
    rstd.fill_(1.0 / std::sqrt(p.eps));
    return;
  }
  const at::Tensor W = p.W.defined() ? p.W : at::ones({N}, p.X.options());  // [N]
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::rms_norm", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* x = p.X.const_data_ptr<scalar_t>();                          // [M, N]
    const scalar_t* r = p.R.defined() ? p.R.const_data_ptr<scalar_t>() : nullptr;  // [M, N]
    const scalar_t* w = W.const_data_ptr<scalar_t>();                            // [N]
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();                                // [M, N]
    scalar_t* z = Z.defined() ? Z.mutable_data_ptr<scalar_t>() : nullptr;         // [M, N]
    opmath_t* rs = rstd.mutable_data_ptr<opmath_t>();                            // [M]
    const double eps = p.eps;
    cpu::AmaxWord<scalar_t> word;
    const bool want_amax = amax != nullptr;
    at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
      typename cpu::AmaxBits<scalar_t>::bits_t task_max = 0;
      for (int64_t m = m0; m < m1; ++m) {
        forward_row<scalar_t>(x + m * N, r ? r + m * N : nullptr, w, y + m * N, z ? z + m * N : nullptr, rs + m, N,
                              eps);
        if (want_amax) task_max = cpu::AmaxBits<scalar_t>::fold(y + m * N, N, task_max);
      }
      if (want_amax) word.combine(task_max);
    });
    if (want_amax) word.store(*amax);
  });
}

// One backward row (rs = rstd of the row):
//   s = Σ w·dy·x;  dx = rs·w·dy − x·(rs³·s/N);  dw_acc += dy·x·rs (when dw_acc)
template <typename scalar_t>
void backward_row(const scalar_t* dy, const scalar_t* x, const scalar_t* w, at::opmath_type<scalar_t> rs,
                  scalar_t* dx, at::opmath_type<scalar_t>* dw_acc, int64_t N) {
  using IO = VecIO<scalar_t>;
  using opmath_t = typename IO::opmath_t;
  using fVec = typename IO::fVec;
  constexpr int64_t W = IO::kWidth;
  constexpr int P = IO::kParts;
  const fVec rv(rs);
  if (dx != nullptr) {
    fVec acc[P];
    for (int k = 0; k < P; ++k) acc[k] = fVec(opmath_t(0));
    int64_t i = 0;
    for (; i + W <= N; i += W) {
      fVec g[P], a[P], b[P];
      IO::load(dy + i, g);
      IO::load(x + i, a);
      IO::load(w + i, b);
      for (int k = 0; k < P; ++k) acc[k] = at::vec::fmadd(g[k] * b[k], a[k], acc[k]);
    }
    for (int k = 1; k < P; ++k) acc[0] = acc[0] + acc[k];
    opmath_t s = at::vec::vec_reduce_all<opmath_t>([](fVec& u, fVec& v) { return u + v; }, acc[0]);
    for (; i < N; ++i)
      s += static_cast<opmath_t>(w[i]) * static_cast<opmath_t>(dy[i]) * static_cast<opmath_t>(x[i]);
    const opmath_t c = rs * rs * rs * s / static_cast<opmath_t>(N);
    const fVec cv(c);
    i = 0;
    for (; i + W <= N; i += W) {
      fVec g[P], a[P], b[P];
      IO::load(dy + i, g);
      IO::load(x + i, a);
      IO::load(w + i, b);
      fVec d[P];
      for (int k = 0; k < P; ++k) d[k] = rv * b[k] * g[k] - a[k] * cv;
      IO::store(dx + i, d);
      if (dw_acc != nullptr) {
        for (int k = 0; k < P; ++k) {
          const int64_t j = i + k * fVec::size();
          at::vec::fmadd(g[k] * a[k], rv, fVec::loadu(dw_acc + j)).store(dw_acc + j);
        }
      }
    }
    for (; i < N; ++i) {
      const opmath_t g = static_cast<opmath_t>(dy[i]), a = static_cast<opmath_t>(x[i]);
      dx[i] = static_cast<scalar_t>(rs * static_cast<opmath_t>(w[i]) * g - a * c);
      if (dw_acc != nullptr) dw_acc[i] += g * a * rs;
    }
  } else {
    int64_t i = 0;
    for (; i + W <= N; i += W) {
      fVec g[P], a[P];
      IO::load(dy + i, g);
      IO::load(x + i, a);
      for (int k = 0; k < P; ++k) {
        const int64_t j = i + k * fVec::size();
        at::vec::fmadd(g[k] * a[k], rv, fVec::loadu(dw_acc + j)).store(dw_acc + j);
      }
    }
    for (; i < N; ++i) dw_acc[i] += static_cast<opmath_t>(dy[i]) * static_cast<opmath_t>(x[i]) * rs;
  }
}

at::Tensor backward_cpu(rmsnorm::BackwardSetup& s, const at::Tensor& weight) {
  const rmsnorm::BackwardProblem& p = s.p;
  const int64_t M = p.M, N = p.N;
  // Rows split into nblocks fixed blocks; block b accumulates rows [b·M/B, (b+1)·M/B) in order into its dweight
  // partial row partials[b]. B depends on M and N only (at most kMaxDwBlocks, each at least row_grain(N) rows),
  // so the sums are independent of how many threads run the blocks.
  constexpr int64_t kMaxDwBlocks = 64;
  const int64_t nblocks =
      s.want_dw ? std::max<int64_t>(1, std::min<int64_t>(kMaxDwBlocks, M / row_grain(N))) : 0;
  at::Tensor partials = s.want_dw ? at::zeros({nblocks, N}, p.X.options().dtype(s.acc_dtype)) : at::Tensor();  // [B, N]
  if (M > 0 && N > 0) {
    const at::Tensor W = p.W.defined() ? p.W : at::ones({N}, p.X.options());  // [N]
    OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::rms_norm_backward", [&] {
      using opmath_t = at::opmath_type<scalar_t>;
      const scalar_t* dy = p.dY.const_data_ptr<scalar_t>();       // [M, N]
      const scalar_t* x = p.X.const_data_ptr<scalar_t>();         // [M, N]
      const opmath_t* rs = p.rstd.const_data_ptr<opmath_t>();     // [M]
      const scalar_t* w = W.const_data_ptr<scalar_t>();           // [N]
      scalar_t* dx = s.want_dx ? s.dX.mutable_data_ptr<scalar_t>() : nullptr;  // [M, N]
      if (s.want_dw) {
        opmath_t* part = partials.mutable_data_ptr<opmath_t>();
        at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) {
            for (int64_t m = b * M / nblocks; m < (b + 1) * M / nblocks; ++m)
              backward_row<scalar_t>(dy + m * N, x + m * N, w, rs[m], dx ? dx + m * N : nullptr, part + b * N, N);
          }
        });
      } else {
        at::parallel_for(0, M, row_grain(N), [&](int64_t m0, int64_t m1) {
          for (int64_t m = m0; m < m1; ++m)
            backward_row<scalar_t>(dy + m * N, x + m * N, w, rs[m], dx + m * N, nullptr, N);
        });
      }
    });
  }
  at::Tensor dW;
  if (s.want_dw) {
    // dW[j] = Σ_b partials[b, j], b in order (ATen's sum may split the reduction by thread count)
    at::Tensor sum = at::empty({N}, partials.options());  // [N]
    AT_DISPATCH_FLOATING_TYPES(s.acc_dtype, "opforge::rms_norm_backward_dw", [&] {
      const scalar_t* part = partials.const_data_ptr<scalar_t>();  // [B, N]
      scalar_t* out = sum.mutable_data_ptr<scalar_t>();            // [N]
      at::parallel_for(0, N, 4096, [&](int64_t j0, int64_t j1) {
        for (int64_t j = j0; j < j1; ++j) out[j] = part[j];
        for (int64_t b = 1; b < nblocks; ++b)
          for (int64_t j = j0; j < j1; ++j) out[j] += part[b * N + j];
      });
    });
    dW = rmsnorm::as_weight_grad(sum, weight);
  }
  return dW;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input,
                                                         const at::Tensor& rstd,
                                                         const std::optional<at::Tensor>& weight,
                                                         std::array<bool, 2> output_mask) {
  return rmsnorm::rms_norm_backward(backward_cpu, grad_output, input, rstd, weight, output_mask);
}

at::Tensor rms_norm_apply_cpu(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  const rmsnorm::BackwardProblem p = rmsnorm::check_apply(input, rstd, weight);
  at::Tensor Y = at::empty(input.sizes(), p.X.options());
  if (p.M == 0 || p.N == 0) return Y;
  const at::Tensor W = p.W.defined() ? p.W : at::ones({p.N}, p.X.options());  // [N] (ones: x · rstd · 1, exact)
  OPFORGE_DISPATCH_FLOATING(p.X.scalar_type(), "opforge::_rms_norm_apply", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* x = p.X.const_data_ptr<scalar_t>();
    const opmath_t* rs = p.rstd.const_data_ptr<opmath_t>();
    const scalar_t* w = W.const_data_ptr<scalar_t>();
    scalar_t* y = Y.mutable_data_ptr<scalar_t>();
    const int64_t N = p.N;
    at::parallel_for(0, p.M, row_grain(N), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) apply_row<scalar_t>(x + m * N, rs[m], w, y + m * N, N);
    });
  });
  return Y;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("_rms_norm_apply", &rms_norm_apply_cpu);
  rmsnorm::ForwardOps<forward_cpu>::register_for(m);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
}

}  // namespace opforge
