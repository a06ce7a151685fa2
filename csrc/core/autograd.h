// The one autograd pattern of opforge (docs/adding_an_op.md, "The autograd pattern").
//
// Every differentiable op registers an Autograd-key kernel whose body is one call of `autograd_op` (below):
//   1. forward-mode AD is refused, naming the op (check_no_forward_ad);
//   2. the op's forward runs below autograd and returns any number of tensors: the op's outputs and, where the
//      backward needs them, statistics only the private `_<op>_forward` returns (rms_norm's rstd). The forward is
//      told whether a node will be recorded, so without gradients it runs the public kernel (nothing extra kept);
//   3. when grad mode is on and an input requires grad, one `OpNode` is recorded as grad_fn of the differentiable
//      outputs, with edges to the inputs. Each output is declared differentiable, differentiable in a subset of
//      the inputs (fused_add_rms_norm's residual_out = input + residual does not depend on weight, so it requires
//      grad only when input or residual does), or not differentiable (statistics, masks: no history);
//   4. a save callback stores what backward needs: tensors (OpNode::save, SavedVariable) and non-tensor attributes
//      (OpNode::attr, IValues).
// The node's backward calls `<op>_backward` through the dispatcher with a mask from the edges that need a gradient
// (nothing nobody asked for is computed).
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

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
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

/// The backward node of every opforge op. Built by `autograd_op`; holds saved tensors and attributes and routes
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
  const char* name_;
  BackwardFn backward_;
  BackwardFn double_backward_;
  std::vector<torch::autograd::SavedVariable> saved_;
  std::vector<bool> saved_is_output_;
  std::vector<c10::IValue> attrs_;
};

/// A new autograd node: c10::intrusive_ptr where torch's Node is an intrusive_ptr_target (torch >= 2.13),
/// std::shared_ptr in older releases (torch 2.11).
template <typename NodeT, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  }
}

/// True when `t` is defined and requires grad; for a list, when one of its tensors does.
inline bool requires_grad_of(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad_of(const std::optional<at::Tensor>& t) { return t.has_value() && requires_grad_of(*t); }
inline bool requires_grad_of(at::TensorList ts) {
  for (const auto& t : ts)
    if (requires_grad_of(t)) return true;
  return false;
}

/// True when grad mode is on and any of `tensors` (at::Tensor, std::optional<at::Tensor> or a TensorList)
/// requires grad.
template <typename... Tensors>
inline bool any_requires_grad(const Tensors&... tensors) {
  return at::GradMode::is_enabled() && (requires_grad_of(tensors) || ...);
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
inline bool has_fw_grad(at::TensorList ts) {
  for (const auto& t : ts)
    if (has_fw_grad(t)) return true;
  return false;
}

/// Raises NotImplementedError "opforge::<op>: forward-mode AD is not supported; use reverse mode (backward)"
/// when any of `tensors` (at::Tensor, std::optional<at::Tensor> or a TensorList) carries a forward-mode tangent
/// (torch names no op in its own message).
template <typename... Tensors>
inline void check_no_forward_ad(const char* op, const Tensors&... tensors) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_fw_grad(tensors) || ...), "opforge::", op,
                              ": forward-mode AD is not supported; use reverse mode (backward, torch.func.grad, vjp, "
                              "jacrev)");
}

/// The node an Autograd kernel records. `op`: the op's name in error messages ("fused_add_rms_norm"); `node`: the
/// node's name as autograd shows it ("opforge::FusedAddRMSNormBackward"), a string literal; `backward`: the
/// first-order backward; `double_backward`: the same math in differentiable ATen ops, or nullptr (differentiating
/// the backward's outputs then raises, lazily).
struct NodeSpec {
  const char* op;
  const char* node;
  BackwardFn backward;
  BackwardFn double_backward;
};

