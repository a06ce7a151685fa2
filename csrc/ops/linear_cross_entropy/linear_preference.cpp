// linear_preference_loss (opforge.losses): checkers, the pair losses' closed forms, Meta kernels, autograd and
// autocast. The kernels are linear_cross_entropy's forward chunk loop (linear_cross_entropy_cpu.cpp,
// linear_cross_entropy_cuda.cu) given an lce::GroupedRows hook: chunks of whole (chosen, rejected) pairs, per chunk
// the policy's logits GEMM and its rows' −log p and (m, r) without a gradient, the reference head's logits GEMM and
// rows (no gradient), then the pairs' closed-form derivative ∂loss/∂(sequence log-probability) broadcast to the
// pair's tokens as the rows' gradient scale, the backward row function on the same logits and the gradient GEMMs:
// 3 GEMMs per chunk for the policy (logits, dX, dW) and 1 for a reference head, nothing recomputed.
//
// Op structure (schemas in csrc/library.cpp):
//   _linear_preference_forward  CPU/CUDA/Meta kernels: (loss, policy_logps, ref_logps, the gradients grad_mask asks
//                               for); not differentiable itself (its outputs raise lazily if differentiated).
//   _linear_preference_loss     CompositeExplicitAutograd: the forward op's first three outputs; Autograd kernel
//                               below: nothing kept when nothing needs a gradient, else the forward op with grad_mask
//                               = which of input, linear_weight, linear_bias require grad, and linear_cross_entropy's
//                               gradient-in-forward node (lce::saved_grads_backward: the saved gradients times
//                               grad_output, Note [all targets ignored]).
//
// Row layout: the batch is TRL's (B chosen sequences, then B rejected, each of T tokens). A pair's loss depends on
// both of its sequences' sums, so a chunk must hold whole pairs; the rows are reordered once pair by pair (pair k's
// chosen sequence, then its rejected one: a copy of input, N x H, and of grad_input back) so that a chunk of whole
// pairs is one contiguous block of rows and the chunk loop stays the one of the other losses (one logits GEMM and one
// dX GEMM per chunk, dW from the chunk's rows as they are).
//
// Chunk size: the engine's byte budget rounded down to whole pairs, at least one pair (a pair of long sequences may
// exceed the budget: 2T x V logits, as Liger-Kernel's pair chunks). A chunk_size argument smaller than a pair (2T
// tokens) is kept as the memory the caller asked for: the forward loop then only writes the rows' values and stats,
// and linear_log_probs's backward loop recomputes each chunk's logits with G for all rows (two sweeps, 4 + 1 GEMMs).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace opforge {
namespace pref {

namespace {
constexpr const char* kOp = "linear_preference_loss";
constexpr double kLn2 = 0.6931471805599453;

LossType parse_loss_type(c10::string_view s) {
  if (s == "sigmoid") return LossType::kSigmoid;
  if (s == "ipo") return LossType::kIpo;
  if (s == "hinge") return LossType::kHinge;
  if (s == "robust") return LossType::kRobust;
  if (s == "simpo") return LossType::kSimpo;
  if (s == "cpo") return LossType::kCpo;
  if (s == "orpo") return LossType::kOrpo;
  TORCH_CHECK_VALUE(false, "opforge::", kOp, ": expected loss_type to be one of sigmoid, ipo, hinge, robust, simpo, "
                    "cpo, orpo, but got \"", std::string(s), "\"");
  return LossType::kSigmoid;
}

// The types on a reference's log-probabilities (DPO's), and those on per-token mean log-probabilities.
bool uses_reference(LossType t) {
  return t == LossType::kSigmoid || t == LossType::kIpo || t == LossType::kHinge || t == LossType::kRobust;
}
bool averaged(LossType t) { return t == LossType::kIpo || t == LossType::kSimpo || t == LossType::kOrpo; }

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// ---- the pair losses: f(l_c, l_r) per pair and its two partial derivatives, in closed form -----------------------
// Each as opforge.losses.preference_loss computes it (TRL's formulas); σ the sigmoid, ε = label_smoothing.

// −(1 − ε) log σ(a) − ε log σ(−a) and its derivative in a, −(1 − ε) σ(−a) + ε σ(a): the (conservative) DPO loss
// of a margin a (Rafailov et al. 2023, "Direct Preference Optimization"; cDPO's ε, Mitchell 2023).
std::pair<at::Tensor, at::Tensor> smoothed_logsigmoid(const at::Tensor& a, double eps) {
  const at::Tensor loss = at::log_sigmoid(a).mul(-(1.0 - eps)).sub(at::log_sigmoid(a.neg()).mul(eps));
  const at::Tensor d = at::sigmoid(a.neg()).mul(-(1.0 - eps)).add(at::sigmoid(a).mul(eps));
  return {loss, d};
}

// A loss of the DPO margin h = (l_c − l_r) − (rc − rr), df/dh given: ∂f/∂l_c = df/dh, ∂f/∂l_r = −df/dh.
PairTerms of_margin(const at::Tensor& loss, const at::Tensor& dh) { return {loss, dh, dh.neg()}; }

// "sigmoid" (DPO): −(1 − ε) log σ(β h) − ε log σ(−β h);  df/dh = β (−(1 − ε) σ(−β h) + ε σ(β h)).
PairTerms sigmoid_terms(const Params& a, const at::Tensor& h) {
  auto [loss, d] = smoothed_logsigmoid(h.mul(a.beta), a.label_smoothing);
  return of_margin(loss, d.mul(a.beta));
}

// "robust" (Chowdhury et al. 2024, "Provably Robust DPO"): (−(1 − ε) log σ(β h) + ε log σ(−β h)) / (1 − 2ε);
// df/dh = β (−(1 − ε) σ(−β h) − ε σ(β h)) / (1 − 2ε).
PairTerms robust_terms(const Params& a, const at::Tensor& h) {
  const double eps = a.label_smoothing;
  const at::Tensor bh = h.mul(a.beta);
  const at::Tensor loss =
      at::log_sigmoid(bh).mul(-(1.0 - eps)).add(at::log_sigmoid(bh.neg()).mul(eps)).div(1.0 - 2.0 * eps);
  const at::Tensor d =
      at::sigmoid(bh.neg()).mul(-(1.0 - eps)).sub(at::sigmoid(bh).mul(eps)).mul(a.beta / (1.0 - 2.0 * eps));
  return of_margin(loss, d);
}

// "hinge" (SLiC, Zhao et al. 2023, "SLiC-HF"): max(0, 1 − β h); df/dh = −β where 1 − β h > 0, else 0 (relu's
// subgradient 0 at the kink, as torch's).
PairTerms hinge_terms(const Params& a, const at::Tensor& h) {
  const at::Tensor m = h.mul(a.beta).neg().add(1.0);  // 1 − β h
  return of_margin(at::relu(m), at::where(m > 0, at::full({}, -a.beta, h.options()), at::zeros({}, h.options())));
}

// "ipo" (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human Preferences"), on mean
// per-token log-probabilities: (h − 1/(2β))²; df/dh = 2 (h − 1/(2β)).
PairTerms ipo_terms(const Params& a, const at::Tensor& h) {
  const at::Tensor c = h.sub(1.0 / (2.0 * a.beta));
  return of_margin(c.pow(2), c.mul(2.0));
}

// "simpo" (Meng et al. 2024, "SimPO"), on mean per-token log-probabilities, u = l_c − l_r, reference-free:
// −(1 − ε) log σ(β u − γ) − ε log σ(−(β u − γ)); df/du = β (−(1 − ε) σ(−(β u − γ)) + ε σ(β u − γ)).
PairTerms simpo_terms(const Params& a, const at::Tensor& u) {
  auto [loss, d] = smoothed_logsigmoid(u.mul(a.beta).sub(a.simpo_gamma), a.label_smoothing);
  return of_margin(loss, d.mul(a.beta));
}

// "cpo" (Xu et al. 2024, "Contrastive Preference Optimization"), u = l_c − l_r, reference-free: the DPO loss of β u
// (the chosen NLL term is added per token: Problems::nll_scale).
PairTerms cpo_terms(const Params& a, const at::Tensor& u) {
  auto [loss, d] = smoothed_logsigmoid(u.mul(a.beta), a.label_smoothing);
  return of_margin(loss, d.mul(a.beta));
}

// log(1 − eˣ) as opforge.losses._log1mexp (Mächler 2012): x taken at most −tiny; log(−expm1(x)) above −ln 2,
// log1p(−exp(x)) below. And its derivative as autograd takes it through those clamps and branches: 0 where x > −tiny
// (the clamp's bound), else eˣ / expm1(x) (above −ln 2) or −eˣ / (1 − eˣ) (below).
std::pair<at::Tensor, at::Tensor> log1mexp(const at::Tensor& x0) {
  const double tiny = x0.scalar_type() == at::kDouble ? std::numeric_limits<double>::min()
                                                       : static_cast<double>(std::numeric_limits<float>::min());
  const at::Tensor x = x0.clamp_max(-tiny);
  const at::Tensor xn = x.clamp_min(-kLn2), xf = x.clamp_max(-kLn2);
  const at::Tensor upper = x > -kLn2;
  const at::Tensor value = at::where(upper, at::log(at::expm1(xn).neg()), at::log1p(at::exp(xf).neg()));
  const at::Tensor ef = at::exp(xf);
  const at::Tensor d = at::where(upper, at::exp(xn).div(at::expm1(xn)), ef.neg().div(ef.neg().add(1.0)));
  return {value, at::where(x0 <= -tiny, d, at::zeros({}, d.options()))};
}

// "orpo" (Hong et al. 2024, "ORPO"), on mean per-token log-probabilities, reference-free: −β log σ(lo),
// lo = (l_c − l_r) − (log(1 − e^l_c) − log(1 − e^l_r)); df/dlo = −β σ(−lo), ∂lo/∂l_c = 1 − D(l_c),
// ∂lo/∂l_r = −1 + D(l_r), D the derivative of log(1 − eˡ) (log1mexp). The chosen NLL is added per token.
PairTerms orpo_terms(const Params& a, const at::Tensor& lc, const at::Tensor& lr) {
  auto [gc, dgc] = log1mexp(lc);
  auto [gr, dgr] = log1mexp(lr);
  const at::Tensor lo = lc.sub(lr).sub(gc.sub(gr));
  const at::Tensor dlo = at::sigmoid(lo.neg()).mul(-a.beta);
  return {at::log_sigmoid(lo).mul(-a.beta), dlo.mul(dgc.neg().add(1.0)), dlo.mul(dgr.sub(1.0))};
}

}  // namespace

PairTerms pair_terms(const Params& a, const at::Tensor& lc, const at::Tensor& lr, const at::Tensor& rc,
                     const at::Tensor& rr) {
  switch (a.type) {
    case LossType::kSimpo: return simpo_terms(a, lc.sub(lr));
    case LossType::kCpo: return cpo_terms(a, lc.sub(lr));
    case LossType::kOrpo: return orpo_terms(a, lc, lr);
    default: break;
  }
  const at::Tensor h = lc.sub(lr).sub(rc.sub(rr));
  switch (a.type) {
    case LossType::kSigmoid: return sigmoid_terms(a, h);
    case LossType::kRobust: return robust_terms(a, h);
    case LossType::kHinge: return hinge_terms(a, h);
    default: return ipo_terms(a, h);
  }
}

std::pair<LossType, bool> check_args(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double temperature,
    std::optional<int64_t> chunk_size) {
  const LossType type = parse_loss_type(loss_type);
  TORCH_CHECK_VALUE(target.defined(), "opforge::", kOp, ": expected target to be a tensor, but got None");
  TORCH_CHECK_VALUE(target.dim() == 2 && target.sym_size(0) % 2 == 0, "opforge::", kOp,
                    ": expected a batch of 2B sequences (chosen, then rejected): target of shape (2B, T), but got "
                    "target of shape ", shape_str(target.sym_sizes()));
  lce::check_args(kOp, input, linear_weight, target, linear_bias, std::nullopt, "sum", 0.0, 0.0, std::nullopt,
                  chunk_size);
  TORCH_CHECK_VALUE(std::isfinite(beta) && beta > 0.0, "opforge::", kOp, ": expected beta > 0 and finite, but got ",
                    num_str(beta));
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing < 0.5, "opforge::", kOp,
                    ": expected label_smoothing in [0, 0.5), but got ", num_str(label_smoothing));
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0, "opforge::", kOp,
                    ": expected temperature > 0 and finite, but got ", num_str(temperature));
  const bool rc = given(ref_chosen_logps), rr = given(ref_rejected_logps);
  TORCH_CHECK_VALUE(rc == rr, "opforge::", kOp, ": expected both ref_chosen_logps and ref_rejected_logps, or "
                    "neither, but got only ", rc ? "ref_chosen_logps" : "ref_rejected_logps");
  if (!uses_reference(type)) return {type, false};
  if (rc) {
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"ref_chosen_logps", &*ref_chosen_logps},
                                  {"ref_rejected_logps", &*ref_rejected_logps}}) {
      check_floating(kOp, name, *t);
      check_same_device(kOp, "input", input, name, *t);
      TORCH_CHECK_VALUE(t->dim() == 1 && t->sym_size(0) * 2 == target.sym_size(0), "opforge::", kOp,
                        ": expected ", name, " of shape (B,) = [", num_str(target.sym_size(0) / 2),
                        "] (half of target's 2B), but got ", shape_str(t->sym_sizes()));
    }
    return {type, false};
  }
  TORCH_CHECK_VALUE(given(ref_linear_weight), "opforge::", kOp, ": expected ref_chosen_logps / ref_rejected_logps or "
                    "ref_linear_weight for loss_type \"", std::string(loss_type), "\", but got None");
  const at::Tensor& rw = *ref_linear_weight;
  check_floating(kOp, "ref_linear_weight", rw);
  check_same_device(kOp, "input", input, "ref_linear_weight", rw);
  const auto xs = input.sym_sizes();
  const auto lead = xs.slice(0, xs.size() - 1);
  c10::SymInt hr = input.sym_size(-1);
  if (given(ref_input)) {
    const at::Tensor& ri = *ref_input;
    check_floating(kOp, "ref_input", ri);
    check_same_device(kOp, "input", input, "ref_input", ri);
    TORCH_CHECK_VALUE(ri.dim() >= 1 && ri.sym_sizes().slice(0, ri.dim() - 1).equals(lead), "opforge::", kOp,
                      ": expected ref_input of input's leading shape ", shape_str(lead), " (2B, T, Hr), but got ",
                      shape_str(ri.sym_sizes()));
    hr = ri.sym_size(-1);
  }
  TORCH_CHECK_VALUE(rw.dim() == 2 && rw.sym_size(0) == linear_weight.sym_size(0) && rw.sym_size(1) == hr, "opforge::",
                    kOp, ": expected ref_linear_weight of shape [", num_str(linear_weight.sym_size(0)), ", ",
                    num_str(hr), "] (linear_weight's V, ", given(ref_input) ? "ref_input's" : "input's",
                    " hidden size), but got ", shape_str(rw.sym_sizes()));
  if (given(ref_linear_bias)) {
    const at::Tensor& b = *ref_linear_bias;
    check_floating(kOp, "ref_linear_bias", b);
    check_same_device(kOp, "input", input, "ref_linear_bias", b);
    TORCH_CHECK_VALUE(b.dim() == 1 && b.sym_size(0) == linear_weight.sym_size(0), "opforge::", kOp,
                      ": expected ref_linear_bias of shape [", num_str(linear_weight.sym_size(0)),
                      "] (linear_weight's V), but got ", shape_str(b.sym_sizes()));
  }
  return {type, true};
}

