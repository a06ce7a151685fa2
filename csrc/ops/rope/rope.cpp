// rope: checkers, the public C++ API, Meta kernels and autograd.
//
// Op structure (schemas in csrc/library.cpp):
//   rope, rope_from_positions                      CPU/CUDA/Meta kernels; Autograd: a node whose backward is
//                                                  the matching *_backward op.
//   rope_backward, rope_from_positions_backward    CPU/CUDA/Meta kernels; Autograd: differentiable too (rope is
//                                                  linear in q, k: the backward of the backward is the forward),
//                                                  so gradients of any order work.
#include "ops/rope/rope.h"

#include <ATen/OpMathType.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>

#include "core/autocast.h"
#include "core/autograd.h"
#include "core/check.h"
#include "core/dispatch.h"

#include <string_view>

namespace opforge {
namespace rotary {
namespace {

// "B or 1" for a shape message's batch dim, or "1" when the batch is 1 (a message, read only when a check fails)
std::string batch_or_one(const c10::SymInt& B) {
  const auto b = B.maybe_as_int();
  return b.has_value() && *b == 1 ? std::string("1") : num_str(B) + " or 1";
}

// q and k: rank 4, floating, same dtype and device, same batch, seq and (even) head_dim. Returns the defined one
// (q preferred) as the shape reference.
const at::Tensor& check_qk(const char* op, const char* q_name, const at::Tensor& q, const char* k_name,
                           const at::Tensor& k) {
  TORCH_CHECK_VALUE(q.defined() || k.defined(), "opforge::", op, ": expected ", q_name, " or ", k_name,
                    " to be a tensor, but got None for both");
  // The forward ops take both q and k (the schema's `Tensor`); only the backward ops' gradients are optional.
  const bool forward = std::string_view(q_name) == "q";
  TORCH_CHECK_VALUE(!forward || (q.defined() && k.defined()), "opforge::", op, ": expected ",
                    q.defined() ? k_name : q_name, " to be a tensor, but got None");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{q_name, &q}, {k_name, &k}}) {
    if (!t->defined()) continue;
    check_floating(op, name, *t);
    TORCH_CHECK_VALUE(t->dim() == 4, "opforge::", op, ": expected ", name,
                      " of shape (batch, heads, seq, head_dim), but got shape ", shape_str(t->sym_sizes()));
  }
  if (q.defined() && k.defined()) {
    TORCH_CHECK_TYPE(q.scalar_type() == k.scalar_type(), "opforge::", op, ": expected ", q_name, " and ", k_name,
                     " of the same dtype, but got ", q.scalar_type(), " and ", k.scalar_type());
    check_same_device(op, q_name, q, k_name, k);
    const auto qs = q.sym_sizes(), ks = k.sym_sizes();
    TORCH_CHECK_VALUE(qs[0] == ks[0] && qs[2] == ks[2] && qs[3] == ks[3], "opforge::", op, ": expected ", q_name,
                      " and ", k_name, " of the same batch, seq and head_dim (dims 0, 2, 3), but got ",
                      shape_str(qs), " and ", shape_str(ks));
  }
  const at::Tensor& ref = q.defined() ? q : k;
  const c10::SymInt& D = ref.sym_size(3);
  TORCH_CHECK_VALUE(D % 2 == 0, "opforge::", op, ": expected an even head_dim, but got ", num_str(D));
  return ref;
}

void check_rotary_dim(const char* op, const c10::SymInt& R, const c10::SymInt& D) {
  TORCH_CHECK_VALUE(R > 0 && R % 2 == 0 && R <= D, "opforge::", op,
                    ": expected rotary_dim to be even, positive and at most head_dim ", num_str(D), ", but got ",
                    num_str(R));
}

}  // namespace

