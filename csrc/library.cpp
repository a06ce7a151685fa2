// Every opforge schema, one commented line each, sorted. Kernels are registered beside each op
// (csrc/ops/<op>/): CPU and CUDA in <op>_cpu.cpp / <op>_cuda.cu, Meta and Autograd in <op>.cpp.
// Argument names follow torch.nn.functional.
#include <torch/library.h>

TORCH_LIBRARY(opforge, m) {
  // y = input · weightᵀ + bias; input (*, K), weight (N, K), bias (N,)
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // (grad_input, grad_weight, grad_bias) of linear, each only if its output_mask entry is set;
  // grad_bias in bias_dtype (the forward's bias dtype; input's dtype when None)
  m.def("linear_backward(Tensor grad_output, Tensor input, Tensor weight, bool[3] output_mask, ScalarType? bias_dtype=None) -> (Tensor, Tensor, Tensor)");
  // y = 1 / (1 + exp(-input))
  m.def("sigmoid(Tensor input) -> Tensor");
  // grad_input = grad_output · output · (1 − output)
  m.def("sigmoid_backward(Tensor grad_output, Tensor output) -> Tensor");
  // y = input²
  m.def("square(Tensor input) -> Tensor");
  // y = input² + other, other broadcastable to input
  m.def("square_add(Tensor input, Tensor other) -> Tensor");
  // (grad_input, grad_other) of square_add, each only if its output_mask entry is set
  m.def("square_add_backward(Tensor grad_output, Tensor input, Tensor other, bool[2] output_mask) -> (Tensor, Tensor)");
  // grad_input = 2 · input · grad_output
  m.def("square_backward(Tensor grad_output, Tensor input) -> Tensor");
}
