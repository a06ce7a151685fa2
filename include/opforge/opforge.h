// opforge: the public C++ API.
//
// Each function enters PyTorch's dispatcher (torch.ops.opforge.<op> from Python), so a C++ program
// gets the same CPU/CUDA kernels, the same checks and the same autograd as Python. Link the target
// opforge::opforge from find_package(opforge); the ops are registered when libopforge.so loads.
//
// dtypes: float64, float32, float16, bfloat16 for every tensor argument; anything else raises
// c10::Error ("opforge::<op>: expected ... but got ..."). Mixed dtypes: the output takes input's
// dtype; a parameter of another floating dtype is converted to it, and the parameter's gradient comes
// back in the parameter's own dtype. Any strides, zero-size tensors, any CUDA device.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace opforge {

/// y = act(input · weightᵀ + bias); with activation "none" (the default) torch.nn.functional.linear.
/// input (*, K), weight (N, K), bias (N,) or none -> (*, N) in input's dtype.
/// activation: "none", "relu", "gelu" (erf form), "gelu_tanh" (tanh approximation) or "silu".
/// Raises: weight not 2-D, K mismatch, bias not of shape (N,), non-floating dtypes, different devices,
/// an unknown activation (ValueError naming the allowed values and the given one).
at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias = std::nullopt, c10::string_view activation = "none");

/// linear's forward for autograd: (output, pre_activation), both (*, N) in input's dtype and contiguous;
/// pre_activation = input · weightᵀ + bias (a separate tensor even for activation "none").
std::tuple<at::Tensor, at::Tensor> _linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                                   const std::optional<at::Tensor>& bias,
                                                   c10::string_view activation);

/// Gradients of linear: (grad_input (*, K), grad_weight (N, K), grad_bias (N,)) for grad_output (*, N);
/// entry i is computed only when output_mask[i] (else undefined). grad_input takes input's dtype,
/// grad_weight weight's dtype, grad_bias bias_dtype (pass the forward bias's dtype; input's dtype when
/// nullopt). The linear has no bias argument here: grad_bias = Σ_rows grad_z, accumulated in fp32.
/// activation (as in linear) with pre_activation (*, N) = the forward's input · weightᵀ + bias (for
/// "relu" the forward's output may be passed instead: relu'(z) = [z > 0] = [relu(z) > 0]); required
/// unless activation is "none". grad_z = grad_output · act'(pre_activation), in fp32 math.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype = std::nullopt, c10::string_view activation = "none",
    const std::optional<at::Tensor>& pre_activation = std::nullopt);

/// y = input / sqrt(mean(input², over the normalized dims) + eps) · weight  (torch.nn.functional.rms_norm).
/// input (*, normalized_shape...), weight normalized_shape or none -> input's shape, in input's dtype.
/// eps = none: float32's machine epsilon (float64's for float64 input), as torch's rms_norm computes.
/// Raises: normalized_shape empty or not input's trailing dims, weight of another shape, non-floating dtypes.
at::Tensor rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                    const std::optional<at::Tensor>& weight = std::nullopt, std::optional<double> eps = std::nullopt);

/// (output, residual_out): residual_out = input + residual, output = rms_norm(residual_out, ...), in one pass.
/// input, residual (*, normalized_shape...); residual converted to input's dtype; both outputs in input's dtype.
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& input, const at::Tensor& residual,
                                                      at::IntArrayRef normalized_shape,
                                                      const std::optional<at::Tensor>& weight = std::nullopt,
                                                      std::optional<double> eps = std::nullopt);

/// rms_norm's forward for autograd: (output, rstd), rstd (*) = 1/sqrt(mean(x²) + eps) per row, float32
/// (float64 for float64 input).
std::tuple<at::Tensor, at::Tensor> _rms_norm_forward(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                     const std::optional<at::Tensor>& weight,
                                                     std::optional<double> eps);

/// fused_add_rms_norm's forward for autograd: (output, residual_out, rstd), rstd (*) as in _rms_norm_forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> _fused_add_rms_norm_forward(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps);

