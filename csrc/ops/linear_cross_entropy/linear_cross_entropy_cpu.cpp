// CPU kernels of linear_cross_entropy: the chunked algorithm of linear_cross_entropy.h with ATen's GEMM in the
// accumulation dtype (float32; float64 for float64 input: float16/bfloat16 inputs are converted once, the weight
// for the whole call, the input per chunk) and an at::parallel_for row kernel with at::vec::Vectorized bodies.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>

#include "core/check.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace opforge {
namespace {

using at::vec::Vectorized;
using lce::Problem;

// Bytes of logits one chunk may hold on CPU (fp32 [chunk, V]): small enough to stay in the last-level cache's
// neighbourhood, large enough for an efficient GEMM (at V = 32000: 256 rows).
constexpr int64_t kCpuChunkBudget = int64_t{32} << 20;

template <typename acc_t>
struct RowParams {
  const acc_t* bias;  // [V] or nullptr
  const acc_t* cw;    // [V] class weights or nullptr
  acc_t wsum;         // Σ_j cw[j] (V without class weights)
  int64_t V, ignore_index;
  acc_t eps, z_loss, cap;  // cap 0: no softcap
};

// z = cap(l + b) in place over a row (only when there is a bias or a softcap).
template <typename acc_t>
void cap_row(acc_t* z, const RowParams<acc_t>& q) {
  using V = Vectorized<acc_t>;
  const int64_t n = q.V;
  const acc_t cap = q.cap;
  auto f = [&](acc_t x, int64_t j) {
    if (q.bias) x += q.bias[j];
    return cap > 0 ? cap * std::tanh(x / cap) : x;
  };
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V x = V::loadu(z + j);
    if (q.bias) x = x + V::loadu(q.bias + j);
    if (cap > 0) x = V(cap) * (x / V(cap)).tanh();
    x.store(z + j);
  }
  for (; j < n; ++j) z[j] = f(z[j], j);
}

// loss of one row; z: the row's logits (capped in place); returns (m, r) through m_out, r_out.
//   m = max z; r = log Σ exp(z − m); loss = (1 − ε) w_t ((m − z_t) + r) + ε/V (Σ_j w_j (m − z_j) + W r) + z_loss (m + r)²
template <typename acc_t>
acc_t forward_row(acc_t* z, int64_t t, const RowParams<acc_t>& q, acc_t& m_out, acc_t& r_out) {
  using V = Vectorized<acc_t>;
  if (t == q.ignore_index) {
    m_out = r_out = acc_t(0);
    return acc_t(0);
  }
  if (q.bias || q.cap > 0) cap_row(z, q);
  const int64_t n = q.V;
  const acc_t m = at::vec::reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); }, z, n);
  const bool finite_m = std::isfinite(m);
  const acc_t s = finite_m ? at::vec::map_reduce_all<acc_t>([m](V x) { return (x - V(m)).exp(); },
                                                            [](V a, V b) { return a + b; }, z, n)
                           : acc_t(NAN);
  const acc_t r = std::log(s);
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  acc_t loss = (acc_t(1) - q.eps) * wt * ((m - z[t]) + r);
  if (q.eps > 0) {
    acc_t sm;  // Σ_j w_j (m − z_j)
    if (q.cw) {
      sm = at::vec::map2_reduce_all<acc_t>([m](V x, V w) { return w * (V(m) - x); }, [](V a, V b) { return a + b; },
                                           z, q.cw, n);
    } else {
      sm = at::vec::map_reduce_all<acc_t>([m](V x) { return V(m) - x; }, [](V a, V b) { return a + b; }, z, n);
    }
    loss += q.eps / acc_t(n) * (sm + q.wsum * r);
  }
  if (q.z_loss > 0) loss += q.z_loss * (m + r) * (m + r);
  m_out = m;
  r_out = r;
  return loss;
}

