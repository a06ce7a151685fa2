// swiglu: the gated activation of Llama-style MLPs, y = silu(gate) · up, silu(g) = g · σ(g).
// Source: Shazeer 2020, "GLU Variants Improve Transformer".
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "opforge/opforge.h"

namespace opforge {

/// Validates (gate, up): floating dtypes, same device, same shape. Returns gate as given and up in gate's
/// dtype (the mixed-dtype policy: gate plays input's role; a conversion copies), layouts untouched: each
/// backend makes them contiguous or reads them through row_view. Symbolic-shape safe.
std::pair<at::Tensor, at::Tensor> check_swiglu(const char* op, const at::Tensor& gate, const at::Tensor& up);

/// Validates (grad_output, gate, up) of swiglu_backward: check_swiglu's rules, and grad_output of
/// gate's shape and device. Returns all three in gate's dtype, layouts untouched (as check_swiglu).
std::tuple<at::Tensor, at::Tensor, at::Tensor> check_swiglu_backward(const at::Tensor& grad_output,
                                                                     const at::Tensor& gate, const at::Tensor& up);

/// A tensor read as a row-strided 2-D view: element (r, c) at data_ptr + r * row_stride + c.
struct RowView {
  int64_t rows;        ///< numel / cols
  int64_t cols;        ///< size(-1) (1 for a 0-d tensor)
  int64_t row_stride;  ///< elements between the starts of consecutive rows, >= cols
};

/// t as a [numel / size(-1), size(-1)] row-strided view without copying, e.g. a column slice
/// `x[..., :I]` of a wider tensor: the last dim of stride 1 and the leading dims collapsible to one row
/// stride >= size(-1). nullopt when t's layout does not fit (transposed, permuted leading dims, ...).
std::optional<RowView> row_view(const at::Tensor& t);

}  // namespace opforge
