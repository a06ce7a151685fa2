// swiglu: the gated activation of Llama-style MLPs, y = silu(gate) · up, silu(g) = g · σ(g).
// Source: Shazeer 2020, "GLU Variants Improve Transformer".
#pragma once

#include <ATen/ATen.h>

#include "opforge/opforge.h"

namespace opforge {

/// Validates (gate, up): floating dtypes, same device, same shape. Returns gate as given and up in gate's
/// dtype (the mixed-dtype policy: gate plays input's role; a conversion copies), layouts untouched: each
/// backend makes them contiguous or reads them through core/layout.h's row_view. Symbolic-shape safe.
std::pair<at::Tensor, at::Tensor> check_swiglu(const char* op, const at::Tensor& gate, const at::Tensor& up);

/// Validates (grad_output, gate, up) of swiglu_backward: check_swiglu's rules, and grad_output of
/// gate's shape and device. Returns all three in gate's dtype, layouts untouched (as check_swiglu).
std::tuple<at::Tensor, at::Tensor, at::Tensor> check_swiglu_backward(const at::Tensor& grad_output,
                                                                     const at::Tensor& gate, const at::Tensor& up);

}  // namespace opforge