// The logit gradient of one row, in place over its logits l, scaled by g:
//   p_j = exp((z_j − m) − r); dz_j = g ((1 − ε) w_t (p_j − [j = t]) + ε/V (W p_j − w_j) + 2 z_loss (m + r) p_j);
//   dl_j = dz_j · (1 − (z_j / cap)²) with a softcap, else dz_j.
// RAW: l holds the raw logits x·w (z = cap(l + b) is recomputed: the backward op); else l already holds z (the
// forward's row after forward_row capped it in place: the gradient-in-forward path).
template <typename acc_t, bool RAW = true>
void backward_row(acc_t* l, int64_t t, const RowParams<acc_t>& q, acc_t m, acc_t r, acc_t g) {
  using V = Vectorized<acc_t>;
  const int64_t n = q.V;
  if (t == q.ignore_index) {
    std::fill(l, l + n, acc_t(0));
    return;
  }
  const acc_t cap = q.cap;
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  const acc_t c1 = g * ((acc_t(1) - q.eps) * wt + q.eps / acc_t(n) * q.wsum + acc_t(2) * q.z_loss * (m + r));
  const acc_t c2 = g * q.eps / acc_t(n);  // times w_j
  // the target's own correction, from its logit before it is overwritten
  acc_t gz_t = acc_t(1);
  if (cap > 0) {
    const acc_t zt = RAW ? cap * std::tanh((l[t] + (q.bias ? q.bias[t] : acc_t(0))) / cap) : l[t];
    gz_t = acc_t(1) - (zt / cap) * (zt / cap);
  }
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V x = V::loadu(l + j);
    if (RAW && q.bias) x = x + V::loadu(q.bias + j);
    V gz(acc_t(1));
    if (cap > 0) {
      if (RAW) x = V(cap) * (x / V(cap)).tanh();
      const V u = x / V(cap);
      gz = V(acc_t(1)) - u * u;
    }
    const V p = ((x - V(m)) - V(r)).exp();
    V d = V(c1) * p - (q.cw ? V(c2) * V::loadu(q.cw + j) : V(c2));
    (d * gz).store(l + j);
  }
  for (; j < n; ++j) {
    acc_t x = l[j] + (RAW && q.bias ? q.bias[j] : acc_t(0));
    acc_t gz = acc_t(1);
    if (cap > 0) {
      if (RAW) x = cap * std::tanh(x / cap);
      gz = acc_t(1) - (x / cap) * (x / cap);
    }
    const acc_t p = std::exp((x - m) - r);
    l[j] = (c1 * p - c2 * (q.cw ? q.cw[j] : acc_t(1))) * gz;
  }
  l[t] -= g * (acc_t(1) - q.eps) * wt * gz_t;
}

// Raises IndexError for the first target outside [0, V) that is not ignore_index (a host read: CPU only).
void check_targets(const Problem& p, const char* op) {
  const int64_t* T = p.T.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t t = T[i];
    TORCH_CHECK_INDEX(t == p.ignore_index || (t >= 0 && t < p.V), "opforge::", op,
                      ": expected every target in [0, ", num_str(p.V), ") (linear_weight's V) or equal to ignore_index ",
                      num_str(p.ignore_index), ", but got target ", num_str(t), " at flat position ", num_str(i));
  }
}

template <typename acc_t>
RowParams<acc_t> row_params(const Problem& p) {
  RowParams<acc_t> q;
  q.bias = p.b.defined() ? p.b.const_data_ptr<acc_t>() : nullptr;
  q.cw = p.cw.defined() ? p.cw.const_data_ptr<acc_t>() : nullptr;
  q.wsum = p.cw.defined() ? p.cw.sum().item<acc_t>() : static_cast<acc_t>(p.V);
  lce::set_row_scalars(q, p);
  return q;
}

int64_t row_grain(int64_t V) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(V, 1)); }

// The chunk's gradient GEMMs from its logit gradient L = dZ_c [c, V] (acc dtype) for the rows [s0, s0 + c):
// dX_c = dZ_c · W, dW += dZ_cᵀ · X_c, db += Σ_rows dZ_c (fp32 accumulators); each only where its buffer is.
// A 16-bit dW (OPFORGE_LCE_DW_ACCUM=1) is added to by a GEMM in its own dtype, as on CUDA: dZ_c rounded to it, X_c
// as stored (p.X), fp32 math and one rounding of dW + dZ_cᵀ · X_c; a 16-bit db adds the fp32 column sum, one rounding.
void chunk_grads(const at::Tensor& L, const at::Tensor& Xc, const at::Tensor& Wf, const Problem& p, int64_t s0,
                 const lce::GradBuffers& g) {
  if (g.dX.defined()) {
    at::Tensor dXc = g.dX.narrow(0, s0, L.size(0));
    if (dXc.scalar_type() == L.scalar_type()) {
      at::mm_out(dXc, L, Wf);
    } else {
      dXc.copy_(at::mm(L, Wf));
    }
  }
  if (g.dW.defined()) {
    if (g.dW.scalar_type() == L.scalar_type()) {
      g.dW.addmm_(L.t(), Xc);
    } else {
      g.dW.addmm_(L.to(g.dW.scalar_type()).t(), p.X.narrow(0, s0, L.size(0)));
    }
  }
  if (g.db.defined()) g.db.add_(L.sum(0));
}

