// CPU kernels of linear_cross_entropy and linear_log_probs: the chunked algorithm of linear_cross_entropy.h with
// ATen's GEMM in the accumulation dtype (float32; float64 for float64 input: float16/bfloat16 inputs are converted
// once, the weight for the whole call, the input per chunk) and an at::parallel_for row kernel with
// at::vec::Vectorized bodies. One forward and one backward chunk loop serve both ops: linear_log_probs's row is the
// cross-entropy row without smoothing, class weights or z-loss (its value −log p), with the logits scaled by
// 1 / temperature and, on request, the entropy.
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
  acc_t scale;             // z = cap(l + b) · scale (1 / temperature; 1 for linear_cross_entropy)
};

// z = cap(l + b) · scale in place over a row (only when there is a bias, a softcap or a scale).
template <typename acc_t>
void cap_row(acc_t* z, const RowParams<acc_t>& q) {
  using V = Vectorized<acc_t>;
  const int64_t n = q.V;
  const acc_t cap = q.cap, scale = q.scale;
  auto f = [&](acc_t x, int64_t j) {
    if (q.bias) x += q.bias[j];
    return (cap > 0 ? cap * std::tanh(x / cap) : x) * scale;
  };
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V x = V::loadu(z + j);
    if (q.bias) x = x + V::loadu(q.bias + j);
    if (cap > 0) x = V(cap) * (x / V(cap)).tanh();
    if (scale != acc_t(1)) x = x * V(scale);
    x.store(z + j);
  }
  for (; j < n; ++j) z[j] = f(z[j], j);
}

// loss of one row; z: the row's logits (capped and scaled in place); returns (m, r) through m_out, r_out and, when
// ent_out is given, the entropy H = −Σ p log p = r + Σ_j p_j (m − z_j) (both terms >= 0: no cancellation).
//   m = max z; r = log Σ exp(z − m); loss = (1 − ε) w_t ((m − z_t) + r) + ε/V (Σ_j w_j (m − z_j) + W r) + z_loss (m + r)²
template <typename acc_t>
acc_t forward_row(acc_t* z, int64_t t, const RowParams<acc_t>& q, acc_t& m_out, acc_t& r_out, acc_t* ent_out) {
  using V = Vectorized<acc_t>;
  if (t == q.ignore_index) {
    m_out = r_out = acc_t(0);
    if (ent_out) *ent_out = acc_t(0);
    return acc_t(0);
  }
  if (q.bias || q.cap > 0 || q.scale != acc_t(1)) cap_row(z, q);
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
  if (ent_out) {
    // p_j = exp((z_j − m) − r): m + r would round r away under a large logit offset
    *ent_out = r + at::vec::map_reduce_all<acc_t>([m, r](V x) { return ((x - V(m)) - V(r)).exp() * (V(m) - x); },
                                                  [](V a, V b) { return a + b; }, z, n);
  }
  m_out = m;
  r_out = r;
  return loss;
}

