// rope: rotary position embedding of q and k in one op (Su et al. 2021, "RoFormer: Enhanced Transformer with
// Rotary Position Embedding"; Hugging Face transformers' apply_rotary_pos_emb).
//
// For each (batch b, token s) a table of R = rotary_dim entries, then for every head row x (D = head_dim) of q and k:
//   y[j] = x[j] · C[j] + x[partner(j)] · S[j]      j < R
//   y[j] = x[j]                                     j ≥ R   (copied bit-identical)
// pairs (a, b) = (i, i + R/2) in the rotate-half (Hugging Face / GPT-NeoX) convention, (2i, 2i + 1) in the
// interleaved (GPT-J) one, i < R/2; partner(a) = b, partner(b) = a. With cos/sin given (as transformers passes
// them, one value per rotary dim), forward C = cos, S[a] = −sin[a], S[b] = sin[b]: exactly HF's
// x·cos + rotate_half(x)·sin. The backward is the transpose: C = cos, S[a] = sin[b], S[b] = −sin[a] (the
// rotation by −θ when, as always in practice, the pair's two cos/sin entries are equal).
// From positions: θ_i = position · base^(−2i/R), computed in float64, C[a] = C[b] = cos θ_i,
// S[a] = ∓ sin θ_i, S[b] = ± sin θ_i (forward / backward).
#pragma once

#include <tuple>

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

#include <cmath>

#include "opforge/opforge.h"