Checked check_rope(const char* op, const char* q_name, const at::Tensor& q, const char* k_name, const at::Tensor& k,
                   const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim) {
  const at::Tensor& ref = check_qk(op, q_name, q, k_name, k);
  check_floating(op, "cos", cos);
  check_floating(op, "sin", sin);
  check_same_device(op, q_name, ref, "cos", cos);
  check_same_device(op, "cos", cos, "sin", sin);
  TORCH_CHECK_VALUE(cos.sym_sizes().equals(sin.sym_sizes()), "opforge::", op,
                    ": expected cos and sin of the same shape, but got ", shape_str(cos.sym_sizes()), " and ",
                    shape_str(sin.sym_sizes()));
  const int64_t nd = cos.dim();
  TORCH_CHECK_VALUE(nd >= 2 && nd <= 4 && (nd != 4 || cos.sym_size(1) == 1), "opforge::", op,
                    ": expected cos and sin of shape (seq, rotary_dim), (batch, seq, rotary_dim) or (batch, 1, seq, "
                    "rotary_dim), but got ",
                    shape_str(cos.sym_sizes()));
  at::Tensor C = nd == 2 ? cos.unsqueeze(0) : nd == 4 ? cos.select(1, 0) : cos;
  at::Tensor S = nd == 2 ? sin.unsqueeze(0) : nd == 4 ? sin.select(1, 0) : sin;
  const auto B = ref.sym_size(0), seq = ref.sym_size(2);
  TORCH_CHECK_VALUE(C.sym_size(1) == seq && (C.sym_size(0) == 1 || C.sym_size(0) == B), "opforge::", op,
                    ": expected cos and sin of shape (", batch_or_one(B), ", ", num_str(seq),
                    ", rotary_dim) to match ", q_name, "'s (batch, seq), but got ", shape_str(cos.sym_sizes()));
  const c10::SymInt R = C.sym_size(2);
  TORCH_CHECK_VALUE(rotary_dim == -1 || R == rotary_dim, "opforge::", op, ": expected rotary_dim of -1 or cos.size(-1) ",
                    num_str(R), ", but got ", num_str(rotary_dim));
  check_rotary_dim(op, R, ref.sym_size(3));
  // cos/sin stay in q's dtype or q's opmath dtype (a float32 table with bf16 q is used as float32); any other
  // dtype (or two different ones) is converted to opmath once.
  const at::ScalarType dt = ref.scalar_type(), opmath = at::toOpMathType(dt);
  if (!(C.scalar_type() == S.scalar_type() && (C.scalar_type() == dt || C.scalar_type() == opmath))) {
    C = C.to(opmath);
    S = S.to(opmath);
  }
  return {C, S, at::Tensor(), R};
}

Checked check_rope_from_positions(const char* op, const char* q_name, const at::Tensor& q, const char* k_name,
                                  const at::Tensor& k, const at::Tensor& position_ids, double base,
                                  int64_t rotary_dim) {
  const at::Tensor& ref = check_qk(op, q_name, q, k_name, k);
  TORCH_CHECK_VALUE(position_ids.defined(), "opforge::", op, ": expected position_ids to be a tensor, but got None");
  TORCH_CHECK_TYPE(at::isIntegralType(position_ids.scalar_type(), /*includeBool=*/false), "opforge::", op,
                   ": expected position_ids of an integer dtype, but got ", position_ids.scalar_type());
  check_same_device(op, q_name, ref, "position_ids", position_ids);
  const auto B = ref.sym_size(0), seq = ref.sym_size(2);
  const int64_t nd = position_ids.dim();
  TORCH_CHECK_VALUE((nd == 1 || nd == 2) && position_ids.sym_size(-1) == seq &&
                        (nd == 1 || position_ids.sym_size(0) == 1 || position_ids.sym_size(0) == B),
                    "opforge::", op, ": expected position_ids of shape (", num_str(seq), ",) or (", batch_or_one(B),
                    ", ", num_str(seq), ") to match ", q_name, "'s (batch, seq), but got ",
                    shape_str(position_ids.sym_sizes()));
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 0, "opforge::", op, ": expected a finite base > 0, but got ",
                    num_str(base));
  const c10::SymInt D = ref.sym_size(3);
  const c10::SymInt R = rotary_dim == -1 ? D : c10::SymInt(rotary_dim);
  check_rotary_dim(op, R, D);
  at::Tensor P = nd == 1 ? position_ids.unsqueeze(0) : position_ids;
  if (P.scalar_type() != at::kLong) P = P.to(at::kLong);
  return {at::Tensor(), at::Tensor(), P, R};
}

Problem make_problem(const at::Tensor& q, const at::Tensor& k, const Checked& c, bool interleaved, bool backward,
                     double base) {
  Problem p;
  p.x[0] = q;
  p.x[1] = k;
  for (int i = 0; i < 2; ++i)
    if (p.x[i].defined()) p.y[i] = at::empty_like(p.x[i]);
  const at::Tensor& ref = q.defined() ? q : k;
  p.B = ref.size(0);
  p.S = ref.size(2);
  p.D = ref.size(3);
  p.R = c.rotary_dim.expect_int();
  p.cos = c.cos;
  p.sin = c.sin;
  p.positions = c.positions;
  p.base = base;
  p.interleaved = interleaved;
  p.backward = backward;
  return p;
}

}  // namespace rotary

