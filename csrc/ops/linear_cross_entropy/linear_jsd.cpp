// linear_jsd: checkers, the public C++ API, Meta kernels, autograd and autocast. The kernels are
// linear_cross_entropy's forward chunk loop (linear_cross_entropy_cpu.cpp, linear_cross_entropy_cuda.cu) given a
// teacher head: per chunk a second logits GEMM (the teacher's, no gradient) and the JSD row function.
//
// Op structure (schemas in csrc/library.cpp):
//   _linear_jsd_forward   CPU/CUDA/Meta kernels: (loss, the student's gradients grad_mask asks for); not
//                         differentiable itself (its outputs raise lazily if differentiated).
//   linear_jsd            CompositeExplicitAutograd: the forward op's loss; Autograd kernel below: nothing kept when
//                         nothing needs a gradient, else the forward op with grad_mask = which of the student's
//                         input, weight and bias require grad, and linear_cross_entropy's gradient-in-forward node
//                         (lce::saved_grads_backward: the saved gradients times grad_output, Note [all targets
//                         ignored]). The loss is a scalar, so the gradient is known up to that factor in the forward:
//                         3 GEMMs for the student (logits, dX, dW) and 1 for the teacher, nothing recomputed.
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
namespace jsd {

namespace {
constexpr const char* kOp = "linear_jsd";
}  // namespace

lce::Reduction check_args(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
                          const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
                          const std::optional<at::Tensor>& linear_bias,
                          const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                          c10::string_view reduction, std::optional<int64_t> chunk_size) {
  check_floating(kOp, "input", input);
  check_floating(kOp, "teacher_input", teacher_input);
  TORCH_CHECK_VALUE(input.dim() >= 1, "opforge::", kOp,
                    ": expected input to have at least 1 dimension (*, H), but got a 0-dimensional tensor");
  const auto xs = input.sym_sizes();
  const auto lead = xs.slice(0, xs.size() - 1);
  // the target the student's checks see: the given one, or a stand-in of the leading shape (every token counts)
  const at::Tensor tgt = target.has_value() && target->defined()
                             ? *target
                             : at::empty_symint(lead, input.options().dtype(at::kLong));
  lce::check_args(kOp, input, linear_weight, tgt, linear_bias, std::nullopt, "mean", 0.0, 0.0, std::nullopt,
                  chunk_size);
  check_same_device(kOp, "input", input, "teacher_input", teacher_input);
  check_floating(kOp, "teacher_linear_weight", teacher_linear_weight);
  check_same_device(kOp, "input", input, "teacher_linear_weight", teacher_linear_weight);
  TORCH_CHECK_VALUE(teacher_input.dim() >= 1 && teacher_input.sym_sizes().slice(0, teacher_input.dim() - 1).equals(lead),
                    "opforge::", kOp, ": expected teacher_input of input's leading shape ", shape_str(lead),
                    " (*, Ht), but got ", shape_str(teacher_input.sym_sizes()));
  TORCH_CHECK_VALUE(teacher_linear_weight.dim() == 2 && teacher_linear_weight.sym_size(0) == linear_weight.sym_size(0) &&
                        teacher_linear_weight.sym_size(1) == teacher_input.sym_size(-1),
                    "opforge::", kOp, ": expected teacher_linear_weight of shape [", num_str(linear_weight.sym_size(0)),
                    ", ", num_str(teacher_input.sym_size(-1)), "] (linear_weight's V, teacher_input's Ht), but got ",
                    shape_str(teacher_linear_weight.sym_sizes()));
  if (teacher_linear_bias.has_value() && teacher_linear_bias->defined()) {
    const at::Tensor& b = *teacher_linear_bias;
    check_floating(kOp, "teacher_linear_bias", b);
    check_same_device(kOp, "input", input, "teacher_linear_bias", b);
    TORCH_CHECK_VALUE(b.dim() == 1 && b.sym_size(0) == linear_weight.sym_size(0), "opforge::", kOp,
                      ": expected teacher_linear_bias of shape [", num_str(linear_weight.sym_size(0)),
                      "] (linear_weight's V), but got ", shape_str(b.sym_sizes()));
  }
  TORCH_CHECK_VALUE(beta >= 0.0 && beta <= 1.0, "opforge::", kOp, ": expected beta in [0, 1], but got ",
                    num_str(beta));
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, "opforge::", kOp,
                    ": expected temperature > 0 and finite, but got ", num_str(temperature));
  const lce::Reduction r = lce::parse_reduction(kOp, reduction);
  TORCH_CHECK_VALUE(r != lce::Reduction::kNone, "opforge::", kOp,
                    ": expected reduction to be one of \"mean\", \"sum\", but got \"none\"");
  return r;
}

