// geglu and geglu_packed: the GELU-gated activation of Gemma-style MLPs, y = gelu(gate) · up, gelu as
// torch.nn.functional.gelu(gate, approximate) ("none": the erf form; "tanh": Gemma's gelu_pytorch_tanh).
// Source: Shazeer 2020, "GLU Variants Improve Transformer". The engine is swiglu's (core/gated.h), instantiated
// with Activation::kGELU or kGELUTanh.
#pragma once

#include <c10/util/string_view.h>

#include <utility>

#include "core/activation.h"

namespace opforge {

/// Calls f(std::integral_constant<Activation, A>{}) with A = kGELU for approximate "none", kGELUTanh for "tanh":
/// one kernel instantiation per form. Raises ValueError (core/activation.h's parse_gelu_approximate) naming `op`
/// for another value.
template <typename F>
decltype(auto) with_gelu_approximate(const char* op, c10::string_view approximate, F&& f) {
  if (parse_gelu_approximate(op, approximate) == Activation::kGELUTanh) {
    return f(std::integral_constant<Activation, Activation::kGELUTanh>{});
  }
  return f(std::integral_constant<Activation, Activation::kGELU>{});
}

}  // namespace opforge
