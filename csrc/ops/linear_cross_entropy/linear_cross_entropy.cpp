// linear_cross_entropy: checkers, the public C++ API, Meta kernels, autograd and autocast.
//
// Op structure (schemas in csrc/library.cpp):
//   _linear_cross_entropy_forward   CPU/CUDA/Meta kernels: (loss, stats (m, r) per token, the gradients grad_mask
//                                   asks for); Autograd records the recompute node.
//   linear_cross_entropy            CompositeExplicitAutograd: the forward op's loss; Autograd kernel below: nothing
//                                   kept when nothing needs a gradient, else one of the two paths:
//     gradient in forward (mean/sum)  the forward op with grad_mask = which inputs require grad; the node saves
//                                   the gradients and its backward is _linear_cross_entropy_scale_grads.
//     recompute (none, or knob OPFORGE_LCE_GRAD_IN_FORWARD=0)  the node saves the inputs and stats; its backward is
//                                   linear_cross_entropy_backward.
//   linear_cross_entropy_backward   CPU/CUDA/Meta kernels; double backward refused lazily.
//   _linear_cross_entropy_scale_grads  CompositeExplicitAutograd (a multiply); double backward refused lazily.
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "core/knobs.h"

namespace opforge {
namespace lce {

Reduction parse_reduction(const char* op, c10::string_view reduction) {
  if (reduction == "mean") return Reduction::kMean;
  if (reduction == "sum") return Reduction::kSum;
  if (reduction == "none") return Reduction::kNone;
  TORCH_CHECK_VALUE(false, "opforge::", op, ": expected reduction to be one of \"none\", \"mean\", \"sum\", but got \"",
                    std::string(reduction), "\"");
  return Reduction::kMean;
}

const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::kNone: return "none";
    case Reduction::kMean: return "mean";
    case Reduction::kSum: return "sum";
  }
  return "mean";
}

at::ScalarType acc_dtype(at::ScalarType input_dtype) { return input_dtype == at::kDouble ? at::kDouble : at::kFloat; }

Reduction check_args(const char* op, const at::Tensor& input, const at::Tensor& linear_weight,
                     const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                     const std::optional<at::Tensor>& weight, c10::string_view reduction, double label_smoothing,
                     double z_loss, std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  check_floating(op, "input", input);
  check_floating(op, "linear_weight", linear_weight);
  TORCH_CHECK_VALUE(target.defined(), "opforge::", op, ": expected target to be a tensor, but got None");
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "opforge::", op,
                   ": expected target of dtype int64 (class indices), but got ", target.scalar_type());
  check_same_device(op, "input", input, "linear_weight", linear_weight);
  check_same_device(op, "input", input, "target", target);
  TORCH_CHECK_VALUE(input.dim() >= 1, "opforge::", op,
                    ": expected input to have at least 1 dimension (*, H), but got a 0-dimensional tensor");
  TORCH_CHECK_VALUE(linear_weight.dim() == 2, "opforge::", op, ": expected linear_weight to be 2-D (V, H), but got shape ",
                    shape_str(linear_weight.sym_sizes()));
  TORCH_CHECK_VALUE(input.sym_size(-1) == linear_weight.sym_size(1), "opforge::", op,
                    ": expected input's last dimension to equal linear_weight's H ", num_str(linear_weight.sym_size(1)),
                    ", but got ", num_str(input.sym_size(-1)), " (input of shape ", shape_str(input.sym_sizes()),
                    ", linear_weight of shape ", shape_str(linear_weight.sym_sizes()), ")");
  TORCH_CHECK_VALUE(linear_weight.sym_size(0) >= 1, "opforge::", op,
                    ": expected linear_weight with at least one row (V >= 1 classes), but got shape ",
                    shape_str(linear_weight.sym_sizes()));
  const auto xs = input.sym_sizes();
  TORCH_CHECK_VALUE(target.sym_sizes().equals(xs.slice(0, xs.size() - 1)), "opforge::", op,
                    ": expected target of input's leading shape ", shape_str(xs.slice(0, xs.size() - 1)),
                    ", but got ", shape_str(target.sym_sizes()));
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{"linear_bias", &linear_bias},
                                {"weight", &weight}}) {
    if (!t->has_value() || !(*t)->defined()) continue;
    const at::Tensor& v = **t;
    check_floating(op, name, v);
    check_same_device(op, "input", input, name, v);
    TORCH_CHECK_VALUE(v.dim() == 1 && v.sym_size(0) == linear_weight.sym_size(0), "opforge::", op, ": expected ", name,
                      " of shape [", num_str(linear_weight.sym_size(0)), "] (linear_weight's V), but got ",
                      shape_str(v.sym_sizes()));
  }
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, "opforge::", op,
                    ": expected label_smoothing in [0, 1], but got ", num_str(label_smoothing));
  TORCH_CHECK_VALUE(std::isfinite(z_loss) && z_loss >= 0.0, "opforge::", op,
                    ": expected z_loss >= 0 and finite, but got ", num_str(z_loss));
  TORCH_CHECK_VALUE(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0.0), "opforge::", op,
                    ": expected softcap > 0 and finite (or None), but got ", num_str(softcap.value_or(0.0)));
  TORCH_CHECK_VALUE(!chunk_size.has_value() || *chunk_size >= 1, "opforge::", op,
                    ": expected chunk_size >= 1 (or None), but got ", num_str(chunk_size.value_or(0)));
  return parse_reduction(op, reduction);
}

