"""Vocabulary-parallel linear_cross_entropy: the lm_head weight `Shard(0)` over the tensor-parallel group.

`opforge.linear_cross_entropy(input, linear_weight, target, ...)` with `linear_weight` a DTensor sharded on its
vocabulary dim (`Shard(0)`, as ColwiseParallel shards an lm_head) runs here, through DTensor op handlers of the
loss's three ops (the public op, `_linear_cross_entropy_forward` that autograd calls, and
`linear_cross_entropy_backward`): each rank computes the logits of its vocabulary slice chunk by chunk, the row max
is all-reduced (max) and the row's sum of exponentials, target logit and weighted logit sum are all-reduced (sum), so
every rank gets the exact global loss and the global (m, r) stats; no rank ever holds more than one chunk of its own
slice, `[chunk, V / ranks]`, of the logits.

Why Python math over local GEMMs and not the C++ kernels per slice: the kernels index a target inside their
vocabulary (a target of another rank's slice is an error, or with ignore_index a token without any gradient), and
their row statistics, label smoothing (ε / V) and mean divisor are of the slice alone; exact slices need the global
max and sum between the logits GEMM and the row's loss, i.e. a collective inside the chunk loop. The chunk loop here
is the same math as the C++ op's (docs/ops/linear_cross_entropy.md), in the accumulation dtype (float32; float64 for
float64), with every reduction option: reduction none/mean/sum, ignore_index, label_smoothing, z_loss, softcap and
class weights (replicated, `(V,)`).

Results as DTensors on the tensor-parallel mesh: loss and stats `Replicate`; grad_input `Partial` (each rank's
`dZ_r · W_r`: DTensor reduces it where the next op needs it, a reduce-scatter under sequence parallelism);
grad_linear_weight and grad_linear_bias `Shard(0)`, like the weight. The input is gathered (all-gather) to every
rank, as Megatron's vocabulary-parallel loss needs it.

Autograd: the op's own C++ node records the call; on the gradient-in-forward path (reduction mean/sum) the forward
computes the gradients of the slice in the same chunk loop and backward scales them
(`_linear_cross_entropy_scale_grads`: each gradient keeps its placement); on the recompute path (reduction none) the
backward handler recomputes each chunk's slice from the global stats.

Without a DTensor weight: `vocab_parallel_forward` / `vocab_parallel_backward` are the same math on plain local
tensors and a process group (a rank's slice starts at `vocab_start`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor

from .sharding import HANDLED, P, R, _one_dim_mesh, _placement, to_local, wrap

__all__ = ["vocab_parallel_forward", "vocab_parallel_backward", "vocab_parallel_jsd_forward",
           "vocab_parallel_log_probs_forward", "vocab_parallel_log_probs_backward", "vocab_slice"]

#: rows per chunk when chunk_size is None: about 32 MiB of float32 logits of the widest slice (ceil(V / ranks),
#: the same on every rank), a multiple of 64
_BUDGET_BYTES = 32 << 20


def vocab_slice(vocab: int, ranks: int, rank: int) -> Tuple[int, int]:
    """(start, size) of rank's slice of `vocab` classes split as `Shard(0)` splits them (torch.chunk: ceil(V / ranks)
    classes a rank, the last ones shorter or empty).

    Args:
        vocab: int. V. ranks: int. The tensor-parallel size. rank: int. This rank's index in [0, ranks).

    Returns:
        (int, int): the first class of the slice and its number of classes.
    """
    step = -(-vocab // ranks)
    start = min(rank * step, vocab)
    return start, min(step, vocab - start)


def _chunk_rows(n: int, width: int, chunk_size: Optional[int], acc_bytes: int) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"opforge::linear_cross_entropy: expected chunk_size >= 1, but got {chunk_size}")
        return min(chunk_size, max(n, 1))
    rows = _BUDGET_BYTES // max(width * acc_bytes, 1)
    rows = max(64, rows // 64 * 64)
    return min(rows, max(n, 1))


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _check_head(op: str, input: Tensor, linear_weight: Tensor, target: Tensor, softcap: Optional[float]) -> None:
    """The checks every vocabulary-parallel head loss shares: softcap, target's dtype, the hidden dims."""
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"{op}: expected softcap > 0, but got {softcap}")
    if target.dtype != torch.int64:
        raise TypeError(f"{op}: expected target of dtype int64, but got {target.dtype}")
    if input.shape[-1] != linear_weight.shape[-1]:
        raise ValueError(f"{op}: expected input's last dim ({input.shape[-1]}) to equal linear_weight's "
                         f"({linear_weight.shape[-1]})")


def _check(input: Tensor, linear_weight: Tensor, target: Tensor, reduction: str, label_smoothing: float,
           z_loss: float, softcap: Optional[float]) -> None:
    op = "opforge::linear_cross_entropy"
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{op}: expected reduction of mean, sum or none, but got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: expected label_smoothing in [0, 1], but got {label_smoothing}")
    if not z_loss >= 0.0:
        raise ValueError(f"{op}: expected z_loss >= 0, but got {z_loss}")
    _check_head(op, input, linear_weight, target, softcap)


