// The one autograd pattern of opforge (docs/adding_an_op.md, "Autograd").
//
// Every differentiable op registers an Autograd-key kernel that
//   1. returns straight to the kernel below autograd when no input needs a gradient (no node, nothing saved);
//   2. otherwise runs the forward below autograd (the public op, or its private `_<op>_forward` that also
//      returns saved statistics), and records one `OpNode` as grad_fn of the differentiable outputs, with
//      edges to the differentiable inputs, the tensors backward needs (SavedVariable) and its non-tensor
//      attributes (IValues);
//   3. the node's backward calls `<op>_backward` through the dispatcher with a mask from the edges that need
//      a gradient (nothing nobody asked for is computed).
//
// Why a Node subclass and not torch::autograd::Function (measured, benchmarks/bench_overhead.py): the Function
// machinery (context dictionary, output wrapping, forward-AD hooks) costs several microseconds a call; and a
// C++ Function refuses torch.func transforms outright ("cannot use C++ torch::autograd::Function with functorch
// transforms"). A Node is what ATen's generated autograd uses: torch.func's grad/vjp/jacrev record it like any
// ATen node, and OpNode implements compiled autograd's two hooks (compiled_args / apply_with_saved), lifting
// the backward into the compiled graph as one call that Dynamo runs on fake tensors through the Meta kernels.
//
// Double backward (backward with create_graph=True, which torch.func always uses): an op may give a
// `double_backward` function written with differentiable ATen ops; it then serves whenever grad mode is on and
// a gradient or saved tensor requires grad, so second derivatives are correct (gradgradcheck). Without one, the
// backward op's outputs get a node that raises "opforge::<op>_backward: double backward is not supported ..."
// only if someone differentiates through them: first-order gradients under create_graph=True still work.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <type_traits>
#include <vector>

namespace opforge {

using torch::autograd::variable_list;

/// What a node's backward function receives. `grads[i]`: gradient of the node's i-th differentiable output
/// (undefined when nothing flowed into it); `saved`: the saved tensors in the order they were saved (undefined
/// where an absent optional was saved); `attrs`: the non-tensor attributes in the order they were added;
/// `needs[j]`: whether input edge j needs a gradient. Returns one tensor per input edge (undefined where none).
struct BackwardArgs {
  const variable_list& grads;
  const std::vector<at::Tensor>& saved;
  const std::vector<c10::IValue>& attrs;
  const std::vector<bool>& needs;
};
using BackwardFn = variable_list (*)(const BackwardArgs&);

/// The backward node of every opforge op. Built by `record_node`; holds saved tensors and attributes and routes
/// backward to `backward` (normally one dispatcher call of `<op>_backward`).
struct OpNode final : public torch::autograd::Node {
  /// `name`: the node's name as autograd shows it ("opforge::LinearBackward"); a string literal.
  /// `backward`: the first-order backward. `double_backward`: optional, the same math in differentiable ATen ops.
  OpNode(const char* name, BackwardFn backward, BackwardFn double_backward)
      : name_(name), backward_(backward), double_backward_(double_backward) {}

  std::string name() const override { return name_; }

  /// Saves `t` (undefined allowed) for backward. `is_output`: t is an output of this node (after set_history),
  /// saved without a reference cycle, as ATen does.
  void save(const at::Tensor& t, bool is_output = false);
  void save(const std::optional<at::Tensor>& t) { save(t.has_value() ? *t : at::Tensor()); }
  /// Adds a non-tensor attribute (int, double, bool, string, ScalarType as int, optional of those).
  void attr(c10::IValue v) { attrs_.push_back(std::move(v)); }

  variable_list apply(variable_list&& grads) override;
  void release_variables() override;
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override;
  variable_list apply_with_saved(const variable_list& inputs,
                                 torch::dynamo::autograd::SwapSavedVariables& saved) override;

 private:
  variable_list run(const variable_list& grads, const std::vector<at::Tensor>& saved,
                    const std::vector<bool>& needs) const;

  const char* name_;
  BackwardFn backward_;
  BackwardFn double_backward_;
  std::vector<torch::autograd::SavedVariable> saved_;
  std::vector<bool> saved_is_output_;
  std::vector<c10::IValue> attrs_;
};

/// A new autograd node: c10::intrusive_ptr where torch's Node is an intrusive_ptr_target (torch >= 2.13),
/// std::shared_ptr before (torch 2.11 on the GPU machine).
template <typename NodeT, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  }
}

/// True when grad mode is on and any of `tensors` (at::Tensor or std::optional<at::Tensor>) requires grad.
template <typename... Tensors>
inline bool any_requires_grad(const Tensors&... tensors) {
  auto rg = [](const auto& t) -> bool {
    if constexpr (std::is_same_v<std::decay_t<decltype(t)>, at::Tensor>) {
      return t.defined() && t.requires_grad();
    } else {
      return t.has_value() && t->defined() && t->requires_grad();
    }
  };
  return at::GradMode::is_enabled() && (rg(tensors) || ...);
}

