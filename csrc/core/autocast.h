// Autocast policy of opforge ops (torch.autocast), one kernel per policy, registered for every op on the
// AutocastCPU and AutocastCUDA keys. Each mirrors the native op the opforge op stands for, so eager, compiled
// (Dynamo traces through these kernels) and Meta runs give the same dtypes:
//   kLowerPrecision  linear-like ops (torch's `linear`, `matmul`): floating tensors other than float64 are cast to
//                    the autocast dtype (torch.get_autocast_dtype), as ATen's lower_precision_fp policy does.
//   kFloat32         loss-like ops (torch's `cross_entropy`, `nll_loss` on CUDA): floating inputs of lower precision
//                    are cast to float32.
//   kFloat32OnCUDA   ops torch autocasts to float32 on CUDA only (torch's `pow`, hence square): float32 under CUDA
//                    autocast, no cast under CPU autocast.
//   kInputDtype      everything else (norms, elementwise, as torch's `rms_norm`, `sigmoid` in eager): no cast.
// Every policy then runs the op with autocast turned off, so autocast never reaches the ATen calls that a
// kernel makes internally (a CPU GEMM inside a kernel stays in the dtype the kernel chose).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace opforge {

enum class AutocastPolicy { kInputDtype, kLowerPrecision, kFloat32, kFloat32OnCUDA };

/// Boxed autocast kernels, one per policy.
void autocast_input_dtype_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
void autocast_lower_precision_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
void autocast_float32_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
void autocast_float32_on_cuda_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Registers the kernel of `policy` for op `name` in `m` (a TORCH_LIBRARY_IMPL block of AutocastCPU or
/// AutocastCUDA). Use through OPFORGE_AUTOCAST below.
inline void register_autocast(torch::Library& m, const char* name, AutocastPolicy policy) {
  switch (policy) {
    case AutocastPolicy::kInputDtype:
      m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_input_dtype_kernel>());
      break;
    case AutocastPolicy::kLowerPrecision:
      m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_lower_precision_kernel>());
      break;
    case AutocastPolicy::kFloat32:
      m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_float32_kernel>());
      break;
    case AutocastPolicy::kFloat32OnCUDA:
      m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autocast_float32_on_cuda_kernel>());
      break;
  }
}

}  // namespace opforge

/// Registers the autocast policy of ops on both autocast keys, e.g.
///   OPFORGE_AUTOCAST(linear, { {"linear", AutocastPolicy::kLowerPrecision}, {"linear_backward", ...} })
/// TAG is a unique identifier of the call site (the op family's name).
#define OPFORGE_AUTOCAST(TAG, ...)                                                                  \
  static void opforge_autocast_##TAG(torch::Library& m) {                                          \
    for (const auto& [name, policy] : std::initializer_list<std::pair<const char*, opforge::AutocastPolicy>> __VA_ARGS__) \
      opforge::register_autocast(m, name, policy);                                                  \
  }                                                                                                 \
  TORCH_LIBRARY_IMPL(opforge, AutocastCPU, m) { opforge_autocast_##TAG(m); }                        \
  TORCH_LIBRARY_IMPL(opforge, AutocastCUDA, m) { opforge_autocast_##TAG(m); }