def _mm(a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """a · b in the accumulation dtype: a plain GEMM for float32/float64 operands; for 16-bit ones on CUDA a GEMM with
    float32 output (no float32 copy of the operands), on the CPU in float32 copies."""
    if a.dtype == acc and b.dtype == acc:
        return torch.mm(a, b)
    if a.is_cuda and a.dtype == b.dtype:
        try:
            return torch.mm(a, b, out_dtype=acc)
        except (RuntimeError, TypeError):  # a torch or GPU without this GEMM: float32 copies
            pass
    return torch.mm(a.to(acc), b.to(acc))


class _Problem:
    """The flattened problem of one rank: x (N, H), its slice W_r (V_r, H) starting at class `start` of V.

    Memory per chunk of c rows: one `[c, V_r]` logits block in the accumulation dtype, turned in place into the
    exponentials, the probabilities and the logit gradient (plus, with softcap, one block of the cap's derivative and,
    for 16-bit operands on CUDA, a 16-bit copy of the logit gradient for the grad_input GEMM)."""

    def __init__(self, x, w, target, bias, class_weight, start, vocab, ignore_index, label_smoothing, z_loss,
                 softcap, reduction, chunk_size, group, op="opforge::linear_cross_entropy"):
        self.acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        self.x, self.bias = x, None if bias is None else bias.to(self.acc)
        # the weight as the GEMMs read it: itself (float32/float64, or 16-bit on CUDA), else one float32 copy
        self.w = w if w.dtype == self.acc or (w.is_cuda and w.dtype == x.dtype) else w.to(self.acc)
        self.t = target.reshape(-1)
        self.start, self.vocab, self.v_local = start, vocab, w.shape[0]
        self.ignore_index, self.eps, self.z_loss, self.softcap = ignore_index, label_smoothing, z_loss, softcap
        self.reduction, self.group = reduction, group
        self.valid = self.t != ignore_index
        self.bad = self.valid & ((self.t < 0) | (self.t >= vocab))
        if x.device.type == "cpu" and bool(self.bad.any()):
            i = int(self.bad.nonzero()[0, 0])
            raise IndexError(f"{op}: expected targets in [0, {vocab}) or ignore_index "
                             f"({ignore_index}), but got {int(self.t[i])} at position {i}")
        zero = torch.zeros((), dtype=self.acc, device=x.device)
        if class_weight is not None:
            cw = class_weight.to(self.acc)
            self.w_t = torch.where(self.valid, cw[self.t.clamp(0, vocab - 1)], zero)
            self.w_local = cw[start:start + self.v_local]
            self.w_sum = cw.sum()
        else:
            self.w_t = self.valid.to(self.acc)
            self.w_local = None
            self.w_sum = torch.tensor(float(vocab), dtype=self.acc, device=x.device)
        local_t = self.t - start
        self.inside = self.valid & (local_t >= 0) & (local_t < self.v_local)
        self.local_t = local_t.clamp(0, max(self.v_local - 1, 0))
        # the default chunk rows from a width every rank shares (ceil(V / ranks), not this rank's slice): each chunk
        # is a collective, so every rank must run the same chunks
        ranks = dist.get_world_size(group) if group is not None else 1
        self.rows = _chunk_rows(x.shape[0], -(-vocab // ranks), chunk_size, torch.finfo(self.acc).bits // 8)

    def denominator(self) -> Tensor:
        return self.w_t.sum()

    def logits(self, a: int, b: int) -> Tuple[Tensor, Optional[Tensor]]:
        """The chunk's capped logits of the slice (rows a..b) in the accumulation dtype, and with softcap the cap's
        derivative 1 − tanh²(z / c)."""
        x = self.x[a:b]
        z = _mm(x if self.w.dtype == x.dtype else x.to(self.w.dtype), self.w.t(), self.acc)
        if self.bias is not None:
            z.add_(self.bias)
        if self.softcap is None:
            return z, None
        z.div_(self.softcap).tanh_()
        deriv = 1.0 - z * z
        return z.mul_(self.softcap), deriv

    def target_logit(self, z: Tensor, a: int, b: int) -> Tensor:
        if not self.v_local:
            return torch.zeros(b - a, dtype=self.acc, device=z.device)
        picked = z.gather(1, self.local_t[a:b].unsqueeze(1)).squeeze(1)
        return torch.where(self.inside[a:b], picked, torch.zeros((), dtype=self.acc, device=z.device))

    def grad_from_probs(self, p: Tensor, deriv: Optional[Tensor], lse: Tensor, scale: Tensor, a: int, b: int) -> Tensor:
        """p (the chunk's probabilities, overwritten) into d(Σ_i scale_i · loss_i) / d(raw logits) of the slice."""
        valid, w_t = self.valid[a:b], self.w_t[a:b]
        zero = torch.zeros((), dtype=self.acc, device=p.device)
        coef = (1.0 - self.eps) * w_t + self.eps / self.vocab * self.w_sum + 2.0 * self.z_loss * lse
        coef = torch.where(valid, coef, zero)
        coef = torch.where(self.bad[a:b], torch.full_like(coef, float("nan")), coef)
        p.mul_(coef.unsqueeze(1))
        if self.v_local:
            hit = torch.where(self.inside[a:b], -(1.0 - self.eps) * w_t, zero)
            p.scatter_add_(1, self.local_t[a:b].unsqueeze(1), hit.unsqueeze(1))
        if self.eps:
            wl = self.w_local if self.w_local is not None else torch.ones(self.v_local, dtype=self.acc,
                                                                          device=p.device)
            p.addr_(torch.where(valid, torch.full_like(lse, self.eps / self.vocab), zero), wl, alpha=-1.0)
        p.mul_(scale.unsqueeze(1))
        if deriv is not None:
            p.mul_(deriv)
        return p


def _grad_buffers(p: _Problem, mask) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    gi = torch.empty(p.x.shape, dtype=p.acc, device=p.x.device) if mask[0] else None
    gw = torch.zeros((p.v_local, p.x.shape[1]), dtype=p.acc, device=p.x.device) if mask[1] else None
    gb = torch.zeros(p.v_local, dtype=p.acc, device=p.x.device) if mask[2] and p.bias is not None else None
    return gi, gw, gb


def _accumulate(p: _Problem, dz: Tensor, a: int, b: int, gi, gw, gb) -> None:
    if gi is not None:
        gi[a:b] = _mm(dz if p.w.dtype == p.acc else dz.to(p.w.dtype), p.w, p.acc)
    if gw is not None:
        gw.addmm_(dz.t(), p.x[a:b].to(p.acc))
    if gb is not None:
        gb.add_(dz.sum(0))


def _finish(p: _Problem, gi, gw, gb, input_dtype, weight_dtype, bias_dtype):
    return (None if gi is None else gi.to(input_dtype), None if gw is None else gw.to(weight_dtype),
            None if gb is None else gb.to(bias_dtype))


def vocab_parallel_forward(input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Optional[Tensor] = None,
                           weight: Optional[Tensor] = None, reduction: str = "mean", ignore_index: int = -100,
                           label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                           chunk_size: Optional[int] = None, grad_mask=(False, False, False), *, vocab_start: int = 0,
                           vocab_size: Optional[int] = None, group=None):
    """(loss, stats, grad_input, grad_linear_weight, grad_linear_bias) of linear_cross_entropy over a vocabulary split
    across `group`, on plain local tensors: this rank's slice `linear_weight` (V_r, H) of classes
    [vocab_start, vocab_start + V_r) of `vocab_size` (V), the same input (*, H) and target (*) on every rank.

    The formula and arguments are `opforge.linear_cross_entropy`'s (its docs/ops/linear_cross_entropy.md);
    `weight`: the class weights of all V classes, `(V,)`, or None. Per chunk of rows: this slice's logits, the row max
    all-reduced (max), then (Σ exp(z − m), z_target, Σ_j w_j z_j) all-reduced (sum).

    Args:
        grad_mask: which of (grad_input, grad_linear_weight, grad_linear_bias) of `loss.sum()` to compute in the same
            chunk loop (the gradient-in-forward path of the op); None where not asked.
        vocab_start: int. The first class of this rank's slice. Default 0.
        vocab_size: int or None. V; None: V_r (one rank).
        group: the process group of the slices (None: no collective, one rank).

    Returns:
        loss `()` for mean/sum, `(*)` for none, in float32 (float64 for float64); stats `(*, 2)` of the global (m, r);
        grad_input `(*, H)` this rank's partial sum (dZ_r · W_r: sum over ranks for the gradient), in input's dtype;
        grad_linear_weight `(V_r, H)` and grad_linear_bias `(V_r,)` of the slice, in their dtypes.

    Raises:
        ValueError: an unknown reduction; label_smoothing outside [0, 1]; z_loss < 0; softcap <= 0; chunk_size < 1;
            input's H != linear_weight's H.
        TypeError: target not int64.
        IndexError: (CPU) a target outside [0, V) that is not ignore_index (CUDA: that token's loss and gradients
            are NaN, no host synchronisation).
    """
    _check(input, linear_weight, target, reduction, label_smoothing, z_loss, softcap)
    lead = input.shape[:-1]
    x = input.reshape(-1, input.shape[-1])
    vocab = linear_weight.shape[0] if vocab_size is None else vocab_size
    p = _Problem(x, linear_weight, target, linear_bias, weight, vocab_start, vocab, ignore_index, label_smoothing,
                 z_loss, softcap, reduction, chunk_size, group)
    n = x.shape[0]
    m_all = torch.empty(n, dtype=p.acc, device=x.device)
    r_all = torch.empty(n, dtype=p.acc, device=x.device)
    token_loss = torch.empty(n, dtype=p.acc, device=x.device)
    want = any(grad_mask)
    gi, gw, gb = _grad_buffers(p, grad_mask) if want else (None, None, None)
    if want:  # the gradient of loss.sum(): the mean's 1/Σw folded in per row (0 where nothing is valid)
        den = p.denominator()
        s = torch.where(den > 0, 1.0 / den, torch.zeros_like(den)) if reduction == "mean" else torch.ones_like(den)
    for a in range(0, n, p.rows):
        b = min(a + p.rows, n)
        z, deriv = p.logits(a, b)
        m = z.amax(1) if p.v_local else torch.full((b - a,), -float("inf"), dtype=p.acc, device=x.device)
        m = _all_reduce(m, dist.ReduceOp.MAX, group)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        zt = p.target_logit(z, a, b)
        wz = z @ p.w_local if p.w_local is not None else z.sum(1)
        e = z.sub_(m_safe.unsqueeze(1)).exp_()  # z is not needed past here: its block holds exp(z − m)
        sums = _all_reduce(torch.stack([e.sum(1), zt, wz], 1), dist.ReduceOp.SUM, group)
        r = torch.log(sums[:, 0])
        lse = m_safe + r
        loss = (1.0 - p.eps) * p.w_t[a:b] * (lse - sums[:, 1])
        if p.eps:
            loss = loss + p.eps / vocab * (p.w_sum * lse - sums[:, 2])
        if z_loss:
            loss = loss + z_loss * lse * lse
        loss = torch.where(p.valid[a:b], loss, torch.zeros_like(loss))
        token_loss[a:b] = torch.where(p.bad[a:b], torch.full_like(loss, float("nan")), loss)
        m_all[a:b], r_all[a:b] = m, r
        if want:  # e / Σ: the probabilities, in the same block
            probs = e.div_(sums[:, 0].unsqueeze(1))
            _accumulate(p, p.grad_from_probs(probs, deriv, lse, s.expand(b - a), a, b), a, b, gi, gw, gb)
    if reduction == "none":
        out = token_loss.reshape(lead)
    elif reduction == "sum":
        out = token_loss.sum()
    else:
        out = token_loss.sum() / p.denominator()
    stats = torch.stack([m_all, r_all], 1).reshape(*lead, 2)
    gi, gw, gb = _finish(p, gi, gw, gb, input.dtype, linear_weight.dtype,
                         None if linear_bias is None else linear_bias.dtype)
    return out, stats, None if gi is None else gi.reshape(input.shape), gw, gb


def vocab_parallel_backward(grad_output: Tensor, input: Tensor, linear_weight: Tensor, target: Tensor, stats: Tensor,
                            linear_bias: Optional[Tensor], weight: Optional[Tensor], reduction: str, ignore_index: int,
                            label_smoothing: float, z_loss: float, softcap: Optional[float], output_mask,
                            chunk_size: Optional[int] = None, *, vocab_start: int = 0,
                            vocab_size: Optional[int] = None, group=None):
    """(grad_input, grad_linear_weight, grad_linear_bias) of this rank's slice from the global stats of
    `vocab_parallel_forward`: each chunk's logits recomputed, p = exp(z − m − r), and the logit gradient scaled per
    token by grad_output. No collective: the stats are global.

    Args:
        grad_output: `()` for mean/sum, `(*)` for none; float. The loss's gradient.
        input: as `vocab_parallel_forward`, and so are linear_weight, target, linear_bias, weight, reduction,
            ignore_index, label_smoothing, z_loss, softcap, chunk_size, vocab_start, vocab_size and group.
        stats: `(*, 2)` float32 (float64 for float64). The global (m, r) per token from `vocab_parallel_forward`.
        output_mask: which of the three gradients to compute.

    Returns:
        grad_input `(*, H)` in input's dtype, this rank's partial sum (sum over the ranks for the gradient);
        grad_linear_weight `(V_r, H)` and grad_linear_bias `(V_r,)` of the slice in their dtypes; None where not
        asked.

    Raises:
        ValueError, TypeError, IndexError: as `vocab_parallel_forward`.
    """
    _check(input, linear_weight, target, reduction, label_smoothing, z_loss, softcap)
    x = input.reshape(-1, input.shape[-1])
    vocab = linear_weight.shape[0] if vocab_size is None else vocab_size
    p = _Problem(x, linear_weight, target, linear_bias, weight, vocab_start, vocab, ignore_index, label_smoothing,
                 z_loss, softcap, reduction, chunk_size, group)
    st = stats.reshape(-1, 2).to(p.acc)
    g = grad_output.to(p.acc)
    if reduction == "none":
        scale = g.reshape(-1)
    else:
        if reduction == "mean":
            den = p.denominator()
            g = torch.where(den > 0, g / den, torch.zeros_like(g))
        scale = g.expand(x.shape[0])
    gi, gw, gb = _grad_buffers(p, output_mask)
    n = x.shape[0]
    for a in range(0, n, p.rows):
        b = min(a + p.rows, n)
        z, deriv = p.logits(a, b)
        m = st[a:b, 0]
        lse = torch.where(torch.isfinite(m), m, torch.zeros_like(m)) + st[a:b, 1]
        probs = z.sub_(lse.unsqueeze(1)).exp_()
        _accumulate(p, p.grad_from_probs(probs, deriv, lse, scale[a:b], a, b), a, b, gi, gw, gb)
    gi, gw, gb = _finish(p, gi, gw, gb, input.dtype, linear_weight.dtype,
                         None if linear_bias is None else linear_bias.dtype)
    return None if gi is None else gi.reshape(input.shape), gw, gb


def _check_log_probs(input: Tensor, linear_weight: Tensor, target: Tensor, temperature: float,
                     softcap: Optional[float]) -> None:
    op = "opforge::linear_log_probs"
    if not (temperature > 0.0 and temperature != float("inf")):
        raise ValueError(f"{op}: expected temperature > 0 and finite, but got {temperature}")
    _check_head(op, input, linear_weight, target, softcap)


def _log_probs_problem(input, linear_weight, target, linear_bias, ignore_index, softcap, chunk_size, vocab_start,
                       vocab_size, group) -> _Problem:
    x = input.reshape(-1, input.shape[-1])
    vocab = linear_weight.shape[0] if vocab_size is None else vocab_size
    return _Problem(x, linear_weight, target, linear_bias, None, vocab_start, vocab, ignore_index, 0.0, 0.0, softcap,
                    "none", chunk_size, group, op="opforge::linear_log_probs")


def vocab_parallel_log_probs_forward(input: Tensor, linear_weight: Tensor, target: Tensor,
                                     linear_bias: Optional[Tensor] = None, temperature: float = 1.0,
                                     ignore_index: int = -100, softcap: Optional[float] = None,
                                     return_entropy: bool = False, chunk_size: Optional[int] = None, *,
                                     vocab_start: int = 0, vocab_size: Optional[int] = None, group=None):
    """(log_probs, entropy, stats) of linear_log_probs over a vocabulary split across `group`, on plain local tensors:
    log_probs_i = z_t − m − r and entropy_i = r + m − Σ_j p_j z_j of z = cap(x · Wᵀ + b) / temperature, m = max_j z_j,
    r = log Σ_j exp(z_j − m), p = softmax(z) (docs/ops/post_training.md), 0 where target == ignore_index.

    Per chunk of rows: this slice's logits, the row max all-reduced (max), then (Σ exp(z − m), z_target,
    Σ exp(z − m) · z) all-reduced (sum). No rank holds more than one `[chunk, V_r]` block of logits.

    Args:
        input: `(*, H)` float. The same hidden states on every rank.
        linear_weight: `(V_r, H)`. This rank's slice, classes [vocab_start, vocab_start + V_r) of vocab_size (V).
        target: `(*)` int64, the same on every rank. linear_bias: `(V_r,)` the slice's bias, or None.
        temperature, ignore_index, softcap, return_entropy, chunk_size: as `opforge.linear_log_probs`.
        vocab_start: int. Default 0. vocab_size: int or None (V_r: one rank). group: the process group, or None.

    Returns:
        log_probs `(*)` float32 (float64 for float64); entropy `(*)` of the same dtype, or an empty `(0,)` tensor
        without return_entropy; stats `(*, 2)`: the global (m, r) per token, for `vocab_parallel_log_probs_backward`.

    Raises:
        ValueError: temperature not > 0 and finite; softcap <= 0; chunk_size < 1; input's H != linear_weight's H.
        TypeError: target not int64.
        IndexError: (CPU) a target outside [0, V) that is not ignore_index (CUDA: that token's values are NaN).
    """
    _check_log_probs(input, linear_weight, target, temperature, softcap)
    lead = input.shape[:-1]
    p = _log_probs_problem(input, linear_weight, target, linear_bias, ignore_index, softcap, chunk_size, vocab_start,
                           vocab_size, group)
    n = p.x.shape[0]
    lp_all = torch.empty(n, dtype=p.acc, device=input.device)
    ent_all = torch.empty(n, dtype=p.acc, device=input.device)
    m_all = torch.empty(n, dtype=p.acc, device=input.device)
    r_all = torch.empty(n, dtype=p.acc, device=input.device)
    for a in range(0, n, p.rows):
        b = min(a + p.rows, n)
        z, _ = p.logits(a, b)
        z.div_(temperature)
        m = z.amax(1) if p.v_local else torch.full((b - a,), -float("inf"), dtype=p.acc, device=z.device)
        m = _all_reduce(m, dist.ReduceOp.MAX, group)
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        zt = p.target_logit(z, a, b)
        e = torch.exp(z - m_safe.unsqueeze(1))
        sums = _all_reduce(torch.stack([e.sum(1), zt, (e * z).sum(1)], 1), dist.ReduceOp.SUM, group)
        r = torch.log(sums[:, 0])
        zero = torch.zeros((), dtype=p.acc, device=z.device)
        valid, bad = p.valid[a:b], p.bad[a:b]
        lp = torch.where(valid, sums[:, 1] - m_safe - r, zero)
        ent = torch.where(valid, r + m_safe - sums[:, 2] / sums[:, 0], zero)
        lp_all[a:b] = torch.where(bad, torch.full_like(lp, float("nan")), lp)
        ent_all[a:b] = torch.where(bad, torch.full_like(ent, float("nan")), ent)
        m_all[a:b], r_all[a:b] = m_safe, r
    entropy = ent_all.reshape(lead) if return_entropy else torch.empty(0, dtype=p.acc, device=input.device)
    return lp_all.reshape(lead), entropy, torch.stack([m_all, r_all], 1).reshape(*lead, 2)


def vocab_parallel_log_probs_backward(grad_log_probs: Optional[Tensor], grad_entropy: Optional[Tensor],
                                      input: Tensor, linear_weight: Tensor, target: Tensor, stats: Tensor,
                                      entropy: Optional[Tensor], linear_bias: Optional[Tensor], temperature: float,
                                      ignore_index: int, softcap: Optional[float], output_mask,
                                      chunk_size: Optional[int] = None, *, vocab_start: int = 0,
                                      vocab_size: Optional[int] = None, group=None):
    """(grad_input, grad_linear_weight, grad_linear_bias) of this rank's slice of linear_log_probs from the global stats
    of `vocab_parallel_log_probs_forward`: per chunk the logits recomputed, p = exp(z − m − r) and

        dz_j = g_lp ([j = t] − p_j) − g_H p_j ((z_j − m) − (r − H)),   dl_j = dz_j · cap' / temperature

    (0 for an ignored token). No collective: the stats and the entropy H are global.

    Args:
        grad_log_probs, grad_entropy: `(*)` float or None. The outputs' gradients.
        stats: `(*, 2)`. The forward's (m, r). entropy: `(*)` the forward's entropy (needed with grad_entropy).
        output_mask: which of the three gradients to compute. The rest: as `vocab_parallel_log_probs_forward`.

    Returns:
        grad_input `(*, H)` in input's dtype, this rank's partial sum; grad_linear_weight `(V_r, H)` and
        grad_linear_bias `(V_r,)` of the slice in their dtypes; None where not asked.

    Raises:
        As `vocab_parallel_log_probs_forward`.
    """
    _check_log_probs(input, linear_weight, target, temperature, softcap)
    p = _log_probs_problem(input, linear_weight, target, linear_bias, ignore_index, softcap, chunk_size, vocab_start,
                           vocab_size, group)
    n = p.x.shape[0]
    st = stats.reshape(-1, 2).to(p.acc)
    zero = torch.zeros((), dtype=p.acc, device=input.device)
    g_lp = zero.expand(n) if grad_log_probs is None else grad_log_probs.reshape(-1).to(p.acc)
    use_h = grad_entropy is not None and entropy is not None and entropy.numel() == n
    g_h = grad_entropy.reshape(-1).to(p.acc) if use_h else None
    h = entropy.reshape(-1).to(p.acc) if use_h else None
    gi, gw, gb = _grad_buffers(p, output_mask)
    for a in range(0, n, p.rows):
        b = min(a + p.rows, n)
        z, deriv = p.logits(a, b)
        z.div_(temperature)
        m, r = st[a:b, 0], st[a:b, 1]
        probs = torch.exp(z - (m + r).unsqueeze(1))
        valid = p.valid[a:b]
        coef = g_lp[a:b].unsqueeze(1).expand_as(probs).clone()
        if g_h is not None:
            coef = coef + g_h[a:b].unsqueeze(1) * ((z - m.unsqueeze(1)) - (r - h[a:b]).unsqueeze(1))
        dz = probs.mul_(coef).neg_()
        if p.v_local:
            hit = torch.where(p.inside[a:b], g_lp[a:b], zero)
            dz.scatter_add_(1, p.local_t[a:b].unsqueeze(1), hit.unsqueeze(1))
        dz = torch.where(valid.unsqueeze(1), dz, zero)
        dz = torch.where(p.bad[a:b].unsqueeze(1), torch.full_like(dz, float("nan")), dz)
        dz.div_(temperature)
        if deriv is not None:
            dz.mul_(deriv)
        _accumulate(p, dz, a, b, gi, gw, gb)
    gi, gw, gb = _finish(p, gi, gw, gb, input.dtype, linear_weight.dtype,
                         None if linear_bias is None else linear_bias.dtype)
    return None if gi is None else gi.reshape(input.shape), gw, gb


def vocab_parallel_jsd_forward(input: Tensor, linear_weight: Tensor, teacher_input: Tensor,
                               teacher_linear_weight: Tensor, target: Optional[Tensor] = None,
                               linear_bias: Optional[Tensor] = None, teacher_linear_bias: Optional[Tensor] = None,
                               beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                               reduction: str = "mean", chunk_size: Optional[int] = None,
                               grad_mask=(False, False, False), *, vocab_start: int = 0,
                               vocab_size: Optional[int] = None, group=None):
    """(loss, grad_input, grad_linear_weight, grad_linear_bias) of linear_jsd over a vocabulary split across `group`,
    on plain local tensors: both heads' slices of classes [vocab_start, vocab_start + V_r) of vocab_size (V).

    Per token, with p_s, p_t the softmax of the student's and the teacher's logits / temperature and
    m = β p_t + (1 − β) p_s: KL(p_t ‖ p_s) for β = 0, KL(p_s ‖ p_t) for β = 1, else β KL(p_t ‖ m) + (1 − β)
    KL(p_s ‖ m) (docs/ops/post_training.md); summed over the tokens whose target is not ignore_index (all without
    target), divided by their number for "mean". Per chunk: both slices' logits, both row maxima all-reduced (max),
    both sums of exponentials all-reduced (sum), then the divergence sums all-reduced (sum); the student's logit
    gradient (p_s − p_t; p_s (log p_s − log p_t − KL); (1 − β) p_s (log p_s − log m − K), over temperature) feeds the
    gradients of the loss in the same loop.

    Args:
        input: `(*, H)`, teacher_input `(*, Ht)`: the same on every rank. linear_weight `(V_r, H)`,
            teacher_linear_weight `(V_r, Ht)`: this rank's slices; the biases `(V_r,)` or None.
        target: `(*)` int64 or None (the mask only). beta, temperature, ignore_index, reduction ("mean" or "sum"),
            chunk_size: as `opforge.linear_jsd`.
        grad_mask: which of (grad_input, grad_linear_weight, grad_linear_bias) of the loss to compute.
        vocab_start: int. Default 0. vocab_size: int or None (V_r: one rank). group: the process group, or None.

    Returns:
        loss `()` float32 (float64 for float64); grad_input `(*, H)` this rank's partial sum; grad_linear_weight
        `(V_r, H)`, grad_linear_bias `(V_r,)` of the slice; None where not asked.

    Raises:
        ValueError: beta outside [0, 1]; temperature not > 0; reduction not mean/sum; mismatched shapes.
    """
    op = "opforge::linear_jsd"
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"{op}: expected beta in [0, 1], but got {beta}")
    if not (temperature > 0.0 and temperature != float("inf")):
        raise ValueError(f"{op}: expected temperature > 0 and finite, but got {temperature}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{op}: expected reduction of mean or sum, but got {reduction!r}")
    if input.shape[:-1] != teacher_input.shape[:-1]:
        raise ValueError(f"{op}: expected teacher_input's leading shape {list(input.shape[:-1])}, but got "
                         f"{list(teacher_input.shape[:-1])}")
    if linear_weight.shape[0] != teacher_linear_weight.shape[0]:
        raise ValueError(f"{op}: expected both heads to have the same classes, but got {linear_weight.shape[0]} "
                         f"and {teacher_linear_weight.shape[0]}")
    x = input.reshape(-1, input.shape[-1])
    xt = teacher_input.reshape(-1, teacher_input.shape[-1]).to(input.dtype)
    n = x.shape[0]
    if target is None:
        mask_t = torch.zeros(n, dtype=torch.int64, device=x.device)
        ignore = -1
    else:
        mask_t = torch.where(target.reshape(-1) != ignore_index, 0, -1).to(torch.int64)
        ignore = -1
    vocab = linear_weight.shape[0] if vocab_size is None else vocab_size
    ps_ = _Problem(x, linear_weight, mask_t, linear_bias, None, 0, max(vocab, 1), ignore, 0.0, 0.0, None, "sum",
                   chunk_size, group, op=op)
    pt_ = _Problem(xt, teacher_linear_weight.to(input.dtype), mask_t, teacher_linear_bias, None, 0, max(vocab, 1),
                   ignore, 0.0, 0.0, None, "sum", ps_.rows, group, op=op)
    acc, valid = ps_.acc, ps_.valid
    count = valid.sum().to(acc)
    scale = 1.0 / count if reduction == "mean" else torch.ones((), dtype=acc, device=x.device)
    gi, gw, gb = _grad_buffers(ps_, grad_mask)
    total = torch.zeros((), dtype=acc, device=x.device)
    neg_inf = -float("inf")
    for a in range(0, n, ps_.rows):
        b = min(a + ps_.rows, n)
        zs, _ = ps_.logits(a, b)
        zt, _ = pt_.logits(a, b)
        zs.div_(temperature)
        zt.div_(temperature)
        if ps_.v_local:
            m = torch.stack([zs.amax(1), zt.amax(1)], 1)
        else:
            m = torch.full((b - a, 2), neg_inf, dtype=acc, device=x.device)
        m = _all_reduce(m, dist.ReduceOp.MAX, group)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        sums = _all_reduce(torch.stack([torch.exp(zs - m[:, :1]).sum(1), torch.exp(zt - m[:, 1:]).sum(1)], 1),
                           dist.ReduceOp.SUM, group)
        ls = zs.sub_((m[:, 0] + sums[:, 0].log()).unsqueeze(1))  # log p_s, in place
        lt = zt.sub_((m[:, 1] + sums[:, 1].log()).unsqueeze(1))
        p_s, p_t = ls.exp(), lt.exp()
        if beta == 0.0:
            div = _all_reduce((p_t * (lt - ls)).sum(1), dist.ReduceOp.SUM, group)
            dz = p_s - p_t
        elif beta == 1.0:
            div = _all_reduce((p_s * (ls - lt)).sum(1), dist.ReduceOp.SUM, group)
            dz = p_s * (ls - lt - div.unsqueeze(1))
        else:
            lm = torch.log(beta * p_t + (1.0 - beta) * p_s)
            ak = _all_reduce(torch.stack([(p_t * (lt - lm)).sum(1), (p_s * (ls - lm)).sum(1)], 1), dist.ReduceOp.SUM,
                             group)
            div = beta * ak[:, 0] + (1.0 - beta) * ak[:, 1]
            dz = (1.0 - beta) * p_s * (ls - lm - ak[:, 1:])
        v = valid[a:b]
        total = total + torch.where(v, div, torch.zeros_like(div)).sum()
        if any(grad_mask):
            dz = torch.where(v.unsqueeze(1), dz, torch.zeros((), dtype=acc, device=x.device))
            dz.mul_(torch.where(count > 0, scale, torch.zeros_like(scale)) / temperature)
            _accumulate(ps_, dz, a, b, gi, gw, gb)
    loss = total * scale
    gi, gw, gb = _finish(ps_, gi, gw, gb, input.dtype, linear_weight.dtype,
                         None if linear_bias is None else linear_bias.dtype)
    return loss, None if gi is None else gi.reshape(input.shape), gw, gb


# ---- DTensor handlers ------------------------------------------------------------------------------------

_ARGS = ("input", "linear_weight", "target", "linear_bias", "weight", "reduction", "ignore_index", "label_smoothing",
         "z_loss", "softcap", "chunk_size")
_DEFAULTS = {"linear_bias": None, "weight": None, "reduction": "mean", "ignore_index": -100, "label_smoothing": 0.0,
             "z_loss": 0.0, "softcap": None, "chunk_size": None, "grad_mask": [False, False, False]}


def _bind(op_call, args, kwargs, defaults: Optional[dict] = None) -> dict:
    """op_call's arguments by their schema names, `defaults` (linear_cross_entropy's by default) where not given."""
    names = [a.name for a in op_call._schema.arguments]
    return {**(_DEFAULTS if defaults is None else defaults), **dict(zip(names, args)), **kwargs}


def _is_vocab_sharded(w) -> bool:
    return isinstance(w, DTensor) and isinstance(w.placements[0], Shard) and w.placements[0].dim == 0


def _token_sharded(a: dict):
    """The input's Shard(d) on a leading dim when the loss can run per token shard (sum, none), else None."""
    p = _placement(a["input"])
    if isinstance(p, Shard) and p.dim < a["input"].ndim - 1 and a["reduction"] in ("sum", "none") \
            and not _is_sharded_other(a["linear_weight"]):
        return p
    return None


def _is_sharded_other(w) -> bool:
    return isinstance(w, DTensor) and not isinstance(w.placements[0], Replicate)


def _common(a: dict, mesh, op: str = "opforge::linear_cross_entropy"):
    """Local tensors of the vocabulary-parallel problem: input, target and class weights replicated."""
    w = a["linear_weight"]
    start, size = vocab_slice(w.shape[0], mesh.size(), mesh.get_local_rank())
    if size != w._local_tensor.shape[0]:
        raise ValueError(f"{op}: expected the Shard(0) linear_weight's local slice on rank "
                         f"{mesh.get_local_rank()} to have {size} of its {w.shape[0]} rows (torch.chunk's split), but "
                         f"got {w._local_tensor.shape[0]}")
    b = a["linear_bias"]
    if b is not None and tuple(b.shape) != (w.shape[0],):
        raise ValueError(f"{op}: expected linear_bias of shape [{w.shape[0]}], but got "
                         f"{list(b.shape)}")
    bias = to_local(a["linear_bias"], mesh, Shard(0))
    return dict(input=to_local(a["input"], mesh, R), linear_weight=w._local_tensor,
                target=to_local(a["target"], mesh, R), linear_bias=bias, weight=to_local(a.get("weight"), mesh, R),
                vocab_start=start, vocab_size=w.shape[0], group=mesh.get_group())


def _scalars(a: dict) -> dict:
    return {k: a[k] for k in ("reduction", "ignore_index", "label_smoothing", "z_loss", "softcap", "chunk_size")}


def _loss_shape(a: dict) -> tuple:
    return tuple(a["target"].shape) if a["reduction"] == "none" else ()


def _grad_results(a: dict, res, mesh, placements):
    """The gradients as DTensors in `placements`; a gradient of a plain-tensor argument (an input or a bias given as a
    torch Tensor beside a DTensor weight: replicated) comes back as a plain tensor, whole: all-reduced where it is a
    partial sum, all-gathered where it is sharded (the Shard(0) bias gradient of the vocabulary-parallel loss)."""
    shapes = [tuple(a["input"].shape), tuple(a["linear_weight"].shape),
              None if a["linear_bias"] is None else tuple(a["linear_bias"].shape)]
    out = []
    for g, p, s, arg in zip(res, placements, shapes, (a["input"], a["linear_weight"], a["linear_bias"])):
        if g is not None and not isinstance(arg, DTensor):
            if p != R:
                src = DTensorSpec(mesh, (p,), tensor_meta=TensorMeta(torch.Size(s), torch.empty(s, device="meta")
                                                                     .stride(), g.dtype))
                g = redistribute_local_tensor(g, src, DTensorSpec(mesh, (R,), tensor_meta=src.tensor_meta))
            out.append(g)
        else:
            out.append(wrap(g, mesh, p, s))
    return tuple(out)


def _forward_handler(op_call, args, kwargs):
    a = _bind(op_call, args, kwargs)
    full = op_call.name().endswith("_linear_cross_entropy_forward")
    mesh = next(x.device_mesh for x in (a["input"], a["linear_weight"], a["target"]) if isinstance(x, DTensor))
    _one_dim_mesh("linear_cross_entropy", mesh)
    mask = list(a["grad_mask"]) if full else [False, False, False]
    if _is_vocab_sharded(a["linear_weight"]):
        loss, stats, gi, gw, gb = vocab_parallel_forward(**_common(a, mesh), **_scalars(a), grad_mask=mask)
        loss, stats = wrap(loss, mesh, R), wrap(stats, mesh, R)
        grads = _grad_results(a, (gi, gw, gb), mesh, [P, Shard(0), Shard(0)])
    else:
        tok = _token_sharded(a)
        pl = tok if tok is not None else R
        local = [to_local(a["input"], mesh, pl), to_local(a["linear_weight"], mesh, R),
                 to_local(a["target"], mesh, pl), to_local(a["linear_bias"], mesh, R),
                 to_local(a["weight"], mesh, R)]
        sc = _scalars(a)
        res = op_call(*local, sc["reduction"], sc["ignore_index"], sc["label_smoothing"], sc["z_loss"], sc["softcap"],
                      sc["chunk_size"], *([mask] if full else []))
        if not full:
            res = (res,)
        lp = (P if a["reduction"] == "sum" else tok) if tok is not None else R
        loss = wrap(res[0], mesh, lp, _loss_shape(a))
        stats = wrap(res[1], mesh, pl, tuple(a["target"].shape) + (2,)) if full else None
        grads = _grad_results(a, res[2:5], mesh, [pl, P if tok is not None else R, P if tok is not None else R]) \
            if full else (None, None, None)
    return (loss, stats, *grads) if full else loss


def _backward_handler(op_call, args, kwargs):
    a = _bind(op_call, args, kwargs, {"chunk_size": None})
    mesh = next(x.device_mesh for x in (a["input"], a["linear_weight"], a["grad_output"]) if isinstance(x, DTensor))
    _one_dim_mesh("linear_cross_entropy_backward", mesh)
    mask = list(a["output_mask"])
    if _is_vocab_sharded(a["linear_weight"]):
        res = vocab_parallel_backward(to_local(a["grad_output"], mesh, R), stats=to_local(a["stats"], mesh, R),
                                      output_mask=mask, **_common(a, mesh), **_scalars(a))
        return _grad_results(a, res, mesh, [P, Shard(0), Shard(0)])
    tok = _token_sharded(a)
    pl = tok if tok is not None else R
    go = to_local(a["grad_output"], mesh, pl if a["reduction"] == "none" else R)
    res = op_call(go, to_local(a["input"], mesh, pl), to_local(a["linear_weight"], mesh, R),
                  to_local(a["target"], mesh, pl), to_local(a["stats"], mesh, pl),
                  to_local(a["linear_bias"], mesh, R), to_local(a["weight"], mesh, R), a["reduction"],
                  a["ignore_index"], a["label_smoothing"], a["z_loss"], a["softcap"], mask, a["chunk_size"])
    red = P if tok is not None else R
    return _grad_results(a, res, mesh, [pl, red, red])


HANDLED.update({"linear_cross_entropy": _forward_handler, "_linear_cross_entropy_forward": _forward_handler,
                "linear_cross_entropy_backward": _backward_handler})


# ---- linear_log_probs with a Shard(0) lm_head (the post-training losses' op) ------------------------------------

_LP_DEFAULTS = {"linear_bias": None, "temperature": 1.0, "ignore_index": -100, "softcap": None,
                "return_entropy": False, "chunk_size": None}


def _log_probs_call(op_call, args, kwargs, defaults: dict, name: str):
    """(arguments by name, mesh, _common's local tensors without the class weights) of a linear_log_probs op with a
    Shard(0) linear_weight on a 1-D mesh; mesh None when the head is not vocabulary-sharded."""
    a = _bind(op_call, args, kwargs, defaults)
    if not _is_vocab_sharded(a["linear_weight"]):
        return a, None, None
    mesh = a["linear_weight"].device_mesh
    _one_dim_mesh(name, mesh)
    c = _common(a, mesh, op="opforge::linear_log_probs")
    c.pop("weight")
    return a, mesh, c


def _log_probs_forward_handler(op_call, args, kwargs):
    """linear_log_probs and _linear_log_probs_forward: vocabulary-parallel when linear_weight is Shard(0) (log-probs,
    entropy and stats Replicate, the input gathered); otherwise DTensor's dispatch of the op's rule."""
    from .sharding import _default_dispatch

    a, mesh, c = _log_probs_call(op_call, args, kwargs, _LP_DEFAULTS, "linear_log_probs")
    if mesh is None:
        return _default_dispatch(op_call, args, kwargs)
    lp, ent, stats = vocab_parallel_log_probs_forward(
        **c, temperature=a["temperature"], ignore_index=a["ignore_index"], softcap=a["softcap"],
        return_entropy=a["return_entropy"], chunk_size=a["chunk_size"])
    out = (wrap(lp, mesh, R), wrap(ent, mesh, R))
    return (*out, wrap(stats, mesh, R)) if op_call.name().endswith("_linear_log_probs_forward") else out


def _log_probs_backward_handler(op_call, args, kwargs):
    from .sharding import _default_dispatch

    a, mesh, c = _log_probs_call(op_call, args, kwargs, {"chunk_size": None}, "linear_log_probs_backward")
    if mesh is None:
        return _default_dispatch(op_call, args, kwargs)
    res = vocab_parallel_log_probs_backward(
        to_local(a["grad_log_probs"], mesh, R), to_local(a["grad_entropy"], mesh, R),
        stats=to_local(a["stats"], mesh, R),
        entropy=to_local(a["entropy"], mesh, R), temperature=a["temperature"], ignore_index=a["ignore_index"],
        softcap=a["softcap"], output_mask=list(a["output_mask"]), chunk_size=a["chunk_size"], **c)
    return _grad_results(a, res, mesh, [P, Shard(0), Shard(0)])


HANDLED.update({"linear_log_probs": _log_probs_forward_handler,
                "_linear_log_probs_forward": _log_probs_forward_handler,
                "linear_log_probs_backward": _log_probs_backward_handler})


# ---- linear_jsd with Shard(0) heads -------------------------------------------------------------------------------

def _jsd_handler(op_call, args, kwargs):
    """linear_jsd and _linear_jsd_forward: vocabulary-parallel when a head is Shard(0) (both heads and biases taken as
    Shard(0), the inputs and target gathered; the loss Replicate, grad_input Partial, the student's weight and bias
    gradients Shard(0)); otherwise DTensor's dispatch of the op's rule."""
    from .sharding import _default_dispatch

    a = _bind(op_call, args, kwargs, {
        "target": None, "linear_bias": None, "teacher_linear_bias": None, "beta": 0.5, "temperature": 1.0,
        "ignore_index": -100, "reduction": "mean", "chunk_size": None, "grad_mask": [False, False, False]})
    w, tw = a["linear_weight"], a["teacher_linear_weight"]
    if not (_is_vocab_sharded(w) or _is_vocab_sharded(tw)):
        return _default_dispatch(op_call, args, kwargs)
    mesh = w.device_mesh if isinstance(w, DTensor) else tw.device_mesh
    _one_dim_mesh("linear_jsd", mesh)
    V = w.shape[0]
    start, size = vocab_slice(V, mesh.size(), mesh.get_local_rank())
    for name in ("linear_bias", "teacher_linear_bias"):
        if a[name] is not None and tuple(a[name].shape) != (V,):
            raise ValueError(f"opforge::linear_jsd: expected {name} of shape [{V}], but got {list(a[name].shape)}")
    full = op_call.name().endswith("_linear_jsd_forward")
    mask = list(a["grad_mask"]) if full else [False, False, False]
    loss, gi, gw, gb = vocab_parallel_jsd_forward(
        to_local(a["input"], mesh, R), to_local(w, mesh, Shard(0)), to_local(a["teacher_input"], mesh, R),
        to_local(tw, mesh, Shard(0)), to_local(a["target"], mesh, R), to_local(a["linear_bias"], mesh, Shard(0)),
        to_local(a["teacher_linear_bias"], mesh, Shard(0)), a["beta"], a["temperature"], a["ignore_index"],
        a["reduction"], a["chunk_size"], mask, vocab_start=start, vocab_size=V, group=mesh.get_group())
    loss = wrap(loss, mesh, R)
    if not full:
        return loss
    return (loss, *_grad_results(a, (gi, gw, gb), mesh, [P, Shard(0), Shard(0)]))


HANDLED.update({"linear_jsd": _jsd_handler, "_linear_jsd_forward": _jsd_handler})
