// Autograd helpers shared by every op's autograd glue.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace opforge {

/// Boxed Autograd-key kernel for the `*_backward` ops. A backward op computes a gradient; it is not
/// itself differentiable. Called with grad mode on and an input that requires grad (double
/// backward, `create_graph=True`), it raises
///   "opforge::<op>: double backward is not supported ..."
/// instead of returning a gradient that silently lacks second-order terms. Otherwise it redispatches
/// to the CPU/CUDA/Meta kernel below autograd.
void not_differentiable_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// True when `t` carries a forward-mode tangent (torch.autograd.forward_ad, torch.func.jvp).
inline bool has_fw_grad(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
inline bool has_fw_grad(const std::optional<at::Tensor>& t) { return t.has_value() && has_fw_grad(*t); }

/// Raises NotImplementedError "opforge::<op>: forward-mode AD is not supported; use reverse mode (backward)"
/// when any of `tensors` (at::Tensor or std::optional<at::Tensor>, taken by reference: no copies on the
/// call path) carries a forward-mode tangent, instead of torch's anonymous "jvp is not implemented for
/// the c++ API of custom Function" (which names no op).
template <typename... Tensors>
inline void check_no_forward_ad(const char* op, const Tensors&... tensors) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_fw_grad(tensors) || ...), "opforge::", op,
                              ": forward-mode AD is not supported; use reverse mode (backward)");
}

/// Registers `not_differentiable_kernel` as the Autograd kernel of `name` (e.g. "sigmoid_backward").
inline void register_backward_op_autograd(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&not_differentiable_kernel>());
}

}  // namespace opforge
