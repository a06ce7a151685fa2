// linear_log_probs: checkers, the public C++ API, Meta kernels, autograd and autocast. The kernels are
// linear_cross_entropy's chunk loops (linear_cross_entropy_cpu.cpp, linear_cross_entropy_cuda.cu) with another row
// function: the row value −log p(target) (the cross-entropy row without smoothing, class weights or z-loss), the
// logits scaled by 1 / temperature and, on request, the entropy; see lce::RowGrad for the backward row.
//
// Op structure (schemas in csrc/library.cpp):
//   _linear_log_probs_forward   CPU/CUDA/Meta kernels: (log_probs, entropy or an empty (0,) tensor, stats (m, r));
//                               Autograd records the node below.
//   linear_log_probs            CompositeExplicitAutograd: the forward op's first two outputs; Autograd kernel
//                               below: nothing kept when nothing needs a gradient, else the forward op and a node
//                               that saves the inputs, stats and the entropy (an output: no reference cycle).
//   linear_log_probs_backward   CPU/CUDA/Meta kernels: each chunk's logits recomputed with the per-token gradients
//                               of log_probs and entropy (a per-token grad_output, as linear_cross_entropy's
//                               reduction "none"); double backward refused lazily.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace opforge {
namespace llp {

void check_args(const char* op, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                const std::optional<at::Tensor>& linear_bias, double temperature, std::optional<double> softcap,
                std::optional<int64_t> chunk_size) {
  lce::check_args(op, input, linear_weight, target, linear_bias, std::nullopt, "none", 0.0, 0.0, softcap, chunk_size);
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, "opforge::", op,
                    ": expected temperature > 0 and finite, but got ", num_str(temperature));
}

void check_backward_args(const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
                         const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                         const at::Tensor& stats, const std::optional<at::Tensor>& entropy,
                         const std::optional<at::Tensor>& linear_bias, double temperature,
                         std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  const char* op = "linear_log_probs_backward";
  check_args(op, input, linear_weight, target, linear_bias, temperature, softcap, chunk_size);
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{"grad_log_probs",
                                                                                         &grad_log_probs},
                                {"grad_entropy", &grad_entropy},
                                {"entropy", &entropy}}) {
    if (!t->has_value() || !(*t)->defined()) continue;
    const at::Tensor& v = **t;
    check_floating(op, name, v);
    check_same_device(op, name, v, "input", input);
    TORCH_CHECK_VALUE(v.sym_sizes().equals(target.sym_sizes()), "opforge::", op, ": expected ", name,
                      " of target's shape ", shape_str(target.sym_sizes()), ", but got ", shape_str(v.sym_sizes()));
  }
  TORCH_CHECK_VALUE(!(grad_entropy.has_value() && grad_entropy->defined()) || (entropy.has_value() && entropy->defined()),
                    "opforge::", op, ": expected the forward's entropy with grad_entropy, but got None");
  check_same_device(op, "stats", stats, "input", input);
  c10::SymDimVector ss(target.sym_sizes().begin(), target.sym_sizes().end());
  ss.push_back(2);
  TORCH_CHECK_VALUE(stats.sym_sizes().equals(ss), "opforge::", op, ": expected stats of shape ", shape_str(ss),
                    " (target's shape, 2), but got ", shape_str(stats.sym_sizes()));
  TORCH_CHECK_TYPE(stats.scalar_type() == lce::acc_dtype(input.scalar_type()), "opforge::", op,
                   ": expected stats of dtype ", lce::acc_dtype(input.scalar_type()), ", but got ",
                   stats.scalar_type());
}

namespace {
lce::Problem make_problem(const char* op, const at::Tensor& input, const at::Tensor& linear_weight,
                          const at::Tensor& target, const std::optional<at::Tensor>& linear_bias, double temperature,
                          int64_t ignore_index, std::optional<double> softcap) {
  lce::Problem p = lce::make_problem(input, linear_weight, target, linear_bias, std::nullopt, lce::Reduction::kNone,
                                     ignore_index, 0.0, 0.0, softcap);
  p.scale = 1.0 / temperature;
  p.op = op;
  return p;
}
}  // namespace

