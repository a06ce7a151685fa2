// Every opforge schema, one commented line each. Their order means nothing to the dispatcher: the ops of linear,
// rms_norm, rope, the elementwise family and swiglu come roughly by name (private forward ops first), with
// fake_quant_linear's block among them; linear_cross_entropy and the linear variants (linear_cat, indexed_linear)
// follow in blocks of their own, and linear_cross_entropy's _linear_cross_entropy_scale_grads comes last.
// Kernels are registered beside each op (csrc/ops/<op>/): CPU and CUDA in <op>_cpu.cpp / <op>_cuda.cu, Meta and
// Autograd in <op>.cpp. Argument names follow torch.nn.functional.
#include <torch/library.h>

TORCH_LIBRARY(opforge, m) {
  // fused_add_rms_norm plus rstd = 1/sqrt(mean(z²) + eps) over the normalized dims, [*] in float32 (float64 for float64)
  m.def("_fused_add_rms_norm_forward(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor residual_out, Tensor rstd)");
  // linear plus its pre-activation z = input · weightᵀ + bias (a new tensor), for autograd
  m.def("_linear_forward(Tensor input, Tensor weight, Tensor? bias=None, str activation=\"none\") -> (Tensor output, Tensor pre_activation)");
  // swiglu_linear plus its pre-activation z = input · weightᵀ + bias (*, 2I, a new tensor), for autograd
  m.def("_swiglu_linear_forward(Tensor input, Tensor weight, Tensor? bias=None) -> (Tensor output, Tensor pre_activation)");
  // rms_norm plus rstd = 1/sqrt(mean(x²) + eps) over the normalized dims, [*] in float32 (float64 for float64)
  m.def("_rms_norm_forward(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor rstd)");
  // _rms_norm_forward plus amax = max |output| as stored ([1] float32, float64 for float64; NaN if any output is NaN, else inf if any is inf; 0 when empty), reduced as the output is written; amax not differentiable (FP8 current scaling of the next GEMM's input)
  m.def("_rms_norm_forward_amax(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor rstd, Tensor amax)");
  // _fused_add_rms_norm_forward plus amax of output (the normed tensor, not residual_out), as _rms_norm_forward_amax's
  m.def("_fused_add_rms_norm_forward_amax(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor residual_out, Tensor rstd, Tensor amax)");
  // input · rstd · weight from a saved rstd (normalized dims = input's dims after rstd's): bitwise the output of
  // _rms_norm_forward / _fused_add_rms_norm_forward for that input (z for the fused op), rstd and weight; not
  // differentiable (opforge.patch recomputes a norm's output with it in backward)
  m.def("_rms_norm_apply(Tensor input, Tensor rstd, Tensor? weight=None) -> Tensor");
  // residual_out = input + residual; output = rms_norm(residual_out, normalized_shape, weight, eps)
  m.def("fused_add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> (Tensor output, Tensor residual_out)");
  // y = act(input · weightᵀ + bias); input (*, K), weight (N, K), bias (N,); activation in none, relu, gelu, gelu_tanh, silu
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None, str activation=\"none\") -> Tensor");
  // (grad_input, grad_weight, grad_bias) of linear, each only if its output_mask entry is set; grad_bias in
  // bias_dtype (the forward's bias dtype; input's dtype when None); pre_activation (the forward's z, or for relu its
  // output) required unless activation is none
  m.def("linear_backward(Tensor grad_output, Tensor input, Tensor weight, bool[3] output_mask, ScalarType? bias_dtype=None, str activation=\"none\", Tensor? pre_activation=None) -> (Tensor, Tensor, Tensor)");
  // ---- fake_quant_linear (csrc/ops/fake_quant_linear) ----
  // fake_quant_linear plus what its backward needs: fq_w(weight) (N, K) in input's dtype, weight's in-range mask (N, K) bool, fq_a(input) (*, K) and its in-range mask (*, K) bool with act_quant (else empty [0] tensors)
  m.def("_fake_quant_linear_forward(Tensor input, Tensor weight, Tensor? bias=None, *, int weight_bits=4, int group_size=-1, bool symmetric=True, bool act_quant=False) -> (Tensor output, Tensor weight_fq, Tensor weight_mask, Tensor input_fq, Tensor input_mask)");
  // y = fq_a(input) · fq_w(weight)ᵀ + bias; fq_w: weight_bits-bit per channel (group_size -1), per tensor (0) or per group of group_size columns, symmetric or not; fq_a: per-token asymmetric int8 when act_quant
  m.def("fake_quant_linear(Tensor input, Tensor weight, Tensor? bias=None, *, int weight_bits=4, int group_size=-1, bool symmetric=True, bool act_quant=False) -> Tensor");
  // (grad_input, grad_weight, grad_bias) of fake_quant_linear from the GEMM's input and weight (fq_a(input), fq_w(weight)) and the in-range masks (straight-through estimator): grad_input masked by input_mask (if given), grad_weight by weight_mask, in weight_dtype; each only if its output_mask entry is set
  m.def("fake_quant_linear_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor weight_mask, Tensor? input_mask, bool[3] output_mask, ScalarType? weight_dtype=None, ScalarType? bias_dtype=None) -> (Tensor, Tensor, Tensor)");
  // (fq_w(weight) in weight's dtype, in-range mask bool, scale float32, zero_point int32) of a 2-D weight; scale shape (1, 1) per tensor, (N, 1) per channel, (N, K / group_size) per group; not differentiable
  m.def("fake_quantize_weight(Tensor weight, int bits=4, int group_size=-1, bool symmetric=True) -> (Tensor output, Tensor mask, Tensor scale, Tensor zero_point)");
  // ---- end fake_quant_linear ----
  // ---- fp8 (csrc/ops/fp8) ----
  // (data, scale): current-scaling FP8 quantization, data = dtype(clamp(float32(input) · scale, ±fp8_max)) rounded to nearest even, scale = float32(fp8_max / max(amax, 1e-12)) with amax = max|input| over the tensor ("tensorwise", scale shape []) or over each row of the last dim ("rowwise", scale (*, 1)); dtype float8_e4m3fn (None) or float8_e5m2; not differentiable
  m.def("quantize_fp8(Tensor input, ScalarType? dtype=None, str granularity=\"tensorwise\") -> (Tensor data, Tensor scale)");
  // a weight's FP8 operands for _fp8_linear_quantized in one call: the data of quantize_fp8(weight) and of quantize_fp8(weight.t()) in float8_e4m3fn, each with its dequantization scale 1 / scale, flat (tensorwise: one amax pass and one cast pass write both)
  m.def("_quantize_fp8_weight(Tensor weight, str granularity=\"tensorwise\") -> (Tensor data, Tensor inv_scale, Tensor data_t, Tensor inv_scale_t)");
  // y = deq(q(input)) · deq(q(weight))ᵀ + bias with input, weight quantized by quantize_fp8 to float8_e4m3fn ("tensorwise": one scale each; "rowwise": per token and per output channel), the scaled FP8 GEMM in fp32, output in input's dtype; gradients in FP8 with grad_output in grad_dtype (None: float8_e5m2 tensorwise, float8_e4m3fn rowwise)
  m.def("fp8_linear(Tensor input, Tensor weight, Tensor? bias=None, *, str granularity=\"tensorwise\", ScalarType? grad_dtype=None) -> Tensor");
  // (grad_input, grad_weight, grad_bias) of fp8_linear: grad_input = deq(q(grad_output)) · deq(q(weight)), grad_weight = deq(q(grad_outputᵀ)) · deq(q(inputᵀ))ᵀ (rowwise: scales along each GEMM's non-contracted dim), grad_bias = Σ_rows grad_output in bias_dtype (fp32 accumulation); each only if its output_mask entry is set
  m.def("fp8_linear_backward(Tensor grad_output, Tensor input, Tensor weight, bool[3] output_mask, str granularity=\"tensorwise\", ScalarType? grad_dtype=None, ScalarType? bias_dtype=None) -> (Tensor, Tensor, Tensor)");
  // fp8_linear's forward for autograd, tensorwise: (output, input_t_data, input_t_inv_scale) with q(inputᵀ) [K, M] in float8_e4m3fn and its one dequantization scale 1 / scale [1] (the forward's q(input) transposed, written by the same pass), saved for grad_weight; weight_data/weight_inv_scale: q(weight) precomputed (quantize_fp8 of weight, the reciprocal of its scale), else quantized here; input_amax: max|input| as a [1] tensor (float32, float64 for a float64 input) from the kernel that wrote input, used instead of the amax pass (the same bits)
  m.def("_fp8_linear_forward(Tensor input, Tensor weight, Tensor? bias=None, Tensor? weight_data=None, Tensor? weight_inv_scale=None, *, str granularity=\"tensorwise\", ScalarType? grad_dtype=None, Tensor? input_amax=None) -> (Tensor output, Tensor input_t_data, Tensor input_t_inv_scale)");
  // fp8_linear with the weight's operands precomputed: weight_data and weight_t_data the data of quantize_fp8(weight, e4m3, granularity) and of quantize_fp8(weight.t(), ...), weight_inv_scale and weight_t_inv_scale the reciprocals of their scales, flat (_quantize_fp8_weight's outputs); bit-identical to fp8_linear; gradients to input, weight (the high-precision parameter) and bias, none to the quantized operands; input_amax (tensorwise): max|input| given, as _fp8_linear_forward's, saved with input under save_input for the backward's q(inputᵀ); no gradient
  m.def("_fp8_linear_quantized(Tensor input, Tensor weight, Tensor weight_data, Tensor weight_inv_scale, Tensor weight_t_data, Tensor weight_t_inv_scale, Tensor? bias=None, *, str granularity=\"tensorwise\", ScalarType? grad_dtype=None, bool save_input=False, Tensor? input_amax=None) -> Tensor");
  // fp8_linear_backward reading saved quantized operands: grad_weight's GEMM takes q(inputᵀ) (input_t_data, input_t_inv_scale = 1 / its scale) when given, else quantizes input; grad_input's takes q(weightᵀ) (weight_t_data, weight_t_inv_scale) when given, else quantizes weight; grad_input in input's dtype and shape (grad_output's dtype, (*, K), without input); input_amax (tensorwise, with input): max|input| given for q(inputᵀ), as _fp8_linear_forward's
  m.def("_fp8_linear_quantized_backward(Tensor grad_output, Tensor? input, Tensor? input_t_data, Tensor? input_t_inv_scale, Tensor weight, Tensor? weight_t_data, Tensor? weight_t_inv_scale, bool[3] output_mask, str granularity=\"tensorwise\", ScalarType? grad_dtype=None, ScalarType? bias_dtype=None, *, Tensor? input_amax=None) -> (Tensor, Tensor, Tensor)");
  // ---- end fp8 ----
  // y = input / sqrt(mean(input², over normalized dims) + eps) · weight; eps=None: float32's machine eps (float64's for float64)
  m.def("rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) -> Tensor");
  // (grad_input, grad_weight) of rms_norm from the saved rstd (normalized dims = input's dims after rstd's), each only if its output_mask entry is set
  m.def("rms_norm_backward(Tensor grad_output, Tensor input, Tensor rstd, Tensor? weight, bool[2] output_mask) -> (Tensor, Tensor)");
  // (q_out, k_out): rotary position embedding of q (batch, q_heads, seq, head_dim) and k (batch, kv_heads, seq, head_dim),
  // any strides, with cos/sin (seq, R), (batch or 1, seq, R) or (batch or 1, 1, seq, R) as transformers passes them:
  // out = x·cos + rotate(x)·sin on the first R = rotary_dim (-1: cos.size(-1)) dims, pairs (i, i+R/2) or, interleaved, (2i, 2i+1); dims past R copied
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin, *, bool interleaved=False, int rotary_dim=-1) -> (Tensor q_out, Tensor k_out)");
  // (grad_q, grad_k) of rope: the transpose (rotation by −θ); each computed only when its gradient is given
  m.def("rope_backward(Tensor? grad_q_out, Tensor? grad_k_out, Tensor cos, Tensor sin, *, bool interleaved=False, int rotary_dim=-1) -> (Tensor grad_q, Tensor grad_k)");
  // rope with θ_i = position_ids · base^(−2i/R) computed in float64 in the kernel; position_ids (seq,) or (batch or 1, seq); R = rotary_dim (-1: head_dim)
  m.def("rope_from_positions(Tensor q, Tensor k, Tensor position_ids, float base=10000., *, bool interleaved=False, int rotary_dim=-1) -> (Tensor q_out, Tensor k_out)");
  // (grad_q, grad_k) of rope_from_positions: the rotation by −θ; each computed only when its gradient is given
  m.def("rope_from_positions_backward(Tensor? grad_q_out, Tensor? grad_k_out, Tensor position_ids, float base=10000., *, bool interleaved=False, int rotary_dim=-1) -> (Tensor grad_q, Tensor grad_k)");
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
  // y = silu(input[..., :I]) · input[..., I:], input (*, 2I) the packed [gate | up] halves -> (*, I)
  m.def("swiglu_packed(Tensor input) -> Tensor");
  // swiglu_packed plus amax = max |output| as stored, as _rms_norm_forward_amax's (reduced as the output is written; not differentiable)
  m.def("_swiglu_packed_amax(Tensor input) -> (Tensor output, Tensor amax)");
  // grad_input (*, 2I) of swiglu_packed, both halves written in one fused pass
  m.def("swiglu_packed_backward(Tensor grad_output, Tensor input) -> Tensor");
  // y = silu(z[..., 0::2]) · z[..., 1::2], z = input · weightᵀ + bias; input (*, K), weight (2I, K) with the gate's and
  // the up projection's rows interleaved (row 2j gate j, row 2j + 1 up j), bias (2I,); y (*, I)
  m.def("swiglu_linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  // (grad_input, grad_weight, grad_bias) of swiglu_linear, each only if its output_mask entry is set; pre_activation
  // the forward's z (*, 2I); grad_bias in bias_dtype (the forward's bias dtype; input's dtype when None)
  m.def("swiglu_linear_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor pre_activation, bool[3] output_mask, ScalarType? bias_dtype=None) -> (Tensor, Tensor, Tensor)");
  // ---- geglu (csrc/ops/geglu; the gated engine of swiglu, csrc/core/gated.h) ----
  // y = gelu(gate, approximate) · up, gate and up of one shape; approximate "none" (erf) or "tanh", as F.gelu
  m.def("geglu(Tensor gate, Tensor up, str approximate=\"none\") -> Tensor");
  // (grad_gate, grad_up) of geglu in one fused pass
  m.def("geglu_backward(Tensor grad_output, Tensor gate, Tensor up, str approximate=\"none\") -> (Tensor, Tensor)");
  // y = gelu(input[..., :I], approximate) · input[..., I:], input (*, 2I) the packed [gate | up] halves -> (*, I)
  m.def("geglu_packed(Tensor input, str approximate=\"none\") -> Tensor");
  // grad_input (*, 2I) of geglu_packed, both halves written in one fused pass
  m.def("geglu_packed_backward(Tensor grad_output, Tensor input, str approximate=\"none\") -> Tensor");
  // ---- linear_cross_entropy (csrc/ops/linear_cross_entropy) ----
  // loss = cross_entropy(cap(input · linear_weightᵀ + linear_bias), target, weight, reduction, ignore_index, label_smoothing)
  // + z_loss · logsumexp² per valid token, cap(x) = softcap · tanh(x / softcap); input (*, H), linear_weight (V, H),
  // target (*) int64; computed in token chunks of chunk_size rows (None: from a memory budget), never all [*, V] logits
  m.def("linear_cross_entropy(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? weight=None, str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None, int? chunk_size=None) -> Tensor");
  // linear_cross_entropy plus stats (*, 2) float32 (float64 for float64): per token the row max m of the capped
  // logits and r = log Σ exp(z − m) (logsumexp = m + r), for the backward; and, where grad_mask asks, the gradients
  // (grad_input, grad_linear_weight, grad_linear_bias) of loss.sum() computed in the same chunk loop (undefined
  // where not asked; the autograd of linear_cross_entropy uses them for reduction "mean" and "sum")
  m.def("_linear_cross_entropy_forward(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? weight=None, str reduction=\"mean\", int ignore_index=-100, float label_smoothing=0.0, float z_loss=0.0, float? softcap=None, int? chunk_size=None, bool[3] grad_mask=[False, False, False]) -> (Tensor loss, Tensor stats, Tensor grad_input, Tensor grad_linear_weight, Tensor grad_linear_bias)");
  // (grad_input, grad_linear_weight, grad_linear_bias) of linear_cross_entropy, each only if its output_mask entry is
  // set; grad_output () for mean/sum, (*) for none; logits recomputed per chunk from stats; dW, db accumulated in fp32
  m.def("linear_cross_entropy_backward(Tensor grad_output, Tensor input, Tensor linear_weight, Tensor target, Tensor stats, Tensor? linear_bias, Tensor? weight, str reduction, int ignore_index, float label_smoothing, float z_loss, float? softcap, bool[3] output_mask, int? chunk_size=None) -> (Tensor, Tensor, Tensor)");
  // ---- linear_log_probs (csrc/ops/linear_cross_entropy: linear_cross_entropy's chunk engine, another row function) ----
  // (log_probs, entropy): log p(target) = z_target − logsumexp(z) per token, z = cap(input · linear_weightᵀ +
  // linear_bias) / temperature, and with return_entropy −Σ_j p_j log p_j (else entropy is an empty (0,) tensor);
  // 0 where target == ignore_index; float32 (float64 for float64); in token chunks, never all [*, V] logits
  m.def("linear_log_probs(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, float temperature=1.0, int ignore_index=-100, float? softcap=None, bool return_entropy=False, int? chunk_size=None) -> (Tensor log_probs, Tensor entropy)");
  // linear_log_probs plus stats (*, 2) float32 (float64 for float64): per token (m, r) of the scaled logits, as
  // _linear_cross_entropy_forward's, for the backward
  m.def("_linear_log_probs_forward(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, float temperature=1.0, int ignore_index=-100, float? softcap=None, bool return_entropy=False, int? chunk_size=None) -> (Tensor log_probs, Tensor entropy, Tensor stats)");
  // (grad_input, grad_linear_weight, grad_linear_bias) of linear_log_probs for per-token grad_log_probs and
  // grad_entropy (either undefined: none through it), each only if its output_mask entry is set; logits recomputed
  // per chunk from stats (and the forward's entropy, for grad_entropy)
  m.def("linear_log_probs_backward(Tensor? grad_log_probs, Tensor? grad_entropy, Tensor input, Tensor linear_weight, Tensor target, Tensor stats, Tensor? entropy, Tensor? linear_bias, float temperature, int ignore_index, float? softcap, bool[3] output_mask, int? chunk_size=None) -> (Tensor, Tensor, Tensor)");
  // ---- linear_jsd (csrc/ops/linear_cross_entropy: the chunk engine with a teacher head, two logits GEMMs a chunk) ----
  // generalised JSD between the student's softmax((input · linear_weightᵀ + linear_bias) / temperature) and the
  // teacher's, per token (β 0: KL(teacher ‖ student), 1: KL(student ‖ teacher), else β KL(t ‖ m) + (1 − β) KL(s ‖ m),
  // m = β p_t + (1 − β) p_s), summed or averaged over the tokens whose target is not ignore_index (all without target)
  m.def("linear_jsd(Tensor input, Tensor linear_weight, Tensor teacher_input, Tensor teacher_linear_weight, Tensor? target=None, Tensor? linear_bias=None, Tensor? teacher_linear_bias=None, float beta=0.5, float temperature=1.0, int ignore_index=-100, str reduction=\"mean\", int? chunk_size=None) -> Tensor");
  // linear_jsd plus, where grad_mask asks, the student's gradients (grad_input, grad_linear_weight, grad_linear_bias)
  // of the loss computed in the same chunk loop (undefined where not asked); its autograd scales them by grad_output
  // (_linear_cross_entropy_scale_grads)
  m.def("_linear_jsd_forward(Tensor input, Tensor linear_weight, Tensor teacher_input, Tensor teacher_linear_weight, Tensor? target=None, Tensor? linear_bias=None, Tensor? teacher_linear_bias=None, float beta=0.5, float temperature=1.0, int ignore_index=-100, str reduction=\"mean\", int? chunk_size=None, bool[3] grad_mask=[False, False, False]) -> (Tensor loss, Tensor grad_input, Tensor grad_linear_weight, Tensor grad_linear_bias)");
  // ---- linear_preference_loss (csrc/ops/linear_cross_entropy: the chunk engine over whole (chosen, rejected) pairs) ----
  // opforge.losses.linear_preference_loss's DPO-family loss (loss_type sigmoid, ipo, hinge, robust, simpo, cpo, orpo)
  // from the policy head, the reference's log-probabilities given or from its head: (loss, policy_logps (2B,),
  // ref_logps (2B,) from the reference head, else empty), float32 (float64 for float64); only the loss differentiable
  m.def("_linear_preference_loss(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? ref_input=None, Tensor? ref_linear_weight=None, Tensor? ref_linear_bias=None, Tensor? ref_chosen_logps=None, Tensor? ref_rejected_logps=None, str loss_type=\"sigmoid\", float beta=0.1, float label_smoothing=0.0, float simpo_gamma=0.5, float cpo_alpha=1.0, float temperature=1.0, int ignore_index=-100, int? chunk_size=None) -> (Tensor loss, Tensor policy_logps, Tensor ref_logps)");
  // _linear_preference_loss plus, where grad_mask asks, the loss's (grad_input, grad_linear_weight, grad_linear_bias)
  // computed in the same chunk loop (undefined where not asked); its autograd scales them by grad_output
  m.def("_linear_preference_forward(Tensor input, Tensor linear_weight, Tensor target, Tensor? linear_bias=None, Tensor? ref_input=None, Tensor? ref_linear_weight=None, Tensor? ref_linear_bias=None, Tensor? ref_chosen_logps=None, Tensor? ref_rejected_logps=None, str loss_type=\"sigmoid\", float beta=0.1, float label_smoothing=0.0, float simpo_gamma=0.5, float cpo_alpha=1.0, float temperature=1.0, int ignore_index=-100, int? chunk_size=None, bool[3] grad_mask=[False, False, False]) -> (Tensor loss, Tensor policy_logps, Tensor ref_logps, Tensor grad_input, Tensor grad_linear_weight, Tensor grad_linear_bias)");
  // ---- linear variants: linear_cat, indexed_linear (csrc/ops/linear_cat, csrc/ops/indexed_linear) ----
  // y = linear(cat(inputs, -1), weight, bias) without the concatenated buffer; inputs (*, K_i) of one leading shape, weight (N, ΣK_i), bias (N,)
  m.def("linear_cat(Tensor[] inputs, Tensor weight, Tensor? bias=None) -> Tensor");
  // (grad_inputs (one per input, an empty list unless output_mask[0]), grad_weight, grad_bias in bias_dtype) of linear_cat
  m.def("linear_cat_backward(Tensor grad_output, Tensor[] inputs, Tensor weight, bool[3] output_mask, ScalarType? bias_dtype=None) -> (Tensor[] grad_inputs, Tensor grad_weight, Tensor grad_bias)");
  // y[t] = input[t] · weight[index[t]]ᵀ + bias[index[t]]; input (T, K), weight (E, N, K), index (T,) int64 (−1: a zero row), bias (E, N)
  m.def("indexed_linear(Tensor input, Tensor weight, Tensor index, Tensor? bias=None, *, bool index_sorted=False) -> Tensor");
  // (grad_input, grad_weight, grad_bias in bias_dtype) of indexed_linear, each only if its output_mask entry is set; experts without tokens get zeros
  m.def("indexed_linear_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor index, bool[3] output_mask, ScalarType? bias_dtype=None, *, bool index_sorted=False) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
  // the backward of the gradient-in-forward path: each defined gradient the forward computed, times the scalar
  // grad_output (in the gradient's dtype); not differentiable (double backward raises lazily)
  m.def("_linear_cross_entropy_scale_grads(Tensor grad_output, Tensor? grad_input, Tensor? grad_linear_weight, Tensor? grad_linear_bias) -> (Tensor, Tensor, Tensor)");
}