// ---- public C++ API ----------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin, bool interleaved, int64_t rotary_dim) {
  static auto op = typed_op<decltype(rope)>("opforge::rope");
  return op.call(q, k, cos, sin, interleaved, rotary_dim);
}
std::tuple<at::Tensor, at::Tensor> rope_backward(const std::optional<at::Tensor>& grad_q_out,
                                                 const std::optional<at::Tensor>& grad_k_out, const at::Tensor& cos,
                                                 const at::Tensor& sin, bool interleaved, int64_t rotary_dim) {
  static auto op = typed_op<decltype(rope_backward)>("opforge::rope_backward");
  return op.call(grad_q_out, grad_k_out, cos, sin, interleaved, rotary_dim);
}
std::tuple<at::Tensor, at::Tensor> rope_from_positions(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& position_ids, double base, bool interleaved,
                                                       int64_t rotary_dim) {
  static auto op = typed_op<decltype(rope_from_positions)>("opforge::rope_from_positions");
  return op.call(q, k, position_ids, base, interleaved, rotary_dim);
}
std::tuple<at::Tensor, at::Tensor> rope_from_positions_backward(const std::optional<at::Tensor>& grad_q_out,
                                                                const std::optional<at::Tensor>& grad_k_out,
                                                                const at::Tensor& position_ids, double base,
                                                                bool interleaved, int64_t rotary_dim) {
  static auto op = typed_op<decltype(rope_from_positions_backward)>("opforge::rope_from_positions_backward");
  return op.call(grad_q_out, grad_k_out, position_ids, base, interleaved, rotary_dim);
}

namespace {

at::Tensor opt(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }
std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}
at::Tensor empty_like_or_undefined(const at::Tensor& t) { return t.defined() ? at::empty_like(t) : at::Tensor(); }

// ---- Meta: the checkers, then outputs allocated as the real kernels do (rotary::make_problem) -----------------

std::tuple<at::Tensor, at::Tensor> rope_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin, bool, int64_t rotary_dim) {
  rotary::check_rope("rope", "q", q, "k", k, cos, sin, rotary_dim);
  return {at::empty_like(q), at::empty_like(k)};
}

std::tuple<at::Tensor, at::Tensor> rope_backward_meta(const std::optional<at::Tensor>& grad_q_out,
                                                      const std::optional<at::Tensor>& grad_k_out,
                                                      const at::Tensor& cos, const at::Tensor& sin, bool,
                                                      int64_t rotary_dim) {
  const at::Tensor gq = opt(grad_q_out), gk = opt(grad_k_out);
  if (!gq.defined() && !gk.defined()) return {};
  rotary::check_rope("rope_backward", "grad_q_out", gq, "grad_k_out", gk, cos, sin, rotary_dim);
  return {empty_like_or_undefined(gq), empty_like_or_undefined(gk)};
}

std::tuple<at::Tensor, at::Tensor> rope_from_positions_meta(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& position_ids, double base, bool,
                                                            int64_t rotary_dim) {
  rotary::check_rope_from_positions("rope_from_positions", "q", q, "k", k, position_ids, base, rotary_dim);
  return {at::empty_like(q), at::empty_like(k)};
}

std::tuple<at::Tensor, at::Tensor> rope_from_positions_backward_meta(const std::optional<at::Tensor>& grad_q_out,
                                                                     const std::optional<at::Tensor>& grad_k_out,
                                                                     const at::Tensor& position_ids, double base,
                                                                     bool, int64_t rotary_dim) {
  const at::Tensor gq = opt(grad_q_out), gk = opt(grad_k_out);
  if (!gq.defined() && !gk.defined()) return {};
  rotary::check_rope_from_positions("rope_from_positions_backward", "grad_q_out", gq, "grad_k_out", gk, position_ids,
                                  base, rotary_dim);
  return {empty_like_or_undefined(gq), empty_like_or_undefined(gk)};
}