/// _rms_norm_forward plus amax = max |output| over the output as stored: (output, rstd, amax), amax [1] float32
/// (float64 for float64 input) on output's device; NaN if any output is NaN, else inf if any is inf; 0 when empty.
/// Outputs other than amax bitwise those of _rms_norm_forward; amax not differentiable (FP8 current scaling).
std::tuple<at::Tensor, at::Tensor, at::Tensor> _rms_norm_forward_amax(const at::Tensor& input,
                                                                      c10::SymIntArrayRef normalized_shape,
                                                                      const std::optional<at::Tensor>& weight,
                                                                      std::optional<double> eps);

/// _fused_add_rms_norm_forward plus amax of output (the normed tensor, not residual_out), as _rms_norm_forward_amax's:
/// (output, residual_out, rstd, amax).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _fused_add_rms_norm_forward_amax(
    const at::Tensor& input, const at::Tensor& residual, c10::SymIntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight, std::optional<double> eps);

/// Gradients of rms_norm from the saved rstd (*): (grad_input of input's shape and dtype, grad_weight of
/// weight's shape and dtype, accumulated over rows in float32); entry i only when output_mask[i]. The
/// normalized dims are input's dims after rstd's.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                     const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                                     std::array<bool, 2> output_mask);

/// y = 1 / (1 + exp(-input)), elementwise; same shape and dtype as input; fp32 math for fp16/bf16.
/// Saturates to exactly 0 and 1, never NaN for finite or infinite input.
at::Tensor sigmoid(const at::Tensor& input);

/// grad_input = grad_output · output · (1 − output), where output = sigmoid(input); same shapes.
at::Tensor sigmoid_backward(const at::Tensor& grad_output, const at::Tensor& output);

/// y = input², elementwise; same shape and dtype as input.
at::Tensor square(const at::Tensor& input);

/// grad_input = 2 · input · grad_output; same shapes.
at::Tensor square_backward(const at::Tensor& grad_output, const at::Tensor& input);

/// y = input² + other, with other broadcastable to input's shape; output has input's shape and dtype.
at::Tensor square_add(const at::Tensor& input, const at::Tensor& other);

/// (grad_input = 2 · input · grad_output, grad_other = grad_output summed to other's shape, in other's
/// dtype); entry i computed only when output_mask[i].
std::tuple<at::Tensor, at::Tensor> square_add_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                                       const at::Tensor& other, std::array<bool, 2> output_mask);

/// y = silu(gate) · up = gate · σ(gate) · up (Shazeer 2020, "GLU Variants Improve Transformer").
/// gate and up of one shape (*), floating; output in gate's dtype; fp32 math for fp16/bf16.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

/// (grad_gate, grad_up) of swiglu in one fused pass: with s = σ(gate),
/// grad_gate = grad_output · up · s · (1 + gate · (1 − s)), grad_up = grad_output · gate · s.
std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                   const at::Tensor& up);

/// y = silu(gate) · up over one packed tensor: gate = input[..., :I], up = input[..., I:].
/// input (*, 2I) floating, any strides, last dimension even (ValueError otherwise) -> (*, I) in input's dtype,
/// contiguous; fp32 math for fp16/bf16; bitwise equal to swiglu(gate, up) on the two halves.
at::Tensor swiglu_packed(const at::Tensor& input);

/// swiglu_packed plus amax = max |output| over the output as stored: (output, amax), amax [1] float32 (float64 for
/// float64 input) on output's device; NaN if any output is NaN, else inf if any is inf; 0 when empty. output bitwise
/// swiglu_packed's; amax not differentiable (FP8 current scaling of the down projection's input).
std::tuple<at::Tensor, at::Tensor> _swiglu_packed_amax(const at::Tensor& input);

/// grad_input (*, 2I) of swiglu_packed in one fused pass, contiguous, in input's dtype: with gate, up the halves of
/// input and s = σ(gate), grad_input[..., :I] = grad_output · up · s · (1 + gate · (1 − s)),
/// grad_input[..., I:] = grad_output · gate · s. grad_output (*, I), converted to input's dtype if it differs.
at::Tensor swiglu_packed_backward(const at::Tensor& grad_output, const at::Tensor& input);

// ---- swiglu_linear (csrc/ops/swiglu_linear) ----

