// linear_cross_entropy: the language-model loss cross_entropy(input · linear_weightᵀ + linear_bias, target)
// without materialising the [N, V] logits.
//
//   z[i, j]  = cap(input[i] · linear_weight[j] + linear_bias[j]),  cap(x) = softcap · tanh(x / softcap) (or x)
//   m[i]     = max_j z[i, j];  r[i] = log Σ_j exp(z[i, j] − m[i]);  lse[i] = m[i] + r[i]
//   loss[i]  = (1 − ε) · w[t_i] · (lse[i] − z[i, t_i]) + ε / V · Σ_j w[j] · (lse[i] − z[i, j]) + z_loss · lse[i]²
//              (0 where t_i == ignore_index; w = class weights, all ones when None; ε = label_smoothing)
//   mean     = Σ_i loss[i] / Σ_{i valid} w[t_i];   sum = Σ_i loss[i];   none = loss[i]
//
// Algorithm (CPU and CUDA alike): the N tokens are processed in chunks of `chunk` rows, so at most one chunk of
// logits [chunk, V] (fp32) exists at a time. Per chunk: logits = X_c · Wᵀ (a GEMM, fp32 out), then one row kernel
// computes (m, r) and the loss of every row (forward), or the logit gradient in place (backward, with the
// saved (m, r)), which then feeds dX_c = dZ_c · W and dW += dZ_cᵀ · X_c (fp32 accumulator across chunks) and
// db += Σ_rows dZ_c (fp32). With the knob OPFORGE_LCE_DW_ACCUM=1 and 16-bit parameters of input's dtype, dW and db
// accumulate in that dtype instead (Problem::dw_dtype / db_dtype): the dW GEMM adds into the 16-bit gradient with
// beta = 1 (fp32 math inside, one rounding per GEMM), no fp32 V x H buffer, no final cast.
//
// Lean mode (CUDA, where input, linear_weight and linear_bias share one 16-bit dtype; the default, the knob
// OPFORGE_LCE_LEAN=0 turns it off): the logits chunk is held in that storage dtype instead of fp32. The logits GEMM
// accumulates in fp32, adds the bias in its epilogue and rounds once to bf16/fp16; the row kernels read it with 16-byte
// loads and compute in fp32; the logit gradient overwrites the same buffer in place and feeds the dX and dW GEMMs
// directly (no second [chunk, V] buffer); db sums that 16-bit gradient with fp32 accumulation. dW accumulates in the
// 16-bit gradient itself (beta = 1 GEMMs, fp32 math inside, one rounding per chunk, as OPFORGE_LCE_DW_ACCUM=1), so no
// fp32 V x H buffer exists. The chunk size comes from a 512 MiB budget for the one 16-bit [chunk, V] buffer (two with
// linear_jsd's teacher): 2048 rows at V = 128256 in bf16 (1024 for linear_jsd). Numerics: the logits are rounded to the
// storage dtype before the softmax, as Hugging Face's own lm_head output (and torch.compile's unfused loss over it) is:
// each logit carries a relative error of at most u = 2^-8 for bf16 (2^-11 for fp16: half the dtype's eps), so to first
// order the loss moves by at most u · Σ_j |∂loss/∂z_j| · |z_j| (for the plain cross-entropy row:
// u · (|z_t| + Σ_j p_j |z_j|) per token) and p_j by at most p_j · u · (|z_j| + Σ_k p_k |z_k|); (m, r), the loss and
// every accumulation stay fp32. The logit gradient is rounded to the storage dtype as with OPFORGE_LCE_LEAN=0 (where
// the gradient GEMMs read a 16-bit copy).
//
// Two autograd paths (linear_cross_entropy.cpp, docs/ops/linear_cross_entropy.md):
//   gradient in forward (reduction "mean" / "sum", the default): the forward's chunk loop also computes the logit
//     gradient of the loss (grad_output = 1) and from it dX_c (written once per chunk), dW (fp32 across chunks, cast
//     to linear_weight's dtype at the end) and db, only those whose input requires grad; the node saves these
//     gradients (not the inputs) and its backward multiplies them by the scalar grad_output. 3 GEMMs in all.
//   recompute (reduction "none", where a per-token grad_output is only known in backward; or the knob
//     OPFORGE_LCE_GRAD_IN_FORWARD=0): the forward keeps only (m, r) per token; linear_cross_entropy_backward
//     recomputes each chunk's logits with the given grad_output. 4 GEMMs in all.
#pragma once

