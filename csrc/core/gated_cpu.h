// CPU kernels of the gated activations (core/gated.h), templates over the activation A that the op families'
// *_cpu.cpp instantiate (compiled there, with the CPU kernels' ISA flags): core/vec.h's Vectorized maps
// (partial-vector tails), parallel over row segments, inputs read in place through their row strides.
//
// Every element is the same Vectorized lane math of its own inputs wherever a row or chunk puts it (core/vec.h),
// so reading a view in place equals reading its contiguous copy bitwise, at any thread count, and a packed op
// equals its (gate, up) form on the two halves bitwise.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

#include "core/activation.h"
#include "core/amax_cpu.h"
#include "core/dispatch.h"
#include "core/gated.h"
#include "core/layout.h"
#include "core/vec.h"

namespace opforge {
namespace cpu {

/// y = act(g) · u on Vectorized<opmath_t>, for A in kSiLU, kGELU, kGELUTanh.
template <Activation A>
struct GatedVecOp {
  template <typename V>
  V operator()(const V& g, const V& u) const {
    if constexpr (A == Activation::kSiLU) {
      return vec_silu(g) * u;
    } else if constexpr (A == Activation::kGELU) {
      return vec_gelu(g) * u;
    } else {
      static_assert(A == Activation::kGELUTanh, "gated activations: silu, gelu, gelu_tanh");
      return vec_gelu_tanh(g) * u;
    }
  }
};

/// (dg, du) = (dy · u · act'(g), dy · act(g)), the intermediates of act and act' computed once:
///   silu       s = σ(g):                 dg = dy · u · s · (1 + g · (1 − s)),     du = dy · g · s
///   gelu       c = Φ(g), p = φ(g):        dg = dy · u · (c + g · p),               du = dy · g · c
///   gelu_tanh  t = tanh(√(2/π)(g + κg³)): dg = dy · u · (½(1 + t) + ½g(1 − t²) · √(2/π)(1 + 3κg²)),
///                                         du = dy · ½g · (1 + t)
template <Activation A>
struct GatedBackwardVecOp {
  template <typename V>
  void operator()(const V& dy, const V& g, const V& u, V& dg, V& du) const {
    if constexpr (A == Activation::kSiLU) {
      const V s = vec_sigmoid(g);
      dg = dy * u * s * (V(1) + g * (V(1) - s));
      du = dy * g * s;
    } else if constexpr (A == Activation::kGELU) {
      const V cdf = V(0.5) * (g * V(-act::kSqrt1_2)).erfc();  // Φ(g), accurate in the tail (vec_gelu)
      const V pdf = V(act::kInvSqrt2Pi) * (V(-0.5) * g * g).exp();
      dg = dy * u * (cdf + g * pdf);
      du = dy * g * cdf;
    } else {
      static_assert(A == Activation::kGELUTanh, "gated activations: silu, gelu, gelu_tanh");
      const V g2 = g * g;
      const V t = (V(act::kSqrt2OverPi) * (g + V(act::kGeluTanhKappa) * g2 * g)).tanh();
      const V half_g = V(0.5) * g;
      const V dinner = V(act::kSqrt2OverPi) * (V(1) + V(3 * act::kGeluTanhKappa) * g2);
      dg = dy * u * (V(0.5) * (V(1) + t) + half_g * (V(1) - t * t) * dinner);
      du = dy * half_g * (V(1) + t);
    }
  }
};

/// The rows of a tensor read in place: t's last dim of stride 1 (or of size <= 1), row r at data + offset(r) from
/// t's leading sizes and strides (any of them: sliced, permuted or expanded rows); another layout reads one
/// contiguous copy of t.
class Rows {
 public:
  explicit Rows(const at::Tensor& t) {
    const bool inner_unit = t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1;
    if (const auto v = row_view(t)) {  // one row stride: the common case (a column slice), one multiply per row
      t_ = t;
      sizes_.push_back(v->rows);
      strides_.push_back(v->row_stride);
      return;
    }
    t_ = inner_unit ? t : t.contiguous();
    for (int64_t d = 0; d + 1 < t_.dim(); ++d) {
      sizes_.push_back(t_.size(d));
      strides_.push_back(t_.stride(d));
    }
  }

  /// The tensor the offsets index: t, or its contiguous copy.
  const at::Tensor& tensor() const { return t_; }

  /// Element offset of row r (r < rows_of(t)) from tensor()'s data pointer.
  int64_t offset(int64_t r) const {
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      const int64_t size = sizes_[d];
      off += (r % size) * strides_[d];
      r /= size;
    }
    return off;
  }

 private:
  at::Tensor t_;
  c10::SmallVector<int64_t, 5> sizes_, strides_;  // leading dims, outermost first
};

namespace detail {

inline int64_t gated_cols(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }

// Y[r, :] = act(G[r, :]) · U[r, :] over rows × cols, G and U rows read at g.offset(r) (+ g_col0 for a packed half),
// Y contiguous [rows, cols]. amax (the *_amax ops; null otherwise): [1] in amax's dtype (core/amax_cpu.h), set to
// max |y| over Y, each segment of Y folded right after it is written.
template <Activation A>
void gated_forward_rows(const Rows& g, int64_t g_col0, const Rows& u, int64_t u_col0, int64_t rows,
                        int64_t cols, at::Tensor& Y, at::Tensor* amax = nullptr) {
  OPFORGE_DISPATCH_FLOATING(Y.scalar_type(), "opforge::gated", [&] {
    const scalar_t* gp = g.tensor().const_data_ptr<scalar_t>() + g_col0;
    const scalar_t* up = u.tensor().const_data_ptr<scalar_t>() + u_col0;
    scalar_t* yp = Y.mutable_data_ptr<scalar_t>();
    if (amax == nullptr) {
      parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
        map_binary_range(gp + g.offset(r), up + u.offset(r), yp + r * cols, c0, c1, GatedVecOp<A>{});
      });
      return;
    }
    AmaxWord<scalar_t> word;
    parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
      map_binary_range(gp + g.offset(r), up + u.offset(r), yp + r * cols, c0, c1, GatedVecOp<A>{});
      word.combine(AmaxBits<scalar_t>::fold(yp + r * cols + c0, c1 - c0));
    });
    word.store(*amax);
  });
}

