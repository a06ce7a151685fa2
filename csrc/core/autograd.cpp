#include "core/autograd.h"

#include <ATen/core/stack.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <cstring>

namespace opforge {

namespace {

using torch::autograd::SavedVariable;

// The backward of a node, given unpacked saved tensors: the double-backward form when one exists and the
// gradient itself is being differentiated (grad mode on and a gradient or saved tensor requires grad).
variable_list run_backward(BackwardFn backward, BackwardFn double_backward, const variable_list& grads,
                           const std::vector<at::Tensor>& saved, const std::vector<c10::IValue>& attrs,
                           const std::vector<bool>& needs) {
  bool any_grad = false;
  for (const auto& g : grads) any_grad = any_grad || g.defined();
  if (!any_grad) return variable_list(needs.size());
  bool differentiate = false;
  if (double_backward != nullptr && at::GradMode::is_enabled()) {
    for (const auto& g : grads) differentiate = differentiate || (g.defined() && g.requires_grad());
    for (const auto& s : saved) differentiate = differentiate || (s.defined() && s.requires_grad());
  }
  BackwardArgs args{grads, saved, attrs, needs};
  variable_list out = (differentiate ? double_backward : backward)(args);
  TORCH_INTERNAL_ASSERT(out.size() == needs.size(), "opforge: a backward returned ", out.size(),
                        " gradients for ", needs.size(), " inputs");
  for (const auto i : c10::irange(out.size()))
    if (!needs[i]) out[i] = at::Tensor();
  return out;
}

// Attributes enter the compiled-autograd cache key as constants (never lifted to graph inputs: the backward
// uses them as C++ values, e.g. a dtype or an enum).
uint64_t attr_key(const c10::IValue& v) {
  if (v.isInt()) return static_cast<uint64_t>(v.toInt());
  if (v.isBool()) return v.toBool() ? 1u : 2u;
  if (v.isDouble()) {
    const double d = v.toDouble();
    uint64_t bits = 0;
    std::memcpy(&bits, &d, sizeof bits);
    return bits;
  }
  if (v.isNone()) return 0x9e3779b97f4a7c15ull;
  return static_cast<uint64_t>(c10::IValue::hash(v));
}

bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && v.toTensor().requires_grad();
  if (v.isOptionalTensorList() || v.isTensorList()) {
    for (const auto& t : v.toListRef())
      if (t.isTensor() && t.toTensor().defined() && t.toTensor().requires_grad()) return true;
  }
  return false;
}

}  // namespace

void OpNode::save(const at::Tensor& t, bool is_output) {
  saved_.emplace_back(t, is_output);
  saved_is_output_.push_back(is_output);
}

variable_list OpNode::apply(variable_list&& grads) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<bool> needs(num_outputs());
  bool any = false;
  // what this backward pass asks for (torch.autograd.grad(..., inputs=...) prunes the rest), not every edge
  // that requires grad: a weight's gradient is not computed when only the input's is wanted
  for (const auto i : c10::irange(needs.size())) any |= (needs[i] = task_should_compute_output(i));
  if (!any) return variable_list(num_outputs());
  std::vector<at::Tensor> saved;
  saved.reserve(saved_.size());
  for (const auto& s : saved_) saved.push_back(s.unpack(getptr()));
  return run_backward(backward_, double_backward_, grads, saved, attrs_, needs);
}

void OpNode::release_variables() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& s : saved_) s.reset_data();
}

void OpNode::compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const {
  args.collect(std::string(name_));
  args.collect(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(backward_)));
  for (const auto i : c10::irange(saved_.size())) args.collect(saved_[i], saved_is_output_[i]);
  args.collect(static_cast<uint64_t>(attrs_.size()));
  for (const auto& a : attrs_) {
    args.collect(static_cast<uint64_t>(a.isNone() ? 0 : a.isInt() ? 1 : a.isDouble() ? 2 : a.isBool() ? 3 : 4));
    args.collect(attr_key(a));
  }
}

