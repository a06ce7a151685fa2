// Elementwise ops: checkers, the public C++ API, Meta kernels and autograd.
#include "ops/elementwise/elementwise.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ExpandUtils.h>
#include <ATen/OpMathType.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"

namespace opforge {
namespace elementwise {

at::Tensor check_unary(const char* op, const at::Tensor& input) {
  check_floating(op, "input", input);
  return input.contiguous();
}

std::pair<at::Tensor, at::Tensor> check_unary_backward(const char* op, const at::Tensor& grad_output,
                                                       const at::Tensor& saved, const char* saved_name) {
  check_floating(op, "grad_output", grad_output);
  check_floating(op, saved_name, saved);
  check_same_device(op, "grad_output", grad_output, saved_name, saved);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(saved.sym_sizes()), "opforge::", op, ": expected grad_output and ",
                    saved_name, " of the same shape, but got ", shape_str(grad_output.sym_sizes()), " and ",
                    shape_str(saved.sym_sizes()));
  return {grad_output.contiguous(), to_input_dtype(saved, grad_output.scalar_type()).contiguous()};
}

void check_square_add_args(const at::Tensor& input, const at::Tensor& other) {
  check_floating("square_add", "input", input);
  check_floating("square_add", "other", other);
  check_same_device("square_add", "input", input, "other", other);
  const auto xs = input.sym_sizes();
  const auto os = other.sym_sizes();
  bool ok = os.size() <= xs.size();
  for (size_t i = 0; ok && i < os.size(); ++i) {
    const auto& o = os[os.size() - 1 - i];
    const auto& x = xs[xs.size() - 1 - i];
    ok = (o == 1) || (o == x);
  }
  TORCH_CHECK_VALUE(ok, "opforge::square_add: expected other broadcastable to input's shape ", shape_str(xs),
                    ", but got other of shape ", shape_str(os));
}

SquareAddProblem check_square_add(const at::Tensor& input, const at::Tensor& other) {
  check_square_add_args(input, other);
  at::Tensor X = input.contiguous();
  at::Tensor B = to_input_dtype(other, input.scalar_type());
  const int64_t d = input.dim();
  // Pad other to input's rank, then find the first dim j such that other matches input on dims >= j
  // and is 1 on dims < j: other then repeats with period prod(sizes[j:]) over the flat input.
  std::vector<int64_t> os(d, 1);
  for (int64_t i = 0; i < other.dim(); ++i) os[d - other.dim() + i] = other.size(i);
  int64_t j = d;
  while (j > 0 && os[j - 1] == input.size(j - 1)) --j;
  bool leading_ones = true;
  for (int64_t i = 0; i < j; ++i) leading_ones = leading_ones && os[i] == 1;
  if (leading_ones) {
    int64_t period = 1;
    for (int64_t i = j; i < d; ++i) period *= input.size(i);
    return {X, B.reshape({period}).contiguous(), period};
  }
  return {X, B.expand(input.sizes()).contiguous().view({-1}), X.numel()};
}

}  // namespace elementwise

// ---- public C++ API: typed dispatcher calls --------------------------------------------------------

at::Tensor sigmoid(const at::Tensor& input) {
  static auto op = typed_op<decltype(sigmoid)>("opforge::sigmoid");
  return op.call(input);
}
at::Tensor sigmoid_backward(const at::Tensor& grad_output, const at::Tensor& output) {
  static auto op = typed_op<decltype(sigmoid_backward)>("opforge::sigmoid_backward");
  return op.call(grad_output, output);
}
at::Tensor square(const at::Tensor& input) {
  static auto op = typed_op<decltype(square)>("opforge::square");
  return op.call(input);
}
at::Tensor square_backward(const at::Tensor& grad_output, const at::Tensor& input) {
  static auto op = typed_op<decltype(square_backward)>("opforge::square_backward");
  return op.call(grad_output, input);
}
at::Tensor square_add(const at::Tensor& input, const at::Tensor& other) {
  static auto op = typed_op<decltype(square_add)>("opforge::square_add");
  return op.call(input, other);
}
std::tuple<at::Tensor, at::Tensor> square_add_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                       const at::Tensor& other, std::array<bool, 2> output_mask) {
  static auto op = typed_op<decltype(square_add_backward)>("opforge::square_add_backward");
  return op.call(grad_output, input, other, output_mask);
}

