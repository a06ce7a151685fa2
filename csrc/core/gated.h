// The gated activations of transformer MLPs, y = act(gate) · up (Shazeer 2020, "GLU Variants Improve Transformer"):
// swiglu (act = silu) and geglu (act = gelu, erf or tanh form). One engine serves both: the checkers and Meta
// kernels here, the CPU kernels in core/gated_cpu.h and the CUDA kernels in core/gated_cuda.cuh, each a template
// over core/activation.h's Activation that an op family instantiates for its activation. Every op comes in two
// forms: (gate, up) of one shape, and packed, one (*, 2I) tensor input = [gate | up] whose gradient is one tensor.
//
// Mixed dtypes: gate (or input) plays input's role (core/check.h's to_input_dtype): up and grad_output are
// converted to its dtype, up's gradient is returned in up's dtype.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

namespace opforge {

/// Validates (gate, up) of the gated op `op` ("swiglu", "geglu", or their backward's name): floating dtypes, same
/// device, same shape. Returns gate as given and up in gate's dtype (a conversion copies), layouts untouched: each
/// backend makes them contiguous or reads them through core/layout.h's row_view. Symbolic-shape safe.
std::pair<at::Tensor, at::Tensor> check_gated(const char* op, const at::Tensor& gate, const at::Tensor& up);

/// Validates (grad_output, gate, up) of the backward op `op` ("swiglu_backward"): check_gated's rules, and
/// grad_output of gate's shape and device. Returns all three in gate's dtype, layouts untouched (as check_gated).
std::tuple<at::Tensor, at::Tensor, at::Tensor> check_gated_backward(const char* op, const at::Tensor& grad_output,
                                                                    const at::Tensor& gate, const at::Tensor& up);

/// Validates input of a packed gated op (`op`: the op named in errors): floating, at least 1-D, last dimension even
/// (2I). Returns I. Symbolic-shape safe.
c10::SymInt check_gated_packed(const char* op, const at::Tensor& input);

/// input's sizes with the last dimension halved: the shape (*, I) of a packed op's output and grad_output.
c10::SymDimVector gated_packed_output_shape(const at::Tensor& input);

/// Validates (grad_output, input) of a packed backward op `op` ("swiglu_packed_backward"): check_gated_packed's
/// rules, grad_output floating, on input's device, of shape (*, I). Returns (grad_output in input's dtype, I),
/// layouts untouched.
std::pair<at::Tensor, c10::SymInt> check_gated_packed_backward(const char* op, const at::Tensor& grad_output,
                                                               const at::Tensor& input);

// Meta kernels: the checker named `op`, then empty outputs with the real kernels' shapes, dtypes and strides
// (contiguous; grad_up in up's dtype).
at::Tensor gated_meta(const char* op, const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> gated_backward_meta(const char* op, const at::Tensor& grad_output,
                                                       const at::Tensor& gate, const at::Tensor& up);
at::Tensor gated_packed_meta(const char* op, const at::Tensor& input);
/// The packed *_amax ops' Meta kernel: gated_packed_meta's output and amax [1], float32 (float64 for float64 input).
std::tuple<at::Tensor, at::Tensor> gated_packed_amax_meta(const char* op, const at::Tensor& input);
at::Tensor gated_packed_backward_meta(const char* op, const at::Tensor& grad_output, const at::Tensor& input);

}  // namespace opforge
