// Autocast policy of opforge ops (torch.autocast), registered for every op on the AutocastCPU and AutocastCUDA keys
// by OPFORGE_AUTOCAST. Each op's rule mirrors the native op the opforge op stands for, so eager, compiled (Dynamo
// traces through these kernels) and Meta runs give the same dtypes:
//   kLowerPrecision  linear-like ops (torch's `linear`, `matmul`): floating tensors other than float64 are cast to
//                    the autocast dtype (torch.get_autocast_dtype), as ATen's lower_precision_fp policy does.
//   kFloat32         loss-like ops (torch's `cross_entropy`, `nll_loss` on CUDA): floating inputs of lower precision
//                    are cast to float32.
//   kFloat32OnCUDA   ops torch autocasts to float32 on CUDA only (torch's `pow`, hence square): float32 under CUDA
//                    autocast, no cast under CPU autocast.
//   kInputDtype      everything else (norms, elementwise, as torch's `rms_norm`, `sigmoid` in eager): no cast.
// A rule applies its policy to every tensor argument, or only to the arguments it names: linear_cross_entropy casts
// its GEMM operands (input, linear_weight, linear_bias) as torch's linear and leaves the class weights as they are;
// fake_quant_linear casts input and bias and quantizes the weight from its own precision.
// Every rule then runs the op with autocast turned off, so autocast never reaches the ATen calls that a kernel makes
// internally (a CPU GEMM inside a kernel stays in the dtype the kernel chose).
#pragma once

#include <torch/library.h>

#include <initializer_list>
#include <vector>

namespace opforge {

enum class AutocastPolicy { kInputDtype, kLowerPrecision, kFloat32, kFloat32OnCUDA };

/// The autocast rule of one op. `op`: the op's name ("linear"); `policy`: how its tensor arguments are cast;
/// `args`: the names of the arguments (as in the schema) the policy casts, every tensor argument when empty.
struct AutocastRule {
  const char* op;
  AutocastPolicy policy;
  std::vector<const char*> args = {};
};

/// Registers the autocast kernel of `rule` in `m` (a TORCH_LIBRARY_IMPL block of AutocastCPU or AutocastCUDA).
/// Use through OPFORGE_AUTOCAST below. A name in `rule.args` that the op's schema lacks raises an internal assert
/// at the op's first autocast call.
void register_autocast(torch::Library& m, const AutocastRule& rule);

}  // namespace opforge

/// Registers the autocast rules of ops on both autocast keys, e.g.
///   OPFORGE_AUTOCAST(linear, {{"linear", AutocastPolicy::kLowerPrecision}, {"linear_backward", ...}})
///   OPFORGE_AUTOCAST(lce, {{"linear_cross_entropy", AutocastPolicy::kLowerPrecision, {"input", "linear_weight"}}})
/// TAG is a unique identifier of the call site (the op family's name).
#define OPFORGE_AUTOCAST(TAG, ...)                                                                  \
  static void opforge_autocast_##TAG(torch::Library& m) {                                          \
    for (const opforge::AutocastRule& rule : std::initializer_list<opforge::AutocastRule> __VA_ARGS__) \
      opforge::register_autocast(m, rule);                                                          \
  }                                                                                                 \
  TORCH_LIBRARY_IMPL(opforge, AutocastCPU, m) { opforge_autocast_##TAG(m); }                        \
  TORCH_LIBRARY_IMPL(opforge, AutocastCUDA, m) { opforge_autocast_##TAG(m); }