// ---- Autograd ------------------------------------------------------------------------------------------------
// rope is linear in (q, k): y = A·x with A a per-token block rotation. Its backward is Aᵀ·g (rope_backward), and
// the backward of rope_backward is A·gg (rope). Each node's backward calls the other op through the dispatcher
// (Autograd key included), so with create_graph=True the result is differentiable again: gradients of any order.
// cos, sin and position_ids get no gradient (cos/sin requiring grad is refused in the forward).

// The second of (q, k) for a call where only one is given: a 0-head view of the other (no allocation).
at::Tensor zero_heads_like(const at::Tensor& t) { return t.narrow(1, 0, 0); }

// Node of rope: saved cos, sin; attrs interleaved, rotary_dim; edges q, k.
variable_list rope_backward_fn(const BackwardArgs& a) {
  auto [gq, gk] = opforge::rope_backward(a.needs[0] ? opt(a.grads[0]) : std::nullopt,
                                         a.needs[1] ? opt(a.grads[1]) : std::nullopt, a.saved[0], a.saved[1],
                                         a.attrs[0].toBool(), a.attrs[1].toInt());
  return {gq, gk};
}

// Node of rope_backward: saved cos, sin; attrs interleaved, rotary_dim; edges grad_q_out, grad_k_out.
variable_list rope_backward_backward_fn(const BackwardArgs& a) {
  at::Tensor gq = a.needs[0] ? a.grads[0] : at::Tensor(), gk = a.needs[1] ? a.grads[1] : at::Tensor();
  if (!gq.defined() && !gk.defined()) return {at::Tensor(), at::Tensor()};
  auto [yq, yk] = opforge::rope(gq.defined() ? gq : zero_heads_like(gk), gk.defined() ? gk : zero_heads_like(gq),
                                a.saved[0], a.saved[1], a.attrs[0].toBool(), a.attrs[1].toInt());
  return {gq.defined() ? yq : at::Tensor(), gk.defined() ? yk : at::Tensor()};
}

// Node of rope_from_positions: saved position_ids; attrs base, interleaved, rotary_dim; edges q, k.
variable_list rope_from_positions_backward_fn(const BackwardArgs& a) {
  auto [gq, gk] = opforge::rope_from_positions_backward(
      a.needs[0] ? opt(a.grads[0]) : std::nullopt, a.needs[1] ? opt(a.grads[1]) : std::nullopt, a.saved[0],
      a.attrs[0].toDouble(), a.attrs[1].toBool(), a.attrs[2].toInt());
  return {gq, gk};
}

// Node of rope_from_positions_backward: as above, edges grad_q_out, grad_k_out.
variable_list rope_from_positions_backward_backward_fn(const BackwardArgs& a) {
  at::Tensor gq = a.needs[0] ? a.grads[0] : at::Tensor(), gk = a.needs[1] ? a.grads[1] : at::Tensor();
  if (!gq.defined() && !gk.defined()) return {at::Tensor(), at::Tensor()};
  auto [yq, yk] = opforge::rope_from_positions(gq.defined() ? gq : zero_heads_like(gk),
                                               gk.defined() ? gk : zero_heads_like(gq), a.saved[0],
                                               a.attrs[0].toDouble(), a.attrs[1].toBool(), a.attrs[2].toInt());
  return {gq.defined() ? yq : at::Tensor(), gk.defined() ? yk : at::Tensor()};
}

void check_table_no_grad(const char* op, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK_NOT_IMPLEMENTED(!any_requires_grad(cos, sin), "opforge::", op,
                              ": gradients with respect to cos and sin are not supported; pass them without "
                              "requires_grad (e.g. cos.detach())");
}

// The Autograd kernel of a table op (rope, rope_backward) of two tensors a, b (q and k, or the two incoming
// gradients): records node `node` (backward is also its own double backward) with the table and the attributes.
// cos and sin are refused with a forward-mode tangent or requiring grad, before the forward runs.
template <typename A, typename Forward>
std::tuple<at::Tensor, at::Tensor> table_autograd(const char* op, const char* node, BackwardFn backward, const A& a,
                                                  const A& b, const at::Tensor& cos, const at::Tensor& sin,
                                                  bool interleaved, int64_t rotary_dim, Forward&& forward) {
  check_no_forward_ad(op, cos, sin);
  return autograd_op(
      {op, node, backward, backward}, {kDifferentiable, kDifferentiable},
      [&](bool) {
        check_table_no_grad(op, cos, sin);
        return forward();
      },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>&) {
        n.save(cos);
        n.save(sin);
        n.attr(interleaved);
        n.attr(rotary_dim);
      },
      a, b);
}

