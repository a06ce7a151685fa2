// The gated ops' checkers and Meta kernels (core/gated.h), shared by swiglu and geglu.
#include "core/gated.h"

#include "core/amax.h"
#include "core/check.h"

namespace opforge {

std::pair<at::Tensor, at::Tensor> check_gated(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_floating(op, "gate", gate);
  check_floating(op, "up", up);
  check_same_device(op, "gate", gate, "up", up);
  TORCH_CHECK_VALUE(gate.sym_sizes().equals(up.sym_sizes()), "opforge::", op,
                    ": expected gate and up of the same shape, but got ", shape_str(gate.sym_sizes()), " and ",
                    shape_str(up.sym_sizes()));
  return {gate, to_input_dtype(up, gate.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> check_gated_backward(const char* op, const at::Tensor& grad_output,
                                                                    const at::Tensor& gate, const at::Tensor& up) {
  auto [G, U] = check_gated(op, gate, up);
  check_floating(op, "grad_output", grad_output);
  check_same_device(op, "grad_output", grad_output, "gate", gate);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(gate.sym_sizes()), "opforge::", op,
                    ": expected grad_output of gate's shape ", shape_str(gate.sym_sizes()), ", but got ",
                    shape_str(grad_output.sym_sizes()));
  return {to_input_dtype(grad_output, gate.scalar_type()), G, U};
}

c10::SymInt check_gated_packed(const char* op, const at::Tensor& input) {
  check_floating(op, "input", input);
  TORCH_CHECK_VALUE(input.dim() >= 1, "opforge::", op,
                    ": expected input of shape (*, 2I) (the [gate | up] halves), but got a 0-d tensor");
  const c10::SymInt& N = input.sym_size(-1);
  TORCH_CHECK_VALUE(N % 2 == 0, "opforge::", op,
                    ": expected input's last dimension to be even (2I: the [gate | up] halves), but got ", num_str(N));
  return N / 2;
}

c10::SymDimVector gated_packed_output_shape(const at::Tensor& input) {
  c10::SymDimVector shape(input.sym_sizes().begin(), input.sym_sizes().end());
  shape.back() = shape.back() / 2;
  return shape;
}

std::pair<at::Tensor, c10::SymInt> check_gated_packed_backward(const char* op, const at::Tensor& grad_output,
                                                               const at::Tensor& input) {
  c10::SymInt I = check_gated_packed(op, input);
  check_floating(op, "grad_output", grad_output);
  check_same_device(op, "grad_output", grad_output, "input", input);
  const c10::SymDimVector expected = gated_packed_output_shape(input);
  TORCH_CHECK_VALUE(grad_output.sym_sizes().equals(expected), "opforge::", op,
                    ": expected grad_output of shape ", shape_str(expected),
                    " (input's with the last dimension halved), but got ", shape_str(grad_output.sym_sizes()));
  return {to_input_dtype(grad_output, input.scalar_type()), std::move(I)};
}

at::Tensor gated_meta(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_gated(op, gate, up);
  return at::empty_symint(gate.sym_sizes(), gate.options());
}

std::tuple<at::Tensor, at::Tensor> gated_backward_meta(const char* op, const at::Tensor& grad_output,
                                                       const at::Tensor& gate, const at::Tensor& up) {
  check_gated_backward(op, grad_output, gate, up);
  return {at::empty_symint(gate.sym_sizes(), gate.options()), at::empty_symint(up.sym_sizes(), up.options())};
}

at::Tensor gated_packed_meta(const char* op, const at::Tensor& input) {
  check_gated_packed(op, input);
  return at::empty_symint(gated_packed_output_shape(input), input.options());
}

std::tuple<at::Tensor, at::Tensor> gated_packed_amax_meta(const char* op, const at::Tensor& input) {
  at::Tensor output = gated_packed_meta(op, input);
  return {output, empty_amax(input)};
}

at::Tensor gated_packed_backward_meta(const char* op, const at::Tensor& grad_output, const at::Tensor& input) {
  check_gated_packed_backward(op, grad_output, input);
  return at::empty_symint(input.sym_sizes(), input.options());
}

}  // namespace opforge
