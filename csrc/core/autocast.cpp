#include "core/autocast.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

namespace opforge {

namespace {

c10::DeviceType autocast_device(c10::DispatchKeySet ks) {
  return ks.has(c10::DispatchKey::AutocastCUDA) ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
}

// Casts, in place on the stack, every floating tensor argument for which `cast(t)` says so to `to`.
template <typename Pred>
void cast_args(const c10::OperatorHandle& op, torch::jit::Stack* stack, at::ScalarType to, c10::DeviceType device,
               Pred eligible) {
  const auto n = op.schema().arguments().size();
  for (size_t k = stack->size() - n; k < stack->size(); ++k) {
    c10::IValue& arg = (*stack)[k];
    if (arg.isTensor()) {
      const at::Tensor& t = arg.toTensor();
      if (t.defined() && eligible(t)) arg = at::autocast::cached_cast(to, t, device);
    } else if (arg.isTensorList()) {
      auto list = arg.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        at::Tensor t = list[i];
        if (t.defined() && eligible(t)) list[i] = at::autocast::cached_cast(to, t, device);
      }
      arg = list;
    }
  }
}

void call_without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

}  // namespace

void autocast_input_dtype_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  call_without_autocast(op, stack);
}

void autocast_lower_precision_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto device = autocast_device(ks);
  const auto to = at::autocast::get_autocast_dtype(device);
  cast_args(op, stack, to, device, [](const at::Tensor& t) {
    return at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kDouble;
  });
  call_without_autocast(op, stack);
}

void autocast_float32_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  cast_args(op, stack, at::kFloat, autocast_device(ks), [](const at::Tensor& t) {
    return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
  });
  call_without_autocast(op, stack);
}

void autocast_float32_on_cuda_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  if (autocast_device(ks) == c10::DeviceType::CUDA) {
    autocast_float32_kernel(op, ks, stack);
  } else {
    call_without_autocast(op, stack);
  }
}

}  // namespace opforge
