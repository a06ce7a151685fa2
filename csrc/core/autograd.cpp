#include "core/autograd.h"

#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace opforge {

namespace {
bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && v.toTensor().requires_grad();
  if (v.isOptionalTensorList() || v.isTensorList()) {
    for (const auto& t : v.toListRef())
      if (t.isTensor() && t.toTensor().defined() && t.toTensor().requires_grad()) return true;
  }
  return false;
}
}  // namespace

void not_differentiable_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto num_args = op.schema().arguments().size();
  if (at::GradMode::is_enabled()) {
    for (const auto& arg : torch::jit::last(*stack, num_args)) {
      TORCH_CHECK(!requires_grad(arg), "opforge::", op.schema().name().substr(9),
                  ": double backward is not supported (this backward op is not differentiable): expected no "
                  "input to require grad while grad mode is on (differentiating a gradient with create_graph=True, "
                  "or calling the op directly on such inputs), but got one that does; detach its inputs or call it "
                  "under torch.no_grad()");
    }
  }
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

}  // namespace opforge
