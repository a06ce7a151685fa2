// The schema names of core/activation.h's activations.
#include "core/activation.h"

#include <c10/util/Exception.h>

#include <string>

namespace opforge {

Activation parse_activation(const char* op, c10::string_view name) {
  if (name == "none") return Activation::kNone;
  if (name == "relu") return Activation::kReLU;
  if (name == "gelu") return Activation::kGELU;
  if (name == "gelu_tanh") return Activation::kGELUTanh;
  if (name == "silu") return Activation::kSiLU;
  TORCH_CHECK_VALUE(false, "opforge::", op,
                    ": expected activation to be one of \"none\", \"relu\", \"gelu\", \"gelu_tanh\", \"silu\", "
                    "but got \"",
                    std::string(name), "\"");
  return Activation::kNone;
}

Activation parse_gelu_approximate(const char* op, c10::string_view approximate) {
  if (approximate == "none") return Activation::kGELU;
  if (approximate == "tanh") return Activation::kGELUTanh;
  TORCH_CHECK_VALUE(false, "opforge::", op, ": expected approximate to be \"none\" or \"tanh\", but got \"",
                    std::string(approximate), "\"");
  return Activation::kGELU;
}

const char* gelu_approximate_name(Activation act) { return act == Activation::kGELUTanh ? "tanh" : "none"; }

const char* activation_name(Activation act) {
  switch (act) {
    case Activation::kNone: return "none";
    case Activation::kReLU: return "relu";
    case Activation::kGELU: return "gelu";
    case Activation::kGELUTanh: return "gelu_tanh";
    case Activation::kSiLU: return "silu";
    case Activation::kSigmoid: return "sigmoid";
  }
  return "none";
}

}  // namespace opforge
