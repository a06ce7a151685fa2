// CPU kernels of indexed_linear: the tokens are grouped by expert (a stable argsort of index), then one ATen GEMM
// per expert that received tokens (at::addmm / at::mm on the gathered rows), scattered back with index_copy_; with
// index_sorted the rows are already grouped and each GEMM reads and writes its slice of rows in place.
// Indices are validated first (an index ≥ E or < −1 raises IndexError).
#include <torch/library.h>

#include "core/check.h"
#include "ops/indexed_linear/indexed_linear.h"

namespace opforge {
namespace {

at::ScalarType opmath_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

/// Tokens grouped by expert: rows (the token ids in expert order; undefined when the rows are already in order)
/// and, per expert e, its range [start[e], start[e] + count[e]) in that order.
struct Groups {
  at::Tensor rows;
  std::vector<int64_t> start, count;
};

/// The experts' ranges from their token counts, the first `first` positions belonging to no expert.
void count_groups(Groups& g, const at::Tensor& counts, int64_t first, int64_t E) {
  const auto* c = counts.const_data_ptr<int64_t>();
  int64_t s = first;
  for (int64_t e = 0; e < E; ++e) {
    g.start.push_back(s);
    g.count.push_back(c[e + 1]);
    s += c[e + 1];
  }
}

/// Groups of any index: a stable argsort (the −1 rows first, in no group).
Groups group_tokens(const at::Tensor& index, int64_t E) {
  Groups g;
  g.rows = std::get<1>(at::sort(index, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::bincount(index + 1, {}, E + 1);  // [E + 1], slot 0: index −1
  count_groups(g, counts, counts.const_data_ptr<int64_t>()[0], E);
  return g;
}

/// Groups of an index already in expert order (index_sorted, checked): the rows in place, the −1 rows last.
Groups given_groups(const at::Tensor& index, int64_t E) {
  Groups g;
  count_groups(g, at::bincount(index + 1, {}, E + 1), 0, E);
  return g;
}

/// The rows of group e of t [T, ·]: a slice when the rows are in place, else gathered through g.rows.
at::Tensor rows_of(const at::Tensor& t, const Groups& g, int64_t e) {
  return g.rows.defined() ? t.index_select(0, g.rows.narrow(0, g.start[e], g.count[e]))
                          : t.narrow(0, g.start[e], g.count[e]);
}

/// Writes v into the rows of group e of t (through g.rows, or into the slice).
void set_rows(at::Tensor& t, const Groups& g, int64_t e, const at::Tensor& v) {
  if (g.rows.defined()) {
    t.index_copy_(0, g.rows.narrow(0, g.start[e], g.count[e]), v);
  } else {
    t.narrow(0, g.start[e], g.count[e]).copy_(v);
  }
}

at::Tensor indexed_linear_cpu(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                              const std::optional<at::Tensor>& bias, bool index_sorted) {
  const auto p = indexed_linear_op::check_indexed_linear("indexed_linear", input, weight, index, bias);
  indexed_linear_op::check_index_values_cpu("indexed_linear", p.index, p.E);
  if (index_sorted) indexed_linear_op::check_index_sorted_cpu("indexed_linear", p.index);
  at::Tensor Y = at::zeros({p.T, p.N}, input.options());  // rows with index −1 stay zero
  if (p.T == 0 || p.N == 0) return Y;
  const Groups g = index_sorted ? given_groups(p.index, p.E) : group_tokens(p.index, p.E);
  for (int64_t e = 0; e < p.E; ++e) {
    if (g.count[e] == 0) continue;
    if (p.K == 0) {
      set_rows(Y, g, e, p.b.defined() ? p.b[e].expand({g.count[e], p.N}) : at::zeros({g.count[e], p.N}, input.options()));
      continue;
    }
    const at::Tensor Xe = rows_of(p.X, g, e);  // [T_e, K]
    if (!g.rows.defined()) {  // Y_e = X_e · W[e]ᵀ + b[e] straight into its rows
      at::Tensor Ye = Y.narrow(0, g.start[e], g.count[e]);
      if (p.b.defined()) {
        at::addmm_out(Ye, p.b[e], Xe, p.W[e].t());
      } else {
        at::mm_out(Ye, Xe, p.W[e].t());
      }
      continue;
    }
    set_rows(Y, g, e, p.b.defined() ? at::addmm(p.b[e], Xe, p.W[e].t()) : at::mm(Xe, p.W[e].t()));
  }
  return Y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> indexed_linear_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype, bool index_sorted) {
  const auto p = indexed_linear_op::check_indexed_linear_backward(grad_output, input, weight, index, bias_dtype);
  indexed_linear_op::check_index_values_cpu("indexed_linear_backward", p.index, p.E);
  if (index_sorted) indexed_linear_op::check_index_sorted_cpu("indexed_linear_backward", p.index);
  const auto dtype = input.scalar_type();
  const at::Tensor dY = to_input_dtype(grad_output, dtype).contiguous();  // [T, N]
  at::Tensor gi, gw, gb;
  if (output_mask[0]) gi = at::zeros({p.T, p.K}, input.options());
  const auto wdt = at::promote_types(dtype, weight.scalar_type());
  if (output_mask[1]) gw = at::zeros({p.E, p.N, p.K}, weight.options().dtype(wdt));
  if (output_mask[2]) gb = at::zeros({p.E, p.N}, input.options().dtype(opmath_dtype(dtype)));
  if (p.T > 0 && (output_mask[0] || output_mask[1] || output_mask[2])) {
    const Groups g = index_sorted ? given_groups(p.index, p.E) : group_tokens(p.index, p.E);
    for (int64_t e = 0; e < p.E; ++e) {
      if (g.count[e] == 0) continue;  // an expert with no token: exactly zero gradients
      const at::Tensor dYe = rows_of(dY, g, e);  // [T_e, N]
      if (output_mask[0] && p.N > 0) {  // dX_e = dY_e · W[e]
        if (g.rows.defined()) {
          set_rows(gi, g, e, at::mm(dYe, p.W[e]));
        } else {
          at::Tensor gie = gi.narrow(0, g.start[e], g.count[e]);
          at::mm_out(gie, dYe, p.W[e]);
        }
      }
      if (output_mask[1] && p.K > 0)
        gw[e].copy_(at::mm(dYe.t().to(wdt), rows_of(p.X, g, e).to(wdt)));  // dW[e] = dY_eᵀ · X_e
      if (output_mask[2]) gb[e].copy_(at::sum(dYe, {0}, false, opmath_dtype(dtype)));  // db[e] = Σ dY_e
    }
  }
  if (gw.defined()) gw = gw.to(weight.scalar_type());
  if (gb.defined()) gb = gb.to(bias_dtype.value_or(dtype));
  return {gi, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("indexed_linear", &indexed_linear_cpu);
  m.impl("indexed_linear_backward", &indexed_linear_backward_cpu);
}

}  // namespace opforge