// The logit gradient of one row, in place over its logits l (lce::RowGrad's formula), for the loss scale g and the
// entropy's gradient ge (0: no entropy term, em = r − H):
//   c = cap(l + b) (or l + b), z = c · scale, p_j = exp((z_j − m) − r);
//   dz_j = g ((1 − ε) w_t (p_j − [j = t]) + ε/V (W p_j − w_j) + 2 z_loss (m + r) p_j) − ge p_j ((z_j − m) − em);
//   dl_j = dz_j · scale · (1 − (c_j / cap)²) with a softcap, else dz_j · scale.
// RAW: l holds the raw logits x·w (z is recomputed: the backward op); else l already holds z (the forward's row
// after forward_row capped and scaled it in place: the gradient-in-forward path).
template <typename acc_t, bool RAW = true>
void backward_row(acc_t* l, int64_t t, const RowParams<acc_t>& q, acc_t m, acc_t r, acc_t g, acc_t ge = acc_t(0),
                  acc_t em = acc_t(0)) {
  using V = Vectorized<acc_t>;
  const int64_t n = q.V;
  if (t == q.ignore_index) {
    std::fill(l, l + n, acc_t(0));
    return;
  }
  const acc_t cap = q.cap, scale = q.scale;
  const acc_t inv = cap > 0 ? acc_t(1) / (cap * scale) : acc_t(0);  // c / cap = z · inv
  const bool ent = ge != acc_t(0);
  const acc_t wt = q.cw ? q.cw[t] : acc_t(1);
  const acc_t c1 = g * ((acc_t(1) - q.eps) * wt + q.eps / acc_t(n) * q.wsum + acc_t(2) * q.z_loss * (m + r));
  const acc_t c2 = g * q.eps / acc_t(n);  // times w_j
  auto z_of = [&](acc_t x, int64_t j) {    // z from the row's stored value
    if (!RAW) return x;
    x += q.bias ? q.bias[j] : acc_t(0);
    return (cap > 0 ? cap * std::tanh(x / cap) : x) * scale;
  };
  auto dz_dl = [&](acc_t z) { return cap > 0 ? scale * (acc_t(1) - (z * inv) * (z * inv)) : scale; };
  // the target's own correction, from its logit before it is overwritten
  const acc_t gz_t = dz_dl(z_of(l[t], t));
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V x = V::loadu(l + j);
    if (RAW) {
      if (q.bias) x = x + V::loadu(q.bias + j);
      if (cap > 0) x = V(cap) * (x / V(cap)).tanh();
      if (scale != acc_t(1)) x = x * V(scale);
    }
    V gz(scale);
    if (cap > 0) {
      const V u = x * V(inv);
      gz = V(scale) * (V(acc_t(1)) - u * u);
    }
    const V p = ((x - V(m)) - V(r)).exp();
    V d = V(c1) * p - (q.cw ? V(c2) * V::loadu(q.cw + j) : V(c2));
    if (ent) d = d - V(ge) * p * ((x - V(m)) - V(em));
    (d * gz).store(l + j);
  }
  for (; j < n; ++j) {
    const acc_t x = z_of(l[j], j);
    const acc_t p = std::exp((x - m) - r);
    acc_t d = c1 * p - c2 * (q.cw ? q.cw[j] : acc_t(1));
    if (ent) d -= ge * p * ((x - m) - em);
    l[j] = d * dz_dl(x);
  }
  l[t] -= g * (acc_t(1) - q.eps) * wt * gz_t;
}

// log-softmax of a row in place (z → (z − m) − log Σ exp(z − m)).
template <typename acc_t>
void log_softmax_row(acc_t* z, int64_t n) {
  using V = Vectorized<acc_t>;
  const acc_t m = at::vec::reduce_all<acc_t>([](V& a, V& b) { return at::vec::maximum(a, b); }, z, n);
  const acc_t s = std::isfinite(m) ? at::vec::map_reduce_all<acc_t>([m](V x) { return (x - V(m)).exp(); },
                                                                   [](V a, V b) { return a + b; }, z, n)
                                   : acc_t(NAN);
  // (z − m) − log s, not z − (m + log s): rounding m + log s would scale every probability exp(ls) by one common
  // error factor, which the JSD's gradient does not cancel
  const acc_t ls = std::log(s);
  at::vec::map([m, ls](V x) { return (x - V(m)) - V(ls); }, z, z, n);
}