Reduction check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight,
                              const at::Tensor& target, const at::Tensor& stats,
                              const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                              c10::string_view reduction, double label_smoothing, double z_loss,
                              std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  const char* op = "linear_cross_entropy_backward";
  const Reduction r = check_args(op, input, linear_weight, target, linear_bias, weight, reduction, label_smoothing,
                                 z_loss, softcap, chunk_size);
  check_floating(op, "grad_output", grad_output);
  check_same_device(op, "grad_output", grad_output, "input", input);
  check_same_device(op, "stats", stats, "input", input);
  if (r == Reduction::kNone) {
    TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(target.sym_sizes()), "opforge::", op,
                      ": expected grad_output of target's shape ", shape_str(target.sym_sizes()),
                      " (reduction=\"none\"), but got ", shape_str(grad_output.sym_sizes()));
  } else {
    TORCH_CHECK_VALUE(grad_output.dim() == 0, "opforge::", op, ": expected a 0-dimensional grad_output (reduction=\"",
                      reduction_name(r), "\"), but got shape ", shape_str(grad_output.sym_sizes()));
  }
  c10::SymDimVector ss(target.sym_sizes().begin(), target.sym_sizes().end());
  ss.push_back(2);
  TORCH_CHECK_VALUE(stats.sym_sizes().equals(ss), "opforge::", op, ": expected stats of shape ", shape_str(ss),
                    " (target's shape, 2), but got ", shape_str(stats.sym_sizes()));
  TORCH_CHECK_TYPE(stats.scalar_type() == acc_dtype(input.scalar_type()), "opforge::", op,
                   ": expected stats of dtype ", acc_dtype(input.scalar_type()), ", but got ", stats.scalar_type());
  return r;
}

int64_t resolve_chunk(std::optional<int64_t> chunk_size, int64_t N, int64_t V, int64_t budget_bytes,
                      int64_t bytes_per_logit) {
  int64_t rows;
  if (chunk_size.has_value()) {
    rows = *chunk_size;
  } else if (const int64_t env_chunk = knobs::get(knobs::Knob::kLceChunkSize); env_chunk > 0) {
    rows = env_chunk;
  } else {
    rows = budget_bytes / std::max<int64_t>(1, V * bytes_per_logit);
    if (rows >= 64) rows -= rows % 64;
    rows = std::max<int64_t>(rows, 1);
  }
  return std::max<int64_t>(1, std::min(rows, std::max<int64_t>(N, 1)));
}

bool accumulate_in_param_dtype(at::ScalarType param, at::ScalarType input) {
  return param == input && (param == at::kHalf || param == at::kBFloat16) &&
         knobs::get(knobs::Knob::kLceDwAccum) == 1;
}

