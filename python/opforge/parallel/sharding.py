"""DTensor sharding rules for every opforge operator, its private forward and its backward.

DTensor (`torch.distributed.tensor`) dispatches below autograd: an opforge op called on DTensors first runs its
C++ Autograd kernel, which records the op's node (OpNode) with the DTensor inputs and calls the forward below
autograd; that call reaches DTensor, which picks a sharding from the rules here, redistributes the inputs it has to
and runs the op's CPU/CUDA kernel on the local shards. The node's backward calls `<op>_backward` on DTensor
gradients and saved DTensors, which DTensor dispatches the same way. So every op needs rules for the public op
(called without gradients), the private `_<op>_forward` (what autograd calls) and `<op>_backward`.

A rule lists, for one mesh dimension, the placements under which the op computed on local shards gives exactly the
sharded global result; DTensor expands it over every mesh dimension and picks the cheapest. An input in a placement
no rule accepts (a `Partial` sum into a norm, a token-sharded input of a row-wise linear) is redistributed first:
never a silently wrong result. Placements per op (S = Shard, R = Replicate, P = Partial sum):

| op | placements |
| --- | --- |
| rms_norm, fused_add_rms_norm (and _forward, _rms_norm_apply) | R; S(d) on a leading (token) dim, weight R |
| their backward | as forward; grad_weight P when token-sharded; a P grad_output with R inputs gives P |
| _rms_norm_forward_amax, _fused_add_rms_norm_forward_amax, _swiglu_packed_amax | R only (amax, a max over the whole output, is replicated: a sharded input is gathered) |
| sigmoid, square, swiglu | R or S(d) on any dim, all inputs alike |
| square_add | as square; other S on its matching dim, R where it broadcasts |
| elementwise / swiglu backward | as forward (broadcast grads P); P grad_output with R inputs gives P |
| swiglu_packed, geglu_packed (and backward) | R; S(d) on a leading dim (the packed last dim is never split) |
| geglu (and backward) | as swiglu |
| swiglu_linear (and _forward, backward) | R; token-sharded (input S(d), weight R; grad_weight P) |
| rope, rope_from_positions (and backward) | R; S(1) heads; S(0) batch; S(2) sequence (cos/sin/positions alike) |
| linear, _linear_forward, fake_quant_linear, linear_cat | R; column-wise (weight S(0), bias S(0), output S(-1)); row-wise (input S(-1), weight S(1), output P; no bias, activation none; not fake_quant_linear or linear_cat); token-sharded (input S(d), weight R) |
| their backward | the three strategies' gradients (column-wise: grad_input P; token-sharded: grad_weight P) |
| quantize_fp8 | R; rowwise: S(d) on a leading dim (data and scale alike) |
| _quantize_fp8_weight | R (the scales of Wᵀ run across the output channels, tensorwise's across the whole weight) |
| fp8_linear | R; rowwise: column-wise (weight S(0), bias S(0), output S(-1)) and token-sharded (input S(d), weight R) |
| fp8_linear_backward, _fp8_linear_quantized_backward | R (its rowwise scales run across tokens and output channels; input_amax R) |
| _fp8_linear_forward, _fp8_linear_quantized | R (quantized operands precomputed for whole tensors; input_amax R) |
| indexed_linear (and backward) | R; experts sharded (weight S(0), output P); weight S(1) (column-wise within each expert); token-sharded |
| linear_cross_entropy (all its ops) | vocabulary-parallel when linear_weight is S(0) (opforge.parallel.loss); token-sharded for sum/none; R |
| _linear_cross_entropy_scale_grads | each gradient keeps its placement |
| linear_log_probs (and _forward, backward) | vocabulary-parallel when linear_weight is S(0) (opforge.parallel.loss); R; token-sharded (input, target, outputs S(d); lm_head R; its gradients P) |
| linear_jsd, _linear_jsd_forward | vocabulary-parallel when a head is S(0) (opforge.parallel.loss); R; token-sharded for reduction "sum" (loss P; both inputs and target S(d), heads R) |
| _linear_preference_loss, _linear_preference_forward | R (linear_preference_loss composes the vocabulary-parallel linear_log_probs on DTensors) |

The rules are registered when `opforge.parallel` is imported (`register_sharding_rules()`, idempotent). Ops whose
sharding is not a pure placement rule (experts sharded: the expert index is shifted to the local experts; the
vocabulary-parallel linear_cross_entropy, linear_log_probs and linear_jsd: all-reduce inside; linear_cat_backward: a
list of gradients; square_add_backward: a plain shape carrier for `other`; _linear_cross_entropy_scale_grads: plain
gradients beside DTensor ones) get a DTensor op handler, which redistributes, runs the op on local tensors and wraps
the results. Handlers are defined on a 1-D mesh (the tensor-parallel one: FSDP2 gathers its own mesh dimension before
compute) and raise NotImplementedError on another.

Every forward op (public or private, not a backward) also goes through a handler that first registers, once per
tensor, a gradient hook on each leaf DTensor input that requires grad (`keep_param_placements`): a parameter's
gradient comes back in the parameter's placements even where a rule gathered it (a Partial gradient of a Replicate
parameter stays Partial, as ATen's rules leave it); then the op's own handler runs, or DTensor's dispatch of its rule.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.experimental import register_sharding

__all__ = ["register_sharding_rules", "RULES", "HANDLED", "grad_placements", "keep_param_placements"]

R = Replicate()
P = Partial()

#: op name -> rule function (the placements, one mesh dim), filled by @_rule
RULES: Dict[str, Callable] = {}
#: op name -> DTensor op handler (ops whose sharding needs more than placements)
HANDLED: Dict[str, Callable] = {}


def _rule(*names: str):
    def deco(fn):
        for n in names:
            RULES[n] = fn
        return fn
    return deco


def _opt(t, p):
    """p for a tensor argument that is given, None for an absent optional one."""
    return None if t is None else p


def _ndim(spec) -> int:
    return len(spec.tensor_meta.shape) if spec.tensor_meta is not None else spec.ndim


def _shape(spec) -> tuple:
    return tuple(spec.tensor_meta.shape)


def _leading(n: int) -> List[Shard]:
    return [Shard(d) for d in range(max(n, 0))]


def _grad_of(p, mask: bool, reduced: bool = False):
    """Placement of a gradient: None when not asked for; P when it sums over a sharded dim (reduced)."""
    if not mask:
        return None
    return P if reduced and p != R else p


# ---- rms_norm family ---------------------------------------------------------------------------------

@_rule("rms_norm")
def _rms_norm(input, normalized_shape, weight=None, eps=None):
    return [([p], [p, None, _opt(weight, R), None]) for p in [R, *_leading(_ndim(input) - len(normalized_shape))]]


@_rule("_rms_norm_forward")
def _rms_norm_forward(input, normalized_shape, weight=None, eps=None):
    return [([p, p], [p, None, _opt(weight, R), None])
            for p in [R, *_leading(_ndim(input) - len(normalized_shape))]]


@_rule("_rms_norm_apply")
def _rms_norm_apply(input, rstd, weight=None):
    return [([p], [p, p, _opt(weight, R)]) for p in [R, *_leading(_ndim(rstd))]]


@_rule("fused_add_rms_norm")
def _fused_add_rms_norm(input, residual, normalized_shape, weight=None, eps=None):
    return [([p, p], [p, p, None, _opt(weight, R), None])
            for p in [R, *_leading(_ndim(input) - len(normalized_shape))]]


@_rule("_fused_add_rms_norm_forward")
def _fused_add_rms_norm_forward(input, residual, normalized_shape, weight=None, eps=None):
    return [([p, p, p], [p, p, None, _opt(weight, R), None])
            for p in [R, *_leading(_ndim(input) - len(normalized_shape))]]


# The *_amax ops (FP8 current scaling): amax is the max over the whole output, which no placement of the local results
# expresses (a partial max is not a DTensor placement), so they run replicated only: DTensor gathers a sharded input
# and every rank computes the same, replicated amax (and replicated outputs).
@_rule("_rms_norm_forward_amax")
def _rms_norm_forward_amax(input, normalized_shape, weight=None, eps=None):
    return [([R, R, R], [R, None, _opt(weight, R), None])]


@_rule("_fused_add_rms_norm_forward_amax")
def _fused_add_rms_norm_forward_amax(input, residual, normalized_shape, weight=None, eps=None):
    return [([R, R, R, R], [R, R, None, _opt(weight, R), None])]


@_rule("rms_norm_backward")
def _rms_norm_backward(grad_output, input, rstd, weight, output_mask):
    gw = output_mask[1] and weight is not None
    out = [([_grad_of(p, output_mask[0]), _grad_of(p, gw, reduced=True)], [p, p, p, _opt(weight, R), None])
           for p in [R, *_leading(_ndim(rstd))]]
    # linear in grad_output: a partial sum of gradients stays one
    out.append(([_grad_of(P, output_mask[0]), _grad_of(P, gw)], [P, R, R, _opt(weight, R), None]))
    return out


# ---- elementwise, swiglu ---------------------------------------------------------------------------------

def _all_dims(spec) -> list:
    return [R, *[Shard(d) for d in range(_ndim(spec))]]


@_rule("sigmoid", "square")
def _unary(input):
    return [([p], [p]) for p in _all_dims(input)]


@_rule("sigmoid_backward", "square_backward")
def _unary_backward(grad_output, other):
    return [([p], [p, p]) for p in _all_dims(grad_output)] + [([P], [P, R])]


def _broadcast_placement(input, other, p):
    """other's placement when input is in p: the matching Shard, or R where other broadcasts along p's dim."""
    if p == R:
        return R, False
    d = p.dim
    od = d - (_ndim(input) - _ndim(other))
    if od >= 0 and _shape(other)[od] == _shape(input)[d]:
        return Shard(od), False
    return R, True  # broadcast along the sharded dim: other's gradient is a partial sum


@_rule("square_add")
def _square_add(input, other):
    return [([p], [p, _broadcast_placement(input, other, p)[0]]) for p in _all_dims(input)]


@_rule("swiglu")
def _swiglu(gate, up):
    return [([p], [p, p]) for p in _all_dims(gate)]


@_rule("swiglu_backward")
def _swiglu_backward(grad_output, gate, up):
    return [([p, p], [p, p, p]) for p in _all_dims(gate)] + [([P, P], [P, R, R])]


@_rule("geglu")
def _geglu(gate, up, approximate="none"):
    return [([p], [p, p, None]) for p in _all_dims(gate)]


@_rule("geglu_backward")
def _geglu_backward(grad_output, gate, up, approximate="none"):
    return [([p, p], [p, p, p, None]) for p in _all_dims(gate)] + [([P, P], [P, R, R, None])]


@_rule("geglu_packed")
def _geglu_packed(input, approximate="none"):
    return [([p], [p, None]) for p in [R, *_leading(_ndim(input) - 1)]]


@_rule("geglu_packed_backward")
def _geglu_packed_backward(grad_output, input, approximate="none"):
    return [([p], [p, p, None]) for p in [R, *_leading(_ndim(input) - 1)]] + [([P], [P, R, None])]


@_rule("swiglu_packed")
def _swiglu_packed(input):
    return [([p], [p]) for p in [R, *_leading(_ndim(input) - 1)]]


@_rule("_swiglu_packed_amax")
def _swiglu_packed_amax(input):
    # replicated only, as the rms_norm *_amax ops (a partial max is not a placement)
    return [([R, R], [R])]


@_rule("swiglu_packed_backward")
def _swiglu_packed_backward(grad_output, input):
    return [([p], [p, p]) for p in [R, *_leading(_ndim(input) - 1)]] + [([P], [P, R])]


# ---- rope ------------------------------------------------------------------------------------------------

def _table_placement(q, table, p, seq_dim_from_end: int):
    """cos/sin/position_ids' placement when q (B, H, S, D) is in p: R for heads and replicated; for batch S(0) where
    the table has a batch dim of B (R where it is 1 or absent); for sequence the table's sequence dim."""
    if p == R or p.dim == 1:
        return R
    nd = _ndim(table)
    if p.dim == 0:
        has_batch = nd >= seq_dim_from_end + 1 and _shape(table)[0] == _shape(q)[0] and _shape(q)[0] != 1
        return Shard(0) if has_batch else R
    return Shard(nd - seq_dim_from_end)  # p.dim == 2: the sequence