#include <ATen/ATen.h>
#include <opforge/opforge.h>
#include <c10/util/string_view.h>

#include <array>
#include <functional>
#include <optional>
#include <tuple>
#include <vector>

namespace opforge {

struct BackwardArgs;  // core/autograd.h

// linear_cross_entropy(...) itself is declared in include/opforge/opforge.h (the public C++ API).


/// linear_cross_entropy's forward for autograd: (loss, stats, grad_input, grad_linear_weight, grad_linear_bias).
/// stats (*, 2) in float32 (float64 for float64 input) holds per token (m, r): the row max of the (capped) logits
/// and log Σ exp(z − m), so lse = m + r (kept apart: with large logit offsets m + r would round away r); ignored
/// tokens get (0, 0). The gradients are those of loss.sum() (the loss itself for "mean" and "sum"), computed in the
/// forward's chunk loop, entry k only when grad_mask[k] (undefined otherwise; grad_linear_bias also undefined
/// without a bias): grad_input (*, H) in input's dtype, grad_linear_weight (V, H) in linear_weight's dtype (fp32
/// accumulation across chunks), grad_linear_bias (V,) in linear_bias's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask = {false, false, false});

// linear_cross_entropy_backward is declared in include/opforge/opforge.h (public C++ API).

/// The backward of the gradient-in-forward path: (grad_output · grad_input, grad_output · grad_linear_weight,
/// grad_output · grad_linear_bias) for the defined ones (undefined where the argument is), each in its own dtype.
/// grad_output: the loss's 0-dim gradient. Not differentiable: differentiating its outputs raises lazily.
std::tuple<at::Tensor, at::Tensor, at::Tensor> _linear_cross_entropy_scale_grads(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_input,
    const std::optional<at::Tensor>& grad_linear_weight, const std::optional<at::Tensor>& grad_linear_bias);

namespace lce {

enum class Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };

/// "none" | "mean" | "sum"; raises ValueError "opforge::<op>: expected reduction to be one of ..." otherwise.
Reduction parse_reduction(const char* op, c10::string_view reduction);
const char* reduction_name(Reduction r);

/// Symbolic-safe checks shared by the real kernels and Meta. Raises ValueError for shapes (input rank 0,
/// linear_weight not 2-D or without rows, H mismatch, target not input's leading dims, bias/weight not (V,)),
/// label_smoothing outside [0, 1], z_loss < 0 or not finite, softcap <= 0, chunk_size < 1, unknown reduction;
/// TypeError for non-floating input/linear_weight/bias/weight or a target that is not int64; RuntimeError for
/// tensors on different devices.
Reduction check_args(const char* op, const at::Tensor& input, const at::Tensor& linear_weight,
                     const at::Tensor& target, const std::optional<at::Tensor>& linear_bias,
                     const std::optional<at::Tensor>& weight, c10::string_view reduction, double label_smoothing,
                     double z_loss, std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// The backward's extra checks (grad_output of the loss's shape, stats (*, 2) in the stats dtype).
Reduction check_backward_args(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight,
                              const at::Tensor& target, const at::Tensor& stats,
                              const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                              c10::string_view reduction, double label_smoothing, double z_loss,
                              std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// dtype of stats, of the logits chunk and of every accumulator: float32 (float64 for float64 input).
at::ScalarType acc_dtype(at::ScalarType input_dtype);

/// Rows per chunk: chunk_size if given, else $OPFORGE_LCE_CHUNK_SIZE (read once per process) if set, else
/// budget_bytes / (V · bytes_per_logit) rounded down to a multiple of 64 (at least 1), at most N.
int64_t resolve_chunk(std::optional<int64_t> chunk_size, int64_t N, int64_t V, int64_t budget_bytes,
                      int64_t bytes_per_logit);

/// Whether a parameter of dtype `param` accumulates its gradient across chunks in its own dtype for input of dtype
/// `input`: the knob OPFORGE_LCE_DW_ACCUM is 1, `param` is float16/bfloat16 and equals `input`.
bool accumulate_in_param_dtype(at::ScalarType param, at::ScalarType input);

/// Whether the chunk loops run in lean mode (see "Lean mode" above): the knob OPFORGE_LCE_LEAN is 1, input is a CUDA
/// tensor of a 16-bit dtype and linear_weight (and linear_bias, when given) share that dtype.
bool lean_mode(const at::Tensor& input, const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias);

/// The canonical problem the kernels see.
struct Problem {
  at::Tensor X;   // [N, H] contiguous, input's dtype
  at::Tensor W;   // [V, H] contiguous, input's dtype
  at::Tensor b;   // [V] contiguous, acc dtype, or undefined
  at::Tensor T;   // [N] int64 contiguous
  at::Tensor cw;  // [V] contiguous, acc dtype, or undefined (class weights)
  int64_t N, H, V;
  Reduction reduction;
  int64_t ignore_index;
  double label_smoothing, z_loss, softcap;  // softcap 0: none
  // the row function's logit scale, z = cap(l + b) · scale: 1 for linear_cross_entropy, 1 / temperature for
  // linear_log_probs
  double scale = 1.0;
  const char* op = "linear_cross_entropy";  // the op named in the kernels' errors (the backward op in a backward)
  // dtypes of the dW and db accumulators across chunks: the acc dtype, or with the knob OPFORGE_LCE_DW_ACCUM=1 the
  // parameter's own dtype where it is 16-bit and equals input's (the GEMMs then add into the returned gradient)
  at::ScalarType dw_dtype = at::kFloat, db_dtype = at::kFloat;
  // lean mode (lean_mode; CUDA only): the logits chunk in input's 16-bit dtype, dW accumulated in that dtype
  // (dw_dtype), the chunk size from the lean budget
  bool lean = false;
};
Problem make_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                     Reduction reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                     std::optional<double> softcap);

/// Σ_{valid i} w[t_i] (the count of valid tokens without class weights), a 0-dim acc-dtype tensor on X's device
/// (no host sync). Out-of-range targets are clamped for the gather (the kernels flag them).
at::Tensor mean_denominator(const Problem& p);

/// The loss from the per-token losses [N] (acc dtype): reshaped to target's shape (none), summed, or summed and
/// divided by mean_denominator (mean: NaN when every target is ignored, as torch's cross_entropy); in the acc dtype
/// (float32; float64 for float64), for 16-bit input too.
at::Tensor reduce_loss(const Problem& p, const at::Tensor& token_loss, const at::Tensor& target);

/// The gradient buffers of a chunk loop (CPU and CUDA): dX [N, H] in input's dtype, dW [V, H] in p.dw_dtype and
/// db [V] in p.db_dtype, each allocated only when its mask entry is set (db only with a bias). db starts at zero; dW
/// too with `zero_dw` (a loop that adds every chunk), else uninitialised (the first chunk's GEMM writes it).
struct GradBuffers {
  at::Tensor dX, dW, db;
  GradBuffers(const Problem& p, std::array<bool, 3> mask, bool zero_dw);
  /// (grad_input in input's shape, grad_linear_weight in linear_weight's dtype, grad_linear_bias in
  /// linear_bias's dtype), each undefined where it was not asked.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> finish(const at::Tensor& input, const at::Tensor& linear_weight,
                                                        const std::optional<at::Tensor>& linear_bias) const;
};

/// The forward's checked problem (CPU and CUDA): check_args, then make_problem.
Problem forward_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                        const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                        c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                        std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// The backward's checked problem (CPU and CUDA): check_backward_args, then make_problem.
Problem backward_problem(const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight,
                         const at::Tensor& target, const at::Tensor& stats,
                         const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
                         c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
                         std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// _linear_cross_entropy_forward's outputs from a backend's results (CPU and CUDA): (reduce_loss of token_loss,
/// stats [N, 2] viewed as target's shape + (2,), then grads.finish's three gradients).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(
    const Problem& p, const at::Tensor& token_loss, const at::Tensor& stats, const GradBuffers& grads,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias);

/// The per-token gradient scale [N] or [1] (acc dtype) from grad_output: grad_output itself for none,
/// grad_output / mean_denominator for mean, grad_output for sum. `stride` is set to 1 ([N]) or 0 ([1]).
at::Tensor grad_scale(const Problem& p, const at::Tensor& grad_output, int64_t& stride);

/// The per-token gradient scale [1] (acc dtype) of the gradient-in-forward path (grad_output = 1 on loss.sum()):
/// 1 / mean_denominator for mean (inf when every target is ignored: those rows' gradients are zeros regardless),
/// 1 for sum and none.
at::Tensor unit_grad_scale(const Problem& p);

/// The gradients one call computes: mask's entries for (input, linear_weight, linear_bias); db only with a bias.
struct GradNeeds {
  bool dx, dw, db;
  GradNeeds(const Problem& p, std::array<bool, 3> mask) : dx(mask[0]), dw(mask[1]), db(mask[2] && p.b.defined()) {}
  /// Whether any gradient is wanted.
  bool any() const { return dx || dw || db; }
};

/// What the backward row function is given per token, besides the saved (m, r). Every backward (recompute) row is
///   dz_j = G ((1 − ε) w_t (p_j − [j = t]) + ε/V (W p_j − w_j) + 2 z_loss (m + r) p_j) − GE p_j ((z_j − m) − Em),
///   dl_j = dz_j · scale · (1 − (cap(l_j + b_j) / cap)²)   (without a softcap: dz_j · scale),
/// the first part the gradient of the row's cross-entropy loss (linear_cross_entropy; with ε = 0, w = 1, z_loss = 0
/// and G = −grad_log_probs that of the log-probability), the second that of the entropy H = −Σ p log p
/// (linear_log_probs), whose Em = E_p[z] − m = r − H.
struct RowGrad {
  at::Tensor G;          // [N] or [1] acc dtype (the loss's per-token scale)
  int64_t g_stride = 0;  // 1 ([N]) or 0 ([1])
  at::Tensor GE;         // [N] acc dtype: the entropy's gradient, or undefined (no entropy term)
  at::Tensor Em;         // [N] acc dtype: r − H per token (with GE)
};

/// A backend's backward chunk loop once the problem is checked: fills `grads` (allocated for `need`).
using BackwardKernel = void (*)(const Problem& p, const RowGrad& g, const at::Tensor& stats, const GradNeeds& need,
                                std::optional<int64_t> chunk_size, const GradBuffers& grads);

/// linear_cross_entropy_backward on one backend (the op's arguments after `kernel` and `zero_dw`): the checked
/// problem, the gradient buffers (dW zeroed when `zero_dw`), `kernel`, then the gradients in the parameters' shapes
/// and dtypes (GradBuffers::finish).
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    BackwardKernel kernel, bool zero_dw, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size);