/// y = silu(z[..., 0::2]) · z[..., 1::2] with z = input · weightᵀ + bias: a gated MLP's gate and up projections and
/// their SwiGLU, the two projections' rows interleaved in weight (row 2j the gate's row j, row 2j + 1 the up
/// projection's). input (*, K), weight (2I, K), bias (2I,) or none -> (*, I) in input's dtype, contiguous.
at::Tensor swiglu_linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias = std::nullopt);

/// swiglu_linear's forward for autograd: (output (*, I), pre_activation z (*, 2I)), both in input's dtype, contiguous.
std::tuple<at::Tensor, at::Tensor> _swiglu_linear_forward(const at::Tensor& input, const at::Tensor& weight,
                                                          const std::optional<at::Tensor>& bias = std::nullopt);

/// Gradients of swiglu_linear: (grad_input (*, K), grad_weight (2I, K), grad_bias (2I,)) for grad_output (*, I) and
/// the forward's pre_activation (*, 2I); each computed only if its output_mask entry is set (else undefined);
/// grad_bias in bias_dtype (input's dtype when nullopt), accumulated in fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& pre_activation,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype = std::nullopt);
// ---- geglu (csrc/ops/geglu) ----

/// y = gelu(gate) · up, gelu as torch.nn.functional.gelu(gate, approximate): approximate "none" (the erf form,
/// gate · Φ(gate)) or "tanh" (gate/2 · (1 + tanh(√(2/π)(gate + 0.044715 · gate³))), Gemma's gelu_pytorch_tanh);
/// another value raises ValueError. gate and up of one shape (*), floating; output in gate's dtype, contiguous;
/// fp32 math for fp16/bf16 (Shazeer 2020, "GLU Variants Improve Transformer").
at::Tensor geglu(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate = "none");

/// (grad_gate, grad_up) of geglu in one fused pass: grad_gate = grad_output · up · gelu'(gate),
/// grad_up = grad_output · gelu(gate) (in up's dtype).
std::tuple<at::Tensor, at::Tensor> geglu_backward(const at::Tensor& grad_output, const at::Tensor& gate,
                                                  const at::Tensor& up, c10::string_view approximate = "none");

/// y = gelu(gate) · up over one packed tensor: gate = input[..., :I], up = input[..., I:].
/// input (*, 2I) floating, any strides, last dimension even (ValueError otherwise) -> (*, I) in input's dtype,
/// contiguous; bitwise equal to geglu(gate, up, approximate) on the two halves.
at::Tensor geglu_packed(const at::Tensor& input, c10::string_view approximate = "none");

/// grad_input (*, 2I) of geglu_packed in one fused pass, contiguous, in input's dtype:
/// grad_input[..., :I] = grad_output · up · gelu'(gate), grad_input[..., I:] = grad_output · gelu(gate).
/// grad_output (*, I), converted to input's dtype if it differs.
at::Tensor geglu_packed_backward(const at::Tensor& grad_output, const at::Tensor& input,
                                 c10::string_view approximate = "none");

// ---- fake_quant_linear (csrc/ops/fake_quant_linear) ----

/// y = fq_a(input) · fq_w(weight)ᵀ + bias: a linear layer for quantization-aware training.
/// input (*, K), weight (N, K), bias (N,) or none -> (*, N) in input's dtype.
/// fq_w: weight fake-quantized to weight_bits-bit signed integers (2..8) per output channel (group_size -1), per
/// tensor (0) or per group of group_size consecutive columns (a divisor of K), symmetric or asymmetric, with fp32
/// scales from the group's min/max (as torch.fake_quantize_per_channel_affine with MinMaxObserver's qparams).
/// fq_a (act_quant): each row of input fake-quantized to int8, asymmetric, per token; else the identity.
/// Gradients: straight-through estimator with the in-range masks. Raises: linear's errors, weight_bits outside
/// [2, 8], group_size < -1 or not dividing K (ValueError).
at::Tensor fake_quant_linear(const at::Tensor& input, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias = std::nullopt, int64_t weight_bits = 4,
                             int64_t group_size = -1, bool symmetric = true, bool act_quant = false);