def _rope_placements(q):
    return [R, Shard(0), Shard(1), Shard(2)]


@_rule("rope")
def _rope(q, k, cos, sin, *, interleaved=False, rotary_dim=-1):
    return [([p, p], [p, p, _table_placement(q, cos, p, 2), _table_placement(q, sin, p, 2)])
            for p in _rope_placements(q)]


@_rule("rope_backward")
def _rope_backward(grad_q_out, grad_k_out, cos, sin, *, interleaved=False, rotary_dim=-1):
    ref = grad_q_out if grad_q_out is not None else grad_k_out
    out = []
    for p in _rope_placements(ref):
        out.append(([_opt(grad_q_out, p), _opt(grad_k_out, p)],
                    [_opt(grad_q_out, p), _opt(grad_k_out, p), _table_placement(ref, cos, p, 2),
                     _table_placement(ref, sin, p, 2)]))
    out.append(([_opt(grad_q_out, P), _opt(grad_k_out, P)], [_opt(grad_q_out, P), _opt(grad_k_out, P), R, R]))
    return out


@_rule("rope_from_positions")
def _rope_from_positions(q, k, position_ids, base=10000.0, *, interleaved=False, rotary_dim=-1):
    return [([p, p], [p, p, _table_placement(q, position_ids, p, 1), None]) for p in _rope_placements(q)]


