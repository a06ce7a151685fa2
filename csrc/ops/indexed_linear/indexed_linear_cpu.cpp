// CPU kernels of indexed_linear: the tokens are grouped by expert (a stable argsort of index), then one ATen GEMM
// per expert that received tokens (at::addmm / at::mm on the gathered rows), scattered back with index_copy_.
// Indices are validated first (an index ≥ E or < −1 raises IndexError).
#include <torch/library.h>

#include "core/check.h"
#include "ops/indexed_linear/indexed_linear.h"

namespace opforge {
namespace {

at::ScalarType opmath_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

/// Tokens grouped by expert: rows (the token ids in expert order) and, per expert e, its range
/// [start[e], start[e] + count[e]) in rows. Tokens with index −1 come first and belong to no expert.
struct Groups {
  at::Tensor rows;
  std::vector<int64_t> start, count;
};

Groups group_tokens(const at::Tensor& index, int64_t E) {
  Groups g;
  g.rows = std::get<1>(at::sort(index, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::bincount(index + 1, {}, E + 1);  // [E + 1], slot 0: index −1
  const auto* c = counts.const_data_ptr<int64_t>();
  int64_t s = c[0];
  for (int64_t e = 0; e < E; ++e) {
    g.start.push_back(s);
    g.count.push_back(c[e + 1]);
    s += c[e + 1];
  }
  return g;
}

at::Tensor indexed_linear_cpu(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                              const std::optional<at::Tensor>& bias, bool index_sorted) {
  const auto p = indexed_linear_op::check_indexed_linear("indexed_linear", input, weight, index, bias);
  indexed_linear_op::check_index_values_cpu("indexed_linear", p.index, p.E);
  if (index_sorted) indexed_linear_op::check_index_sorted_cpu("indexed_linear", p.index);
  at::Tensor Y = at::zeros({p.T, p.N}, input.options());  // rows with index −1 stay zero
  if (p.T == 0 || p.N == 0) return Y;
  const Groups g = group_tokens(p.index, p.E);
  for (int64_t e = 0; e < p.E; ++e) {
    if (g.count[e] == 0) continue;
    const at::Tensor rows = g.rows.narrow(0, g.start[e], g.count[e]);
    const at::Tensor Xe = p.X.index_select(0, rows);  // [T_e, K]
    at::Tensor Ye;                                     // [T_e, N] = X_e · W[e]ᵀ + b[e]
    if (p.K == 0) {
      Ye = p.b.defined() ? p.b[e].expand({g.count[e], p.N}) : at::zeros({g.count[e], p.N}, input.options());
    } else {
      Ye = p.b.defined() ? at::addmm(p.b[e], Xe, p.W[e].t()) : at::mm(Xe, p.W[e].t());
    }
    Y.index_copy_(0, rows, Ye);
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
  const at::Tensor dY = to_input_dtype(grad_output, dtype);  // [T, N]
  at::Tensor gi, gw, gb;
  if (output_mask[0]) gi = at::zeros({p.T, p.K}, input.options());
  const auto wdt = at::promote_types(dtype, weight.scalar_type());
  if (output_mask[1]) gw = at::zeros({p.E, p.N, p.K}, weight.options().dtype(wdt));
  if (output_mask[2]) gb = at::zeros({p.E, p.N}, input.options().dtype(opmath_dtype(dtype)));
  if (p.T > 0 && (output_mask[0] || output_mask[1] || output_mask[2])) {
    const Groups g = group_tokens(p.index, p.E);
    for (int64_t e = 0; e < p.E; ++e) {
      if (g.count[e] == 0) continue;  // an expert with no token: exactly zero gradients
      const at::Tensor rows = g.rows.narrow(0, g.start[e], g.count[e]);
      const at::Tensor dYe = dY.index_select(0, rows);  // [T_e, N]
      if (output_mask[0] && p.N > 0) gi.index_copy_(0, rows, at::mm(dYe, p.W[e]));  // dX_e = dY_e · W[e]
      if (output_mask[1] && p.K > 0)
        gw[e].copy_(at::mm(dYe.t().to(wdt), p.X.index_select(0, rows).to(wdt)));  // dW[e] = dY_eᵀ · X_e
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