/// fake_quant_linear's forward for autograd: (output, weight_fq (N, K) in input's dtype, weight_mask (N, K) bool,
/// input_fq (*, K), input_mask (*, K) bool); without act_quant input_fq and input_mask are empty [0] tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _fake_quant_linear_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t weight_bits,
    int64_t group_size, bool symmetric, bool act_quant);

/// Gradients of fake_quant_linear (straight-through estimator): input = the GEMM's input (fq_a(x), or x),
/// weight = fq_w(W) in input's dtype; grad_input = (grad_output · weight) ⊙ input_mask (if given), grad_weight =
/// (grad_outputᵀ · input) ⊙ weight_mask in weight_dtype (weight's dtype when nullopt), grad_bias = Σ_rows
/// grad_output in bias_dtype (fp32 accumulation). Entry i computed only when output_mask[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> fake_quant_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_mask,
    const std::optional<at::Tensor>& input_mask, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> weight_dtype = std::nullopt, std::optional<at::ScalarType> bias_dtype = std::nullopt);

/// Fake-quantizes a weight (N, K) as fake_quant_linear does: (output in weight's dtype, in-range mask bool,
/// scale float32, zero_point int32), scale/zero_point of shape (1, 1) per tensor (group_size 0), (N, 1) per
/// channel (-1), (N, K / group_size) per group. Not differentiable.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fake_quantize_weight(const at::Tensor& weight,
                                                                                int64_t bits = 4,
                                                                                int64_t group_size = -1,
                                                                                bool symmetric = true);
// ---- end fake_quant_linear ----
// ---- fp8 (csrc/ops/fp8) ----

/// Current-scaling FP8 quantization: (data, scale) with data = dtype(clamp(float32(input) · scale, ±fp8_max))
/// (round to nearest even, saturated), scale = float32(fp8_max / max(amax, 1e-12)), amax = max|input| in float64.
/// input (*, K) float64/float32/float16/bfloat16; dtype float8_e4m3fn (nullopt) or float8_e5m2; granularity
/// "tensorwise" (one scale, shape []) or "rowwise" (one per row of the last dim, shape (*, 1)). data has input's
/// shape, contiguous; input ≈ data / scale. A NaN in a group makes its scale and data NaN; an inf makes its scale 0
/// (finite values quantize to 0, the inf to NaN); an all-zero or empty group gets fp8_max / 1e-12. Not
/// differentiable. Raises: non-floating input (TypeError), another dtype or granularity (ValueError).
std::tuple<at::Tensor, at::Tensor> quantize_fp8(const at::Tensor& input,
                                                std::optional<at::ScalarType> dtype = std::nullopt,
                                                c10::string_view granularity = "tensorwise");

/// y = deq(q(input)) · deq(q(weight))ᵀ + bias: a linear layer computed by an FP8 GEMM.
/// input (*, K), weight (N, K), bias (N,) or none -> (*, N) in input's dtype. q: quantize_fp8 to float8_e4m3fn,
/// "tensorwise" or "rowwise" (input per token, weight per output channel); the GEMM (at::_scaled_mm) accumulates in
/// fp32; rowwise rounds its product to bfloat16 (the scaled GEMM's rowwise output) before the bias. Gradients:
/// fp8_linear_backward with grad_dtype (nullopt: float8_e5m2 tensorwise, float8_e4m3fn rowwise). On CUDA, K and N
/// are padded with zeros to multiples of 16 where the scaled GEMM needs it. Raises: linear's errors, another
/// granularity or grad_dtype (ValueError).
at::Tensor fp8_linear(const at::Tensor& input, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias = std::nullopt,
                      c10::string_view granularity = "tensorwise",
                      std::optional<at::ScalarType> grad_dtype = std::nullopt);