@_rule("rope_from_positions_backward")
def _rope_from_positions_backward(grad_q_out, grad_k_out, position_ids, base=10000.0, *, interleaved=False,
                                  rotary_dim=-1):
    ref = grad_q_out if grad_q_out is not None else grad_k_out
    out = []
    for p in _rope_placements(ref):
        out.append(([_opt(grad_q_out, p), _opt(grad_k_out, p)],
                    [_opt(grad_q_out, p), _opt(grad_k_out, p), _table_placement(ref, position_ids, p, 1), None]))
    out.append(([_opt(grad_q_out, P), _opt(grad_k_out, P)], [_opt(grad_q_out, P), _opt(grad_k_out, P), R, None]))
    return out


# ---- linear and its variants -----------------------------------------------------------------------------

def _linear_strategies(input, bias, row_wise: bool):
    """(output, input, weight, bias) placements of y = x · Wᵀ + b: replicated, column-wise, row-wise (when allowed)
    and token-sharded."""
    last = _ndim(input) - 1
    out = [(R, R, R, _opt(bias, R)), (Shard(last), R, Shard(0), _opt(bias, Shard(0)))]
    if row_wise and bias is None:
        out.append((P, Shard(last), Shard(1), None))
    out += [(s, s, R, _opt(bias, R)) for s in _leading(last)]
    return out


@_rule("linear")
def _linear(input, weight, bias=None, activation="none"):
    return [([o], [i, w, b, None]) for o, i, w, b in _linear_strategies(input, bias, activation == "none")]


@_rule("_linear_forward")
def _linear_forward(input, weight, bias=None, activation="none"):
    return [([o, o], [i, w, b, None]) for o, i, w, b in _linear_strategies(input, bias, activation == "none")]


def _linear_grad_strategies(grad_output, row_wise: bool):
    """(grad_input, grad_weight, grad_bias, grad_output, input, weight) placements of the linear backward."""
    last = _ndim(grad_output) - 1
    out = [(R, R, R, R, R, R), (P, Shard(0), Shard(0), Shard(last), R, Shard(0))]
    if row_wise:
        out.append((Shard(last), Shard(1), R, R, Shard(last), Shard(1)))
        out.append((P, P, P, P, R, R))  # linear in grad_output
    out += [(s, P, P, s, s, R) for s in _leading(last)]
    return out


def _masked(mask, gi, gw, gb):
    return [gi if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None]


@_rule("linear_backward")
def _linear_backward(grad_output, input, weight, output_mask, bias_dtype=None, activation="none",
                     pre_activation=None):
    return [(_masked(output_mask, gi, gw, gb), [g, i, w, None, None, None, _opt(pre_activation, g)])
            for gi, gw, gb, g, i, w in _linear_grad_strategies(grad_output, activation == "none")]


def _fq_weight_ok(group_size: int) -> bool:
    return group_size != 0  # per-tensor scales need the whole weight


@_rule("fake_quant_linear")
def _fake_quant_linear(input, weight, bias=None, *, weight_bits=4, group_size=-1, symmetric=True, act_quant=False):
    return [([o], [i, w, b]) for o, i, w, b in _linear_strategies(input, bias, False)
            if w == R or _fq_weight_ok(group_size)]