/// The backward of the gradient-in-forward path (linear_cross_entropy "mean"/"sum", linear_jsd). Saved:
/// grad_input, grad_linear_weight, grad_linear_bias (each undefined where its input needs no gradient) and a 0-dim
/// bool, whether any target counts; edges input, linear_weight, linear_bias. Returns the saved gradients times
/// grad_output (_linear_cross_entropy_scale_grads), grad_output taken as 0 when no target counts (Note [all targets
/// ignored] in linear_cross_entropy.cpp); the saved gradients themselves, scaled in place, when the graph is not
/// kept and no tracer is involved (Note [saved gradients scaled in place]).
std::vector<at::Tensor> saved_grads_backward(const BackwardArgs& a);

/// Gives the gradients a forward computed (gi, gw, gb, undefined allowed) a history that raises
/// "opforge::<op>: double backward is not supported ..." if someone differentiates through them; only when grad mode
/// is on and input, linear_weight or linear_bias requires grad.
void mark_not_differentiable(const char* op, const at::Tensor& gi, const at::Tensor& gw, const at::Tensor& gb,
                             const at::Tensor& input, const at::Tensor& linear_weight,
                             const std::optional<at::Tensor>& linear_bias);

/// A loss whose per-row gradient scale depends on whole groups of rows (linear_preference_loss: a pair's chosen and
/// rejected sequences), its gradient computed in the forward chunk loop all the same. Given one, the loop writes per
/// chunk every row's value and stats (m, r) without a gradient after the logits GEMM and, with `ref`, the reference
/// head's row values into `ref_value` (its own logits GEMM on the same rows, no gradient). When a gradient is wanted
/// and a chunk can hold whole groups (the default chunk, or a chunk_size of at least `group_rows`), the loop sets
/// `fused`, makes each chunk whole groups (rounded down to a multiple of group_rows, at least one group: the default
/// budget may be exceeded by up to one group) and per chunk asks `scale(s0, c)` (called after the chunk's values are
/// written, on the device's stream: no host sync) for the rows' G [c] (acc dtype, RowGrad's G with stride 1); the
/// backward row function turns the same logits into the logit gradient (no recompute GEMM), which feeds the chunk's
/// dX, dW and db as in the plain gradient-in-forward path. Otherwise (a chunk_size smaller than a group: the memory
/// the caller asked for) the loop leaves `fused` false and computes no gradient: the caller runs the backward loop
/// with G = scale(0, N) (two sweeps, the logits recomputed).
struct GroupedRows {
  int64_t group_rows = 1;
  const Problem* ref = nullptr;  // the reference head's problem (its X, W, b; target and scale as the policy's)
  at::Tensor ref_value;          // [N] acc dtype, written by the loop (with ref)
  std::function<at::Tensor(int64_t s0, int64_t c)> scale;
  bool fused = false;            // set by the loop: whether it computed the gradient
};

