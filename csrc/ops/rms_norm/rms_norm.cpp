// RMSNorm ops: checkers, the public C++ API, Meta kernels and autograd.
//
// Op structure (schemas in csrc/library.cpp):
//   _rms_norm_forward, _fused_add_rms_norm_forward   CPU/CUDA/Meta kernels; also return rstd [*] (fp32)
//                                                    for the backward.
//   _rms_norm_forward_amax,                          the same plus amax = max |output| [1] (FP8 current scaling),
//   _fused_add_rms_norm_forward_amax                 reduced as the kernels write the output; amax has no history.
//   rms_norm, fused_add_rms_norm                     CompositeExplicitAutograd: the forward op without
//                                                    its rstd, so they have exactly one kernel each.
//   rms_norm_backward                                CPU/CUDA/Meta kernels; not differentiable.
//   _rms_norm_apply                                  CPU/CUDA/Meta kernels; not differentiable (opforge.patch's
//                                                    recompute of a saved activation).
// The six forward ops have the Autograd kernels below (one node each, core/autograd.h).
#include "ops/rms_norm/rms_norm.h"

#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>
#include <type_traits>

#include "core/amax.h"
#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"

namespace opforge {
namespace rmsnorm {

double default_eps(at::ScalarType input_dtype) {
  // ATen's rms_norm uses std::numeric_limits<opmath_t>::epsilon() (float32's for float16/bfloat16,
  // although torch's docs say finfo(input.dtype).eps); we match the computed values, not the docs.
  return input_dtype == at::kDouble ? std::numeric_limits<double>::epsilon()
                                    : static_cast<double>(std::numeric_limits<float>::epsilon());
}

at::ScalarType rstd_dtype(at::ScalarType input_dtype) { return at::toOpMathType(input_dtype); }

double resolve_eps(const char* op, std::optional<double> eps, at::ScalarType input_dtype) {
  const double e = eps.has_value() ? *eps : default_eps(input_dtype);
  TORCH_CHECK_VALUE(e >= 0, "opforge::", op, ": expected eps >= 0, but got ", num_str(e));
  return e;
}

ForwardOutputs empty_forward_outputs(const Problem& p, const at::Tensor& input, int64_t normalized_ndim, bool fused) {
  ForwardOutputs o;
  o.Y = at::empty(input.sizes(), p.X.options());
  if (fused) o.Z = at::empty(input.sizes(), p.X.options());
  o.rstd = at::empty(input.sizes().slice(0, input.dim() - normalized_ndim),
                     p.X.options().dtype(rstd_dtype(input.scalar_type())));
  return o;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(ForwardKernel kernel, const at::Tensor& input,
                                                    c10::SymIntArrayRef normalized_shape,
                                                    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  const auto p = check_forward("rms_norm", input, normalized_shape, weight, eps);
  auto o = empty_forward_outputs(p, input, normalized_shape.size(), /*fused=*/false);
  kernel(p, o.Y, o.Z, o.rstd, nullptr);
  return {o.Y, o.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward_amax(ForwardKernel kernel, const at::Tensor& input,
                                                                     c10::SymIntArrayRef normalized_shape,
                                                                     const std::optional<at::Tensor>& weight,
                                                                     std::optional<double> eps) {
  const auto p = check_forward("rms_norm", input, normalized_shape, weight, eps);
  auto o = empty_forward_outputs(p, input, normalized_shape.size(), /*fused=*/false);
  at::Tensor amax;
  kernel(p, o.Y, o.Z, o.rstd, &amax);
  return {o.Y, o.rstd, amax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_amax(
    ForwardKernel kernel, const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  const auto p = check_forward("fused_add_rms_norm", input, normalized_shape, weight, eps, residual);
  auto o = empty_forward_outputs(p, input, normalized_shape.size(), /*fused=*/true);
  at::Tensor amax;
  kernel(p, o.Y, o.Z, o.rstd, &amax);
  return {o.Y, o.Z, o.rstd, amax};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward(ForwardKernel kernel, const at::Tensor& input,
                                                                          const at::Tensor& residual,
                                                                          c10::SymIntArrayRef normalized_shape,
                                                                          const std::optional<at::Tensor>& weight,
                                                                          std::optional<double> eps) {
  const auto p = check_forward("fused_add_rms_norm", input, normalized_shape, weight, eps, residual);
  auto o = empty_forward_outputs(p, input, normalized_shape.size(), /*fused=*/true);
  kernel(p, o.Y, o.Z, o.rstd, nullptr);
  return {o.Y, o.Z, o.rstd};
}

BackwardSetup begin_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& rstd,
                             const std::optional<at::Tensor>& weight, std::array<bool, 2> output_mask) {
  BackwardSetup s{check_backward(grad_output, input, rstd, weight), output_mask[0], false, at::Tensor(),
                  rstd_dtype(input.scalar_type())};
  s.want_dw = output_mask[1] && s.p.W.defined();
  if (s.want_dx) s.dX = at::empty(input.sizes(), s.p.X.options());
  return s;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(BackwardKernel kernel, const at::Tensor& grad_output,
                                                     const at::Tensor& input, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& weight,
                                                     std::array<bool, 2> output_mask) {
  BackwardSetup s = begin_backward(grad_output, input, rstd, weight, output_mask);
  if (!s.want_dx && !s.want_dw) return {s.dX, at::Tensor()};
  at::Tensor dW = kernel(s, s.want_dw ? *weight : at::Tensor());
  return {s.dX, dW};
}

c10::SymIntArrayRef leading_sizes(const at::Tensor& input, int64_t normalized_ndim) {
  const auto s = input.sym_sizes();
  return s.slice(0, s.size() - normalized_ndim);
}

void check_args(const char* op, const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& residual) {
  check_floating(op, "input", input);
  const int64_t nd = static_cast<int64_t>(normalized_shape.size());
  TORCH_CHECK_VALUE(nd >= 1, "opforge::", op, ": expected normalized_shape to have at least 1 dimension, but got ",
                    shape_str(normalized_shape));
  const auto xs = input.sym_sizes();
  bool trailing = input.dim() >= nd;
  for (int64_t i = 0; trailing && i < nd; ++i) trailing = xs[input.dim() - nd + i] == normalized_shape[i];
  TORCH_CHECK_VALUE(trailing, "opforge::", op, ": expected input with trailing dims equal to normalized_shape ",
                    shape_str(normalized_shape), ", but got input of shape ", shape_str(xs));
  if (weight.has_value() && weight->defined()) {
    check_floating(op, "weight", *weight);
    check_same_device(op, "input", input, "weight", *weight);
    TORCH_CHECK_VALUE(weight->sym_sizes().equals(normalized_shape), "opforge::", op,
                      ": expected weight of shape ", shape_str(normalized_shape), ", but got ",
                      shape_str(weight->sym_sizes()));
  }
  if (residual.has_value()) {  // fused: a residual is required (an undefined one is a None from Python)
    check_floating(op, "residual", *residual);
    check_same_device(op, "input", input, "residual", *residual);
    TORCH_CHECK_VALUE(residual->sym_sizes().equals(xs), "opforge::", op, ": expected residual of input's shape ",
                      shape_str(xs), ", but got ", shape_str(residual->sym_sizes()));
  }
}

Problem check_forward(const char* op, const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const std::optional<at::Tensor>& weight, std::optional<double> eps,
                      const std::optional<at::Tensor>& residual) {
  check_args(op, input, normalized_shape, weight, residual);
  Problem p;
  p.N = 1;
  for (const auto& s : normalized_shape) p.N *= s.expect_int();
  p.M = p.N == 0 ? 0 : input.numel() / p.N;
  if (p.N == 0) {  // rows of zero length: M is the product of the leading dims
    p.M = 1;
    for (int64_t i = 0; i < input.dim() - static_cast<int64_t>(normalized_shape.size()); ++i) p.M *= input.size(i);
  }
  p.X = input.contiguous();
  if (residual.has_value() && residual->defined()) p.R = to_input_dtype(*residual, input.scalar_type()).contiguous();
  if (weight.has_value() && weight->defined()) p.W = to_input_dtype(*weight, input.scalar_type()).contiguous();
  p.eps = resolve_eps(op, eps, input.scalar_type());
  return p;
}

namespace {
// input / rstd / weight of rms_norm_backward and _rms_norm_apply (after grad_output's own checks): floating dtypes,
// one device, rstd of input's leading dims in rstd_dtype, weight of the normalized shape
void check_rstd_args(const char* op, const at::Tensor& input, const at::Tensor& rstd,
                     const std::optional<at::Tensor>& weight, const at::Tensor* grad_output) {
  check_floating(op, "input", input);
  check_floating(op, "rstd", rstd);
  if (grad_output != nullptr) check_same_device(op, "grad_output", *grad_output, "input", input);
  check_same_device(op, "rstd", rstd, "input", input);
  if (grad_output != nullptr) {
    TORCH_CHECK_VALUE(grad_output->sym_sizes().equals(input.sym_sizes()), "opforge::", op,
                      ": expected grad_output of input's shape ", shape_str(input.sym_sizes()), ", but got ",
                      shape_str(grad_output->sym_sizes()));
  }
  const int64_t nd = input.dim() - rstd.dim();
  TORCH_CHECK_VALUE(nd >= 1 && leading_sizes(input, nd).equals(rstd.sym_sizes()), "opforge::", op,
                    ": expected rstd of input's leading dims (input ", shape_str(input.sym_sizes()),
                    " without the normalized dims), but got ", shape_str(rstd.sym_sizes()));
  TORCH_CHECK_TYPE(rstd.scalar_type() == rstd_dtype(input.scalar_type()), "opforge::", op, ": expected rstd of dtype ",
                   rstd_dtype(input.scalar_type()), ", but got ", rstd.scalar_type());
  if (weight.has_value() && weight->defined()) {
    check_floating(op, "weight", *weight);
    check_same_device(op, "input", input, "weight", *weight);
    const auto xs = input.sym_sizes();
    TORCH_CHECK_VALUE(weight->sym_sizes().equals(xs.slice(xs.size() - nd)), "opforge::", op,
                      ": expected weight of shape ", shape_str(xs.slice(xs.size() - nd)), ", but got ",
                      shape_str(weight->sym_sizes()));
  }
}

// the [M, N] problem of input / rstd / weight (checked)
BackwardProblem rstd_problem(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  BackwardProblem p;
  p.M = rstd.numel();
  p.N = 1;
  for (int64_t i = rstd.dim(); i < input.dim(); ++i) p.N *= input.size(i);
  p.X = input.contiguous();
  p.rstd = rstd.contiguous();
  if (weight.has_value() && weight->defined()) p.W = to_input_dtype(*weight, input.scalar_type()).contiguous();
  return p;
}
}  // namespace

void check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& rstd,
                         const std::optional<at::Tensor>& weight) {
  check_floating("rms_norm_backward", "grad_output", grad_output);
  check_rstd_args("rms_norm_backward", input, rstd, weight, &grad_output);
}

BackwardProblem check_backward(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& rstd,
                               const std::optional<at::Tensor>& weight) {
  check_backward_args(grad_output, input, rstd, weight);
  BackwardProblem p = rstd_problem(input, rstd, weight);
  p.dY = to_input_dtype(grad_output, input.scalar_type()).contiguous();  // materializes expanded/transposed views
  return p;
}

void check_apply_args(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  check_rstd_args("_rms_norm_apply", input, rstd, weight, nullptr);
}

BackwardProblem check_apply(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  check_apply_args(input, rstd, weight);
  return rstd_problem(input, rstd, weight);
}

}  // namespace rmsnorm

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> _rms_norm_forward(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                     const std::optional<at::Tensor>& weight,
                                                     std::optional<double> eps) {
  static auto op = typed_op<decltype(_rms_norm_forward)>("opforge::_rms_norm_forward");
  return op.call(input, normalized_shape, weight, eps);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> _fused_add_rms_norm_forward(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  static auto op = typed_op<decltype(_fused_add_rms_norm_forward)>("opforge::_fused_add_rms_norm_forward");
  return op.call(input, residual, normalized_shape, weight, eps);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> _rms_norm_forward_amax(const at::Tensor& input,
                                                                      c10::SymIntArrayRef normalized_shape,
                                                                      const std::optional<at::Tensor>& weight,
                                                                      std::optional<double> eps) {
  static auto op = typed_op<decltype(_rms_norm_forward_amax)>("opforge::_rms_norm_forward_amax");
  return op.call(input, normalized_shape, weight, eps);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _fused_add_rms_norm_forward_amax(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  static auto op = typed_op<decltype(_fused_add_rms_norm_forward_amax)>("opforge::_fused_add_rms_norm_forward_amax");
  return op.call(input, residual, normalized_shape, weight, eps);
}
at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
                    std::optional<double> eps) {
  using Sig = at::Tensor(const at::Tensor&, c10::SymIntArrayRef, const std::optional<at::Tensor>&, std::optional<double>);
  static auto op = typed_op<Sig>("opforge::rms_norm");
  return op.call(input, c10::fromIntArrayRefSlow(normalized_shape), weight, eps);
}
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                                      at::IntArrayRef normalized_shape,
                                                      const std::optional<at::Tensor>& weight,
                                                      std::optional<double> eps) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef,
                                                 const std::optional<at::Tensor>&, std::optional<double>);
  static auto op = typed_op<Sig>("opforge::fused_add_rms_norm");
  return op.call(input, residual, c10::fromIntArrayRefSlow(normalized_shape), weight, eps);
}
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                     const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                                     std::array<bool, 2> output_mask) {
  static auto op = typed_op<decltype(rms_norm_backward)>("opforge::rms_norm_backward");
  return op.call(grad_output, input, rstd, weight, output_mask);
}

namespace {

// The public ops' typed handles with symbolic sizes (the Autograd kernels call them below autograd).
at::Tensor rms_norm_op(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                           const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  static auto op = typed_op<at::Tensor(const at::Tensor&, c10::SymIntArrayRef, const std::optional<at::Tensor>&,
                                       std::optional<double>)>("opforge::rms_norm");
  return op.call(input, normalized_shape, weight, eps);
}
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_op(const at::Tensor& input, const at::Tensor& residual,
                                                             c10::SymIntArrayRef normalized_shape,
                                                             const std::optional<at::Tensor>& weight,
                                                             std::optional<double> eps) {
  static auto op = typed_op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                               c10::SymIntArrayRef, const std::optional<at::Tensor>&,
                                                               std::optional<double>)>("opforge::fused_add_rms_norm");
  return op.call(input, residual, normalized_shape, weight, eps);
}

// ---- CompositeExplicitAutograd (CPU, CUDA, Meta): the public ops are the forward ops without rstd ----

at::Tensor rms_norm_composite(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  // reached without any tensor (input None, no weight): name this op, not the private one below
  check_floating("rms_norm", "input", input);
  return std::get<0>(opforge::_rms_norm_forward(input, normalized_shape, weight, eps));
}
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_composite(const at::Tensor& input, const at::Tensor& residual,
                                                                c10::SymIntArrayRef normalized_shape,
                                                                const std::optional<at::Tensor>& weight,
                                                                std::optional<double> eps) {
  auto [output, residual_out, rstd] =
      opforge::_fused_add_rms_norm_forward(input, residual, normalized_shape, weight, eps);
  return {output, residual_out};
}

// ---- Meta: the same checkers, then outputs with the real kernels' shapes, dtypes and strides -------

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_meta(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight,
                                                         std::optional<double> eps) {
  rmsnorm::check_args("rms_norm", input, normalized_shape, weight);
  rmsnorm::resolve_eps("rms_norm", eps, input.scalar_type());
  const auto lead = rmsnorm::leading_sizes(input, normalized_shape.size());
  return {at::empty_symint(input.sym_sizes(), input.options()),
          at::empty_symint(lead, input.options().dtype(rmsnorm::rstd_dtype(input.scalar_type())))};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_meta(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  rmsnorm::check_args("fused_add_rms_norm", input, normalized_shape, weight, residual);
  rmsnorm::resolve_eps("fused_add_rms_norm", eps, input.scalar_type());
  const auto lead = rmsnorm::leading_sizes(input, normalized_shape.size());
  return {at::empty_symint(input.sym_sizes(), input.options()), at::empty_symint(input.sym_sizes(), input.options()),
          at::empty_symint(lead, input.options().dtype(rmsnorm::rstd_dtype(input.scalar_type())))};
}
// the *_amax ops: the forward's outputs and their amax (empty_amax)
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward_amax_meta(const at::Tensor& input,
                                                                          c10::SymIntArrayRef normalized_shape,
                                                                          const std::optional<at::Tensor>& weight,
                                                                          std::optional<double> eps) {
  auto [output, rstd] = rms_norm_forward_meta(input, normalized_shape, weight, eps);
  return {output, rstd, empty_amax(input)};
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_amax_meta(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  auto [output, residual_out, rstd] = fused_add_rms_norm_forward_meta(input, residual, normalized_shape, weight, eps);
  return {output, residual_out, rstd, empty_amax(input)};
}
at::Tensor rms_norm_apply_meta(const at::Tensor& input, const at::Tensor& rstd, const std::optional<at::Tensor>& weight) {
  rmsnorm::check_apply_args(input, rstd, weight);
  return at::empty_symint(input.sym_sizes(), input.options());
}
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad_output, const at::Tensor& input,
                                                          const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask) {
  rmsnorm::check_backward_args(grad_output, input, rstd, weight);
  at::Tensor grad_input, grad_weight;
  if (output_mask[0]) grad_input = at::empty_symint(input.sym_sizes(), input.options());
  if (output_mask[1] && weight.has_value() && weight->defined())
    grad_weight = at::empty_symint(weight->sym_sizes(), weight->options());
  return {grad_input, grad_weight};
}

// ---- Autograd: save what backward needs, redispatch below autograd, route backward to the op -------

// rms_norm: saved input, weight (undefined without one), rstd; edges input, weight.
variable_list rms_norm_backward_fn(const BackwardArgs& a) {
  const at::Tensor& weight = a.saved[1];
  const bool has_weight = weight.defined();
  auto [grad_input, grad_weight] = opforge::rms_norm_backward(
      a.grads[0], a.saved[0], a.saved[2], has_weight ? std::optional<at::Tensor>(weight) : std::nullopt,
      {a.needs[0], has_weight && a.needs[1]});
  return {grad_input, grad_weight};
}

// fused_add_rms_norm: residual_out z = input + residual, output = rms_norm(z). Saved z (an output), weight, rstd;
// attributes input's and residual's dtypes; edges input, residual, weight. Both input and residual receive
// dz_total = rms_norm_backward(grad_output) + grad_residual_out, each in its own dtype (as torch's add).
variable_list fused_add_rms_norm_backward_fn(const BackwardArgs& a) {
  const at::Tensor &z = a.saved[0], &weight = a.saved[1], &rstd = a.saved[2];
  const bool has_weight = weight.defined();
  const bool z_needs = a.needs[0] || a.needs[1];
  at::Tensor dz, grad_weight;
  if (a.grads[0].defined()) {
    std::tie(dz, grad_weight) =
        opforge::rms_norm_backward(a.grads[0], z, rstd, has_weight ? std::optional<at::Tensor>(weight) : std::nullopt,
                                   {z_needs, has_weight && a.needs[2]});
  }
  if (a.grads[1].defined() && z_needs) dz = dz.defined() ? dz + a.grads[1] : a.grads[1];
  at::Tensor grad_input, grad_residual;
  if (dz.defined()) {
    if (a.needs[0]) grad_input = dz.to(static_cast<at::ScalarType>(a.attrs[0].toInt()));
    if (a.needs[1]) grad_residual = dz.to(static_cast<at::ScalarType>(a.attrs[1].toInt()));
  }
  return {grad_input, grad_residual, grad_weight};
}

// rms_norm's and _rms_norm_forward's Autograd kernel: `forward(grad)` returns (output, rstd), rstd only when grad
// (the public op's kernel has none to return).
// _rms_norm_forward_amax's: `forward(grad)` returns (output, rstd, amax), amax not differentiable.
template <typename Forward>
auto rms_norm_recorded(const char* op, const at::Tensor& input, const std::optional<at::Tensor>& weight,
                       Forward&& forward) {
  using Result = std::invoke_result_t<Forward&, bool>;
  constexpr size_t kOutputs = std::tuple_size_v<Result>;
  static_assert(kOutputs == 2 || kOutputs == 3, "rms_norm_recorded: (output, rstd[, amax])");
  constexpr Differentiability kNot = kNotDifferentiable;
  Differentiability outputs[kOutputs];
  outputs[0] = kDifferentiable;
  for (size_t i = 1; i < kOutputs; ++i) outputs[i] = kNot;
  return autograd_op(
      {op, "opforge::RMSNormBackward", rms_norm_backward_fn, nullptr}, outputs, forward,
      [&](OpNode& n, const Result& out) {
        n.save(input);
        n.save(weight);
        n.save(std::get<1>(out));  // rstd
      },
      input, weight);
}

// fused_add_rms_norm's and _fused_add_rms_norm_forward's: `forward(grad)` returns (output, residual_out, rstd).
// residual_out = input + residual is differentiable in input and residual only: with only weight requiring grad it
// has no history (requires_grad False, as torch's input + residual).
// _fused_add_rms_norm_forward_amax's: (output, residual_out, rstd, amax), amax not differentiable.
template <typename Forward>
auto fused_add_rms_norm_recorded(const char* op, const at::Tensor& input, const at::Tensor& residual,
                                 const std::optional<at::Tensor>& weight, Forward&& forward) {
  using Result = std::invoke_result_t<Forward&, bool>;
  constexpr size_t kOutputs = std::tuple_size_v<Result>;
  static_assert(kOutputs == 3 || kOutputs == 4, "fused_add_rms_norm_recorded: (output, residual_out, rstd[, amax])");
  Differentiability outputs[kOutputs];
  outputs[0] = kDifferentiable;
  outputs[1] = differentiable_in({0, 1});
  for (size_t i = 2; i < kOutputs; ++i) outputs[i] = kNotDifferentiable;
  return autograd_op(
      {op, "opforge::FusedAddRMSNormBackward", fused_add_rms_norm_backward_fn, nullptr}, outputs, forward,
      [&](OpNode& n, const Result& out) {
        n.save(std::get<1>(out), /*is_output=*/true);  // residual_out
        n.save(weight);
        n.save(std::get<2>(out));  // rstd
        n.attr(static_cast<int64_t>(input.scalar_type()));
        n.attr(static_cast<int64_t>(residual.scalar_type()));
      },
      input, residual, weight);
}

// rms_norm: without gradients the public kernel (no rstd kept), with them the private forward.
at::Tensor rms_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                             const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  return std::get<0>(rms_norm_recorded("rms_norm", input, weight, [&](bool grad) -> std::tuple<at::Tensor, at::Tensor> {
    if (!grad) return {rms_norm_op(input, normalized_shape, weight, eps), at::Tensor()};
    return opforge::_rms_norm_forward(input, normalized_shape, weight, eps);
  }));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_autograd(const at::Tensor& input,
                                                             c10::SymIntArrayRef normalized_shape,
                                                             const std::optional<at::Tensor>& weight,
                                                             std::optional<double> eps) {
  return rms_norm_recorded("_rms_norm_forward", input, weight,
                           [&](bool) { return opforge::_rms_norm_forward(input, normalized_shape, weight, eps); });
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_autograd(const at::Tensor& input, const at::Tensor& residual,
                                                               c10::SymIntArrayRef normalized_shape,
                                                               const std::optional<at::Tensor>& weight,
                                                               std::optional<double> eps) {
  auto [output, residual_out, rstd] = fused_add_rms_norm_recorded(
      "fused_add_rms_norm", input, residual, weight, [&](bool grad) -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
        if (!grad) {
          auto [o, r] = fused_add_rms_norm_op(input, residual, normalized_shape, weight, eps);
          return {std::move(o), std::move(r), at::Tensor()};
        }
        return opforge::_fused_add_rms_norm_forward(input, residual, normalized_shape, weight, eps);
      });
  return {std::move(output), std::move(residual_out)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_autograd(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  return fused_add_rms_norm_recorded("_fused_add_rms_norm_forward", input, residual, weight, [&](bool) {
    return opforge::_fused_add_rms_norm_forward(input, residual, normalized_shape, weight, eps);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_forward_amax_autograd(const at::Tensor& input,
                                                                              c10::SymIntArrayRef normalized_shape,
                                                                              const std::optional<at::Tensor>& weight,
                                                                              std::optional<double> eps) {
  return rms_norm_recorded("_rms_norm_forward_amax", input, weight, [&](bool) {
    return opforge::_rms_norm_forward_amax(input, normalized_shape, weight, eps);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_forward_amax_autograd(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  return fused_add_rms_norm_recorded("_fused_add_rms_norm_forward_amax", input, residual, weight, [&](bool) {
    return opforge::_fused_add_rms_norm_forward_amax(input, residual, normalized_shape, weight, eps);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &rms_norm_composite);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_composite);
}

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("_rms_norm_apply", &rms_norm_apply_meta);
  m.impl("_rms_norm_forward", &rms_norm_forward_meta);
  m.impl("_fused_add_rms_norm_forward", &fused_add_rms_norm_forward_meta);
  m.impl("_rms_norm_forward_amax", &rms_norm_forward_amax_meta);
  m.impl("_fused_add_rms_norm_forward_amax", &fused_add_rms_norm_forward_amax_meta);
  m.impl("rms_norm_backward", &rms_norm_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("rms_norm", &rms_norm_autograd);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_autograd);
  m.impl("_rms_norm_forward", &rms_norm_forward_autograd);
  m.impl("_fused_add_rms_norm_forward", &fused_add_rms_norm_forward_autograd);
  m.impl("_rms_norm_forward_amax", &rms_norm_forward_amax_autograd);
  m.impl("_fused_add_rms_norm_forward_amax", &fused_add_rms_norm_forward_amax_autograd);
  register_backward_op_autograd(m, "rms_norm_backward");
  register_not_differentiable_autograd(m, "_rms_norm_apply");
}

// torch.autocast: as the native ops these mirror (core/autocast.h)
OPFORGE_AUTOCAST(rms_norm, {{"rms_norm", AutocastPolicy::kInputDtype}, {"_rms_norm_forward", AutocastPolicy::kInputDtype}, {"fused_add_rms_norm", AutocastPolicy::kInputDtype}, {"_fused_add_rms_norm_forward", AutocastPolicy::kInputDtype}, {"_rms_norm_forward_amax", AutocastPolicy::kInputDtype}, {"_fused_add_rms_norm_forward_amax", AutocastPolicy::kInputDtype}, {"rms_norm_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