namespace {
// (2B, T, *rest) → rows pair by pair: [B · 2 · T, *rest] (pair k's chosen sequence, then its rejected one).
at::Tensor pairwise(const at::Tensor& t, int64_t B, int64_t T) {
  std::vector<int64_t> split = {2, B, T}, rows = {2 * B * T};
  for (int64_t d = 2; d < t.dim(); ++d) {
    split.push_back(t.size(d));
    rows.push_back(t.size(d));
  }
  return t.reshape(split).transpose(0, 1).reshape(rows);
}

// The per-sequence log-probabilities of pairs [k0, k0 + np): raw sums (np, 2) of the rows' log p (chosen, rejected)
// and those the loss uses (divided by den for the averaged types); the reference's (np, 2) likewise, or undefined.
struct PairLogps {
  at::Tensor sums, pol, ref;
};

PairLogps pair_logps(const Problems& pp, const at::Tensor& value, const at::Tensor& ref_value, int64_t k0,
                     int64_t np) {
  const int64_t T = pp.T;
  auto seq = [&](const at::Tensor& v) { return v.narrow(0, 2 * T * k0, 2 * T * np).view({np, 2, T}).sum(-1).neg(); };
  const at::Tensor den = pp.den.defined() ? pp.den.narrow(0, k0, np) : at::Tensor();
  PairLogps out;
  out.sums = seq(value);
  out.pol = den.defined() ? out.sums.div(den) : out.sums;
  if (pp.ref_given.defined()) {
    out.ref = pp.ref_given.narrow(0, k0, np);
  } else if (pp.has_ref_head) {
    out.ref = den.defined() ? seq(ref_value).div(den) : seq(ref_value);
  }
  return out;
}

PairTerms terms_of(const Problems& pp, const PairLogps& l) {
  const at::Tensor rc = l.ref.defined() ? l.ref.select(1, 0) : at::Tensor();
  const at::Tensor rr = l.ref.defined() ? l.ref.select(1, 1) : at::Tensor();
  return pair_terms(pp.a, l.pol.select(1, 0), l.pol.select(1, 1), rc, rr);
}
}  // namespace