/// Gradients of fp8_linear from the high-precision input (*, K) and weight (N, K): grad_input (*, K) =
/// deq(q(grad_output)) · deq(q(weight)) in input's dtype, grad_weight (N, K) = deq(q(grad_outputᵀ)) ·
/// deq(q(inputᵀ))ᵀ in weight's dtype, grad_bias (N,) = Σ_rows grad_output in bias_dtype (input's dtype when
/// nullopt), fp32 accumulation. grad_output quantized to grad_dtype, input and weight to float8_e4m3fn; rowwise
/// scales run along each GEMM's output dims (grad_output per row for grad_input, per column for grad_weight).
/// Entry i computed only when output_mask[i].
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, std::array<bool, 3> output_mask,
    c10::string_view granularity = "tensorwise", std::optional<at::ScalarType> grad_dtype = std::nullopt,
    std::optional<at::ScalarType> bias_dtype = std::nullopt);

/// fp8_linear's forward for autograd, tensorwise only: (output, input_t_data [K, M] float8_e4m3fn, input_t_inv_scale
/// [1] float32) with output = fp8_linear(input, weight, bias) bit for bit and q(inputᵀ) the transpose of the
/// forward's q(input) (the same scale), written by the same quantization pass, with its dequantization scale
/// 1 / scale: what grad_weight's GEMM reads. With weight_data (quantize_fp8(weight) in float8_e4m3fn) and
/// weight_inv_scale (the reciprocal of its scale, [1]) the weight is not quantized here. Not
/// differentiable (its outputs carry no history: fp8_linear's Autograd kernel calls it below autograd). Raises:
/// fp8_linear's errors, rowwise (ValueError), malformed weight operands (ValueError, TypeError). input_amax: max|input|
/// computed by the kernel that wrote input ([1], float32; float64 for a float64 input; on input's device), which
/// replaces the quantizer's amax pass (the same bits when it is that amax); a malformed one raises TypeError (dtype),
/// ValueError (shape) or RuntimeError (device).
std::tuple<at::Tensor, at::Tensor, at::Tensor> _fp8_linear_forward(
    const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias = std::nullopt,
    const std::optional<at::Tensor>& weight_data = std::nullopt,
    const std::optional<at::Tensor>& weight_inv_scale = std::nullopt, c10::string_view granularity = "tensorwise",
    std::optional<at::ScalarType> grad_dtype = std::nullopt,
    const std::optional<at::Tensor>& input_amax = std::nullopt);

/// The weight operands of _fp8_linear_quantized for a 2-D weight (N, K), in float8_e4m3fn: (data (N, K), inv_scale,
/// data_t (K, N), inv_scale_t): data and data_t the bits of quantize_fp8(weight, float8_e4m3fn, granularity) and of
/// quantize_fp8(weight.t(), float8_e4m3fn, granularity), inv_scale and inv_scale_t the reciprocals of their scales
/// (IEEE division: the bits of scale.reciprocal(); the dequantization scales the scaled GEMMs read), flat float32
/// (1 element each tensorwise; N and K rowwise). Tensorwise, one amax pass and one cast pass write both. Not
/// differentiable. Raises: a weight that is not 2-D (ValueError) or not floating (TypeError), another granularity
/// (ValueError).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _quantize_fp8_weight(
    const at::Tensor& weight, c10::string_view granularity = "tensorwise");

/// fp8_linear(input, weight, bias, granularity, grad_dtype) with the weight's quantized operands precomputed:
/// weight_data (N, K) and weight_t_data (K, N) the data of quantize_fp8(weight, float8_e4m3fn, granularity) and of
/// quantize_fp8(weight.t(), ...), weight_inv_scale (1 or N elements) and weight_t_inv_scale (1 or K elements) the
/// reciprocals of their scales (the dequantization scales the GEMMs read), as _quantize_fp8_weight returns them.
/// Bit-identical to fp8_linear for those operands (forward and gradients); gradients flow to input, weight and bias,
/// none to the quantized operands. save_input: autograd saves the input for backward, which quantizes inputᵀ from
/// it there (the bits the forward would have kept), instead of the forward's q(inputᵀ) (kept tensorwise with a
/// weight gradient): saved-tensor hooks that drop a recomputable input (opforge.patch's recompute) then free it.
/// input_amax (tensorwise): max|input| given, as _fp8_linear_forward's; autograd saves it with the input under
/// save_input for the backward's q(inputᵀ); it gets no gradient.
/// Raises: fp8_linear's errors; operands of another dtype (TypeError), shape, scale size or device (ValueError,
/// RuntimeError); input_amax with rowwise scales (ValueError) or malformed (as _fp8_linear_forward's).
at::Tensor _fp8_linear_quantized(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& weight_data,
                                 const at::Tensor& weight_inv_scale, const at::Tensor& weight_t_data,
                                 const at::Tensor& weight_t_inv_scale,
                                 const std::optional<at::Tensor>& bias = std::nullopt,
                                 c10::string_view granularity = "tensorwise",
                                 std::optional<at::ScalarType> grad_dtype = std::nullopt, bool save_input = false,
                                 const std::optional<at::Tensor>& input_amax = std::nullopt);