/// A new OpNode whose input edges are `inputs` (at::Tensor or std::optional<at::Tensor>, in the order the
/// backward returns their gradients; an undefined one gets an empty edge), made grad_fn of each defined
/// tensor in `outputs` in order (output i of the node is the i-th of them).
template <typename... Inputs>
auto record_node(const char* name, BackwardFn backward, BackwardFn double_backward,
                 std::initializer_list<at::Tensor*> outputs, const Inputs&... inputs) {
  auto node = make_node<OpNode>(name, backward, double_backward);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  for (at::Tensor* out : outputs) {
    if (out->defined()) torch::autograd::set_history(*out, node);
  }
  return node;
}

/// Boxed Autograd-key kernel of the `*_backward` ops: redispatches below autograd; when grad mode is on and an
/// input requires grad (double backward, create_graph=True), the outputs get a node that raises
///   "opforge::<op>: double backward is not supported ..."
/// if, and only if, someone differentiates through them.
void backward_op_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

/// Registers `backward_op_autograd_kernel` as the Autograd kernel of `name` (e.g. "sigmoid_backward").
inline void register_backward_op_autograd(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&backward_op_autograd_kernel>());
}

/// Boxed Autograd-key kernel of private ops that are not differentiable (_rms_norm_apply): as
/// backward_op_autograd_kernel, with "opforge::<op>: this private op is not differentiable ..." raised if, and only
/// if, someone differentiates through the outputs.
void not_differentiable_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                                        torch::jit::Stack* stack);

/// Registers `not_differentiable_autograd_kernel` as the Autograd kernel of `name`.
inline void register_not_differentiable_autograd(torch::Library& m, const char* name) {
  m.impl(name, torch::CppFunction::makeFromBoxedFunction<&not_differentiable_autograd_kernel>());
}

/// `derived` (a tensor computed below autograd from `source`, e.g. a fake-quantized weight) as it is to be saved for
/// backward in `source`'s place: tied to `source` by a node that raises "opforge::<op>: double backward is not
/// supported ..." if differentiated through. Without the tie a gradient computed from `derived` under
/// create_graph=True looks constant in `source`, and a second derivative through it comes out as a silent zero.
/// Returns `derived` itself when `source` does not require grad.
at::Tensor saved_in_place_of(const at::Tensor& derived, const at::Tensor& source, const char* op);

/// True when `t` carries a forward-mode tangent (torch.autograd.forward_ad, torch.func.jvp).
inline bool has_fw_grad(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
inline bool has_fw_grad(const std::optional<at::Tensor>& t) { return t.has_value() && has_fw_grad(*t); }

/// Raises NotImplementedError "opforge::<op>: forward-mode AD is not supported; use reverse mode (backward)"
/// when any of `tensors` carries a forward-mode tangent (torch names no op in its own message).
template <typename... Tensors>
inline void check_no_forward_ad(const char* op, const Tensors&... tensors) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_fw_grad(tensors) || ...), "opforge::", op,
                              ": forward-mode AD is not supported; use reverse mode (backward, torch.func.grad, vjp, "
                              "jacrev)");
}

/// The Autograd kernel of a one-output op whose node's edges are `inputs` (steps 1-2 of the pattern above): raises
/// on forward-mode AD in `inputs`, runs `forward()` below autograd and, when grad mode is on and one of `inputs`
/// requires grad, records node `name` (backward, double_backward) as the output's grad_fn and calls
/// `save(node, output)` to save what backward needs (OpNode::save, OpNode::attr). Returns the output.
template <typename Forward, typename Save, typename... Inputs>
at::Tensor autograd_one_output(const char* op, const char* name, BackwardFn backward, BackwardFn double_backward,
                               Forward&& forward, Save&& save, const Inputs&... inputs) {
  check_no_forward_ad(op, inputs...);
  at::Tensor output;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    output = forward();
  }
  if (any_requires_grad(inputs...)) {
    auto node = record_node(name, backward, double_backward, {&output}, inputs...);
    save(*node, output);
  }
  return output;
}

}  // namespace opforge

/// Registers the Meta and Autograd kernels of an op family made of a public op `OP`, its private
/// `_OP_forward` (the forward that also returns what backward saves) and `OP_backward`, with the house names:
///   Meta:     _OP_forward -> OP_forward_meta,     OP -> OP_meta,     OP_backward -> OP_backward_meta
///   Autograd: _OP_forward -> OP_forward_autograd, OP -> OP_autograd, OP_backward -> backward_op_autograd_kernel
/// Use at namespace scope where those functions are visible, e.g. OPFORGE_FORWARD_OP_FAMILY(linear).
#define OPFORGE_FORWARD_OP_FAMILY(OP)                                  \
  TORCH_LIBRARY_IMPL(opforge, Meta, m) {                              \
    m.impl("_" #OP "_forward", &OP##_forward_meta);                   \
    m.impl(#OP, &OP##_meta);                                          \
    m.impl(#OP "_backward", &OP##_backward_meta);                     \
  }                                                                   \
  TORCH_LIBRARY_IMPL(opforge, Autograd, m) {                          \
    m.impl("_" #OP "_forward", &OP##_forward_autograd);               \
    m.impl(#OP, &OP##_autograd);                                      \
    opforge::register_backward_op_autograd(m, #OP "_backward");       \
  }