// The generalised JSD of one token (linear_jsd) from its student logits zs and teacher logits zt (each row with its
// bias and scale applied: cap_row); with `grad`, the student's logit gradient of g · value in place over zs.
//   ls, lt = log-softmax; β = 0: Σ p_t (lt − ls), dz_j = p_s,j − p_t,j;
//   β = 1: K = Σ p_s (ls − lt), dz_j = p_s,j ((ls_j − lt_j) − K);
//   else lm = log(β p_t + (1 − β) p_s), A = Σ p_t (lt − lm), K = Σ p_s (ls − lm): β A + (1 − β) K,
//        dz_j = (1 − β) p_s,j ((ls_j − lm_j) − K)            (the terms through lm cancel);
//   dl_j = dz_j · scale.
template <typename acc_t>
acc_t jsd_row(acc_t* zs, acc_t* zt, int64_t n, double beta_d, acc_t scale, bool grad, acc_t g) {
  log_softmax_row(zs, n);
  log_softmax_row(zt, n);
  // β's logs and 1 − β from the double β (float32's rounding of β = 0.3 alone moves the divergence by ~1e-7)
  const acc_t beta = static_cast<acc_t>(beta_d), one_m_beta = static_cast<acc_t>(1.0 - beta_d);
  const acc_t lb = static_cast<acc_t>(std::log(beta_d)), l1b = static_cast<acc_t>(std::log1p(-beta_d));
  auto lmix = [&](acc_t ls, acc_t lt) {  // log(β e^lt + (1 − β) e^ls)
    const acc_t a = lt + lb, b = ls + l1b, mx = std::max(a, b);
    return mx + std::log1p(std::exp(-std::abs(a - b)));
  };
  // the two sums in double (a serial float32 sum over V would lose digits that the gradient's (ls − lm) − K keeps)
  double Ad = 0, Kd = 0;
  for (int64_t j = 0; j < n; ++j) {
    const acc_t ls = zs[j], lt = zt[j];
    if (beta == acc_t(0)) {
      Ad += static_cast<double>(std::exp(lt) * (lt - ls));
    } else if (beta == acc_t(1)) {
      Kd += static_cast<double>(std::exp(ls) * (ls - lt));
    } else {
      const acc_t lm = lmix(ls, lt);
      Ad += static_cast<double>(std::exp(lt) * (lt - lm));
      Kd += static_cast<double>(std::exp(ls) * (ls - lm));
    }
  }
  const acc_t A = static_cast<acc_t>(Ad), K = static_cast<acc_t>(Kd);
  const acc_t value = beta_d == 0.0   ? A
                      : beta_d == 1.0 ? K
                                      : static_cast<acc_t>(beta_d * Ad + (1.0 - beta_d) * Kd);
  if (grad) {
    const acc_t gs = g * scale;
    for (int64_t j = 0; j < n; ++j) {
      const acc_t ls = zs[j], lt = zt[j], ps = std::exp(ls);
      acc_t d;
      if (beta == acc_t(0)) {
        d = ps - std::exp(lt);
      } else if (beta == acc_t(1)) {
        d = ps * ((ls - lt) - K);
      } else {
        d = one_m_beta * ps * ((ls - lmix(ls, lt)) - K);
      }
      zs[j] = d * gs;
    }
  }
  return value;
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

// The forward chunk loop of the three ops: per token the row value (token_value [N]), (m, r) (stats [N, 2]) and,
// where `entropy` [N] is defined, the entropy; with a gradient in `need`, also the gradients of Σ token_value · G
// (the reduction's unit scale, lce::unit_grad_scale) in the same loop: each chunk's logit gradient (from the row's
// capped logits, in place, right after its value) feeds dX_c = dZ_c · W, dW += dZ_cᵀ X_c and db += Σ_rows dZ_c
// (fp32 accumulators, zeroed). With a `teacher` (linear_jsd), each chunk also gets the teacher's logits (a second
// GEMM) and the row is jsd_row (no stats, no entropy). With `groups` (linear_preference_loss), chunks of whole groups
// and the gradient scale from the groups' values (lce::GroupedRows): the rows' values and stats, the reference head's
// values (a second GEMM), then each row's logit gradient from its capped logits with the row's G.
void forward_chunks(const Problem& p, const lce::GradNeeds& need, std::optional<int64_t> chunk_size,
                    const at::Tensor& token_value, const at::Tensor& stats, const at::Tensor& entropy,
                    const lce::GradBuffers& grads, const Problem* teacher = nullptr, double beta = 0.0,
                    lce::GroupedRows* groups = nullptr) {
  const auto acc = lce::acc_dtype(p.X.scalar_type());
  const bool need_grad = need.any();
  const Problem* second = teacher ? teacher : groups ? groups->ref : nullptr;  // a second head's logits per chunk
  int64_t chunk = lce::resolve_chunk(chunk_size, p.N, p.V, kCpuChunkBudget, at::elementSize(acc) * (second ? 2 : 1));
  // lce::GroupedRows: the gradient here when a chunk may hold whole groups
  const bool fused_groups = groups && need_grad && (!chunk_size.has_value() || chunk >= groups->group_rows);
  if (groups) groups->fused = fused_groups;
  if (fused_groups) chunk = std::max(groups->group_rows, chunk - chunk % groups->group_rows);
  AT_DISPATCH_FLOATING_TYPES(acc, "opforge::linear_cross_entropy", [&] {
    using acc_t = scalar_t;
    const auto q = row_params<acc_t>(p);
    const at::Tensor G = need_grad ? lce::unit_grad_scale(p) : at::Tensor();  // [1]
    const acc_t g = need_grad ? G.item<acc_t>() : acc_t(0);
    const at::Tensor Wf = p.W.to(acc);                                        // [V, H]
    at::Tensor logits = at::empty({std::min(chunk, p.N), p.V}, Wf.options());  // [chunk, V]
    // the teacher's weight and logits chunk [chunk, V] (linear_jsd)
    const at::Tensor Wt = second ? second->W.to(acc) : at::Tensor();
    at::Tensor tlogits = second ? at::empty_like(logits) : at::Tensor();
    const auto qt = second ? row_params<acc_t>(*second) : q;
    const int64_t* T = p.T.const_data_ptr<int64_t>();
    acc_t* value = token_value.mutable_data_ptr<acc_t>();
    acc_t* st = stats.defined() ? stats.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* ent = entropy.defined() ? entropy.mutable_data_ptr<acc_t>() : nullptr;
    for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
      const int64_t c = std::min(chunk, p.N - s0);
      at::Tensor L = logits.narrow(0, 0, c);
      const at::Tensor Xc = p.X.narrow(0, s0, c).to(acc);  // [c, H]
      at::mm_out(L, Xc, Wf.t());                           // [c, V] = X_c · Wᵀ
      acc_t* Lp = L.mutable_data_ptr<acc_t>();
      acc_t* Tp = nullptr;
      if (second) {
        at::Tensor Lt = tlogits.narrow(0, 0, c);
        at::mm_out(Lt, second->X.narrow(0, s0, c).to(acc), Wt.t());  // [c, V] = X_t,c · W_tᵀ
        Tp = Lt.mutable_data_ptr<acc_t>();
      }
      if (groups) {
        acc_t* rv = Tp ? groups->ref_value.mutable_data_ptr<acc_t>() : nullptr;
        acc_t* no_entropy = nullptr;
        at::parallel_for(0, c, row_grain(p.V), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t row = s0 + i;
            value[row] = forward_row(Lp + i * p.V, T[row], q, st[2 * row], st[2 * row + 1], no_entropy);
            acc_t m, r;
            if (rv) rv[row] = forward_row(Tp + i * p.V, T[row], qt, m, r, no_entropy);
          }
        });
        if (!fused_groups) continue;
        const at::Tensor Gc = groups->scale(s0, c);  // [c]
        const acc_t* gc = Gc.const_data_ptr<acc_t>();
        at::parallel_for(0, c, row_grain(p.V), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t row = s0 + i;
            backward_row<acc_t, false>(Lp + i * p.V, T[row], q, st[2 * row], st[2 * row + 1], gc[i]);
          }
        });
        chunk_grads(L, Xc, Wf, p, s0, grads);
        continue;
      }
      at::parallel_for(0, c, row_grain(p.V), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t row = s0 + i;
          acc_t* l = Lp + i * p.V;
          if (teacher) {
            if (T[row] == p.ignore_index) {
              value[row] = acc_t(0);
              if (need_grad) std::fill(l, l + p.V, acc_t(0));
              continue;
            }
            cap_row(l, q);
            cap_row(Tp + i * p.V, qt);
            value[row] = jsd_row(l, Tp + i * p.V, p.V, beta, q.scale, need_grad, g);
            continue;
          }
          value[row] = forward_row(l, T[row], q, st[2 * row], st[2 * row + 1], ent ? ent + row : nullptr);
          if (need_grad) backward_row<acc_t, false>(l, T[row], q, st[2 * row], st[2 * row + 1], g);
        }
      });
      if (!need_grad) continue;
      chunk_grads(L, Xc, Wf, p, s0, grads);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lce_forward_cpu(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight, c10::string_view reduction,
    int64_t ignore_index, double label_smoothing, double z_loss, std::optional<double> softcap,
    std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  const Problem p = lce::forward_problem(input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
                                         label_smoothing, z_loss, softcap, chunk_size);
  check_targets(p, p.op);
  const auto opts = p.X.options().dtype(lce::acc_dtype(input.scalar_type()));
  at::Tensor token_loss = at::empty({p.N}, opts);   // [N]
  at::Tensor stats = at::empty({p.N, 2}, opts);     // [N, 2]
  lce::GradBuffers grads(p, grad_mask, /*zero_dw=*/true);  // dX [N, H]; dW [V, H], db [V] (zeroed)
  forward_chunks(p, lce::GradNeeds(p, grad_mask), chunk_size, token_loss, stats, at::Tensor(), grads);
  return lce::forward_outputs(p, token_loss, stats, grads, input, linear_weight, target, linear_bias);
}