/// fp8_linear_backward from saved quantized operands: grad_weight's GEMM reads q(inputᵀ) (input_t_data [K, M],
/// input_t_inv_scale = 1 / its scale) when given, else quantizes input; grad_input's GEMM reads q(weightᵀ)
/// (weight_t_data [K, N], weight_t_inv_scale = 1 / its scale) when given, else quantizes weight. The bits of fp8_linear_backward. grad_input has input's
/// shape and dtype, or (*, K) of grad_output's leading dims in grad_output's dtype when input is not given.
/// input_amax (tensorwise, with input): max|input| given for q(inputᵀ), as _fp8_linear_forward's.
/// Raises: fp8_linear_backward's errors; grad_weight asked for with neither input nor input_t_data (ValueError);
/// input_amax without input or with rowwise scales (ValueError) or malformed (as _fp8_linear_forward's).
std::tuple<at::Tensor, at::Tensor, at::Tensor> _fp8_linear_quantized_backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& input,
    const std::optional<at::Tensor>& input_t_data, const std::optional<at::Tensor>& input_t_inv_scale,
    const at::Tensor& weight, const std::optional<at::Tensor>& weight_t_data,
    const std::optional<at::Tensor>& weight_t_inv_scale, std::array<bool, 3> output_mask,
    c10::string_view granularity = "tensorwise", std::optional<at::ScalarType> grad_dtype = std::nullopt,
    std::optional<at::ScalarType> bias_dtype = std::nullopt,
    const std::optional<at::Tensor>& input_amax = std::nullopt);
// ---- end fp8 ----
// ---- linear variants: linear_cat, indexed_linear ----

/// y = linear(cat(inputs, -1), weight, bias) without the concatenated buffer (nor saving it for backward).
/// inputs: P ≥ 1 tensors (*, K_i) of one dtype and one leading shape (*) (K_i may be 0); weight (N, ΣK_i),
/// bias (N,) or none -> (*, N) in the inputs' dtype. The pieces' products are summed in fp32 (fp64 for fp64)
/// with the bias and rounded once.
at::Tensor linear_cat(at::TensorList inputs, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias = std::nullopt);

/// Gradients of linear_cat for grad_output (*, N): (grad_inputs, one per input in its shape and dtype (an empty
/// vector unless output_mask[0]), grad_weight (N, ΣK_i) in weight's dtype, written slice by slice, grad_bias (N,)
/// in bias_dtype (the inputs' dtype when nullopt), Σ_rows in fp32).
std::tuple<std::vector<at::Tensor>, at::Tensor, at::Tensor> linear_cat_backward(
    const at::Tensor& grad_output, at::TensorList inputs, const at::Tensor& weight, std::array<bool, 3> output_mask,
    std::optional<at::ScalarType> bias_dtype = std::nullopt);

/// y[t] = input[t] · weight[index[t]]ᵀ + bias[index[t]]: each token picks its weight from a bank (mixture of
/// experts, multi-LoRA). input (T, K), weight (E, N, K), index (T,) int64, bias (E, N) or none -> (T, N) in
/// input's dtype. index[t] == −1: row t is exactly zero (and gets no gradient). index ≥ E or < −1: an error on
/// CPU (IndexError); on CUDA such a row is treated as −1 (zero row, no gradient, no out-of-bounds read, no host
/// synchronisation). fp32 accumulation.
/// index_sorted: the caller promises the rows in expert order (index non-decreasing over the experts' rows, rows
/// of −1 last), which lets CUDA run the grouped GEMM on the rows in place (no sort, gather or scatter). A broken
/// promise is a ValueError on CPU; on CUDA (which cannot look without a host synchronisation) the rows that break
/// the order come out NaN, never silently wrong.
at::Tensor indexed_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
                          const std::optional<at::Tensor>& bias = std::nullopt, bool index_sorted = false);

