// Argument checks shared by every op's checker (CPU, CUDA and Meta run the same checker).
//
// Every message has the form "opforge::<op>: expected <what>, but got <what was given>".
// TORCH_CHECK raises c10::Error, which Python sees as RuntimeError (ValueError/TypeError where
// TORCH_CHECK_VALUE/TORCH_CHECK_TYPE are used), so a bad input never crashes the process.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>

namespace opforge {

/// Decimal text of a number for error messages. Built with std::to_string / snprintf (C stdio), never
/// through a std::ostream: on some torch builds (2.11 wheels) an ostream numeric insert from this
/// library reached a second copy of libstdc++'s locale facets and crashed the process, so every number
/// that goes into an opforge message goes through num_str first.
inline std::string num_str(int64_t v) { return std::to_string(v); }
inline std::string num_str(int v) { return std::to_string(v); }
inline std::string num_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
inline std::string num_str(const c10::SymInt& v) {
  if (auto i = v.maybe_as_int()) return std::to_string(*i);
  return v.toSymNodeImplUnowned()->str();  // a symbolic size (torch.compile's dynamic shapes)
}

/// "[4, 8]"-style text of a (possibly symbolic) shape, for error messages.
inline std::string shape_str(c10::SymIntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + num_str(sizes[i]);
  return out + "]";
}

/// True for the dtypes opforge computes in: float64, float32, float16, bfloat16.
inline bool is_supported_floating(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

/// Raises unless `t` is defined and of a supported floating dtype.
/// Raises: TypeError "opforge::<op>: expected <name> to have a floating dtype (float64, float32,
///         float16 or bfloat16), but got <dtype>" for integer, bool and complex tensors.
inline void check_floating(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), "opforge::", op, ": expected ", name, " to be a tensor, but got None");
  TORCH_CHECK_TYPE(is_supported_floating(t.scalar_type()), "opforge::", op, ": expected ", name,
                   " to have a floating dtype (float64, float32, float16 or bfloat16), but got ",
                   t.scalar_type());
}

/// Raises unless `a` and `b` are on the same device (a CPU tensor with a CUDA tensor, or cuda:0 with cuda:1).
inline void check_same_device(const char* op, const char* name_a, const at::Tensor& a, const char* name_b,
                              const at::Tensor& b) {
  TORCH_CHECK(a.device() == b.device(), "opforge::", op, ": expected ", name_a, " and ", name_b,
              " to be on the same device, but got ", name_a, " on ", a.device(), " and ", name_b, " on ",
              b.device());
}

/// The mixed-dtype policy of every opforge op, identical on CPU, CUDA and Meta:
/// the output (and all computation) takes the dtype of `input`; a parameter of another floating
/// dtype (weight, bias, other) is converted to input's dtype once on entry, and its gradient is
/// returned in the parameter's own dtype. Returns `t` itself when no conversion is needed.
inline at::Tensor to_input_dtype(const at::Tensor& t, at::ScalarType input_dtype) {
  return t.scalar_type() == input_dtype ? t : t.to(input_dtype);
}

}  // namespace opforge