// (dG, dU) over rows × cols: dY, G, U rows read at their offsets (+ column offsets for packed halves); dG, dU rows
// written at dG_data + r · so (+ d_col0 / d_col0 + cols for the halves of one (*, 2I) gradient).
template <Activation A>
void gated_backward_rows(const Rows& dy, const Rows& g, int64_t g_col0, const Rows& u, int64_t u_col0,
                         int64_t rows, int64_t cols, at::Tensor& dG, at::Tensor& dU, int64_t so) {
  OPFORGE_DISPATCH_FLOATING(dG.scalar_type(), "opforge::gated_backward", [&] {
    const scalar_t* dyp = dy.tensor().const_data_ptr<scalar_t>();
    const scalar_t* gp = g.tensor().const_data_ptr<scalar_t>() + g_col0;
    const scalar_t* up = u.tensor().const_data_ptr<scalar_t>() + u_col0;
    scalar_t* dgp = dG.mutable_data_ptr<scalar_t>();
    scalar_t* dup = dU.mutable_data_ptr<scalar_t>();
    parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
      map3_to2_range(dyp + dy.offset(r), gp + g.offset(r), up + u.offset(r), dgp + r * so, dup + r * so, c0, c1,
                     GatedBackwardVecOp<A>{});
    });
  });
}

}  // namespace detail

/// y = act(gate) · up: gate's shape and dtype, contiguous. `op`: the op's name ("swiglu") in errors.
template <Activation A>
at::Tensor gated_forward(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_gated(op, gate, up);           // gate's shape and dtype, any layout
  at::Tensor Y = at::empty(G.sizes(), G.options());  // contiguous, as Meta
  detail::gated_forward_rows<A>(Rows(G), 0, Rows(U), 0, rows_of(G), detail::gated_cols(G), Y);
  return Y;
}

/// (grad_gate, grad_up), contiguous, grad_up in up's dtype. `op`: the backward op's name ("swiglu_backward").
template <Activation A>
std::tuple<at::Tensor, at::Tensor> gated_backward(const char* op, const at::Tensor& grad_output,
                                                  const at::Tensor& gate, const at::Tensor& up) {
  auto [dY, G, U] = check_gated_backward(op, grad_output, gate, up);  // gate's shape and dtype, any layout
  at::Tensor dG = at::empty(G.sizes(), G.options());                  // contiguous, as Meta
  at::Tensor dU = at::empty(G.sizes(), G.options());
  const int64_t cols = detail::gated_cols(G);
  detail::gated_backward_rows<A>(Rows(dY), Rows(G), 0, Rows(U), 0, rows_of(G), cols, dG, dU, cols);
  return {dG, dU.to(up.scalar_type())};
}

/// The packed form: the same maps over the halves input[r, :I], input[r, I:] of each row of one (*, 2I) tensor;
/// (*, I) contiguous in input's dtype. amax: as gated_forward_rows's (null: none).
template <Activation A>
at::Tensor gated_packed_forward(const char* op, const at::Tensor& input, at::Tensor* amax = nullptr) {
  const int64_t I = check_gated_packed(op, input).expect_int();
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = I;
  at::Tensor Y = at::empty(shape, input.options());  // [*, I], contiguous, as Meta
  const Rows x(input);                               // [rows, 2I]
  detail::gated_forward_rows<A>(x, 0, x, I, rows_of(input), I, Y, amax);
  return Y;
}

/// gated_packed_forward plus amax = max |y| over its output as stored ([1], float32, float64 for float64; NaN if any
/// y is NaN, else inf if any is inf; 0 when empty), folded in as the output is written: (output, amax).
template <Activation A>
std::tuple<at::Tensor, at::Tensor> gated_packed_forward_amax(const char* op, const at::Tensor& input) {
  at::Tensor amax = zeroed_amax_tensor(input);  // the output's dtype and device
  at::Tensor Y = gated_packed_forward<A>(op, input, &amax);
  return {Y, amax};
}

/// grad_input (*, 2I) of the packed form, contiguous in input's dtype, both halves written by one pass.
template <Activation A>
at::Tensor gated_packed_backward(const char* op, const at::Tensor& grad_output, const at::Tensor& input) {
  auto [dY, Is] = check_gated_packed_backward(op, grad_output, input);  // grad_output in input's dtype, any layout
  const int64_t I = Is.expect_int();
  at::Tensor dX = at::empty(input.sizes(), input.options());  // [*, 2I], contiguous, as Meta
  at::Tensor dU = dX.narrow(-1, I, I);                         // the up half: dX's data + I, rows by 2I
  const Rows x(input);
  detail::gated_backward_rows<A>(Rows(dY), x, 0, x, I, rows_of(input), I, dX, dU, 2 * I);
  return dX;
}

}  // namespace cpu
}  // namespace opforge