Problems forward_problems(const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
                          const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
                          const std::optional<at::Tensor>& ref_linear_weight,
                          const std::optional<at::Tensor>& ref_linear_bias,
                          const std::optional<at::Tensor>& ref_chosen_logps,
                          const std::optional<at::Tensor>& ref_rejected_logps, c10::string_view loss_type,
                          double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
                          double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size) {
  const auto [type, ref_head] =
      check_args(input, linear_weight, target, linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
                 ref_chosen_logps, ref_rejected_logps, loss_type, beta, label_smoothing, temperature, chunk_size);
  Problems pp;
  pp.a = {type, beta, label_smoothing, simpo_gamma, cpo_alpha};
  pp.B = target.size(0) / 2;
  pp.T = target.size(1);
  const auto dtype = input.scalar_type();
  const auto acc = lce::acc_dtype(dtype);
  const at::Tensor tgt = pairwise(target, pp.B, pp.T);  // [N]
  pp.s = lce::make_problem(pairwise(input, pp.B, pp.T), linear_weight, tgt, linear_bias, std::nullopt,
                           lce::Reduction::kSum, ignore_index, 0.0, 0.0, std::nullopt);
  pp.s.scale = 1.0 / temperature;
  pp.s.op = kOp;
  if (ref_head) {
    const at::Tensor xr = given(ref_input) ? to_input_dtype(*ref_input, dtype) : input;
    pp.r = lce::make_problem(pairwise(xr, pp.B, pp.T), *ref_linear_weight, tgt, ref_linear_bias, std::nullopt,
                             lce::Reduction::kSum, ignore_index, 0.0, 0.0, std::nullopt);
    pp.r.scale = pp.s.scale;
    pp.r.op = kOp;
    pp.r.lean = pp.s.lean;  // the reference's logits share the policy's chunk dtype (lean mode is the policy's call)
    pp.has_ref_head = true;
  } else if (uses_reference(type)) {
    pp.ref_given = at::stack({ref_chosen_logps->to(acc).reshape({pp.B}), ref_rejected_logps->to(acc).reshape({pp.B})},
                             1);
  }
  const at::Tensor count = tgt.ne(ignore_index).view({pp.B, 2, pp.T}).sum(-1);  // (B, 2) counted tokens
  if (averaged(type)) pp.den = count.clamp_min(1).to(acc);
  if (type == LossType::kCpo || type == LossType::kOrpo) {
    // the chosen tokens' mean NLL, α (−Σ log p) / max(N_chosen, 1): its weight per chosen token
    const double alpha = type == LossType::kCpo ? cpo_alpha : 1.0;
    pp.nll_scale = at::full({1}, alpha, count.options().dtype(acc)).div(count.select(1, 0).sum().clamp_min(1).to(acc));
  }
  return pp;
}