/// Writes p's scalar row parameters into a backend's row-parameter struct q (the CPU RowParams, the CUDA RowArgs):
/// q.V, q.ignore_index, and q.eps (label_smoothing), q.z_loss, q.cap (softcap, 0: none), q.scale in q's
/// accumulation type.
template <typename Q>
void set_row_scalars(Q& q, const Problem& p) {
  using acc_t = decltype(q.eps);
  q.V = p.V;
  q.ignore_index = p.ignore_index;
  q.eps = static_cast<acc_t>(p.label_smoothing);
  q.z_loss = static_cast<acc_t>(p.z_loss);
  q.cap = static_cast<acc_t>(p.softcap);
  q.scale = static_cast<acc_t>(p.scale);
}

}  // namespace lce

// ---- linear_log_probs: the same engine, the row value −log p(target) (the cross-entropy row with ε = 0, no class
// weights, no z-loss) and optionally the entropy; always the recompute autograd path (a per-token grad_output) ----

/// linear_log_probs's forward for autograd: (log_probs, entropy (an empty (0,) tensor without return_entropy),
/// stats (*, 2) as _linear_cross_entropy_forward's, of the scaled logits).
std::tuple<at::Tensor, at::Tensor, at::Tensor> _linear_log_probs_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, bool return_entropy, std::optional<int64_t> chunk_size);

