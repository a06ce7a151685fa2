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

/// Validates input of swiglu_packed (`op`: the op named in errors): floating, at least 1-D, last dimension even
/// (2I). Returns I. Symbolic-shape safe.
c10::SymInt check_swiglu_packed(const char* op, const at::Tensor& input);

/// input's sizes with the last dimension halved: the shape (*, I) of swiglu_packed's output and grad_output.
c10::SymDimVector swiglu_packed_output_shape(const at::Tensor& input);

/// Validates (grad_output, input) of swiglu_packed_backward: check_swiglu_packed's rules, grad_output floating,
/// on input's device, of shape (*, I). Returns (grad_output in input's dtype, I), layouts untouched.
std::pair<at::Tensor, c10::SymInt> check_swiglu_packed_backward(const at::Tensor& grad_output, const at::Tensor& input);

}  // namespace opforge
