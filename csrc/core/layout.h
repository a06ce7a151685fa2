// Tensor layouts a kernel can read in place: a row-strided 2-D view of any tensor whose last dim is contiguous and
// whose leading dims step as one row index (e.g. a column slice `x[..., :I]` of a fused projection), so the
// kernels of core/map_cuda.cuh (*_rows launchers) need no contiguous copy.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>

namespace opforge {

/// Rows of t flattened to [rows, size(-1)]: the product of its leading dims (well defined when size(-1) == 0,
/// where numel / size(-1) is not; 1 for a 1-D or 0-d tensor).
inline int64_t rows_of(const at::Tensor& t) {
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) M *= t.size(d);
  return M;
}

/// A tensor read as a row-strided 2-D view: element (r, c) at data_ptr + r * row_stride + c.
struct RowView {
  int64_t rows;        ///< numel / cols
  int64_t cols;        ///< size(-1) (1 for a 0-d tensor)
  int64_t row_stride;  ///< elements between the starts of consecutive rows, >= cols
};

/// t as a [numel / size(-1), size(-1)] row-strided view without copying: the last dim of stride 1 and the
/// leading dims collapsible to one row stride >= size(-1). nullopt when t's layout does not fit (transposed,
/// permuted leading dims, expanded or overlapping rows). Reads sizes and strides only (no data, no sync).
std::optional<RowView> row_view(const at::Tensor& t);

/// (t, its row stride) when row_view(t) fits, else (t.contiguous(), size(-1)): what a *_rows launcher of
/// core/map_cuda.cuh takes. The copy happens only for layouts row_view refuses.
std::pair<at::Tensor, int64_t> rows_or_contiguous(const at::Tensor& t);

}  // namespace opforge
