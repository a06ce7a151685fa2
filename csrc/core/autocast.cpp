#include "core/autocast.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <memory>
#include <mutex>
#include <string>

namespace opforge {

namespace {

c10::DeviceType autocast_device(c10::DispatchKeySet ks) {
  return ks.has(c10::DispatchKey::AutocastCUDA) ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
}

// Casts to `to`, in place on the stack, every tensor argument (and every tensor of a list argument) that
// `eligible(t)` accepts: of all the op's arguments, or of those at the positions in `only` when given.
template <typename Pred>
void cast_args(const c10::OperatorHandle& op, torch::jit::Stack* stack, at::ScalarType to, c10::DeviceType device,
               const std::vector<size_t>* only, Pred eligible) {
  const auto n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  auto cast = [&](c10::IValue& arg) {
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
  };
  if (only == nullptr) {
    for (size_t k = 0; k < n; ++k) cast((*stack)[base + k]);
  } else {
    for (const size_t k : *only) cast((*stack)[base + k]);
  }
}

// `policy`'s casts (over the arguments at `only`, or all of them), then the op with autocast turned off.
void run_policy(AutocastPolicy policy, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
                const std::vector<size_t>* only) {
  const auto device = autocast_device(ks);
  switch (policy) {
    case AutocastPolicy::kInputDtype:
      break;
    case AutocastPolicy::kLowerPrecision:
      cast_args(op, stack, at::autocast::get_autocast_dtype(device), device, only, [](const at::Tensor& t) {
        return at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kDouble;
      });
      break;
    case AutocastPolicy::kFloat32OnCUDA:
      if (device != c10::DeviceType::CUDA) break;
      [[fallthrough]];
    case AutocastPolicy::kFloat32:
      cast_args(op, stack, at::kFloat, device, only, [](const at::Tensor& t) {
        return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
      });
      break;
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

// The boxed kernel of a rule over every argument.
template <AutocastPolicy P>
void policy_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  run_policy(P, op, ks, stack, nullptr);
}

// The boxed kernel of a rule over named arguments: the names are looked up in the op's schema at the first call
// (a library's schemas may be registered after its kernels).
class NamedArgumentsKernel final : public c10::OperatorKernel {
 public:
  NamedArgumentsKernel(AutocastPolicy policy, const std::vector<const char*>& names)
      : policy_(policy), names_(names.begin(), names.end()) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    std::call_once(resolved_, [&] {
      for (const auto& name : names_) {
        const auto index = op.schema().argumentIndexWithName(name);
        TORCH_INTERNAL_ASSERT(index.has_value(), "opforge: the autocast rule of ", op.schema().name(),
                              " names an argument the schema lacks: ", name);
        positions_.push_back(static_cast<size_t>(*index));
      }
    });
    run_policy(policy_, op, ks, stack, &positions_);
  }

 private:
  AutocastPolicy policy_;
  std::vector<std::string> names_;
  std::once_flag resolved_;
  std::vector<size_t> positions_;
};

}  // namespace

void register_autocast(torch::Library& m, const AutocastRule& rule) {
  if (!rule.args.empty()) {
    m.impl(rule.op, torch::CppFunction::makeFromBoxedFunctor(
                        std::make_unique<NamedArgumentsKernel>(rule.policy, rule.args)));
    return;
  }
  switch (rule.policy) {
    case AutocastPolicy::kInputDtype:
      m.impl(rule.op, torch::CppFunction::makeFromBoxedFunction<&policy_kernel<AutocastPolicy::kInputDtype>>());
      break;
    case AutocastPolicy::kLowerPrecision:
      m.impl(rule.op, torch::CppFunction::makeFromBoxedFunction<&policy_kernel<AutocastPolicy::kLowerPrecision>>());
      break;
    case AutocastPolicy::kFloat32:
      m.impl(rule.op, torch::CppFunction::makeFromBoxedFunction<&policy_kernel<AutocastPolicy::kFloat32>>());
      break;
    case AutocastPolicy::kFloat32OnCUDA:
      m.impl(rule.op, torch::CppFunction::makeFromBoxedFunction<&policy_kernel<AutocastPolicy::kFloat32OnCUDA>>());
      break;
  }
}

}  // namespace opforge