/// Gradients of indexed_linear for grad_output (T, N): (grad_input (T, K), grad_weight (E, N, K) in weight's dtype,
/// grad_bias (E, N) in bias_dtype); entry i only when output_mask[i]. Experts that received no token get exactly
/// zero gradients; rows with index −1 get a zero grad_input. index_sorted as indexed_linear's (on CUDA a broken
/// order makes grad_input's misplaced rows and grad_weight / grad_bias NaN).
std::tuple<at::Tensor, at::Tensor, at::Tensor> indexed_linear_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& index,
    std::array<bool, 3> output_mask, std::optional<at::ScalarType> bias_dtype = std::nullopt,
    bool index_sorted = false);
/// (q_out, k_out): rotary position embedding (RoFormer; Hugging Face's apply_rotary_pos_emb) of q (B, Hq, S, D) and
/// k (B, Hk, S, D), any strides, same dtype; outputs in q's / k's dtype and layout (contiguous where the input is
/// not dense). cos, sin: (S, R), (B or 1, S, R) or (B or 1, 1, S, R), floating (a float32 table with bf16 q is
/// used as float32). rotary_dim: -1 (= cos.size(-1)) or R, even, ≤ D. On the first R dims,
/// y[j] = x[j]·cos[j] + rot(x)[j]·sin[j] with rot(x) = (−x[i+R/2], x[i]) (rotate-half) or, when interleaved,
/// pairs (2i, 2i+1): rot(x)[2i] = −x[2i+1], rot(x)[2i+1] = x[2i]; dims past R are copied. fp32 math.
std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin, bool interleaved = false, int64_t rotary_dim = -1);

/// (grad_q, grad_k) of rope: the transpose of its linear map (the rotation by −θ); grad_q computed only when
/// grad_q_out is given (else undefined), likewise grad_k.
std::tuple<at::Tensor, at::Tensor> rope_backward(const std::optional<at::Tensor>& grad_q_out,
                                                 const std::optional<at::Tensor>& grad_k_out, const at::Tensor& cos,
                                                 const at::Tensor& sin, bool interleaved = false,
                                                 int64_t rotary_dim = -1);

/// rope with the angles computed in the kernel: θ_i = position_ids[b, s] · base^(−2i/R), i < R/2, in float64;
/// position_ids (S,) or (B or 1, S) of an integer dtype; rotary_dim -1 (= D) or R, even, ≤ D.
std::tuple<at::Tensor, at::Tensor> rope_from_positions(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& position_ids, double base = 10000.0,
                                                       bool interleaved = false, int64_t rotary_dim = -1);

/// (grad_q, grad_k) of rope_from_positions (the rotation by −θ); each only when its gradient is given.
std::tuple<at::Tensor, at::Tensor> rope_from_positions_backward(const std::optional<at::Tensor>& grad_q_out,
                                                                const std::optional<at::Tensor>& grad_k_out,
                                                                const at::Tensor& position_ids,
                                                                double base = 10000.0, bool interleaved = false,
                                                                int64_t rotary_dim = -1);

// ---- linear_cross_entropy (csrc/ops/linear_cross_entropy) ----
/// Loss of the tokens' logits input · linear_weightᵀ + linear_bias against target, in chunks of tokens (see
/// csrc/ops/linear_cross_entropy/linear_cross_entropy.h for the two autograd paths). input (*, H), linear_weight (V, H), target (*) int64, linear_bias (V,) or none, weight
/// (V,) class weights or none. reduction "mean" | "sum" | "none"; label_smoothing in [0, 1]; z_loss >= 0;
/// softcap > 0 or none; chunk_size rows per chunk (none: from the memory budget / OPFORGE_LCE_CHUNK_SIZE).
/// Returns the loss: () for mean/sum, (*) for none, in float32 (float64 for float64 input; 16-bit input too).
at::Tensor linear_cross_entropy(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                                const std::optional<at::Tensor>& linear_bias = std::nullopt,
                                const std::optional<at::Tensor>& weight = std::nullopt,
                                c10::string_view reduction = "mean", int64_t ignore_index = -100,
                                double label_smoothing = 0.0, double z_loss = 0.0,
                                std::optional<double> softcap = std::nullopt,
                                std::optional<int64_t> chunk_size = std::nullopt);