namespace llp {

/// Symbolic-safe checks shared by the kernels and Meta: linear_cross_entropy's (lce::check_args, named `op`) and
/// temperature > 0 and finite.
void check_args(const char* op, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                const std::optional<at::Tensor>& linear_bias, double temperature, std::optional<double> softcap,
                std::optional<int64_t> chunk_size);

/// The backward's extra checks: grad_log_probs / grad_entropy / entropy of target's shape, entropy given with
/// grad_entropy, stats (*, 2) in the stats dtype.
void check_backward_args(const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
                         const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                         const at::Tensor& stats, const std::optional<at::Tensor>& entropy,
                         const std::optional<at::Tensor>& linear_bias, double temperature,
                         std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// The forward's checked problem (CPU and CUDA): reduction none, scale 1 / temperature.
lce::Problem forward_problem(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                             const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
                             std::optional<double> softcap, std::optional<int64_t> chunk_size);

/// _linear_log_probs_forward's outputs from a backend's row values (−log p per token [N]), entropy [N] (or
/// undefined) and stats [N, 2], in target's shape.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward_outputs(const lce::Problem& p, const at::Tensor& token_value,
                                                               const at::Tensor& entropy, const at::Tensor& stats,
                                                               const at::Tensor& target);

/// linear_log_probs_backward on one backend (the op's arguments after `kernel` and `zero_dw`), as lce::backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    lce::BackwardKernel kernel, bool zero_dw, const std::optional<at::Tensor>& grad_log_probs,
    const std::optional<at::Tensor>& grad_entropy, const at::Tensor& input, const at::Tensor& linear_weight,
    const at::Tensor& target, const at::Tensor& stats, const std::optional<at::Tensor>& entropy,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size);

}  // namespace llp

