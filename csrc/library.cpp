// Every opforge schema, one commented line each, sorted. Kernels are registered beside each op
// (csrc/ops/<op>/): CPU and CUDA in <op>_cpu.cpp / <op>_cuda.cu, Meta and Autograd in <op>.cpp.
// Argument names follow torch.nn.functional.
#include <torch/library.h>

TORCH_LIBRARY(opforge, m) {
  // fused_add_rms_norm plus rstd = 1/sqrt(mean(z²) + eps) over the normalized dims, [*] in float32 (float64 for float64)
  m.def("_fused_add_rms_norm_forward(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor residual_out, Tensor rstd)");
  // linear plus its pre-activation z = input · weightᵀ + bias (a new tensor), for autograd
  m.def("_linear_forward(Tensor input, Tensor weight, Tensor? bias=None, str activation=\"none\") -> (Tensor output, Tensor pre_activation)");
  // rms_norm plus rstd = 1/sqrt(mean(x²) + eps) over the normalized dims, [*] in float32 (float64 for float64)
  m.def("_rms_norm_forward(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor rstd)");
  // residual_out = input + residual; output = rms_norm(residual_out, normalized_shape, weight, eps)
  m.def("fused_add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor residual_out)");
  // y = act(input · weightᵀ + bias); input (*, K), weight (N, K), bias (N,); activation in none, relu, gelu, gelu_tanh, silu
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None, str activation=\"none\") -> Tensor");
  // (grad_input, grad_weight, grad_bias) of linear, each only if its output_mask entry is set; grad_bias in
  // bias_dtype (the forward's bias dtype; input's dtype when None); pre_activation (the forward's z, or for relu its
  // output) required unless activation is none
  m.def("linear_backward(Tensor grad_output, Tensor input, Tensor weight, bool[3] output_mask, ScalarType? bias_dtype=None, str activation=\"none\", Tensor? pre_activation=None) -> (Tensor, Tensor, Tensor)");
  // y = input / sqrt(mean(input², over normalized dims) + eps) · weight; eps=None: float32's machine eps (float64's for float64)
  m.def("rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor");
  // (grad_input, grad_weight) of rms_norm from the saved rstd (normalized dims = input's dims after rstd's), each only if its output_mask entry is set
  m.def("rms_norm_backward(Tensor grad_output, Tensor input, Tensor rstd, Tensor? weight, bool[2] output_mask) -> (Tensor, Tensor)");
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
  // y = silu(gate) · up, gate and up of one shape
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  // (grad_gate, grad_up) of swiglu in one fused pass
  m.def("swiglu_backward(Tensor grad_output, Tensor gate, Tensor up) -> (Tensor, Tensor)");
  // ---- linear_cross_entropy (issue 10) ----
  // loss = cross_entropy(cap(input · linear_weightᵀ + linear_bias), target, weight, reduction, ignore_index, label_smoothing)
  // + z_loss · logsumexp² per valid token, cap(x) = softcap · tanh(x / softcap); input (*, H), linear_weight (V, H),
  // target (*) int64; computed in token chunks of chunk_size rows (None: from a memory budget), never all [*, V] logits
  m.def("linear_cross_entropy(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? weight=None, str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None, int? chunk_size=None) -> Tensor");
  // linear_cross_entropy plus stats (*, 2) float32 (float64 for float64): per token the row max m of the capped
  // logits and r = log Σ exp(z − m) (logsumexp = m + r), for the backward
  m.def("_linear_cross_entropy_forward(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? weight=None, str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None, int? chunk_size=None) -> (Tensor loss, Tensor stats)");
  // (grad_input, grad_linear_weight, grad_linear_bias) of linear_cross_entropy, each only if its output_mask entry is
  // set; grad_output () for mean/sum, (*) for none; logits recomputed per chunk from stats; dW, db accumulated in fp32
  m.def("linear_cross_entropy_backward(Tensor grad_output, Tensor input, Tensor linear_weight, Tensor target, Tensor stats, Tensor? linear_bias, Tensor? weight, str reduction, int ignore_index, float label_smoothing, float z_loss, float? softcap, bool[3] output_mask, int? chunk_size=None) -> (Tensor, Tensor, Tensor)");
}