Problems forward_problems(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
                          const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
                          const std::optional<at::Tensor>& linear_bias,
                          const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                          int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size) {
  const lce::Reduction r = check_args(input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias,
                                      teacher_linear_bias, beta, temperature, reduction, chunk_size);
  const bool has_target = target.has_value() && target->defined();
  const auto xs = input.sizes();
  // without a target every token counts: zeros, and an ignore_index none of them equals
  const at::Tensor tgt = has_target ? *target : at::zeros(xs.slice(0, xs.size() - 1), input.options().dtype(at::kLong));
  const int64_t ignore = has_target ? ignore_index : -1;
  Problems p{lce::make_problem(input, linear_weight, tgt, linear_bias, std::nullopt, r, ignore, 0.0, 0.0, std::nullopt),
             lce::make_problem(to_input_dtype(teacher_input, input.scalar_type()), teacher_linear_weight, tgt,
                               teacher_linear_bias, std::nullopt, r, ignore, 0.0, 0.0, std::nullopt),
             beta};
  // lean mode is the student's decision (its weight and bias dtypes); the teacher's logits then share the 16-bit
  // chunk dtype (its weight is already in input's dtype; a bias of another dtype is rounded to it in the CUDA loop)
  p.t.lean = p.s.lean;
  p.s.scale = p.t.scale = 1.0 / temperature;
  p.s.op = p.t.op = kOp;
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(
    const Problems& p, const at::Tensor& token_value, const lce::GradBuffers& grads, const at::Tensor& input,
    const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias) {
  auto [gi, gw, gb] = grads.finish(input, linear_weight, linear_bias);
  return {lce::reduce_loss(p.s, token_value, p.s.T), gi, gw, gb};
}

}  // namespace jsd

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor linear_jsd(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
                      const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
                      const std::optional<at::Tensor>& linear_bias,
                      const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                      int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(linear_jsd)>("opforge::linear_jsd");
  return op.call(input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias, teacher_linear_bias,
                 beta, temperature, ignore_index, reduction, chunk_size);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_jsd_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
    const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& teacher_linear_bias, double beta,
    double temperature, int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask) {
  static auto op = typed_op<decltype(_linear_jsd_forward)>("opforge::_linear_jsd_forward");
  return op.call(input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias, teacher_linear_bias,
                 beta, temperature, ignore_index, reduction, chunk_size, grad_mask);
}

namespace {

at::Tensor linear_jsd_composite(const at::Tensor& input, const at::Tensor& linear_weight,
                                const at::Tensor& teacher_input, const at::Tensor& teacher_linear_weight,
                                const std::optional<at::Tensor>& target, const std::optional<at::Tensor>& linear_bias,
                                const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                                int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size) {
  return std::get<0>(opforge::_linear_jsd_forward(input, linear_weight, teacher_input, teacher_linear_weight, target,
                                                  linear_bias, teacher_linear_bias, beta, temperature, ignore_index,
                                                  reduction, chunk_size));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_jsd_forward_meta(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
    const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& teacher_linear_bias, double beta,
    double temperature, int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask) {
  jsd::check_args(input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias,
                  teacher_linear_bias, beta, temperature, reduction, chunk_size);
  at::Tensor gi, gw, gb;
  if (grad_mask[0]) gi = at::empty_symint(input.sym_sizes(), input.options());
  if (grad_mask[1]) gw = at::empty_symint(linear_weight.sym_sizes(), linear_weight.options());
  if (grad_mask[2] && linear_bias.has_value() && linear_bias->defined())
    gb = at::empty_symint(linear_bias->sym_sizes(), linear_bias->options());
  return {at::empty({}, input.options().dtype(lce::acc_dtype(input.scalar_type()))), gi, gw, gb};
}

// The teacher is a constant of the loss: a teacher tensor that requires grad would get a silently missing gradient.
void check_teacher_constant(const at::Tensor& teacher_input, const at::Tensor& teacher_linear_weight,
                            const std::optional<at::Tensor>& teacher_linear_bias) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"teacher_input", &teacher_input},
                                {"teacher_linear_weight", &teacher_linear_weight}}) {
    TORCH_CHECK(!any_requires_grad(*t), "opforge::linear_jsd: expected ", name, " not to require grad (the teacher "
                "gets no gradient), but it does; pass ", name, ".detach() or compute it under torch.no_grad()");
  }
  TORCH_CHECK(!any_requires_grad(teacher_linear_bias), "opforge::linear_jsd: expected teacher_linear_bias not to "
              "require grad (the teacher gets no gradient), but it does; pass teacher_linear_bias.detach()");
}

using JsdForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
constexpr Differentiability kJsdOutputs[] = {kDifferentiable, kNotDifferentiable, kNotDifferentiable,
                                             kNotDifferentiable};

at::Tensor linear_jsd_autograd(const at::Tensor& input, const at::Tensor& linear_weight,
                               const at::Tensor& teacher_input, const at::Tensor& teacher_linear_weight,
                               const std::optional<at::Tensor>& target, const std::optional<at::Tensor>& linear_bias,
                               const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                               int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size) {
  return std::get<0>(autograd_op(
      {"linear_jsd", "opforge::LinearJsdBackward", lce::saved_grads_backward, nullptr}, kJsdOutputs,
      [&](bool grad) -> JsdForward {
        check_teacher_constant(teacher_input, teacher_linear_weight, teacher_linear_bias);
        if (!grad) {
          return {opforge::linear_jsd(input, linear_weight, teacher_input, teacher_linear_weight, target,
                                      linear_bias, teacher_linear_bias, beta, temperature, ignore_index, reduction,
                                      chunk_size),
                  {}, {}, {}};
        }
        // only the gradients of the student's tensors that require grad (a frozen head gets no V x H buffer)
        const std::array<bool, 3> mask = {requires_grad_of(input), requires_grad_of(linear_weight),
                                          requires_grad_of(linear_bias)};
        return opforge::_linear_jsd_forward(input, linear_weight, teacher_input, teacher_linear_weight, target,
                                            linear_bias, teacher_linear_bias, beta, temperature, ignore_index,
                                            reduction, chunk_size, mask);
      },
      [&](OpNode& n, const JsdForward& out) {
        const auto& [loss, gi, gw, gb] = out;
        lce::mark_not_differentiable("linear_jsd", gi, gw, gb, input, linear_weight, linear_bias);
        n.save(gi);
        n.save(gw);
        n.save(gb);
        // Note [all targets ignored] (linear_cross_entropy.cpp): whether any token counts (without a target: any
        // token at all)
        const auto xs = input.sym_sizes();
        n.save(target.has_value() && target->defined()
                   ? target->ne(ignore_index).any()
                   : at::ones_symint(xs.slice(0, xs.size() - 1), input.options().dtype(at::kBool)).any());
      },
      input, linear_weight, linear_bias));
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) { m.impl("linear_jsd", &linear_jsd_composite); }

TORCH_LIBRARY_IMPL(opforge, Meta, m) { m.impl("_linear_jsd_forward", &linear_jsd_forward_meta); }

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("linear_jsd", &linear_jsd_autograd);
  // the gradients it returns are computed, not differentiable: differentiating them raises lazily
  register_not_differentiable_autograd(m, "_linear_jsd_forward");
}

// torch.autocast: the GEMM operands (both heads) in the autocast dtype, as torch's linear; the loss in float32.
OPFORGE_AUTOCAST(linear_jsd,
                 {{"linear_jsd", AutocastPolicy::kLowerPrecision,
                   {"input", "linear_weight", "linear_bias", "teacher_input", "teacher_linear_weight",
                    "teacher_linear_bias"}},
                  {"_linear_jsd_forward", AutocastPolicy::kLowerPrecision,
                   {"input", "linear_weight", "linear_bias", "teacher_input", "teacher_linear_weight",
                    "teacher_linear_bias"}}})

}  // namespace opforge