@_rule("_fake_quant_linear_forward")
def _fake_quant_linear_forward(input, weight, bias=None, *, weight_bits=4, group_size=-1, symmetric=True,
                               act_quant=False):
    out = []
    for o, i, w, b in _linear_strategies(input, bias, False):
        if w != R and not _fq_weight_ok(group_size):
            continue
        pa = i if act_quant else R  # without act_quant the input's outputs are empty [0] tensors
        out.append(([o, w, w, pa, pa], [i, w, b]))
    return out


@_rule("fake_quant_linear_backward")
def _fake_quant_linear_backward(grad_output, input, weight, weight_mask, input_mask, output_mask, weight_dtype=None,
                                bias_dtype=None):
    return [(_masked(output_mask, gi, gw, gb), [g, i, w, w, _opt(input_mask, i), None, None, None])
            for gi, gw, gb, g, i, w in _linear_grad_strategies(grad_output, False)]


@_rule("fake_quantize_weight")
def _fake_quantize_weight(weight, bits=4, group_size=-1, symmetric=True):
    out = [([R, R, R, R], [R])]
    if _fq_weight_ok(group_size):
        out.append(([Shard(0)] * 4, [Shard(0)]))
    return out


# ---- fp8: the scales are reductions over whole groups ------------------------------------------------------
# A tensorwise scale is the amax of the whole tensor: any shard would quantize with its own amax, so only R is exact.
# Rowwise scales run along the last dim (per token of the input, per output channel of the weight): column-wise
# (weight S(0)) and token-sharded forwards are exact. The backward quantizes grad_output per column for grad_weight
# (an amax over every token) and the weight per column for grad_input (over the output channels): it runs
# replicated (DTensor gathers its operands), for both granularities. input_amax (the private ops' keyword-only
# max|input|, after the positional arguments in DTensor's list) is the whole tensor's amax: R, like the scales.

@_rule("quantize_fp8")
def _quantize_fp8(input, dtype=None, granularity="tensorwise"):
    out = [([R, R], [R, None, None])]
    if granularity == "rowwise":
        out += [([p, p], [p, None, None]) for p in _leading(_ndim(input) - 1)]
    return out


@_rule("_quantize_fp8_weight")
def _quantize_fp8_weight(weight, granularity="tensorwise"):
    return [([R, R, R, R], [R, None])]


@_rule("fp8_linear")
def _fp8_linear(input, weight, bias=None, *, granularity="tensorwise", grad_dtype=None):
    strategies = _linear_strategies(input, bias, False)
    if granularity != "rowwise":
        strategies = strategies[:1]  # replicated
    return [([o], [i, w, b]) for o, i, w, b in strategies]


@_rule("fp8_linear_backward")
def _fp8_linear_backward(grad_output, input, weight, output_mask, granularity="tensorwise", grad_dtype=None,
                         bias_dtype=None):
    return [(_masked(output_mask, R, R, R), [R, R, R, None, None, None, None])]


@_rule("_fp8_linear_forward")
def _fp8_linear_forward(input, weight, bias=None, weight_data=None, weight_inv_scale=None, *,
                        granularity="tensorwise", grad_dtype=None, input_amax=None):
    return [([R, R, R], [R, R, _opt(bias, R), _opt(weight_data, R), _opt(weight_inv_scale, R),
                         _opt(input_amax, R)])]


@_rule("_fp8_linear_quantized")
def _fp8_linear_quantized(input, weight, weight_data, weight_inv_scale, weight_t_data, weight_t_inv_scale,
                          bias=None, *, granularity="tensorwise", grad_dtype=None, save_input=False,
                          input_amax=None):
    return [([R], [R, R, R, R, R, R, _opt(bias, R), _opt(input_amax, R)])]


@_rule("_fp8_linear_quantized_backward")
def _fp8_linear_quantized_backward(grad_output, input, input_t_data, input_t_inv_scale, weight, weight_t_data,
                                   weight_t_inv_scale, output_mask, granularity="tensorwise", grad_dtype=None,
                                   bias_dtype=None, *, input_amax=None):
    return [(_masked(output_mask, R, R, R), [R, _opt(input, R), _opt(input_t_data, R), _opt(input_t_inv_scale, R),
                                             R, _opt(weight_t_data, R), _opt(weight_t_inv_scale, R), None, None, None,
                                             None, _opt(input_amax, R)])]


@_rule("linear_cat")
def _linear_cat(inputs, weight, bias=None):
    n = len(inputs)
    return [([o], [*([i] * n), w, b]) for o, i, w, b in _linear_strategies(inputs[0], bias, False)]


def _swiglu_linear_strategies(input, bias):
    """(output, input, weight, bias) placements of swiglu_linear: replicated and token-sharded. The interleaved
    gate/up rows make a column-wise split exact only when each shard holds whole pairs and matches its output
    columns, which a placement rule cannot see: a Shard(0) weight is gathered."""
    return [(R, R, R, _opt(bias, R))] + [(s, s, R, _opt(bias, R)) for s in _leading(_ndim(input) - 1)]


@_rule("swiglu_linear")
def _swiglu_linear(input, weight, bias=None):
    return [([o], [i, w, b]) for o, i, w, b in _swiglu_linear_strategies(input, bias)]


@_rule("_swiglu_linear_forward")
def _swiglu_linear_forward(input, weight, bias=None):
    return [([o, o], [i, w, b]) for o, i, w, b in _swiglu_linear_strategies(input, bias)]


@_rule("swiglu_linear_backward")
def _swiglu_linear_backward(grad_output, input, weight, pre_activation, output_mask, bias_dtype=None):
    out = [(_masked(output_mask, R, R, R), [R, R, R, R, None, None])]
    out += [(_masked(output_mask, s, P, P), [s, s, R, s, None, None]) for s in _leading(_ndim(grad_output) - 1)]
    out.append((_masked(output_mask, P, P, P), [P, R, R, R, None, None]))  # linear in grad_output
    return out