lce::Problem forward_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                             const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
                             std::optional<double> softcap, std::optional<int64_t> chunk_size) {
  check_args("linear_log_probs", input, linear_weight, target, linear_bias, temperature, softcap, chunk_size);
  return make_problem("linear_log_probs", input, linear_weight, target, linear_bias, temperature, ignore_index,
                      softcap);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_outputs(const lce::Problem& p, const at::Tensor& token_value,
                                                               const at::Tensor& entropy, const at::Tensor& stats,
                                                               const at::Tensor& target) {
  auto ss = target.sizes().vec();
  ss.push_back(2);
  // the row value is the cross-entropy row's −log p; adding 0 turns an ignored token's −0 into +0. Without
  // return_entropy the entropy output is an empty (0,) tensor (an op returns defined tensors: Meta, opcheck and
  // torch.compile see the same outputs for every call)
  return {token_value.neg().add_(0).view(target.sizes()),
          entropy.defined() ? entropy.view(target.sizes()) : at::empty({0}, token_value.options()), stats.view(ss)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    lce::BackwardKernel kernel, bool zero_dw, const std::optional<at::Tensor>& grad_log_probs,
    const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input, const at::Tensor& linear_weight,
    const at::Tensor& target, const at::Tensor& stats, const std::optional<at::Tensor>& entropy,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  check_backward_args(grad_log_probs, grad_entropy, input, linear_weight, target, stats, entropy, linear_bias,
                      temperature, softcap, chunk_size);
  const lce::Problem p = make_problem("linear_log_probs_backward", input, linear_weight, target, linear_bias,
                                      temperature, ignore_index, softcap);
  const lce::GradBuffers grads(p, output_mask, zero_dw);
  const lce::GradNeeds need(p, output_mask);
  lce::RowGrad g;
  if (need.any()) {
    const auto acc = lce::acc_dtype(p.X.scalar_type());
    // the log-probability's gradient is the cross-entropy row's with G = −grad_log_probs
    g.g_stride = 1;
    g.G = grad_log_probs.has_value() && grad_log_probs->defined()
              ? grad_log_probs->to(acc).reshape({p.N}).neg().contiguous()
              : at::zeros({p.N}, p.X.options().dtype(acc));
    if (grad_entropy.has_value() && grad_entropy->defined()) {
      g.GE = grad_entropy->to(acc).reshape({p.N}).contiguous();
      // Em = E_p[z] − m = r − H
      g.Em = stats.reshape({p.N, 2}).select(1, 1).sub(entropy->to(acc).reshape({p.N})).contiguous();
    }
  }
  kernel(p, g, stats, need, chunk_size, grads);
  return grads.finish(input, linear_weight, linear_bias);
}

}  // namespace llp

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> linear_log_probs(const at::Tensor& input, const at::Tensor& linear_weight,
                                                    const at::Tensor& target,
                                                    const std::optional<at::Tensor>& linear_bias, double temperature,
                                                    int64_t ignore_index, std::optional<double> softcap,
                                                    bool return_entropy, std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(linear_log_probs)>("opforge::linear_log_probs");
  return op.call(input, linear_weight, target, linear_bias, temperature, ignore_index, softcap, return_entropy,
                 chunk_size);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> _linear_log_probs_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, bool return_entropy, std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(_linear_log_probs_forward)>("opforge::_linear_log_probs_forward");
  return op.call(input, linear_weight, target, linear_bias, temperature, ignore_index, softcap, return_entropy,
                 chunk_size);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_log_probs_backward(
    const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& linear_bias, double temperature,
    int64_t ignore_index, std::optional<double> softcap, std::array<bool, 3> output_mask,
    std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(linear_log_probs_backward)>("opforge::linear_log_probs_backward");
  return op.call(grad_log_probs, grad_entropy, input, linear_weight, target, stats, entropy, linear_bias, temperature,
                 ignore_index, softcap, output_mask, chunk_size);
}

namespace {

// ---- CompositeExplicitAutograd (CPU, CUDA, Meta): the public op is the forward op's first two outputs ----

std::tuple<at::Tensor, at::Tensor> linear_log_probs_composite(const at::Tensor& input, const at::Tensor& linear_weight,
                                                              const at::Tensor& target,
                                                              const std::optional<at::Tensor>& linear_bias,
                                                              double temperature, int64_t ignore_index,
                                                              std::optional<double> softcap, bool return_entropy,
                                                              std::optional<int64_t> chunk_size) {
  auto [lp, ent, stats] = opforge::_linear_log_probs_forward(input, linear_weight, target, linear_bias, temperature,
                                                             ignore_index, softcap, return_entropy, chunk_size);
  return {lp, ent};
}

// ---- Meta: the same checker, then outputs with the real kernels' shapes, dtypes and strides ----------

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_log_probs_forward_meta(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, bool return_entropy, std::optional<int64_t> chunk_size) {
  llp::check_args("linear_log_probs", input, linear_weight, target, linear_bias, temperature, softcap, chunk_size);
  c10::SymDimVector ss(target.sym_sizes().begin(), target.sym_sizes().end());
  ss.push_back(2);
  const auto opts = input.options().dtype(lce::acc_dtype(input.scalar_type()));
  return {at::empty_symint(target.sym_sizes(), opts),
          return_entropy ? at::empty_symint(target.sym_sizes(), opts) : at::empty({0}, opts),
          at::empty_symint(ss, opts)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_log_probs_backward_meta(
    const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& linear_bias, double temperature,
    int64_t ignore_index, std::optional<double> softcap, std::array<bool, 3> output_mask,
    std::optional<int64_t> chunk_size) {
  llp::check_backward_args(grad_log_probs, grad_entropy, input, linear_weight, target, stats, entropy, linear_bias,
                           temperature, softcap, chunk_size);
  at::Tensor gi, gw, gb;
  if (output_mask[0]) gi = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1]) gw = at::empty_symint(linear_weight.sym_sizes(), linear_weight.options());
  if (output_mask[2] && linear_bias.has_value() && linear_bias->defined())
    gb = at::empty_symint(linear_bias->sym_sizes(), linear_bias->options());
  return {gi, gw, gb};
}

// ---- Autograd ----------------------------------------------------------------------------------------

// Saved: input, linear_weight, target, stats, linear_bias (or undefined), entropy (an output; undefined without
// return_entropy); attributes temperature, ignore_index, softcap (0 = none), chunk_size (0 = default). Edges: input,
// linear_weight, linear_bias. Without return_entropy the entropy output is an empty constant: a gradient given for
// it contributes nothing.
variable_list llp_backward_fn(const BackwardArgs& a) {
  const at::Tensor &bias = a.saved[4], &ent = a.saved[5];
  const at::Tensor& glp = a.grads[0];
  const at::Tensor gent = ent.defined() ? a.grads[1] : at::Tensor();
  if (!glp.defined() && !gent.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
  auto opt = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
  const double softcap = a.attrs[2].toDouble();
  const int64_t chunk = a.attrs[3].toInt();
  auto [gi, gw, gb] = opforge::linear_log_probs_backward(
      opt(glp), opt(gent), a.saved[0], a.saved[1], a.saved[2], a.saved[3], opt(ent), opt(bias),
      a.attrs[0].toDouble(), a.attrs[1].toInt(), softcap > 0 ? std::optional<double>(softcap) : std::nullopt,
      {a.needs[0], a.needs[1], bias.defined() && a.needs[2]}, chunk > 0 ? std::optional<int64_t>(chunk) : std::nullopt);
  return {gi, gw, gb};
}

using LlpForward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
// log_probs and entropy are differentiable; stats is not.
constexpr Differentiability kLlpOutputs[] = {kDifferentiable, kDifferentiable, kNotDifferentiable};

LlpForward llp_recorded(const char* op, const at::Tensor& input, const at::Tensor& linear_weight,
                        const at::Tensor& target, const std::optional<at::Tensor>& linear_bias, double temperature,
                        int64_t ignore_index, std::optional<double> softcap, bool return_entropy,
                        std::optional<int64_t> chunk_size, bool public_op) {
  return autograd_op(
      {op, "opforge::LinearLogProbsBackward", llp_backward_fn, nullptr}, kLlpOutputs,
      [&](bool grad) -> LlpForward {
        if (!grad && public_op) {
          auto [lp, ent] = opforge::linear_log_probs(input, linear_weight, target, linear_bias, temperature,
                                                     ignore_index, softcap, return_entropy, chunk_size);
          return {lp, ent, at::Tensor()};
        }
        return opforge::_linear_log_probs_forward(input, linear_weight, target, linear_bias, temperature,
                                                  ignore_index, softcap, return_entropy, chunk_size);
      },
      [&](OpNode& n, const LlpForward& out) {
        const auto& [lp, ent, stats] = out;
        n.save(input);
        n.save(linear_weight);
        n.save(target);
        n.save(stats);
        n.save(linear_bias);
        n.save(return_entropy ? ent : at::Tensor(), /*is_output=*/true);
        n.attr(temperature);
        n.attr(ignore_index);
        n.attr(softcap.value_or(0.0));
        n.attr(chunk_size.value_or(0));
      },
      input, linear_weight, linear_bias);
}

std::tuple<at::Tensor, at::Tensor> linear_log_probs_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                                             const at::Tensor& target,
                                                             const std::optional<at::Tensor>& linear_bias,
                                                             double temperature, int64_t ignore_index,
                                                             std::optional<double> softcap, bool return_entropy,
                                                             std::optional<int64_t> chunk_size) {
  auto [lp, ent, stats] = llp_recorded("linear_log_probs", input, linear_weight, target, linear_bias, temperature,
                                       ignore_index, softcap, return_entropy, chunk_size, /*public_op=*/true);
  return {lp, ent};
}

LlpForward linear_log_probs_forward_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                                             const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                                             double temperature, int64_t ignore_index, std::optional<double> softcap,
                                             bool return_entropy, std::optional<int64_t> chunk_size) {
  return llp_recorded("_linear_log_probs_forward", input, linear_weight, target, linear_bias, temperature,
                      ignore_index, softcap, return_entropy, chunk_size, /*public_op=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) {
  m.impl("linear_log_probs", &linear_log_probs_composite);
}

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("_linear_log_probs_forward", &linear_log_probs_forward_meta);
  m.impl("linear_log_probs_backward", &linear_log_probs_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("linear_log_probs", &linear_log_probs_autograd);
  m.impl("_linear_log_probs_forward", &linear_log_probs_forward_autograd);
  register_backward_op_autograd(m, "linear_log_probs_backward");
}

// torch.autocast: as linear_cross_entropy's (the GEMM operands in the autocast dtype, the outputs in float32).
OPFORGE_AUTOCAST(linear_log_probs,
                 {{"linear_log_probs", AutocastPolicy::kLowerPrecision, {"input", "linear_weight", "linear_bias"}},
                  {"_linear_log_probs_forward", AutocastPolicy::kLowerPrecision,
                   {"input", "linear_weight", "linear_bias"}},
                  {"linear_log_probs_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