bool lean_mode(const at::Tensor& input, const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias) {
  const auto dtype = input.scalar_type();
  if (!input.is_cuda() || (dtype != at::kHalf && dtype != at::kBFloat16) || linear_weight.scalar_type() != dtype) {
    return false;
  }
  if (linear_bias.has_value() && linear_bias->defined() && linear_bias->scalar_type() != dtype) return false;
  return knobs::get(knobs::Knob::kLceLean) == 1;
}

Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     Reduction reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                     std::optional<double> softcap) {
  Problem p;
  const auto dtype = input.scalar_type();
  const auto acc = acc_dtype(dtype);
  p.V = linear_weight.size(0);
  p.H = linear_weight.size(1);
  p.N = target.numel();
  p.X = input.reshape({p.N, p.H}).contiguous();
  p.W = to_input_dtype(linear_weight, dtype).contiguous();
  if (linear_bias.has_value() && linear_bias->defined()) p.b = linear_bias->to(acc).contiguous();
  if (weight.has_value() && weight->defined()) p.cw = weight->to(acc).contiguous();
  p.T = target.reshape({p.N}).contiguous();
  p.reduction = reduction;
  p.ignore_index = ignore_index;
  p.label_smoothing = label_smoothing;
  p.z_loss = z_loss;
  p.softcap = softcap.value_or(0.0);
  p.lean = lean_mode(input, linear_weight, linear_bias);
  p.dw_dtype = p.lean || accumulate_in_param_dtype(linear_weight.scalar_type(), dtype) ? dtype : acc;
  p.db_dtype = p.b.defined() && accumulate_in_param_dtype(linear_bias->scalar_type(), dtype) ? dtype : acc;
  return p;
}

at::Tensor mean_denominator(const Problem& p) {
  const auto acc = acc_dtype(p.X.scalar_type());
  const at::Tensor valid = p.T.ne(p.ignore_index);
  if (!p.cw.defined()) return valid.sum().to(acc);
  const at::Tensor wt = p.cw.index_select(0, p.T.clamp(0, p.V - 1));
  return at::where(valid, wt, at::zeros({}, wt.options())).sum();
}

at::Tensor reduce_loss(const Problem& p, const at::Tensor& token_loss, const at::Tensor& target) {
  // the loss leaves in the dtype it is computed in (float32; float64 for float64): a bf16 loss would be one
  // rounding of a float32 value (bf16's step at a loss of 12 is 0.0625); Liger-Kernel's fused loss and
  // transformers' causal-LM loss do not round theirs either; torch's F.linear_cross_entropy returns the input's dtype
  const auto dtype = acc_dtype(p.X.scalar_type());
  switch (p.reduction) {
    case Reduction::kNone: return token_loss.reshape(target.sizes()).to(dtype);
    case Reduction::kSum: return token_loss.sum().to(dtype);
    case Reduction::kMean: return token_loss.sum().div(mean_denominator(p)).to(dtype);
  }
  return token_loss;
}

