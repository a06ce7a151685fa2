// swiglu: the gated activation of Llama-style MLPs, y = silu(gate) · up, silu(g) = g · σ(g).
// Source: Shazeer 2020, "GLU Variants Improve Transformer".
#pragma once

#include <ATen/ATen.h>

#include "opforge/opforge.h"

namespace opforge {

/// Validates (gate, up): floating dtypes, same device, same shape. Returns both contiguous, up in
/// gate's dtype (the mixed-dtype policy: gate plays input's role). Symbolic-shape safe.
std::pair<at::Tensor, at::Tensor> check_swiglu(const char* op, const at::Tensor& gate, const at::Tensor& up);

/// Validates (grad_output, gate, up) of swiglu_backward: check_swiglu's rules, and grad_output of
/// gate's shape and device. Returns all three contiguous in gate's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> check_swiglu_backward(const at::Tensor& grad_output,
                                                                     const at::Tensor& gate, const at::Tensor& up);

}  // namespace opforge
