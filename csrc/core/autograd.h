// Autograd helpers shared by every op's autograd glue.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace opforge {

/// Boxed Autograd-key kernel for the `*_backward` ops. A backward op computes a gradient; it is not
/// itself differentiable. Called with grad mode on and an input that requires grad (double
/// backward, `create_graph=True`), it raises
///   "opforge::<op>: double backward is not supported ..."
/// instead of returning a gradient that silently lacks second-order terms. Otherwise it redispatches
/// to the CPU/CUDA/Meta kernel below autograd.
void not_differentiable_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Registers `not_differentiable_kernel` as the Autograd kernel of `name` (e.g. "sigmoid_backward").
inline void register_backward_op_autograd(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&not_differentiable_kernel>());
}

}  // namespace opforge