// The backward chunk loop of both ops (lce::BackwardKernel). grads: dX [N, H]; dW [V, H], db [V] zeroed, fp32 (or
// the 16-bit parameter dtype: OPFORGE_LCE_DW_ACCUM=1)
void backward_cpu(const Problem& p, const lce::RowGrad& rg, const at::Tensor& stats, const lce::GradNeeds& need,
                  std::optional<int64_t> chunk_size, const lce::GradBuffers& grads) {
  check_targets(p, p.op);
  const auto acc = lce::acc_dtype(p.X.scalar_type());
  if (!need.any()) return;
  const at::Tensor S = stats.reshape({p.N, 2}).contiguous();
  const int64_t chunk = lce::resolve_chunk(chunk_size, p.N, p.V, kCpuChunkBudget, at::elementSize(acc));
  AT_DISPATCH_FLOATING_TYPES(acc, "opforge::linear_cross_entropy_backward", [&] {
    using acc_t = scalar_t;
    const auto q = row_params<acc_t>(p);
    const at::Tensor Wf = p.W.to(acc);                                        // [V, H]
    at::Tensor logits = at::empty({std::min(chunk, p.N), p.V}, Wf.options());  // [chunk, V]
    const int64_t* T = p.T.const_data_ptr<int64_t>();
    const acc_t* st = S.const_data_ptr<acc_t>();
    const acc_t* g = rg.G.const_data_ptr<acc_t>();
    const int64_t g_stride = rg.g_stride;
    const acc_t* ge = rg.GE.defined() ? rg.GE.const_data_ptr<acc_t>() : nullptr;
    const acc_t* em = rg.GE.defined() ? rg.Em.const_data_ptr<acc_t>() : nullptr;
    for (int64_t s0 = 0; s0 < p.N; s0 += chunk) {
      const int64_t c = std::min(chunk, p.N - s0);
      const at::Tensor Xc = p.X.narrow(0, s0, c).to(acc);  // [c, H]
      at::Tensor L = logits.narrow(0, 0, c);               // [c, V]
      at::mm_out(L, Xc, Wf.t());
      acc_t* Lp = L.mutable_data_ptr<acc_t>();
      at::parallel_for(0, c, row_grain(p.V), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t row = s0 + i;
          backward_row(Lp + i * p.V, T[row], q, st[2 * row], st[2 * row + 1], g[g_stride * row],
                       ge ? ge[row] : acc_t(0), em ? em[row] : acc_t(0));
        }
      });
      chunk_grads(L, Xc, Wf, p, s0, grads);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lce_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const at::Tensor& stats, const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& weight,
    c10::string_view reduction, int64_t ignore_index, double label_smoothing, double z_loss,
    std::optional<double> softcap, std::array<bool, 3> output_mask, std::optional<int64_t> chunk_size) {
  return lce::backward(backward_cpu, /*zero_dw=*/true, grad_output, input, linear_weight, target, stats, linear_bias,
                       weight, reduction, ignore_index, label_smoothing, z_loss, softcap, output_mask, chunk_size);
}

// ---- linear_log_probs: the same loops, the row value −log p(target) and the entropy -------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> jsd_forward_cpu(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& teacher_input,
    const at::Tensor& teacher_linear_weight, const std::optional<at::Tensor>& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& teacher_linear_bias, double beta,
    double temperature, int64_t ignore_index, c10::string_view reduction, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask) {
  const jsd::Problems pp = jsd::forward_problems(input, linear_weight, teacher_input, teacher_linear_weight, target,
                                                 linear_bias, teacher_linear_bias, beta, temperature, ignore_index,
                                                 reduction, chunk_size);
  at::Tensor value = at::empty({pp.s.N}, pp.s.X.options().dtype(lce::acc_dtype(input.scalar_type())));  // [N]
  lce::GradBuffers grads(pp.s, grad_mask, /*zero_dw=*/true);
  forward_chunks(pp.s, lce::GradNeeds(pp.s, grad_mask), chunk_size, value, at::Tensor(), at::Tensor(), grads, &pp.t,
                 pp.beta);
  return jsd::forward_outputs(pp, value, grads, input, linear_weight, linear_bias);
}