# ---- linear_log_probs, linear_jsd (linear_cross_entropy's chunk engine) ---------------------------------
# Each token's value needs the whole vocabulary: replicated, or token-sharded (the input, the target and the per-token
# outputs sharded alike on a leading dim, the head replicated; the head's gradients are partial sums). A Shard(0)
# lm_head is gathered first (no vocabulary-parallel form of these ops).

def _llp_strategies(input, linear_bias):
    """(per-token placement, input, linear_weight, linear_bias) of linear_log_probs: replicated and token-sharded."""
    return [(R, R, R, _opt(linear_bias, R))] + [(s, s, R, _opt(linear_bias, R)) for s in _leading(_ndim(input) - 1)]


@_rule("linear_log_probs")
def _linear_log_probs(input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100,
                      softcap=None, return_entropy=False, chunk_size=None):
    # without return_entropy the entropy output is an empty (0,) tensor on every rank: replicated
    return [([o, o if return_entropy else R], [i, w, o, b, None, None, None, None, None])
            for o, i, w, b in _llp_strategies(input, linear_bias)]


@_rule("_linear_log_probs_forward")
def _linear_log_probs_forward(input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100,
                              softcap=None, return_entropy=False, chunk_size=None):
    # stats (*, 2) shards as the tokens (a leading dim)
    return [([o, o if return_entropy else R, o], [i, w, o, b, None, None, None, None, None])
            for o, i, w, b in _llp_strategies(input, linear_bias)]


@_rule("linear_log_probs_backward")
def _linear_log_probs_backward(grad_log_probs, grad_entropy, input, linear_weight, target, stats, entropy,
                               linear_bias, temperature, ignore_index, softcap, output_mask, chunk_size=None):
    gb = output_mask[2] and linear_bias is not None
    out = []
    for o, i, w, b in _llp_strategies(input, linear_bias):
        out.append(([_grad_of(o, output_mask[0]), _grad_of(o, output_mask[1], reduced=True),
                     _grad_of(o, gb, reduced=True)],
                    [_opt(grad_log_probs, o), _opt(grad_entropy, o), i, w, o, o, _opt(entropy, o), b,
                     None, None, None, None, None]))
    return out


def _jsd_strategies(input, linear_bias, teacher_linear_bias, reduction):
    """(loss, per-token placement, student weight/bias, teacher bias) of linear_jsd: replicated; token-sharded for
    "sum" (the loss a partial sum; "mean" divides by the global count: replicated only)."""
    out = [(R, R, _opt(linear_bias, R), _opt(teacher_linear_bias, R))]
    if reduction == "sum":
        out += [(P, s, _opt(linear_bias, R), _opt(teacher_linear_bias, R)) for s in _leading(_ndim(input) - 1)]
    return out


@_rule("linear_jsd")
def _linear_jsd(input, linear_weight, teacher_input, teacher_linear_weight, target=None, linear_bias=None,
                teacher_linear_bias=None, beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
                chunk_size=None):
    return [([loss], [s, R, s, R, _opt(target, s), b, tb, None, None, None, None, None])
            for loss, s, b, tb in _jsd_strategies(input, linear_bias, teacher_linear_bias, reduction)]


@_rule("_linear_jsd_forward")
def _linear_jsd_forward(input, linear_weight, teacher_input, teacher_linear_weight, target=None, linear_bias=None,
                        teacher_linear_bias=None, beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
                        chunk_size=None, grad_mask=(False, False, False)):
    gb = grad_mask[2] and linear_bias is not None
    return [([loss, _grad_of(s, grad_mask[0]), _grad_of(s, grad_mask[1], reduced=True), _grad_of(s, gb, reduced=True)],
             [s, R, s, R, _opt(target, s), b, tb, None, None, None, None, None, None])
            for loss, s, b, tb in _jsd_strategies(input, linear_bias, teacher_linear_bias, reduction)]


# ---- linear_preference_loss's ops: replicated only (a pair's loss needs both of its sequences and the whole
# vocabulary; a Shard(0) head is gathered first). opforge.losses.linear_preference_loss composes linear_log_probs on
# DTensors instead, whose vocabulary-parallel form keeps the head sharded.

@_rule("_linear_preference_loss")
def _linear_preference_loss(input, linear_weight, target, linear_bias=None, ref_input=None, ref_linear_weight=None,
                            ref_linear_bias=None, ref_chosen_logps=None, ref_rejected_logps=None, loss_type="sigmoid",
                            beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, cpo_alpha=1.0, temperature=1.0,
                            ignore_index=-100, chunk_size=None):
    tensors = [R, R, R] + [_opt(t, R) for t in (linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
                                                 ref_chosen_logps, ref_rejected_logps)]
    return [([R, R, R], tensors + [None] * 8)]


@_rule("_linear_preference_forward")
def _linear_preference_forward(input, linear_weight, target, linear_bias=None, ref_input=None, ref_linear_weight=None,
                               ref_linear_bias=None, ref_chosen_logps=None, ref_rejected_logps=None,
                               loss_type="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, cpo_alpha=1.0,
                               temperature=1.0, ignore_index=-100, chunk_size=None, grad_mask=(False, False, False)):
    tensors = [R, R, R] + [_opt(t, R) for t in (linear_bias, ref_input, ref_linear_weight, ref_linear_bias,
                                                 ref_chosen_logps, ref_rejected_logps)]
    gb = grad_mask[2] and linear_bias is not None
    return [([R, R, R, _grad_of(R, grad_mask[0]), _grad_of(R, grad_mask[1]), _grad_of(R, gb)], tensors + [None] * 9)]


# ---- handlers: ops whose sharding needs more than placements (1-D mesh) ----------------------------------

def _mesh_of(args) -> "torch.distributed.device_mesh.DeviceMesh":
    for a in torch.utils._pytree.tree_leaves(args):
        if isinstance(a, DTensor):
            return a.device_mesh
    raise AssertionError("no DTensor argument")