std::tuple<at::Tensor, at::Tensor> rope_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                 const at::Tensor& sin, bool interleaved, int64_t rotary_dim) {
  return table_autograd("rope", "opforge::RopeBackward", rope_backward_fn, q, k, cos, sin, interleaved, rotary_dim,
                        [&] { return opforge::rope(q, k, cos, sin, interleaved, rotary_dim); });
}

std::tuple<at::Tensor, at::Tensor> rope_backward_autograd(const std::optional<at::Tensor>& grad_q_out,
                                                          const std::optional<at::Tensor>& grad_k_out,
                                                          const at::Tensor& cos, const at::Tensor& sin,
                                                          bool interleaved, int64_t rotary_dim) {
  return table_autograd("rope_backward", "opforge::RopeBackwardBackward", rope_backward_backward_fn, grad_q_out,
                        grad_k_out, cos, sin, interleaved, rotary_dim, [&] {
                          return opforge::rope_backward(grad_q_out, grad_k_out, cos, sin, interleaved, rotary_dim);
                        });
}

// The Autograd kernel of a positions op (rope_from_positions, rope_from_positions_backward) of two tensors a, b:
// records node `node` (backward is also its own double backward) with position_ids and the attributes.
template <typename A, typename Forward>
std::tuple<at::Tensor, at::Tensor> positions_autograd(const char* op, const char* node, BackwardFn backward,
                                                      const A& a, const A& b, const at::Tensor& position_ids,
                                                      double base, bool interleaved, int64_t rotary_dim,
                                                      Forward&& forward) {
  return autograd_op(
      {op, node, backward, backward}, {kDifferentiable, kDifferentiable}, [&](bool) { return forward(); },
      [&](OpNode& n, const std::tuple<at::Tensor, at::Tensor>&) {
        n.save(position_ids);
        n.attr(base);
        n.attr(interleaved);
        n.attr(rotary_dim);
      },
      a, b);
}

std::tuple<at::Tensor, at::Tensor> rope_from_positions_autograd(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& position_ids, double base,
                                                                bool interleaved, int64_t rotary_dim) {
  return positions_autograd("rope_from_positions", "opforge::RopeFromPositionsBackward",
                            rope_from_positions_backward_fn, q, k, position_ids, base, interleaved, rotary_dim, [&] {
                              return opforge::rope_from_positions(q, k, position_ids, base, interleaved, rotary_dim);
                            });
}

std::tuple<at::Tensor, at::Tensor> rope_from_positions_backward_autograd(
    const std::optional<at::Tensor>& grad_q_out, const std::optional<at::Tensor>& grad_k_out,
    const at::Tensor& position_ids, double base, bool interleaved, int64_t rotary_dim) {
  return positions_autograd("rope_from_positions_backward", "opforge::RopeFromPositionsBackwardBackward",
                            rope_from_positions_backward_backward_fn, grad_q_out, grad_k_out, position_ids, base,
                            interleaved, rotary_dim, [&] {
                              return opforge::rope_from_positions_backward(grad_q_out, grad_k_out, position_ids, base,
                                                                           interleaved, rotary_dim);
                            });
}

}  // namespace

TORCH_LIBRARY_IMPL(opforge, Meta, m) {
  m.impl("rope", &rope_meta);
  m.impl("rope_backward", &rope_backward_meta);
  m.impl("rope_from_positions", &rope_from_positions_meta);
  m.impl("rope_from_positions_backward", &rope_from_positions_backward_meta);
}

TORCH_LIBRARY_IMPL(opforge, Autograd, m) {
  m.impl("rope", &rope_autograd);
  m.impl("rope_backward", &rope_backward_autograd);
  m.impl("rope_from_positions", &rope_from_positions_autograd);
  m.impl("rope_from_positions_backward", &rope_from_positions_backward_autograd);
}

// torch.autocast: no cast (as the elementwise math HF's apply_rotary_pos_emb is made of)
OPFORGE_AUTOCAST(rope, {{"rope", AutocastPolicy::kInputDtype},
                        {"rope_backward", AutocastPolicy::kInputDtype},
                        {"rope_from_positions", AutocastPolicy::kInputDtype},
                        {"rope_from_positions_backward", AutocastPolicy::kInputDtype}})

}  // namespace opforge