// ---- linear_preference_loss: the forward loop over whole pairs, the pair losses' gradient scale ---------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> pref_forward_cpu(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  const pref::Problems pp = pref::forward_problems(input, linear_weight, target, linear_bias, ref_input,
                                                   ref_linear_weight, ref_linear_bias, ref_chosen_logps,
                                                   ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma,
                                                   cpo_alpha, temperature, ignore_index, chunk_size);
  check_targets(pp.s, pp.s.op);
  const auto loop = [&](const Problem& p, const lce::GradNeeds& need, const at::Tensor& value, const at::Tensor& stats,
                        const lce::GradBuffers& grads, lce::GroupedRows* groups) {
    forward_chunks(p, need, chunk_size, value, stats, at::Tensor(), grads, nullptr, 0.0, groups);
  };
  return pref::forward(pp, loop, backward_cpu, /*zero_dw=*/true, input, linear_weight, linear_bias, chunk_size,
                       grad_mask);
}

// ---- linear_log_probs: the same loops, the row value −log p(target) and the entropy -------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_forward_cpu(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, double temperature, int64_t ignore_index,
    std::optional<double> softcap, bool return_entropy, std::optional<int64_t> chunk_size) {
  const Problem p = llp::forward_problem(input, linear_weight, target, linear_bias, temperature, ignore_index,
                                         softcap, chunk_size);
  check_targets(p, p.op);
  const auto opts = p.X.options().dtype(lce::acc_dtype(input.scalar_type()));
  at::Tensor value = at::empty({p.N}, opts);                                       // [N]
  at::Tensor stats = at::empty({p.N, 2}, opts);                                    // [N, 2]
  at::Tensor entropy = return_entropy ? at::empty({p.N}, opts) : at::Tensor();     // [N]
  const std::array<bool, 3> none = {false, false, false};
  forward_chunks(p, lce::GradNeeds(p, none), chunk_size, value, stats, entropy,
                 lce::GradBuffers(p, none, /*zero_dw=*/true));
  return llp::forward_outputs(p, value, entropy, stats, target);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> llp_backward_cpu(
    const std::optional<at::Tensor>& grad_log_probs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target, const at::Tensor& stats,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& linear_bias, double temperature,
    int64_t ignore_index, std::optional<double> softcap, std::array<bool, 3> output_mask,
    std::optional<int64_t> chunk_size) {
  return llp::backward(backward_cpu, /*zero_dw=*/true, grad_log_probs, grad_entropy, input, linear_weight, target,
                       stats, entropy, linear_bias, temperature, ignore_index, softcap, output_mask, chunk_size);
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CPU, m) {
  m.impl("_linear_cross_entropy_forward", &lce_forward_cpu);
  m.impl("linear_cross_entropy_backward", &lce_backward_cpu);
  m.impl("_linear_log_probs_forward", &llp_forward_cpu);
  m.impl("linear_log_probs_backward", &llp_backward_cpu);
  m.impl("_linear_jsd_forward", &jsd_forward_cpu);
  m.impl("_linear_preference_forward", &pref_forward_cpu);
}

}  // namespace opforge