namespace opforge {
namespace rotary {

/// Validated, normalized table arguments, shared by every backend and Meta (symbolic-shape safe).
struct Checked {
  at::Tensor cos, sin;    // [Bc, S, R], Bc ∈ {1, B}, in q's dtype or q's opmath dtype (table form)
  at::Tensor positions;   // [Bp, S] int64, Bp ∈ {1, B} (positions form)
  c10::SymInt rotary_dim; // R
};

/// Checks of the cos/sin form. `q`, `k`: (B, Hq, S, D) and (B, Hk, S, D), either may be undefined (a backward
/// gradient nobody passed) but not both; `q_name`/`k_name` name them in messages. cos/sin: (S, R), (Bc, S, R)
/// or (Bc, 1, S, R). rotary_dim: −1 (= cos.size(-1)) or cos.size(-1).
/// Raises: ValueError for wrong ranks, batch/seq/head_dim mismatches between q and k, odd head_dim, cos/sin
/// shapes that do not match q's (batch, seq) or each other, rotary_dim odd, ≤ 0, > head_dim or ≠ cos.size(-1);
/// TypeError for non-floating tensors or q and k of different dtypes; RuntimeError for different devices.
Checked check_rope(const char* op, const char* q_name, const at::Tensor& q, const char* k_name, const at::Tensor& k,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim);

/// Checks of the positions form: q/k as in check_rope; position_ids (S,) or (Bp, S), Bp ∈ {1, B}, of an
/// integer dtype; base > 0 and finite; rotary_dim −1 (= head_dim) or even in (0, head_dim].
Checked check_rope_from_positions(const char* op, const char* q_name, const at::Tensor& q, const char* k_name,
                                  const at::Tensor& k, const at::Tensor& position_ids, double base,
                                  int64_t rotary_dim);

/// A problem as the CPU and CUDA kernels see it (concrete sizes). x[0], x[1]: q and k (or the gradients),
/// undefined where absent; y[i]: their outputs, `at::empty_like(x[i])` (the input's layout where it is dense,
/// contiguous otherwise; Meta allocates the same).
struct Problem {
  at::Tensor x[2], y[2];      // [B, H_i, S, D], any strides
  at::Tensor cos, sin;        // [Bc, S, R], any strides (table form), else undefined
  at::Tensor positions;       // [Bp, S] int64 (positions form), else undefined
  double base = 10000.0;
  int64_t B = 0, S = 0, D = 0, R = 0;
  bool interleaved = false;
  bool backward = false;      // the transpose (rotation by −θ)
};

/// Builds the Problem (allocating outputs) from checked arguments.
Problem make_problem(const at::Tensor& q, const at::Tensor& k, const Checked& c, bool interleaved, bool backward,
                     double base);

/// The four backend kernels of the rope family around one backend runner (`run_cpu` / `run_cuda`: runs a built
/// Problem): check, build the problem, run, return (q_out, k_out). A backward op with neither gradient given returns
/// two undefined tensors. Each backend registers `Kernels<its runner>::...` for its dispatch key.
template <void (*Run)(const Problem&)>
struct Kernels {
  static std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                 const at::Tensor& sin, bool interleaved, int64_t rotary_dim) {
    return run(q, k, check_rope("rope", "q", q, "k", k, cos, sin, rotary_dim), interleaved, false, 0.0);
  }
  static std::tuple<at::Tensor, at::Tensor> rope_backward(const std::optional<at::Tensor>& grad_q_out,
                                                          const std::optional<at::Tensor>& grad_k_out,
                                                          const at::Tensor& cos, const at::Tensor& sin,
                                                          bool interleaved, int64_t rotary_dim) {
    const at::Tensor gq = grad_q_out.value_or(at::Tensor()), gk = grad_k_out.value_or(at::Tensor());
    if (!gq.defined() && !gk.defined()) return {};
    return run(gq, gk, check_rope("rope_backward", "grad_q_out", gq, "grad_k_out", gk, cos, sin, rotary_dim),
               interleaved, true, 0.0);
  }
  static std::tuple<at::Tensor, at::Tensor> rope_from_positions(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& position_ids, double base,
                                                                bool interleaved, int64_t rotary_dim) {
    return run(q, k,
               check_rope_from_positions("rope_from_positions", "q", q, "k", k, position_ids, base, rotary_dim),
               interleaved, false, base);
  }
  static std::tuple<at::Tensor, at::Tensor> rope_from_positions_backward(
      const std::optional<at::Tensor>& grad_q_out, const std::optional<at::Tensor>& grad_k_out,
      const at::Tensor& position_ids, double base, bool interleaved, int64_t rotary_dim) {
    const at::Tensor gq = grad_q_out.value_or(at::Tensor()), gk = grad_k_out.value_or(at::Tensor());
    if (!gq.defined() && !gk.defined()) return {};
    return run(gq, gk,
               check_rope_from_positions("rope_from_positions_backward", "grad_q_out", gq, "grad_k_out", gk,
                                         position_ids, base, rotary_dim),
               interleaved, true, base);
  }

 private:
  static std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x0, const at::Tensor& x1, const Checked& c,
                                                bool interleaved, bool backward, double base) {
    const Problem p = make_problem(x0, x1, c, interleaved, backward, base);
    Run(p);
    return {p.y[0], p.y[1]};
  }
};

/// The two dims of pair p < R/2: (p, p + R/2) rotate-half, (2p, 2p + 1) interleaved.
C10_HOST_DEVICE inline void pair_dims(int64_t p, int64_t R, bool interleaved, int64_t& a, int64_t& b) {
  a = interleaved ? 2 * p : p;
  b = interleaved ? 2 * p + 1 : p + R / 2;
}

/// Table entries of pair (a, b) from cos/sin values (ca, sa) at a and (cb, sb) at b: writes C[a], C[b], S[a], S[b]
/// so that y[j] = x[j]·C[j] + x[partner(j)]·S[j] is the forward (HF's x·cos + rotate_half(x)·sin) or, when
/// `backward`, its transpose.
template <typename T>
C10_HOST_DEVICE inline void table_pair(T ca, T sa, T cb, T sb, bool backward, T& Ca, T& Cb, T& Sa, T& Sb) {
  Ca = ca;
  Cb = cb;
  Sa = backward ? sb : -sa;
  Sb = backward ? -sa : sb;
}

}  // namespace rotary
}  // namespace opforge
