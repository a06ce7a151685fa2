// CPU kernels of swiglu and swiglu_packed: core/vec.h's Vectorized maps (partial-vector tails), parallel over
// row segments, inputs read in place through their row strides.
#include <torch/library.h>

#include "core/dispatch.h"
#include "core/layout.h"
#include "core/vec.h"
#include "ops/swiglu/swiglu.h"

namespace opforge {
namespace {

using at::vec::Vectorized;

// Every element is the same Vectorized lane math of its own inputs wherever a row or chunk puts it
// (core/vec.h), so reading a view in place equals reading its contiguous copy bitwise, at any thread count, and
// swiglu_packed equals swiglu on its two halves bitwise.

// y = silu(g) · u
struct SwigluVecOp {
  template <typename V>
  V operator()(const V& g, const V& u) const { return cpu::vec_silu(g) * u; }
};

// dg = (dy · u) · silu'(g) = dy · u · s · (1 + g · (1 − s)); du = dy · g · s, s = σ(g)
struct SwigluBackwardVecOp {
  template <typename V>
  void operator()(const V& dy, const V& g, const V& u, V& dg, V& du) const {
    const V s = cpu::vec_sigmoid(g);
    dg = dy * u * s * (V(1) + g * (V(1) - s));
    du = dy * g * s;
  }
};

// The rows of a tensor read in place: t's last dim of stride 1 (or of size <= 1), row r at data + offset(r) from
// t's leading sizes and strides (any of them: sliced, permuted or expanded rows); another layout reads one
// contiguous copy of t.
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

// Y[r, :] = silu(G[r, :]) · U[r, :] over rows × cols, G and U rows read at g.offset(r) (+ g_col0 for a packed half),
// Y contiguous [rows, cols].
void swiglu_forward_rows(const Rows& g, int64_t g_col0, const Rows& u, int64_t u_col0, int64_t rows, int64_t cols,
                         at::Tensor& Y) {
  OPFORGE_DISPATCH_FLOATING(Y.scalar_type(), "opforge::swiglu", [&] {
    const scalar_t* gp = g.tensor().const_data_ptr<scalar_t>() + g_col0;
    const scalar_t* up = u.tensor().const_data_ptr<scalar_t>() + u_col0;
    scalar_t* yp = Y.mutable_data_ptr<scalar_t>();
    cpu::parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
      cpu::map_binary_range(gp + g.offset(r), up + u.offset(r), yp + r * cols, c0, c1, SwigluVecOp{});
    });
  });
}

// (dG, dU) of swiglu over rows × cols: dY, G, U rows read at their offsets (+ column offsets for packed halves);
// dG, dU rows written at dG_data + r · so (+ d_col0 / d_col0 + cols for the halves of one (*, 2I) gradient).
void swiglu_backward_rows(const Rows& dy, const Rows& g, int64_t g_col0, const Rows& u, int64_t u_col0, int64_t rows,
                          int64_t cols, at::Tensor& dG, at::Tensor& dU, int64_t so) {
  OPFORGE_DISPATCH_FLOATING(dG.scalar_type(), "opforge::swiglu_backward", [&] {
    const scalar_t* dyp = dy.tensor().const_data_ptr<scalar_t>();
    const scalar_t* gp = g.tensor().const_data_ptr<scalar_t>() + g_col0;
    const scalar_t* up = u.tensor().const_data_ptr<scalar_t>() + u_col0;
    scalar_t* dgp = dG.mutable_data_ptr<scalar_t>();
    scalar_t* dup = dU.mutable_data_ptr<scalar_t>();
    cpu::parallel_rows(rows, cols, [&](int64_t r, int64_t c0, int64_t c1) {
      cpu::map3_to2_range(dyp + dy.offset(r), gp + g.offset(r), up + u.offset(r), dgp + r * so, dup + r * so, c0, c1,
                          SwigluBackwardVecOp{});
    });
  });
}

int64_t cols_of(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_swiglu("swiglu", gate, up);  // gate's shape and dtype, any layout
  at::Tensor Y = at::empty(G.sizes(), G.options());  // contiguous, as Meta
  swiglu_forward_rows(Rows(G), 0, Rows(U), 0, rows_of(G), cols_of(G), Y);
  return Y;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up) {
  auto [dY, G, U] = check_swiglu_backward(grad_output, gate, up);  // gate's shape and dtype, any layout
  at::Tensor dG = at::empty(G.sizes(), G.options());  // contiguous, as Meta
  at::Tensor dU = at::empty(G.sizes(), G.options());
  const int64_t cols = cols_of(G);
  swiglu_backward_rows(Rows(dY), Rows(G), 0, Rows(U), 0, rows_of(G), cols, dG, dU, cols);
  return {dG, dU.to(up.scalar_type())};
}

// swiglu_packed: the same maps over the halves input[r, :I], input[r, I:] of each row of one (*, 2I) tensor.
at::Tensor swiglu_packed_cpu(const at::Tensor& input) {
  const int64_t I = check_swiglu_packed("swiglu_packed", input).expect_int();
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = I;
  at::Tensor Y = at::empty(shape, input.options());  // [*, I], contiguous, as Meta
  const Rows x(input);                               // [rows, 2I]
  swiglu_forward_rows(x, 0, x, I, rows_of(input), I, Y);
  return Y;
}

at::Tensor swiglu_packed_backward_cpu(const at::Tensor& grad_output, const at::Tensor& input) {
  auto [dY, Is] = check_swiglu_packed_backward(grad_output, input);  // grad_output in input's dtype, any layout
  const int64_t I = Is.expect_int();
  at::Tensor dX = at::empty(input.sizes(), input.options());  // [*, 2I], contiguous, as Meta
  at::Tensor dU = dX.narrow(-1, I, I);                         // the up half: dX's data + I, rows by 2I
  const Rows x(input);
  swiglu_backward_rows(Rows(dY), x, 0, x, I, rows_of(input), I, dX, dU, 2 * I);
  return dX;
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("swiglu_packed", &swiglu_packed_cpu);
  m.impl("swiglu_packed_backward", &swiglu_packed_backward_cpu);
}

}  // namespace opforge
