// The legacy `Batched` dispatch key for ops with a Tensor[] argument or return.
//
// torch.autograd.grad(..., is_grads_batched=True) runs the backward pass once under torch's legacy vmap
// (torch._vmap_internals): the batched upstream gradients are legacy BatchedTensors, and every op the backward
// reaches needs a batching rule for the `Batched` key. torch's own fallback for that key (a loop over the samples)
// refuses an op with a Tensor[] argument or a Tensor[] return ("Batching rule not implemented for opforge::...
// We could not generate a fallback"), so such an op registers `legacy_batched_loop_kernel` instead: the same loop,
// list-aware. (torch.func.vmap uses another key, FuncTorchBatched; its rules live in python/opforge/functional.py.)
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

namespace opforge {

/// Boxed `Batched`-key kernel of a functional op (new outputs, no aliasing, no mutation): the BatchedTensors among
/// the arguments (a Tensor, an optional Tensor, or an element of a Tensor[] or Tensor?[]) are aligned to their
/// collective vmap levels (batch dims at the front, broadcast to one set of batch sizes); the op runs once per
/// sample on the unbatched slices (the other arguments as given), and each Tensor or Tensor[] return is the
/// samples' results stacked and rewrapped as a BatchedTensor of those levels. A return the op leaves undefined
/// stays undefined. A batch of size 0 runs the op once on zeros of a sample's shape for the result shapes.
/// Raises NotImplementedError "opforge::<op>: ..." for a return that is neither a Tensor nor a Tensor[].
void legacy_batched_loop_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Registers `legacy_batched_loop_kernel` for `name` (e.g. "linear_cat_backward") in a
/// TORCH_LIBRARY_IMPL(opforge, Batched, m) block.
inline void register_legacy_batched_loop(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&legacy_batched_loop_kernel>());
}

}  // namespace opforge