variable_list OpNode::apply_with_saved(const variable_list& inputs,
                                       torch::dynamo::autograd::SwapSavedVariables& saved) {
  for (auto& s : saved_) saved.before(s);

  // Packed arguments of the lifted backward: the saved tensors, the attributes, then the mask.
  std::vector<c10::IValue> packed;
  packed.reserve(saved_.size() + attrs_.size() + 1);
  for (const auto& s : saved_) packed.emplace_back(s.unpack(getptr()));
  for (const auto& a : attrs_) packed.push_back(a);
  std::vector<bool> needs;
  for (const auto i : c10::irange(num_outputs())) needs.push_back(task_should_compute_output(i));
  c10::List<bool> mask;
  for (const bool b : needs) mask.push_back(b);
  packed.emplace_back(std::move(mask));

  std::vector<at::TypePtr> schema;
  schema.reserve(packed.size());
  for (const auto& v : packed) schema.push_back(v.isTensor() ? at::TensorType::get() : v.type());

  const size_t n_saved = saved_.size(), n_attrs = attrs_.size();
  torch::autograd::functional_apply_t functional = [bw = backward_, dbw = double_backward_, n_saved, n_attrs](
                                                       const variable_list& grads,
                                                       const std::vector<c10::IValue>& args) -> variable_list {
    std::vector<at::Tensor> saved_tensors;
    saved_tensors.reserve(n_saved);
    for (const auto i : c10::irange(n_saved))
      saved_tensors.push_back(args[i].isNone() ? at::Tensor() : args[i].toTensor());
    std::vector<c10::IValue> attrs(args.begin() + n_saved, args.begin() + n_saved + n_attrs);
    std::vector<bool> mask;
    for (const auto& b : args[n_saved + n_attrs].toBoolList()) mask.push_back(b);
    return run_backward(bw, dbw, grads, saved_tensors, attrs, mask);
  };

  const auto& py = torch::dynamo::autograd::getPyCompilerInterface();
  auto fn_name = py->bind_function(saved.get_py_compiler(), name_, std::move(functional), schema,
                                   /*is_custom_function=*/true, /*is_traceable=*/true);
  auto output_metadata = torch::dynamo::autograd::IValuePacker<std::vector<std::optional<
      torch::autograd::InputMetadata>>>::pack(torch::dynamo::autograd::get_input_metadata(next_edges()));
  auto results = py->call_function(saved.get_py_compiler(), "apply_functional", fn_name, inputs, packed,
                                   output_metadata);
  for (auto& s : saved_) saved.after(s);
  return results;
}

at::Tensor saved_in_place_of(const at::Tensor& derived, const at::Tensor& source, const char* op) {
  if (!derived.defined() || !source.defined() || !source.requires_grad() ||
      !torch::autograd::isDifferentiableType(derived.scalar_type())) {
    return derived;
  }
  at::Tensor tied = derived.detach();
  auto node = make_node<torch::autograd::Error>(
      std::string("opforge::") + op +
          ": double backward is not supported (its backward reads a tensor derived from an input below autograd); "
          "a first-order gradient works under create_graph=True and torch.func, but differentiating that gradient "
          "again does not",
      torch::autograd::collect_next_edges(source));
  torch::autograd::set_history(tied, node);
  return tied;
}

namespace {
// The body of the lazy-refusal Autograd kernels: redispatch below autograd, then (grad mode on and an input that
// requires grad) give the outputs a node raising "opforge::<op>: <why>" if differentiated through.
void lazy_refusal(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack, const char* why) {
  const auto num_args = op.schema().arguments().size();
  std::vector<at::Tensor> differentiable_inputs;
  if (at::GradMode::is_enabled()) {
    for (const auto& arg : torch::jit::last(*stack, num_args)) {
      if (!requires_grad(arg)) continue;
      if (arg.isTensor()) {
        differentiable_inputs.push_back(arg.toTensor());
      } else {
        for (const auto& t : arg.toListRef())
          if (t.isTensor() && t.toTensor().defined() && t.toTensor().requires_grad())
            differentiable_inputs.push_back(t.toTensor());
      }
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
  }
  if (differentiable_inputs.empty()) return;
  // Lazy refusal: the outputs are differentiable in form only; differentiating through them raises.
  const auto num_returns = op.schema().returns().size();
  auto node = make_node<torch::autograd::Error>("opforge::" + op.schema().name().substr(9) + ": " + why,
                                                 torch::autograd::collect_next_edges(differentiable_inputs));
  for (auto& ret : torch::jit::last(*stack, num_returns)) {
    if (!ret.isTensor()) continue;
    at::Tensor t = ret.toTensor();
    if (t.defined() && torch::autograd::isDifferentiableType(t.scalar_type())) torch::autograd::set_history(t, node);
  }
}
}  // namespace

void backward_op_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  lazy_refusal(op, ks, stack,
               "double backward is not supported (this backward op is not differentiable); a first-order gradient "
               "works under create_graph=True and torch.func, but differentiating that gradient again does not");
}

void not_differentiable_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                                        torch::jit::Stack* stack) {
  lazy_refusal(op, ks, stack,
               "this private op is not differentiable (opforge.patch calls it under torch.no_grad to recompute a "
               "saved activation in backward)");
}

}  // namespace opforge