// ---- linear_jsd: the same forward loop with a teacher head (a second logits GEMM per chunk) and the JSD row; its
// gradients are computed in the forward (a scalar loss) and scaled in backward (lce::saved_grads_backward) ----

/// linear_jsd's forward for autograd: (loss, grad_input, grad_linear_weight, grad_linear_bias), the gradients of the
/// student's input, weight and bias only where grad_mask asks (undefined otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_jsd_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
    const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& teacher_linear_bias, double beta,
    double temperature, int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask = {false, false, false});

namespace jsd {

/// The student's and the teacher's problems: the student's with the reduction, target (zeros, with an ignore_index
/// none of them equals, when target is None), scale 1 / temperature; the teacher's with teacher_input converted to
/// input's dtype, the same target and scale; beta.
struct Problems {
  lce::Problem s, t;
  double beta;
};

/// Symbolic-safe checks shared by the kernels and Meta (ValueError, TypeError, RuntimeError as lce::check_args, for
/// the student's and the teacher's tensors; beta in [0, 1]; temperature > 0 and finite; reduction "mean" or "sum");
/// returns the reduction.
lce::Reduction check_args(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
                          const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
                          const std::optional<at::Tensor>& linear_bias,
                          const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                          c10::string_view reduction, std::optional<int64_t> chunk_size);

/// The checked problems (CPU and CUDA).
Problems forward_problems(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
                          const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
                          const std::optional<at::Tensor>& linear_bias,
                          const std::optional<at::Tensor>& teacher_linear_bias, double beta, double temperature,
                          int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size);

/// _linear_jsd_forward's outputs from the per-token divergences [N] and the gradient buffers.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(
    const Problems& p, const at::Tensor& token_value, const lce::GradBuffers& grads, const at::Tensor& input,
    const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias);

}  // namespace jsd
// ---- linear_preference_loss: the forward loop over whole (chosen, rejected) pairs (lce::GroupedRows), the policy's
// per-token log-probabilities summed per sequence, the pair losses' closed-form derivatives (linear_preference.cpp)
// as the rows' gradient scale; the gradients computed in the forward (a scalar loss), scaled in backward ----

/// The DPO-family loss of opforge.losses.linear_preference_loss: (loss, policy_logps, ref_logps). loss 0-dim; the
/// policy's per-sequence log-probabilities (2B,) as the loss type uses them (summed, or averaged over each sequence's
/// counted tokens for "ipo", "simpo", "orpo"), chosen first; ref_logps (2B,) likewise from the reference head when
/// one is used, else an empty (0,) tensor; all in float32 (float64 for float64 input). Only the loss is
/// differentiable (in input, linear_weight, linear_bias); the reference is a constant.
std::tuple<at::Tensor, at::Tensor, at::Tensor> _linear_preference_loss(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size);

/// _linear_preference_loss's outputs, then (grad_input, grad_linear_weight, grad_linear_bias) of the loss computed in
/// the same chunk loop where grad_mask asks (undefined otherwise), each in its parameter's shape and dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_preference_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask = {false, false, false});