def to_local(x, mesh, placement):
    """The local tensor of x (a DTensor, or a plain tensor taken as replicated) in `placement` on the 1-D mesh,
    redistributing below autograd where its placement differs; None stays None."""
    if x is None:
        return None
    if not isinstance(x, DTensor):
        if placement == R:
            return x
        x = DTensor.from_local(x, mesh, [R], run_check=False)
    if tuple(x.placements) == (placement,):
        return x._local_tensor
    target = DTensorSpec(mesh, (placement,), tensor_meta=x._spec.tensor_meta)
    return redistribute_local_tensor(x._local_tensor, x._spec, target)


def wrap(local, mesh, placement, global_shape=None):
    """A DTensor of `local` in `placement` on the 1-D mesh; global_shape is required for a Shard placement (local's
    shape for R and P). None stays None."""
    if local is None:
        return None
    if isinstance(placement, Shard) and global_shape is None:
        raise AssertionError("a sharded result needs its global shape")
    shape = torch.Size(global_shape if global_shape is not None else local.shape)
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _placement(x) -> object:
    return x.placements[0] if isinstance(x, DTensor) else R


def _one_dim_mesh(op: str, mesh) -> None:
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"opforge::{op}: its DTensor sharding is defined on a 1-D (tensor-parallel) mesh, but got a {mesh.ndim}-D "
            f"mesh; pass DTensors of the tensor-parallel sub-mesh (FSDP2 gathers its own dimension before compute)")


def _expert_offsets(weight_local: torch.Tensor, mesh) -> int:
    e = weight_local.shape[0]
    return mesh.get_local_rank() * e  # Shard(0) splits experts evenly (torch.chunk): rank r holds [r·e, (r+1)·e)