GradBuffers::GradBuffers(const Problem& p, std::array<bool, 3> mask, bool zero_dw) {
  const auto wo = p.X.options().dtype(p.dw_dtype);
  if (mask[0]) dX = at::empty({p.N, p.H}, p.X.options());
  if (mask[1]) dW = zero_dw ? at::zeros({p.V, p.H}, wo) : at::empty({p.V, p.H}, wo);
  if (mask[2] && p.b.defined()) db = at::zeros({p.V}, p.X.options().dtype(p.db_dtype));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> GradBuffers::finish(
    const at::Tensor& input, const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias) const {
  return {dX.defined() ? dX.view(input.sizes()) : at::Tensor(),
          // no copy where the buffer already is in the parameter's dtype (OPFORGE_LCE_DW_ACCUM=1, float32/float64)
          dW.defined() ? dW.to(linear_weight.scalar_type()) : at::Tensor(),
          db.defined() ? db.to(linear_bias->scalar_type()) : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    BackwardKernel kernel, bool zero_dw, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  const Problem p = backward_problem(grad_output, input, linear_weight, target, stats, linear_bias, weight, reduction,
                                     ignore_index, label_smoothing, z_loss, softcap, chunk_size);
  const GradBuffers grads(p, output_mask, zero_dw);
  const GradNeeds need(p, output_mask);
  RowGrad g;
  if (need.any()) g.G = grad_scale(p, grad_output, g.g_stride);
  kernel(p, g, stats, need, chunk_size, grads);
  return grads.finish(input, linear_weight, linear_bias);
}

Problem forward_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                        std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  const auto red = check_args("linear_cross_entropy", input, linear_weight, target, linear_bias, weight, reduction,
                              label_smoothing, z_loss, softcap, chunk_size);
  return make_problem(input, linear_weight, target, linear_bias, weight, red, ignore_index, label_smoothing, z_loss,
                      softcap);
}

Problem backward_problem(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight,
                         const at::Tensor& target, const at::Tensor& stats,
                         const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                         c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                         std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  const auto red = check_backward_args(grad_output, input, linear_weight, target, stats, linear_bias, weight,
                                       reduction, label_smoothing, z_loss, softcap, chunk_size);
  Problem p = make_problem(input, linear_weight, target, linear_bias, weight, red, ignore_index, label_smoothing,
                           z_loss, softcap);
  p.op = "linear_cross_entropy_backward";
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(
    const Problem& p, const at::Tensor& token_loss, const at::Tensor& stats, const GradBuffers& grads,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias) {
  auto ss = target.sizes().vec();
  ss.push_back(2);
  auto [gi, gw, gb] = grads.finish(input, linear_weight, linear_bias);
  return {reduce_loss(p, token_loss, target), stats.view(ss), gi, gw, gb};
}

at::Tensor grad_scale(const Problem& p, const at::Tensor& grad_output, int64_t& stride) {
  const auto acc = acc_dtype(p.X.scalar_type());
  if (p.reduction == Reduction::kNone) {
    stride = 1;
    return grad_output.to(acc).reshape({p.N}).contiguous();
  }
  stride = 0;
  at::Tensor g = grad_output.to(acc).reshape({1});
  if (p.reduction == Reduction::kMean) g = g.div(mean_denominator(p));
  return g.contiguous();
}

at::Tensor unit_grad_scale(const Problem& p) {
  const auto acc = acc_dtype(p.X.scalar_type());
  at::Tensor one = at::ones({1}, p.X.options().dtype(acc));
  return p.reduction == Reduction::kMean ? one.div(mean_denominator(p)) : one;
}

// Gradient in forward (linear_cross_entropy's "mean"/"sum", linear_jsd): saved grad_input, grad_linear_weight, grad_linear_bias (each undefined where its input
// needs no gradient) and a 0-dim bool, whether any target is not ignore_index; no attributes. The backward scales
// the gradients by grad_output.
//
// Note [all targets ignored]: then every saved gradient is exactly zero, and so is the unfused loss's (each ignored
// token's logit gradient is zero whatever grad_output is). grad_output can then be non-finite: transformers divides
// a "sum" loss by num_items_in_batch, which is 0 for a batch without a target, and 0 * inf would make every
// gradient NaN. So grad_output is replaced by 0 when no target counts (a 0-dim select on the device: no sync).
// Note [saved gradients scaled in place]: the saved gradients are the node's own (the forward op returned them to
// this node alone), so when the engine will release them after this backward (no retain_graph, no create_graph)
// they are scaled in place and handed on as the gradients: the backward allocates nothing the size of the lm_head's
// weight (a V x H copy, 1 GiB at 128256 x 4096 in bfloat16), and the gradient accumulator takes the storage over.
// What is handed on is a detached alias: the saved tensors carry mark_not_differentiable's node, and a gradient
// with that history would reach torch.autograd.grad's results and tensor hooks as requires_grad=True.
// The product is the scale op's (one multiply in the gradient's dtype), so both paths give the same bits. A graph
// kept for another backward, and tensors seen by a tracer (FakeTensor, functionalization, functorch wrappers:
// torch.compile, compiled autograd, torch.func), take the scale op, which leaves the saved tensors as they were.
bool scale_in_place(const BackwardArgs& a) {
  if (torch::autograd::get_current_graph_task_keep_graph() || at::GradMode::is_enabled()) return false;
  for (const at::Tensor& t : {a.grads[0], a.saved[0], a.saved[1], a.saved[2]})
    if (t.defined() && at::isTensorSubclassLike(t)) return false;
  return true;
}

variable_list saved_grads_backward(const BackwardArgs& a) {
  if (!a.grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
  auto pick = [&](int k) -> std::optional<at::Tensor> {
    return a.needs[k] && a.saved[k].defined() ? std::optional<at::Tensor>(a.saved[k]) : std::nullopt;
  };
  const at::Tensor& any_target = a.saved[3];
  const at::Tensor grad_output = at::where(any_target, a.grads[0], at::zeros_like(a.grads[0]));
  if (scale_in_place(a)) {
    // Note [saved gradients scaled in place]
    auto scale = [&](const std::optional<at::Tensor>& g) -> at::Tensor {
      if (!g.has_value()) return at::Tensor();
      at::Tensor t = g->detach();  // the storage without the history mark_not_differentiable gave the saved tensor
      return t.mul_(grad_output.to(t.scalar_type()));
    };
    return {scale(pick(0)), scale(pick(1)), scale(pick(2))};
  }
  auto [gi, gw, gb] = opforge::_linear_cross_entropy_scale_grads(grad_output, pick(0), pick(1), pick(2));
  return {gi, gw, gb};
}

// The gradients computed in the forward depend on the inputs in a way this op does not differentiate: give them a
// history that raises if someone differentiates through them (a double backward; torch.func.grad of grad, where
// the outer level sees the private forward's gradient outputs), so the scale op's outputs carry the usual lazy
// "double backward is not supported" refusal instead of a silently zero second derivative. Only when grad mode is
// on and an input requires grad (otherwise no graph can reach them).
void mark_not_differentiable(const char* op, const at::Tensor& gi, const at::Tensor& gw, const at::Tensor& gb,
                             const at::Tensor& input, const at::Tensor& linear_weight,
                             const std::optional<at::Tensor>& linear_bias) {
  if (!any_requires_grad(input, linear_weight, linear_bias)) return;
  std::vector<at::Tensor> diff;
  for (const at::Tensor* t : {&gi, &gw, &gb})
    if (t->defined() && torch::autograd::isDifferentiableType(t->scalar_type())) diff.push_back(*t);
  if (diff.empty()) return;
  auto err = make_node<torch::autograd::Error>(
      std::string("opforge::") + op +
          ": double backward is not supported (the gradients computed in the forward are not differentiable); a "
          "first-order gradient works under create_graph=True and torch.func, but differentiating that gradient "
          "again does not",
      torch::autograd::collect_next_edges(input, linear_weight, linear_bias));
  for (const at::Tensor& t : diff) torch::autograd::set_history(t, err);
}

}  // namespace lce

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                                c10::string_view reduction, int64_t ignore_index, double label_smoothing,
                                double z_loss, std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(linear_cross_entropy)>("opforge::linear_cross_entropy");
  return op.call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss,
                 softcap, chunk_size);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  static auto op = typed_op<decltype(_linear_cross_entropy_forward)>("opforge::_linear_cross_entropy_forward");
  return op.call(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss,
                 softcap, chunk_size, grad_mask);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(linear_cross_entropy_backward)>("opforge::linear_cross_entropy_backward");
  return op.call(grad_output, input, linear_weight, target, stats, linear_bias, weight, reduction, ignore_index,
                 label_smoothing, z_loss, softcap, output_mask, chunk_size);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_scale_grads(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_input,
    const std::optional<at::Tensor>& grad_linear_weight, const std::optional<at::Tensor>& grad_linear_bias) {
  static auto op =
      typed_op<decltype(_linear_cross_entropy_scale_grads)>("opforge::_linear_cross_entropy_scale_grads");
  return op.call(grad_output, grad_input, grad_linear_weight, grad_linear_bias);
}

namespace {

// ---- CompositeExplicitAutograd (CPU, CUDA, Meta): the public op is the forward op's loss; the scale op --

at::Tensor linear_cross_entropy_composite(const at::Tensor& input, const at::Tensor& linear_weight,
                                          const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                          const std::optional<at::Tensor>& weight, c10::string_view reduction,
                                          int64_t ignore_index, double label_smoothing, double z_loss,
                                          std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  return std::get<0>(opforge::_linear_cross_entropy_forward(input, linear_weight, target, linear_bias, weight,
                                                            reduction, ignore_index, label_smoothing, z_loss, softcap,
                                                            chunk_size));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> scale_grads_composite(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_input,
    const std::optional<at::Tensor>& grad_linear_weight, const std::optional<at::Tensor>& grad_linear_bias) {
  const char* op = "_linear_cross_entropy_scale_grads";
  check_floating(op, "grad_output", grad_output);
  TORCH_CHECK_VALUE(grad_output.dim() == 0, "opforge::", op, ": expected a 0-dimensional grad_output (the loss of "
                    "reduction \"mean\" or \"sum\"), but got shape ", shape_str(grad_output.sym_sizes()));
  // one multiply per gradient, in the gradient's dtype (fp32 opmath inside ATen's kernel for 16-bit types)
  auto scale = [&](const std::optional<at::Tensor>& g) -> at::Tensor {
    if (!g.has_value() || !g->defined()) return at::Tensor();
    return g->mul(grad_output.to(g->scalar_type()));
  };
  return {scale(grad_input), scale(grad_linear_weight), scale(grad_linear_bias)};
}

// ---- Meta: the same checker, then outputs with the real kernels' shapes, dtypes and strides ----------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_forward_meta(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  const auto r = lce::check_args("linear_cross_entropy", input, linear_weight, target, linear_bias, weight, reduction,
                                 label_smoothing, z_loss, softcap, chunk_size);
  c10::SymDimVector ss(target.sym_sizes().begin(), target.sym_sizes().end());
  ss.push_back(2);
  const auto loss_opts = input.options().dtype(lce::acc_dtype(input.scalar_type()));  // reduce_loss's dtype
  at::Tensor loss = r == lce::Reduction::kNone ? at::empty_symint(target.sym_sizes(), loss_opts)
                                               : at::empty({}, loss_opts);
  at::Tensor gi, gw, gb;
  if (grad_mask[0]) gi = at::empty_symint(input.sym_sizes(), input.options());
  if (grad_mask[1]) gw = at::empty_symint(linear_weight.sym_sizes(), linear_weight.options());
  if (grad_mask[2] && linear_bias.has_value() && linear_bias->defined())
    gb = at::empty_symint(linear_bias->sym_sizes(), linear_bias->options());
  return {loss, at::empty_symint(ss, input.options().dtype(lce::acc_dtype(input.scalar_type()))), gi, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward_meta(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  lce::check_backward_args(grad_output, input, linear_weight, target, stats, linear_bias, weight, reduction,
                           label_smoothing, z_loss, softcap, chunk_size);
  at::Tensor gi, gw, gb;
  if (output_mask[0]) gi = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) gw = at::empty_symint(linear_weight.sym_sizes(), linear_weight.options());
  if (output_mask[2] && linear_bias.has_value() && linear_bias->defined())
    gb = at::empty_symint(linear_bias->sym_sizes(), linear_bias->options());
  return {gi, gw, gb};
}

// ---- Autograd: save what backward needs, redispatch below autograd, route backward to the op ---------

// One node, two forms, told apart by what was saved (docs in linear_cross_entropy.h, "Two autograd paths").
//
// Recompute: saved input, linear_weight, target, stats, linear_bias (or undefined), weight (or undefined);
// attributes reduction (int), ignore_index, label_smoothing, z_loss, softcap (double, 0 = none), chunk_size (int,
// 0 = default). The backward op recomputes the logits with grad_output.
variable_list lce_recompute_backward(const BackwardArgs& a) {
  const at::Tensor &bias = a.saved[4], &cw = a.saved[5];
  const auto reduction = static_cast<lce::Reduction>(a.attrs[0].toInt());
  const double softcap = a.attrs[4].toDouble();
  const int64_t chunk = a.attrs[5].toInt();
  auto [gi, gw, gb] = opforge::linear_cross_entropy_backward(
      a.grads[0], a.saved[0], a.saved[1], a.saved[2], a.saved[3],
      bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
      cw.defined() ? std::optional<at::Tensor>(cw) : std::nullopt, lce::reduction_name(reduction), a.attrs[1].toInt(),
      a.attrs[2].toDouble(), a.attrs[3].toDouble(), softcap > 0 ? std::optional<double>(softcap) : std::nullopt,
      {a.needs[0], a.needs[1], bias.defined() && a.needs[2]},
      chunk > 0 ? std::optional<int64_t>(chunk) : std::nullopt);
  return {gi, gw, gb};
}

// Edges: 0 input, 1 linear_weight, 2 linear_bias (the class weights get none).
variable_list lce_backward_fn(const BackwardArgs& a) {
  if (!a.grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
  return a.attrs.empty() ? lce::saved_grads_backward(a) : lce_recompute_backward(a);
}

void save_recompute(OpNode& n, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                    std::optional<double> softcap, std::optional<int64_t> chunk_size, const at::Tensor& stats) {
  n.save(input);
  n.save(linear_weight);
  n.save(target);
  n.save(stats);
  n.save(linear_bias);
  n.save(weight);
  n.attr(static_cast<int64_t>(lce::parse_reduction("linear_cross_entropy", reduction)));
  n.attr(ignore_index);
  n.attr(label_smoothing);
  n.attr(z_loss);
  n.attr(softcap.value_or(0.0));
  n.attr(chunk_size.value_or(0));
}

// Whether the gradient-in-forward path serves a call that needs gradients: reduction "mean" or "sum" (a scalar
// grad_output, known to scale the whole gradient) unless the knob OPFORGE_LCE_GRAD_IN_FORWARD is 0.
bool grad_in_forward(lce::Reduction r) {
  return r != lce::Reduction::kNone && knobs::get(knobs::Knob::kLceGradInForward) != 0;
}

// As F.cross_entropy: the class weights are not differentiable (never a silently missing gradient).
void check_class_weights(const char* op, const std::optional<at::Tensor>& weight) {
  TORCH_CHECK(!any_requires_grad(weight), "opforge::", op, ": expected weight (the class weights) not to require "
              "grad (the loss is not differentiable with respect to them), but it does; pass weight.detach()");
}

using LceForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Of the forward's (loss, stats, grad_input, grad_linear_weight, grad_linear_bias) only the loss is differentiable.
constexpr Differentiability kLceOutputs[] = {kDifferentiable, kNotDifferentiable, kNotDifferentiable,
                                             kNotDifferentiable, kNotDifferentiable};

at::Tensor linear_cross_entropy_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                         const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                         const std::optional<at::Tensor>& weight, c10::string_view reduction,
                                         int64_t ignore_index, double label_smoothing, double z_loss,
                                         std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  bool saved_grads = false;  // the path taken: gradient in forward, or recompute
  return std::get<0>(autograd_op(
      {"linear_cross_entropy", "opforge::LinearCrossEntropyBackward", lce_backward_fn, nullptr}, kLceOutputs,
      [&](bool grad) -> LceForward {
        check_class_weights("linear_cross_entropy", weight);
        if (!grad) {
          return {opforge::linear_cross_entropy(input, linear_weight, target, linear_bias, weight, reduction,
                                                ignore_index, label_smoothing, z_loss, softcap, chunk_size),
                  {}, {}, {}, {}};
        }
        saved_grads = grad_in_forward(lce::parse_reduction("linear_cross_entropy", reduction));
        // gradient in forward: only the gradients of inputs that require grad are computed (a frozen lm_head gets
        // no V x H buffer at all); recompute: none
        const std::array<bool, 3> mask = {saved_grads && requires_grad_of(input),
                                          saved_grads && requires_grad_of(linear_weight),
                                          saved_grads && requires_grad_of(linear_bias)};
        return opforge::_linear_cross_entropy_forward(input, linear_weight, target, linear_bias, weight, reduction,
                                                      ignore_index, label_smoothing, z_loss, softcap, chunk_size,
                                                      mask);
      },
      [&](OpNode& n, const LceForward& out) {
        const auto& [loss, stats, gi, gw, gb] = out;
        if (!saved_grads) {
          save_recompute(n, input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                         label_smoothing, z_loss, softcap, chunk_size, stats);
          return;
        }
        lce::mark_not_differentiable("linear_cross_entropy", gi, gw, gb, input, linear_weight, linear_bias);
        n.save(gi);
        n.save(gw);
        n.save(gb);
        n.save(target.ne(ignore_index).any());  // Note [all targets ignored]
      },
      input, linear_weight, linear_bias));
}

// _linear_cross_entropy_forward called directly: the loss differentiates through the recompute form; stats is not
// differentiable; differentiating the gradients it returns raises.
LceForward linear_cross_entropy_forward_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                                 const at::Tensor& target,
                                                 const std::optional<at::Tensor>& linear_bias,
                                                 const std::optional<at::Tensor>& weight, c10::string_view reduction,
                                                 int64_t ignore_index, double label_smoothing, double z_loss,
                                                 std::optional<double> softcap, std::optional<int64_t> chunk_size,
                                                 std::array<bool, 3> grad_mask) {
  return autograd_op(
      {"_linear_cross_entropy_forward", "opforge::LinearCrossEntropyBackward", lce_backward_fn, nullptr},
      kLceOutputs,
      [&](bool) {
        check_class_weights("_linear_cross_entropy_forward", weight);
        return opforge::_linear_cross_entropy_forward(input, linear_weight, target, linear_bias, weight, reduction,
                                                      ignore_index, label_smoothing, z_loss, softcap, chunk_size,
                                                      grad_mask);
      },
      [&](OpNode& n, const LceForward& out) {
        const auto& [loss, stats, gi, gw, gb] = out;
        save_recompute(n, input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing,
                       z_loss, softcap, chunk_size, stats);
        lce::mark_not_differentiable("linear_cross_entropy", gi, gw, gb, input, linear_weight, linear_bias);
      },
      input, linear_weight, linear_bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_composite);
  m.impl("_linear_cross_entropy_scale_grads", &scale_grads_composite);
}

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("_linear_cross_entropy_forward", &linear_cross_entropy_forward_meta);
  m.impl("linear_cross_entropy_backward", &linear_cross_entropy_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("linear_cross_entropy", &linear_cross_entropy_autograd);
  m.impl("_linear_cross_entropy_forward", &linear_cross_entropy_forward_autograd);
  register_backward_op_autograd(m, "linear_cross_entropy_backward");
  register_backward_op_autograd(m, "_linear_cross_entropy_scale_grads");
}

// torch.autocast (core/autocast.h): the GEMM operands in the autocast dtype, as torch's linear; the class weights
// untouched; the loss in float32 (the kernels return every 16-bit call's loss so, at float32 precision), as torch's
// cross_entropy under autocast. The backward runs in the dtypes autograd hands it.
OPFORGE_AUTOCAST(linear_cross_entropy,
                 {{"linear_cross_entropy", AutocastPolicy::kLowerPrecision, {"input", "linear_weight", "linear_bias"}},
                  {"_linear_cross_entropy_forward", AutocastPolicy::kLowerPrecision,
                   {"input", "linear_weight", "linear_bias"}},
                  {"linear_cross_entropy_backward", AutocastPolicy::kInputDtype},
                  {"_linear_cross_entropy_scale_grads", AutocastPolicy::kInputDtype}})

}  // namespace opforge
