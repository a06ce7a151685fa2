// Row-strided views of tensors (core/layout.h).
#include "core/layout.h"

namespace opforge {

std::optional<RowView> row_view(const at::Tensor& t) {
  const int64_t dim = t.dim();
  const int64_t cols = dim == 0 ? 1 : t.size(-1);
  if (dim > 0 && cols > 1 && t.stride(-1) != 1) return std::nullopt;
  // The leading dims, innermost first, must step as one index over rows: each stride the previous
  // (non-1) dim's stride times its size. Dims of size 1 have no stride that matters.
  int64_t rows = 1, row_stride = cols, expected = -1;
  for (int64_t d = dim - 2; d >= 0; --d) {
    const int64_t size = t.size(d);
    if (size == 1) continue;
    if (expected < 0) {
      row_stride = t.stride(d);
      expected = row_stride * size;
    } else {
      if (t.stride(d) != expected) return std::nullopt;
      expected *= size;
    }
    rows *= size;
  }
  if (rows > 1 && row_stride < cols) return std::nullopt;  // overlapping or expanded rows
  return RowView{rows, cols, row_stride};
}

std::pair<at::Tensor, int64_t> rows_or_contiguous(const at::Tensor& t) {
  if (const auto v = row_view(t)) return {t, v->row_stride};
  at::Tensor c = t.contiguous();
  return {c, c.dim() == 0 ? 1 : c.size(-1)};
}

}  // namespace opforge