// The forward; with a grad_mask entry set, also the gradients of loss.sum() in the same chunk loop: each chunk's
// logit gradient (from the row's capped logits, in place, right after its loss) feeds dX_c = dZ_c · W, dW += dZ_cᵀ X_c
// and db += Σ_rows dZ_c (fp32 accumulators).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lce_forward_cpu(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  const char* op = "linear_cross_entropy";
  const Problem p = lce::forward_problem(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                         label_smoothing, z_loss, softcap, chunk_size);
  check_targets(p, op);
  const auto dtype = input.scalar_type();
  const auto acc = lce::acc_dtype(dtype);
  const lce::GradNeeds need(p, grad_mask);
  const bool need_grad = need.any();
  at::Tensor token_loss = at::empty({p.N}, p.X.options().dtype(acc));  // [N]
  at::Tensor stats = at::empty({p.N, 2}, p.X.options().dtype(acc));    // [N, 2]
  lce::GradBuffers grads(p, grad_mask, /*zero_dw=*/true);  // dX [N, H]; dW [V, H], db [V] (zeroed)
  const int64_t chunk = lce::resolve_chunk(chunk_size, p.N, p.V, kCpuChunkBudget, at::elementSize(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "opforge::linear_cross_entropy", [&] {
    using acc_t = scalar_t;
    const auto q = row_params<acc_t>(p);
    const at::Tensor G = need_grad ? lce::unit_grad_scale(p) : at::Tensor();  // [1]
    const acc_t g = need_grad ? G.item<acc_t>() : acc_t(0);
    const at::Tensor Wf = p.W.to(acc);                                        // [V, H]
    at::Tensor logits = at::empty({std::min(chunk, p.N), p.V}, Wf.options());  // [chunk, V]
    const int64_t* T = p.T.const_data_ptr<int64_t>();
    acc_t* loss_ptr = token_loss.mutable_data_ptr<acc_t>();
    acc_t* st = stats.mutable_data_ptr<acc_t>();
    for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
      const int64_t c = std::min(chunk, p.N - s0);
      at::Tensor L = logits.narrow(0, 0, c);
      const at::Tensor Xc = p.X.narrow(0, s0, c).to(acc);  // [c, H]
      at::mm_out(L, Xc, Wf.t());                           // [c, V] = X_c · Wᵀ
      acc_t* Lp = L.mutable_data_ptr<acc_t>();
      at::parallel_for(0, c, row_grain(p.V), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t row = s0 + i;
          loss_ptr[row] = forward_row(Lp + i * p.V, T[row], q, st[2 * row], st[2 * row + 1]);
          if (need_grad) backward_row<acc_t, false>(Lp + i * p.V, T[row], q, st[2 * row], st[2 * row + 1], g);
        }
      });
      if (!need_grad) continue;
      chunk_grads(L, Xc, Wf, p, s0, grads);
    }
  });
  return lce::forward_outputs(p, token_loss, stats, grads, input, linear_weight, target, linear_bias);
}

// grads: dX [N, H]; dW [V, H], db [V] zeroed, fp32 (or the 16-bit parameter dtype: OPFORGE_LCE_DW_ACCUM=1)
void backward_cpu(const Problem& p, const at::Tensor& grad_output, const at::Tensor& stats, const lce::GradNeeds& need,
                  std::optional<int64_t> chunk_size, const lce::GradBuffers& grads) {
  check_targets(p, "linear_cross_entropy_backward");
  const auto acc = lce::acc_dtype(p.X.scalar_type());
  if (need.any()) {
    int64_t g_stride = 0;
    const at::Tensor G = lce::grad_scale(p, grad_output, g_stride);  // [N] or [1]
    const at::Tensor S = stats.reshape({p.N, 2}).contiguous();
    const int64_t chunk = lce::resolve_chunk(chunk_size, p.N, p.V, kCpuChunkBudget, at::elementSize(acc));
    AT_DISPATCH_FLOATING_TYPES(acc, "opforge::linear_cross_entropy_backward", [&] {
      using acc_t = scalar_t;
      const auto q = row_params<acc_t>(p);
      const at::Tensor Wf = p.W.to(acc);                                        // [V, H]
      at::Tensor logits = at::empty({std::min(chunk, p.N), p.V}, Wf.options());  // [chunk, V]
      const int64_t* T = p.T.const_data_ptr<int64_t>();
      const acc_t* st = S.const_data_ptr<acc_t>();
      const acc_t* g = G.const_data_ptr<acc_t>();
      for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
        const int64_t c = std::min(chunk, p.N - s0);
        const at::Tensor Xc = p.X.narrow(0, s0, c).to(acc);  // [c, H]
        at::Tensor L = logits.narrow(0, 0, c);               // [c, V]
        at::mm_out(L, Xc, Wf.t());
        acc_t* Lp = L.mutable_data_ptr<acc_t>();
        at::parallel_for(0, c, row_grain(p.V), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t row = s0 + i;
            backward_row(Lp + i * p.V, T[row], q, st[2 * row], st[2 * row + 1], g[g_stride * row]);
          }
        });
        chunk_grads(L, Xc, Wf, p, s0, grads);
      }
    });
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  return lce::backward(backward_cpu, /*zero_dw=*/true, grad_output, input, linear_weight, target, stats, linear_bias,
                       weight, reduction, ignore_index, label_smoothing, z_loss, softcap, output_mask, chunk_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("_linear_cross_entropy_forward", &lce_forward_cpu);
  m.impl("linear_cross_entropy_backward", &lce_backward_cpu);
}

}  // namespace opforge