namespace {

// square_add's backward composes ops that have CPU, CUDA and Meta kernels: the grad_input part is
// square_backward; grad_other is ATen's broadcast reduction (at::sum_to), in other's dtype.
std::tuple<at::Tensor, at::Tensor> square_add_backward_composite(const at::Tensor& grad_output,
                                                                 const at::Tensor& input, const at::Tensor& other,
                                                                 std::array<bool, 2> output_mask) {
  elementwise::check_square_add_args(input, other);
  check_floating("square_add_backward", "grad_output", grad_output);
  check_same_device("square_add_backward", "grad_output", grad_output, "input", input);
  // grad_output's shape is checked here for both masks: square_backward checks it only when mask[0] is set, and
  // with mask [false, true] a grad_output of the wrong shape would be summed to other's shape unchecked.
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(input.sym_sizes()),
                    "opforge::square_add_backward: expected grad_output of input's shape ",
                    shape_str(input.sym_sizes()), ", but got ", shape_str(grad_output.sym_sizes()));
  at::Tensor grad_input, grad_other;
  if (output_mask[0]) grad_input = opforge::square_backward(grad_output, input);
  if (output_mask[1]) {
    // a new tensor, never a view of grad_output (the schema returns new tensors)
    if (other.sym_sizes().equals(grad_output.sym_sizes())) {  // no broadcast: nothing to sum
      grad_other = grad_output.to(other.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    } else {  // summed over the broadcast dims in fp32 (fp64 for fp64), rounded once to other's dtype
      const auto acc = at::promote_types(at::toOpMathType(grad_output.scalar_type()), other.scalar_type());
      grad_other = at::sum_to(grad_output.to(acc), other.sym_sizes(), /*always_return_non_view=*/true)
                       .to(other.scalar_type());
    }
  }
  return {grad_input, grad_other};
}

// ---- Meta: the same checkers, then outputs with the real kernels' shapes, dtypes and strides -------

at::Tensor unary_meta(const char* op, const at::Tensor& input) {
  elementwise::check_unary(op, input);
  return at::empty_symint(input.sym_sizes(), input.options());
}
at::Tensor sigmoid_meta(const at::Tensor& input) { return unary_meta("sigmoid", input); }
at::Tensor square_meta(const at::Tensor& input) { return unary_meta("square", input); }
at::Tensor sigmoid_backward_meta(const at::Tensor& grad_output, const at::Tensor& output) {
  elementwise::check_unary_backward("sigmoid_backward", grad_output, output, "output");
  return at::empty_symint(grad_output.sym_sizes(), grad_output.options());
}
at::Tensor square_backward_meta(const at::Tensor& grad_output, const at::Tensor& input) {
  elementwise::check_unary_backward("square_backward", grad_output, input, "input");
  return at::empty_symint(grad_output.sym_sizes(), grad_output.options());
}
at::Tensor square_add_meta(const at::Tensor& input, const at::Tensor& other) {
  elementwise::check_square_add_args(input, other);
  return at::empty_symint(input.sym_sizes(), input.options());
}
// ---- Autograd: save what backward needs, redispatch below autograd, route backward to the op -------

// sigmoid: y = σ(x), dx = g·y·(1−y); saves the output.
variable_list sigmoid_backward_fn(const BackwardArgs& a) { return {opforge::sigmoid_backward(a.grads[0], a.saved[0])}; }
// The same in differentiable ATen ops (double backward, torch.func): g·y·(1−y).
variable_list sigmoid_double_backward_fn(const BackwardArgs& a) {
  const auto& y = a.saved[0];
  return {a.grads[0] * y * (1 - y)};
}

// square: y = x², dx = 2·x·g; saves the input.
variable_list square_backward_fn(const BackwardArgs& a) { return {opforge::square_backward(a.grads[0], a.saved[0])}; }
variable_list square_double_backward_fn(const BackwardArgs& a) { return {2 * a.saved[0] * a.grads[0]}; }

// square_add: y = x² + other; saves the input and, for other, only its shape and dtype (a one-element
// tensor expanded to other's shape: other's data is not kept, so changing it in place before backward is fine,
// as with torch's own add).
variable_list square_add_backward_fn(const BackwardArgs& a) {
  auto [grad_input, grad_other] =
      opforge::square_add_backward(a.grads[0], a.saved[0], a.saved[1], {a.needs[0], a.needs[1]});
  return {grad_input, grad_other};
}
variable_list square_add_double_backward_fn(const BackwardArgs& a) {
  const auto& g = a.grads[0];
  const auto& other = a.saved[1];
  at::Tensor grad_other;
  if (a.needs[1]) grad_other = at::sum_to(g, other.sym_sizes()).to(other.scalar_type());
  return {2 * a.saved[0] * g, grad_other};
}

// The Autograd kernel of a one-input op (sigmoid, square): records node `node` with backward / double_backward,
// saving the output (save_output) or the input.
at::Tensor unary_autograd(const char* op, const char* node, at::Tensor (*forward)(const at::Tensor&),
                          BackwardFn backward, BackwardFn double_backward, bool save_output,
                          const at::Tensor& input) {
  return autograd_op(
      {op, node, backward, double_backward}, {kDifferentiable}, [&](bool) { return forward(input); },
      [&](OpNode& n, const at::Tensor& output) {
        if (save_output) n.save(output, /*is_output=*/true);
        else n.save(input);
      },
      input);
}

at::Tensor sigmoid_autograd(const at::Tensor& input) {
  return unary_autograd("sigmoid", "opforge::SigmoidBackward", &opforge::sigmoid, sigmoid_backward_fn,
                        sigmoid_double_backward_fn, /*save_output=*/true, input);
}
at::Tensor square_autograd(const at::Tensor& input) {
  return unary_autograd("square", "opforge::SquareBackward", &opforge::square, square_backward_fn,
                        square_double_backward_fn, /*save_output=*/false, input);
}
at::Tensor square_add_autograd(const at::Tensor& input, const at::Tensor& other) {
  return autograd_op(
      {"square_add", "opforge::SquareAddBackward", square_add_backward_fn, square_add_double_backward_fn},
      {kDifferentiable}, [&](bool) { return opforge::square_add(input, other); },
      [&](OpNode& n, const at::Tensor&) {
        n.save(input);
        n.save(at::empty({}, other.options()).expand_symint(other.sym_sizes()));
      },
      input, other);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("sigmoid", &sigmoid_meta);
  m.impl("sigmoid_backward", &sigmoid_backward_meta);
  m.impl("square", &square_meta);
  m.impl("square_backward", &square_backward_meta);
  m.impl("square_add", &square_add_meta);
}

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) {
  m.impl("square_add_backward", &square_add_backward_composite);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("sigmoid", &sigmoid_autograd);
  m.impl("square", &square_autograd);
  m.impl("square_add", &square_add_autograd);
  register_backward_op_autograd(m, "sigmoid_backward");
  register_backward_op_autograd(m, "square_backward");
  register_backward_op_autograd(m, "square_add_backward");
}

// torch.autocast: as the native ops these mirror (core/autocast.h)
OPFORGE_AUTOCAST(elementwise, {{"sigmoid", AutocastPolicy::kInputDtype}, {"sigmoid_backward", AutocastPolicy::kInputDtype}, {"square", AutocastPolicy::kFloat32OnCUDA}, {"square_backward", AutocastPolicy::kInputDtype}, {"square_add", AutocastPolicy::kInputDtype}, {"square_add_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