def _local_index(index: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """index shifted to the local experts [start, start + count); other experts' tokens (and −1) become −1: a zero
    row, so the per-rank outputs sum to the global output."""
    inside = (index >= start) & (index < start + count)
    return torch.where(inside, index - start, torch.full_like(index, -1))


def _even_experts(op: str, weight: DTensor, mesh) -> None:
    if weight.shape[0] % mesh.size() != 0:
        raise ValueError(f"opforge::{op}: expected the number of experts ({weight.shape[0]}) to be divisible by the "
                         f"mesh size ({mesh.size()}) for experts sharded as Shard(0)")


def _indexed_linear_handler(op_call, args, kwargs):
    mesh = _mesh_of((args, kwargs))
    _one_dim_mesh("indexed_linear", mesh)
    input, weight, index = args[:3]
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    pw, pi = _placement(weight), _placement(input)
    t = lambda x, p: to_local(x, mesh, p)  # noqa: E731
    # index_sorted holds for every local index except the expert-sharded one (other ranks' rows become -1 in place)
    kw = {"index_sorted": bool(kwargs.get("index_sorted", False))}
    if isinstance(pw, Shard) and pw.dim == 0:  # experts sharded
        _even_experts("indexed_linear", weight, mesh)
        w = weight._local_tensor
        idx = _local_index(t(index, R), _expert_offsets(w, mesh), w.shape[0])
        out = op_call(t(input, R), w, idx, t(bias, Shard(0)))
        return wrap(out, mesh, P)
    if isinstance(pw, Shard) and pw.dim == 1:  # column-wise inside every expert
        out = op_call(t(input, R), weight._local_tensor, t(index, R), t(bias, Shard(1)), **kw)
        return wrap(out, mesh, Shard(1), (input.shape[0], weight.shape[1]))
    if isinstance(pw, Shard) and pw.dim == 2 and bias is None:  # row-wise
        out = op_call(t(input, Shard(1)), weight._local_tensor, t(index, R), None, **kw)
        return wrap(out, mesh, P)
    if isinstance(pi, Shard) and pi.dim == 0:  # token-sharded
        out = op_call(input._local_tensor, t(weight, R), t(index, Shard(0)), t(bias, R), **kw)
        return wrap(out, mesh, Shard(0), (input.shape[0], weight.shape[1]))
    out = op_call(t(input, R), t(weight, R), t(index, R), t(bias, R), **kw)
    return wrap(out, mesh, R)


def _indexed_linear_backward_handler(op_call, args, kwargs):
    mesh = _mesh_of((args, kwargs))
    _one_dim_mesh("indexed_linear_backward", mesh)
    grad_output, input, weight, index, output_mask = args[:5]
    rest = tuple(args[5:])
    if "bias_dtype" in kwargs:
        rest = (kwargs["bias_dtype"],)
    kw = {"index_sorted": bool(kwargs.get("index_sorted", False))}  # as in the forward's handler
    pw, pi = _placement(weight), _placement(input)
    t = lambda x, p: to_local(x, mesh, p)  # noqa: E731
    gshape = [tuple(input.shape), tuple(weight.shape), tuple(weight.shape[:2])]

    def out(res, placements):
        return tuple(None if r is None or not m else wrap(r, mesh, p, s)
                     for r, m, p, s in zip(res, output_mask, placements, gshape))

    if isinstance(pw, Shard) and pw.dim == 0:
        _even_experts("indexed_linear_backward", weight, mesh)
        w = weight._local_tensor
        idx = _local_index(t(index, R), _expert_offsets(w, mesh), w.shape[0])
        return out(op_call(t(grad_output, R), t(input, R), w, idx, output_mask, *rest), [P, Shard(0), Shard(0)])
    if isinstance(pw, Shard) and pw.dim == 1:
        return out(op_call(t(grad_output, Shard(1)), t(input, R), weight._local_tensor, t(index, R), output_mask,
                           *rest, **kw), [P, Shard(1), Shard(1)])
    if isinstance(pw, Shard) and pw.dim == 2:
        return out(op_call(t(grad_output, R), t(input, Shard(1)), weight._local_tensor, t(index, R), output_mask,
                           *rest, **kw), [Shard(1), Shard(2), R])
    if isinstance(pi, Shard) and pi.dim == 0:
        return out(op_call(t(grad_output, Shard(0)), input._local_tensor, t(weight, R), t(index, Shard(0)),
                           output_mask, *rest, **kw), [Shard(0), P, P])
    return out(op_call(t(grad_output, R), t(input, R), t(weight, R), t(index, R), output_mask, *rest, **kw),
               [R, R, R])


def _linear_cat_backward_handler(op_call, args, kwargs):
    mesh = _mesh_of((args, kwargs))
    _one_dim_mesh("linear_cat_backward", mesh)
    grad_output, inputs, weight, output_mask = args[:4]
    rest = tuple(args[4:])
    pw, pi = _placement(weight), _placement(inputs[0])
    t = lambda x, p: to_local(x, mesh, p)  # noqa: E731
    last = grad_output.ndim - 1
    if isinstance(pw, Shard) and pw.dim == 0:  # column-wise
        gi_p, gw_p, gb_p = P, Shard(0), Shard(0)
        res = op_call(t(grad_output, Shard(last)), [t(x, R) for x in inputs], weight._local_tensor, output_mask, *rest)
    elif isinstance(pi, Shard) and pi.dim < last:  # token-sharded
        gi_p, gw_p, gb_p = pi, P, P
        res = op_call(t(grad_output, pi), [t(x, pi) for x in inputs], t(weight, R), output_mask, *rest)
    else:
        gi_p, gw_p, gb_p = R, R, R
        res = op_call(t(grad_output, R), [t(x, R) for x in inputs], t(weight, R), output_mask, *rest)
    gis, gw, gb = res
    gis = [wrap(g, mesh, gi_p, x.shape) for g, x in zip(gis, inputs)]
    return (gis, wrap(gw, mesh, gw_p, weight.shape) if output_mask[1] else None,
            wrap(gb, mesh, gb_p, (weight.shape[0],)) if output_mask[2] else None)


def _square_add_backward_handler(op_call, args, kwargs):
    """square_add's node saves `other` as an expanded 0-dim tensor (a shape carrier, plain even when other is a
    DTensor): so this op takes its placement from input and builds the local carrier of other's local shape."""
    mesh = _mesh_of((args, kwargs))
    _one_dim_mesh("square_add_backward", mesh)
    grad_output, input, other, output_mask = args[:4]
    p = _placement(input)
    if not isinstance(p, Shard):
        p = R
    po, reduced = (R, False) if p == R else _broadcast_placement(input._spec, _spec_of(other, mesh), p)
    local_other_shape = list(other.shape)
    if isinstance(po, Shard):
        local_other_shape[po.dim] = to_local(input, mesh, p).shape[p.dim]
    carrier = torch.empty((), dtype=other.dtype, device=input._local_tensor.device).expand(local_other_shape)
    gi, go = op_call(to_local(grad_output, mesh, p), to_local(input, mesh, p), carrier, output_mask)
    return (wrap(gi, mesh, p, input.shape) if output_mask[0] else None,
            wrap(go, mesh, P if reduced else po, other.shape) if output_mask[1] else None)


def _spec_of(x, mesh):
    if isinstance(x, DTensor):
        return x._spec
    return DTensorSpec(mesh, (R,), tensor_meta=TensorMeta(x.shape, x.stride(), x.dtype))


def _scale_grads_handler(op_call, args, kwargs):
    """_linear_cross_entropy_scale_grads (the scalar grad_output times each saved gradient): each gradient keeps its
    placement, on any mesh; a plain gradient (of a plain input beside a DTensor weight) stays plain."""
    grad_output, *grads = args
    if isinstance(grad_output, DTensor):
        g = grad_output
        if any(not isinstance(p, Replicate) for p in g.placements):
            target = DTensorSpec(g.device_mesh, (R,) * g.device_mesh.ndim, tensor_meta=g._spec.tensor_meta)
            grad_output = redistribute_local_tensor(g._local_tensor, g._spec, target)
        else:
            grad_output = g._local_tensor
    local = [x._local_tensor if isinstance(x, DTensor) else x for x in grads]
    res = op_call(grad_output, *local)
    return tuple(None if r is None else (DTensor(r, x._spec, requires_grad=False) if isinstance(x, DTensor) else r)
                 for r, x in zip(res, grads))


HANDLED.update({"indexed_linear": _indexed_linear_handler, "indexed_linear_backward": _indexed_linear_backward_handler,
                "linear_cat_backward": _linear_cat_backward_handler,
                "square_add_backward": _square_add_backward_handler,
                "_linear_cross_entropy_scale_grads": _scale_grads_handler})


# ---- gradients in their parameter's placements --------------------------------------------------------------
# A rule may gather a parameter (a Shard(0) weight under a replicated-only op, an uneven head split...), and then the
# backward computes its gradient in the gathered placement (R) or as a partial sum (P). A leaf DTensor that requires
# grad (a parameter) gets, once, a gradient hook that redistributes every gradient reaching it to its own placements
# before it is accumulated: R -> Shard is a local slice, P -> Shard a reduce-scatter, Shard(a) -> Shard(b) an
# all-to-all. The one exception is a partial sum into a Replicate parameter, which stays Partial (as ATen's rules
# leave a sequence-parallel norm weight's gradient): the pending sum is reduced where the gradient is used (the
# optimizer step, FSDP2's reduction, a norm), with one all-reduce instead of one per use.

import threading  # noqa: E402

#: the attribute that marks a tensor whose gradient hook is registered (a tensor compares elementwise: no set of them)
_HOOKED = "_opforge_grad_placements_hook"
_DISPATCH_LOCK = threading.RLock()


def grad_placements(param_placements, grad_placements_) -> tuple:
    """The placements a parameter's gradient is brought to: the parameter's own, except that a Partial gradient of a
    Replicate mesh dim stays Partial.

    Args:
        param_placements: the parameter's placements (one per mesh dim).
        grad_placements_: the incoming gradient's placements.

    Returns:
        tuple of Placement.
    """
    return tuple(g if isinstance(q, Replicate) and isinstance(g, Partial) else q
                 for q, g in zip(param_placements, grad_placements_))


def _grad_hook(mesh, placements):
    def hook(grad):
        if not isinstance(grad, DTensor) or grad.device_mesh != mesh:
            return grad
        target = grad_placements(placements, grad.placements)
        if tuple(grad.placements) == target:
            return grad
        return grad.redistribute(mesh, target)
    return hook


def _leaf_of(t):
    """t when it is a leaf; the leaf under a dtype cast (autocast's copy of a parameter: ToCopyBackward over the
    parameter's AccumulateGrad); else None."""
    if t.is_leaf:
        return t
    fn = t.grad_fn
    if fn is not None and fn.name().startswith("ToCopyBackward") and len(fn.next_functions) == 1:
        nxt = fn.next_functions[0][0]
        if nxt is not None and nxt.name().endswith("AccumulateGrad"):
            return nxt.variable
    return None


def keep_param_placements(args) -> None:
    """Registers, once per tensor, the gradient hook above on every leaf DTensor of `args` that requires grad (and on
    the leaf of a dtype-cast copy, as autocast passes a parameter)."""
    if torch.compiler.is_compiling():
        return
    for a in torch.utils._pytree.tree_leaves(args):
        if not (isinstance(a, DTensor) and a.requires_grad):
            continue
        a = _leaf_of(a)
        if isinstance(a, DTensor) and a.requires_grad and not getattr(a, _HOOKED, False):
            a.register_hook(_grad_hook(a.device_mesh, tuple(a.placements)))
            setattr(a, _HOOKED, True)


def _default_dispatch(op_call, args, kwargs):
    """op_call on DTensors through DTensor's own sharding propagation (its rule), bypassing this op's handler."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    with _DISPATCH_LOCK:
        own = handlers.pop(op_call)
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[op_call] = own


def _forward_handler_of(handler):
    """The handler of a forward op (the ops that receive the parameters): the gradient hooks, then the op's own
    handler, or DTensor's dispatch of its rule."""
    def forward(op_call, args, kwargs):
        keep_param_placements((args, kwargs))
        if handler is None:
            return _default_dispatch(op_call, args, kwargs)
        return handler(op_call, args, kwargs)
    return forward


def _is_forward(name: str) -> bool:
    return not name.endswith("_backward") and name != "_linear_cross_entropy_scale_grads"


# ---- registration ----------------------------------------------------------------------------------------

def _is_tensor_type(t) -> bool:
    return "Tensor" in str(t)


def _schema_info(op) -> RuntimeSchemaInfo:
    """Every non-tensor argument is part of the sharding cache key (normalized_shape, output_mask, activation,
    reduction...: the rules depend on them), and lists are flattened."""
    args = op._schema.arguments
    positional = [i for i, a in enumerate(args) if not a.kwarg_only and not _is_tensor_type(a.type)]
    kw = [a.name for a in args if a.kwarg_only and not _is_tensor_type(a.type)]
    return RuntimeSchemaInfo(min(positional) if positional else 100, kw or None, needs_pytree=True)


# ---- ATen ops that opforge's Python losses use and DTensor has no rule for ------------------------------------
# opforge.losses' preference losses (sigmoid, simpo...) differentiate F.logsigmoid: its backward
# aten.log_sigmoid_backward(grad_output, self, buffer) is pointwise (the buffer as self on the CPU, an empty tensor on
# CUDA). Registered only where this torch has no rule of its own.

def _log_sigmoid_backward(grad_output, self, buffer):
    empty = _ndim(buffer) != _ndim(self) or _shape(buffer) != _shape(self)
    out = [([p], [p, p, R if empty else p]) for p in _all_dims(self)]
    out.append(([P], [P, R, R]))  # linear in grad_output
    return out


def _register_aten_gaps() -> None:
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.log_sigmoid_backward.default
    if op not in getattr(propagator, "op_strategy_funcs", {}) and op not in getattr(propagator, "op_to_rules", {}):
        register_sharding(op)(_log_sigmoid_backward)


_registered = False


def register_sharding_rules() -> None:
    """Registers the DTensor sharding rules and handlers of every opforge op in this build (idempotent; called when
    `opforge.parallel` is imported). Ops absent from the build (a library built without one) are skipped."""
    global _registered
    if _registered:
        return
    from . import loss  # noqa: F401  (adds the linear_cross_entropy handlers to HANDLED)

    _register_aten_gaps()

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name, fn in RULES.items():
        if not hasattr(torch.ops.opforge, name):
            continue
        op = getattr(torch.ops.opforge, name).default
        register_sharding(op)(fn)
        propagator.op_to_schema_info[op] = _schema_info(op)
    for name in sorted(set(RULES) | set(HANDLED)):
        if not hasattr(torch.ops.opforge, name):
            continue
        fn = HANDLED.get(name)
        if _is_forward(name):
            fn = _forward_handler_of(fn)
        if fn is not None:
            DTensor._op_dispatcher._custom_op_handlers[getattr(torch.ops.opforge, name).default] = fn
    _registered = True


def covered_ops() -> Sequence[str]:
    """The opforge op names that have a rule or a handler here."""
    return sorted(set(RULES) | set(HANDLED))