lce::GroupedRows grouped_rows(const Problems& pp, const at::Tensor& value) {
  lce::GroupedRows g;
  g.group_rows = std::max<int64_t>(1, 2 * pp.T);
  if (pp.has_ref_head) {
    g.ref = &pp.r;
    g.ref_value = at::empty({pp.s.N}, value.options());
  }
  // G = −∂loss/∂log p per token (lce::RowGrad): for pair k's sequence j, −(1/B) ∂f/∂l_j / den_j, plus α / N_chosen on
  // the chosen tokens (the NLL of "cpo" and "orpo"); the rows of ignored tokens are zeroed by the row function
  g.scale = [&pp, value, ref_value = g.ref_value](int64_t s0, int64_t c) {
    const int64_t T = pp.T, k0 = s0 / (2 * T), np = c / (2 * T);
    const PairLogps l = pair_logps(pp, value, ref_value, k0, np);
    const PairTerms t = terms_of(pp, l);
    at::Tensor d = at::stack({t.d_chosen, t.d_rejected}, 1).div(static_cast<double>(pp.B));  // (np, 2) ∂loss/∂l
    if (pp.den.defined()) d = d.div(pp.den.narrow(0, k0, np));
    at::Tensor G = d.neg();
    if (pp.nll_scale.defined()) G.select(1, 0).add_(pp.nll_scale);
    return G.unsqueeze(-1).expand({np, 2, T}).reshape({c});  // a copy: reshape of an expanded view
  };
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_outputs(
    const Problems& pp, const at::Tensor& value, const lce::GroupedRows& groups, const lce::GradBuffers& grads,
    const at::Tensor& input, const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias) {
  const PairLogps l = pair_logps(pp, value, groups.ref_value, 0, pp.B);
  at::Tensor loss = terms_of(pp, l).loss.mean();  // the mean over the B pairs (NaN without any pair, as torch's mean)
  if (pp.nll_scale.defined()) loss = loss.sub(l.sums.select(1, 0).sum().mul(pp.nll_scale.squeeze(0)));
  // (B, 2) → (2B,): chosen first
  const at::Tensor logps = l.pol.t().reshape({2 * pp.B});
  const at::Tensor ref_logps = pp.has_ref_head ? l.ref.t().reshape({2 * pp.B}) : at::empty({0}, value.options());
  auto [gi, gw, gb] = grads.finish(input, linear_weight, linear_bias);
  // grad_input back from the pair-by-pair rows to TRL's layout
  if (gi.defined()) gi = gi.reshape({pp.B, 2, pp.T, gi.size(-1)}).transpose(0, 1).reshape(input.sizes());
  return {loss, logps, ref_logps, gi, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward(
    const Problems& pp, const GroupedLoop& loop, lce::BackwardKernel kernel, bool zero_dw, const at::Tensor& input,
    const at::Tensor& linear_weight, const std::optional<at::Tensor>& linear_bias, std::optional<int64_t> chunk_size,
    std::array<bool, 3> grad_mask) {
  const auto opts = pp.s.X.options().dtype(lce::acc_dtype(input.scalar_type()));
  at::Tensor value = at::empty({pp.s.N}, opts);     // [N]
  at::Tensor stats = at::empty({pp.s.N, 2}, opts);  // [N, 2]
  const lce::GradBuffers grads(pp.s, grad_mask, zero_dw);
  lce::GroupedRows groups = grouped_rows(pp, value);
  const lce::GradNeeds need(pp.s, grad_mask);
  loop(pp.s, need, value, stats, grads, &groups);
  if (need.any() && !groups.fused && pp.s.N > 0) {  // chunks smaller than a pair: the second sweep recomputes
    lce::RowGrad rg;
    rg.G = groups.scale(0, pp.s.N);
    rg.g_stride = 1;
    kernel(pp.s, rg, stats, need, chunk_size, grads);
  }
  return forward_outputs(pp, value, groups, grads, input, linear_weight, linear_bias);
}

}  // namespace pref

// ---- C++ entry points: typed dispatcher calls ------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> _linear_preference_loss(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size) {
  static auto op = typed_op<decltype(_linear_preference_loss)>("opforge::_linear_preference_loss");
  return op.call(input, linear_weight, target, linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
                 ref_chosen_logps, ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma, cpo_alpha,
                 temperature, ignore_index, chunk_size);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> _linear_preference_forward(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  static auto op = typed_op<decltype(_linear_preference_forward)>("opforge::_linear_preference_forward");
  return op.call(input, linear_weight, target, linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
                 ref_chosen_logps, ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma, cpo_alpha,
                 temperature, ignore_index, chunk_size, grad_mask);
}

namespace {

using PrefForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

std::tuple<at::Tensor, at::Tensor, at::Tensor> preference_loss_composite(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size) {
  auto out = opforge::_linear_preference_forward(input, linear_weight, target, linear_bias, ref_input,
                                                 ref_linear_weight, ref_linear_bias, ref_chosen_logps,
                                                 ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma,
                                                 cpo_alpha, temperature, ignore_index, chunk_size);
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

PrefForward preference_forward_meta(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size, std::array<bool, 3> grad_mask) {
  const auto [type, ref_head] =
      pref::check_args(input, linear_weight, target, linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
                       ref_chosen_logps, ref_rejected_logps, loss_type, beta, label_smoothing, temperature, chunk_size);
  const auto opts = input.options().dtype(lce::acc_dtype(input.scalar_type()));
  const c10::SymInt rows = target.sym_size(0);
  at::Tensor gi, gw, gb;
  if (grad_mask[0]) gi = at::empty_symint(input.sym_sizes(), input.options());
  if (grad_mask[1]) gw = at::empty_symint(linear_weight.sym_sizes(), linear_weight.options());
  if (grad_mask[2] && linear_bias.has_value() && linear_bias->defined())
    gb = at::empty_symint(linear_bias->sym_sizes(), linear_bias->options());
  return {at::empty({}, opts), at::empty_symint({rows}, opts),
          ref_head ? at::empty_symint({rows}, opts) : at::empty({0}, opts), gi, gw, gb};
}

constexpr Differentiability kPrefOutputs[] = {kDifferentiable,    kNotDifferentiable, kNotDifferentiable,
                                              kNotDifferentiable, kNotDifferentiable, kNotDifferentiable};

std::tuple<at::Tensor, at::Tensor, at::Tensor> preference_loss_autograd(
    const at::Tensor& input, const at::Tensor& linear_weight, const at::Tensor& target,
    const std::optional<at::Tensor>& linear_bias, const std::optional<at::Tensor>& ref_input,
    const std::optional<at::Tensor>& ref_linear_weight, const std::optional<at::Tensor>& ref_linear_bias,
    const std::optional<at::Tensor>& ref_chosen_logps, const std::optional<at::Tensor>& ref_rejected_logps,
    c10::string_view loss_type, double beta, double label_smoothing, double simpo_gamma, double cpo_alpha,
    double temperature, int64_t ignore_index, std::optional<int64_t> chunk_size) {
  // the reference (its head and its log-probabilities) is a constant of the loss, as TRL's (computed without
  // gradients): no edge, whether or not its tensors require grad
  const auto out = autograd_op(
      {"linear_preference_loss", "opforge::LinearPreferenceLossBackward", lce::saved_grads_backward, nullptr},
      kPrefOutputs,
      [&](bool grad) -> PrefForward {
        if (!grad) {
          auto [loss, lp, rlp] = opforge::_linear_preference_loss(
              input, linear_weight, target, linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
              ref_chosen_logps, ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma, cpo_alpha,
              temperature, ignore_index, chunk_size);
          return {loss, lp, rlp, {}, {}, {}};
        }
        // only the gradients of the tensors that require grad (a frozen head gets no V x H buffer)
        const std::array<bool, 3> mask = {requires_grad_of(input), requires_grad_of(linear_weight),
                                          requires_grad_of(linear_bias)};
        return opforge::_linear_preference_forward(input, linear_weight, target, linear_bias, ref_input,
                                                   ref_linear_weight, ref_linear_bias, ref_chosen_logps,
                                                   ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma,
                                                   cpo_alpha, temperature, ignore_index, chunk_size, mask);
      },
      [&](OpNode& n, const PrefForward& out) {
        const auto& [loss, lp, rlp, gi, gw, gb] = out;
        lce::mark_not_differentiable("linear_preference_loss", gi, gw, gb, input, linear_weight, linear_bias);
        n.save(gi);
        n.save(gw);
        n.save(gb);
        n.save(target.ne(ignore_index).any());  // Note [all targets ignored] (linear_cross_entropy.cpp)
      },
      input, linear_weight, linear_bias);
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out)};
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, CompositeExplicitAutograd, m) {
  m.impl("_linear_preference_loss", &preference_loss_composite);
}

TORCH_LIBRARY_IMPL(opforge, Meta, m) { m.impl("_linear_preference_forward", &preference_forward_meta); }

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("_linear_preference_loss", &preference_loss_autograd);
  // the gradients it returns are computed, not differentiable: differentiating them raises lazily
  register_not_differentiable_autograd(m, "_linear_preference_forward");
}

// torch.autocast: the GEMM operands (both heads) in the autocast dtype, as torch's linear; the outputs in float32.
OPFORGE_AUTOCAST(linear_preference,
                 {{"_linear_preference_loss", AutocastPolicy::kLowerPrecision,
                   {"input", "linear_weight", "linear_bias", "ref_input", "ref_linear_weight", "ref_linear_bias"}},
                  {"_linear_preference_forward", AutocastPolicy::kLowerPrecision,
                   {"input", "linear_weight", "linear_bias", "ref_input", "ref_linear_weight", "ref_linear_bias"}}})

}  // namespace opforge