namespace pref {

enum class LossType : int64_t { kSigmoid, kIpo, kHinge, kRobust, kSimpo, kCpo, kOrpo };

/// The hyper-parameters of the pair losses (TRL's names).
struct Params {
  LossType type;
  double beta, label_smoothing, simpo_gamma, cpo_alpha;
};

/// One pair loss f(l_c, l_r) over a batch of pairs: its value and ∂f/∂l_c, ∂f/∂l_r, each (P,) in the acc dtype.
struct PairTerms {
  at::Tensor loss, d_chosen, d_rejected;
};

/// f and its derivatives for the policy's (l_c, l_r) and the reference's (rc, rr; undefined for the reference-free
/// types), each (P,): the closed forms of linear_preference.cpp, one function per loss type.
PairTerms pair_terms(const Params& a, const at::Tensor& lc, const at::Tensor& lr, const at::Tensor& rc,
                     const at::Tensor& rr);

/// The checked problem: the policy's and the reference head's lce problems over the rows reordered pair by pair
/// (row block k holds pair k's chosen, then its rejected sequence: a chunk of whole pairs is contiguous), and what
/// the pair math needs.
struct Problems {
  lce::Problem s, r;     // r: only with a reference head (has_ref_head)
  bool has_ref_head = false;
  at::Tensor ref_given;  // (B, 2) acc dtype: the given reference log-probabilities, or undefined
  at::Tensor den;        // (B, 2) acc dtype: each sequence's divisor (its counted tokens, at least 1, for the
                         // averaged types; 1 otherwise)
  at::Tensor nll_scale;  // (1,) acc dtype: the chosen NLL's weight over the chosen tokens' count (at least 1), or
                         // undefined for the types without it
  int64_t B = 0, T = 0;
  Params a;
};

/// Symbolic-safe checks shared by the kernels and Meta (ValueError for shapes and values, TypeError for dtypes,
/// RuntimeError for devices, each naming linear_preference_loss); returns the loss type and whether the reference
/// head is used.
std::pair<LossType, bool> check_args(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double temperature,
    std::optional<int64_t> chunk_size);

/// The checked problems (CPU and CUDA).
Problems forward_problems(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                          const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
                          const std::optional<at::Tensor>& ref_linear_weight,
                          const std::optional<at::Tensor>& ref_linear_bias,
                          const std::optional<at::Tensor>& ref_chosen_logps,
                          const std::optional<at::Tensor>& ref_rejected_logps, c10::string_view loss_type,
                          double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
                          double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size);

/// The forward loop's hook (lce::GroupedRows) for the problems and the policy's row values [N] (−log p per token,
/// written by the loop): groups of 2T rows (a pair), the reference head, and the rows' G = −∂loss/∂log p.
lce::GroupedRows grouped_rows(const Problems& pp, const at::Tensor& value);

/// _linear_preference_forward's outputs from the loop's row values and gradient buffers.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(
    const Problems& pp, const at::Tensor& value, const lce::GroupedRows& groups, const lce::GradBuffers& grads,
    const at::Tensor& input, const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias);

/// A backend's forward chunk loop with the pair hook: (problem, gradients wanted, row values [N], stats [N, 2],
/// gradient buffers, hook), its forward_chunks with `groups`.
using GroupedLoop = std::function<void(const lce::Problem&, const lce::GradNeeds&, const at::Tensor&, const at::Tensor&,
                                       const lce::GradBuffers&, lce::GroupedRows*)>;

/// _linear_preference_forward on one backend once the problems are checked: `loop` over chunks of whole pairs
/// (gradients in the forward), then, where the chunk was smaller than a pair (lce::GroupedRows::fused false), a second
/// sweep by `kernel` (the backend's backward loop) with the rows' G; the gradient buffers' dW zeroed when `zero_dw`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const Problems& pp, const GroupedLoop& loop, lce::BackwardKernel kernel, bool zero_dw, const at::Tensor& input,
    const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask);

}  // namespace pref
}  // namespace opforge