/// Gradients of linear_cross_entropy: (grad_input (*, H) input's dtype, grad_linear_weight (V, H) in
/// linear_weight's dtype, grad_linear_bias (V,) in linear_bias's dtype), entry k only when output_mask[k] (no
/// V × H buffer at all without grad_linear_weight). grad_output: () for mean/sum, (*) for none (a per-token
/// weight). stats: the forward's (m, r). The logits are recomputed chunk by chunk; dW and db accumulate in fp32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_cross_entropy_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size = std::nullopt);

// ---- linear_log_probs (csrc/ops/linear_cross_entropy, the same chunk engine) ----
/// Per-token log-probability of target under the tokens' logits z = cap(input · linear_weightᵀ + linear_bias) /
/// temperature, log p = z_target − logsumexp(z), and with return_entropy the entropy −Σ p log p, in chunks of
/// tokens (no [*, V] logits). input (*, H), linear_weight (V, H), target (*) int64, linear_bias (V,) or none;
/// temperature > 0; softcap > 0 or none; chunk_size rows per chunk (none: the memory budget). Returns (log_probs
/// (*), entropy (*); an empty (0,) tensor without return_entropy), float32 (float64 for float64 input); 0 where
/// target == ignore_index.
std::tuple<at::Tensor, at::Tensor> linear_log_probs(const at::Tensor& input, const at::Tensor& linear_weight,
                                                    const at::Tensor& target,
                                                    const std::optional<at::Tensor>& linear_bias = std::nullopt,
                                                    double temperature = 1.0, int64_t ignore_index = -100,
                                                    std::optional<double> softcap = std::nullopt,
                                                    bool return_entropy = false,
                                                    std::optional<int64_t> chunk_size = std::nullopt);

/// Gradients of linear_log_probs: (grad_input (*, H) input's dtype, grad_linear_weight (V, H) linear_weight's dtype,
/// grad_linear_bias (V,) linear_bias's dtype), entry k only when output_mask[k]. grad_log_probs (*) and
/// grad_entropy (*) (either may be undefined: no gradient through that output); stats: the forward's (m, r) per
/// token (*, 2); entropy: the forward's entropy (*), required with grad_entropy. Each chunk's logits are recomputed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_log_probs_backward(
    const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& linear_bias, double temperature,
    int64_t ignore_index, std::optional<double> softcap, std::array<bool, 3> output_mask,
    std::optional<int64_t> chunk_size = std::nullopt);

// ---- linear_jsd (csrc/ops/linear_cross_entropy, the same chunk engine, two GEMMs per chunk) ----
/// Generalised Jensen-Shannon divergence between a student head and a teacher head, per token over the vocabulary,
/// without either's [*, V] logits: with p_s = softmax((input · linear_weightᵀ + linear_bias) / T) and p_t the
/// teacher's, β = 0 gives KL(p_t ‖ p_s), β = 1 KL(p_s ‖ p_t), else β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m),
/// m = β p_t + (1 − β) p_s. input (*, H), linear_weight (V, H), teacher_input (*, Ht), teacher_linear_weight (V, Ht),
/// target (*) int64 or none (tokens equal to ignore_index count for nothing), biases (V,) or none; beta in [0, 1];
/// temperature > 0; reduction "mean" (over the counted tokens) | "sum". Returns () float32 (float64 for float64).
/// The teacher gets no gradient.
at::Tensor linear_jsd(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
                      const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target = std::nullopt,
                      const std::optional<at::Tensor>& linear_bias = std::nullopt,
                      const std::optional<at::Tensor>& teacher_linear_bias = std::nullopt, double beta = 0.5,
                      double temperature = 1.0, int64_t ignore_index = -100, c10::string_view reduction = "mean",
                      std::optional<int64_t> chunk_size = std::nullopt);

}  // namespace opforge