/// How one tensor an Autograd kernel's forward returns relates to autograd: a bit mask of the inputs it is
/// differentiable in (bit i: the i-th of `autograd_op`'s `inputs`).
using Differentiability = uint32_t;
/// Differentiable in every input: the output gets the node as grad_fn whenever one is recorded.
inline constexpr Differentiability kDifferentiable = ~Differentiability{0};
/// Not differentiable (a statistic, a mask): no history, and not an output of the node.
inline constexpr Differentiability kNotDifferentiable = 0;
/// Differentiable in the inputs at `positions` only (0-based, in `autograd_op`'s `inputs`): the output gets the
/// node as grad_fn when one of them requires grad, and otherwise stays without history (its slot of the node then
/// receives no gradient).
constexpr Differentiability differentiable_in(std::initializer_list<int> positions) {
  Differentiability d = 0;
  for (const int i : positions) d |= Differentiability{1} << i;
  return d;
}

namespace detail {
// Gives `out` its slot among the node's outputs (one slot per output that is not kNotDifferentiable, in order):
// the node becomes its grad_fn when it is defined and differentiable in an input that requires grad (`requiring`:
// one bit per input); otherwise the slot is taken without history, so later outputs keep their slot numbers.
template <typename NodePtr>
void set_output_history(const NodePtr& node, const at::Tensor& out, Differentiability d, Differentiability requiring) {
  if (d == kNotDifferentiable) return;
  if (out.defined() && (d & requiring) != 0) {
    torch::autograd::set_history(out, node);
  } else {
    node->add_input_metadata(torch::autograd::Node::undefined_input());
  }
}
}  // namespace detail

/// The body of every Autograd-key kernel (steps 1-4 of the pattern above).
///   spec:    the op's name and its node's (NodeSpec).
///   outputs: one Differentiability per tensor `forward` returns, in order ({kDifferentiable} for one output).
///   forward: `forward(bool grad)` -> at::Tensor or std::tuple<at::Tensor, ...>, run below autograd; `grad` says
///            whether a node will be recorded (the forward then may return more, through the private
///            `_<op>_forward`: a statistic the backward needs).
///   save:    `save(OpNode& node, const R& result)`, R what `forward` returned; called, outside the below-autograd
///            guard, only when the node was recorded, after the outputs got their history: saves what backward
///            needs (OpNode::save, OpNode::attr).
///   inputs:  the node's input edges, in the order its backward returns their gradients: at::Tensor,
///            std::optional<at::Tensor> (an absent one gets an empty edge) or a TensorList (one edge per tensor).
/// The node is recorded when grad mode is on and one of `inputs` requires grad. Raises NotImplementedError
/// "opforge::<op>: forward-mode AD is not supported ..." when one of `inputs` carries a forward-mode tangent.
/// Returns what `forward` returned.
template <size_t N, typename Forward, typename Save, typename... Inputs>
auto autograd_op(const NodeSpec& spec, const Differentiability (&outputs)[N], Forward&& forward, Save&& save,
                 const Inputs&... inputs) {
  static_assert(sizeof...(Inputs) <= 32, "opforge::autograd_op: at most 32 inputs (one bit each)");
  check_no_forward_ad(spec.op, inputs...);
  Differentiability requiring = 0;  // bit i: the i-th input requires grad
  if (at::GradMode::is_enabled()) {
    int i = 0;
    ((requiring |= static_cast<Differentiability>(requires_grad_of(inputs)) << i++), ...);
  }
  const bool grad = requiring != 0;
  auto result = [&] {
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward(grad);
  }();
  if (grad) {
    auto node = make_node<OpNode>(spec.node, spec.backward, spec.double_backward);
    node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
    using Result = decltype(result);
    if constexpr (std::is_same_v<Result, at::Tensor>) {
      static_assert(N == 1, "opforge::autograd_op: a forward returning one tensor takes one Differentiability");
      detail::set_output_history(node, result, outputs[0], requiring);
    } else {
      static_assert(std::tuple_size_v<Result> == N,
                    "opforge::autograd_op: one Differentiability per tensor the forward returns");
      std::apply(
          [&](const auto&... outs) {
            size_t k = 0;
            (detail::set_output_history(node, outs, outputs[k++], requiring), ...);
          },
          result);
    }
    save(*node, std::as_const(result));
  }
  return result;
}

}  // namespace opforge
