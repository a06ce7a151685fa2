"""Post-training losses on opforge's fused log-probabilities: DPO (sigmoid, IPO, hinge, robust), SimPO, CPO, ORPO, KTO,
GRPO (and its bnpo, dr_grpo and dapo normalisations).

The fused part is `opforge.linear_log_probs` (csrc/ops/linear_cross_entropy): the per-token log-probabilities come
from the hidden states and the lm_head chunk by chunk, never the `(*, V)` logits. What follows is small `(B,)` math
on per-sequence log-probabilities, composed of PyTorch ops (autograd differentiates it):

    sequence_log_probs(input, linear_weight, target)   Σ_t log p(target_t) per sequence (or the mean over its tokens)
    preference_loss(chosen_logps, rejected_logps, ...)  the loss of one of `PREFERENCE_LOSS_TYPES` from those
    kto_loss(...)                                       KTO, whose examples are unpaired
    linear_preference_loss(input, linear_weight, target, ...)   both steps in one native op, the gradient computed
                                                        in its forward chunk loop: a policy head, and the reference
                                                        log-probabilities given or from a reference head
    grpo_loss(log_probs, advantages, mask, ...)         the clipped policy-gradient loss of GRPO on per-token
                                                        log-probabilities, with a KL penalty to a reference
    linear_grpo_loss(input, linear_weight, target, advantages, ...)   the same from a policy head (fused
                                                        log-probabilities; the reference's given or from its head)

Argument names follow TRL (`beta`, `label_smoothing`, `loss_type`, `simpo_gamma`, `cpo_alpha`, `desirable_weight`,
`undesirable_weight`, `epsilon_low`, `epsilon_high`, `delta`, `importance_sampling_level`; chosen first, then rejected,
as TRL's concatenated forward). Each preference loss returns the per-pair losses reduced by `reduction` and the
detached rewards TRL logs; the GRPO losses return the loss and the detached statistics TRL logs.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as TF
from torch import Tensor

from .functional import linear_log_probs

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch without distributed support
    _DTensor = None

__all__ = ["PREFERENCE_LOSS_TYPES", "GRPO_LOSS_TYPES", "sequence_log_probs", "preference_loss", "kto_loss",
           "linear_preference_loss", "grpo_loss", "linear_grpo_loss"]

#: The `loss_type`s of `preference_loss`: DPO's ("sigmoid", "ipo", "hinge", "robust", with reference
#: log-probabilities) and the reference-free "simpo", "cpo" and "orpo".
PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "cpo", "orpo")
_AVERAGED = ("ipo", "simpo", "orpo")  # loss types defined on the per-token mean log-probability (TRL's, the papers')
_REFERENCE = ("sigmoid", "ipo", "hinge", "robust")
#: The `loss_type`s of `grpo_loss`, by how the per-token losses are normalised (TRL's): "grpo" the mean over each
#: sequence's tokens, then over the sequences; "bnpo" the mean over the batch's tokens; "dr_grpo" the sum over
#: B · max_completion_length; "dapo" the sum over the number of counted tokens of the whole (global) batch.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def _reduce(losses: Tensor, reduction: str, op: str) -> Tensor:
    if reduction == "mean":
        return losses.mean()
    if reduction == "sum":
        return losses.sum()
    if reduction == "none":
        return losses
    raise ValueError(f"opforge::{op}: expected reduction to be one of \"none\", \"mean\", \"sum\", but got "
                     f"\"{reduction}\"")


def sequence_log_probs(input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Optional[Tensor] = None, *,
                       temperature: float = 1.0, ignore_index: int = -100, average_log_prob: bool = False,
                       chunk_size: Optional[int] = None) -> Tensor:
    """logps_b = Σ_t log p(target_{b,t}) (or its mean over the sequence's valid tokens) by `opforge.linear_log_probs`.

    Args:
        input: `(B, T, H)` (or `(*, T, H)`) floating. The hidden states, already aligned with target (the caller
            shifts them as for a causal-LM loss).
        linear_weight: `(V, H)` floating. The lm_head weight.
        target: `(B, T)` int64. Token ids, or ignore_index (prompt and padding tokens).
        linear_bias: `(V,)` floating or None. Default: None.
        temperature: float > 0. Default: 1.0.
        ignore_index: int. Default: -100.
        average_log_prob: bool. Divide each sum by the sequence's number of valid tokens (at least 1, so a sequence
            without any valid token gives 0 and zero gradients, not 0/0). Default: False.
        chunk_size: int or None. As `linear_log_probs`. Default: None.

    Returns:
        `(B,)` float32 (float64 for float64 input).

    Raises:
        As `opforge.linear_log_probs`.
    """
    lp = linear_log_probs(input, linear_weight, target, linear_bias, temperature=temperature,
                          ignore_index=ignore_index, chunk_size=chunk_size)
    s = lp.sum(-1)
    if average_log_prob:
        s = s / (target != ignore_index).sum(-1).clamp(min=1).to(s.dtype)
    return s


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x ≤ 0 without cancellation (Mächler 2012): log(−expm1(x)) near 0, log1p(−exp(x)) below
    −ln 2. The naive log1p(−exp(x)) is −inf at x = 0 and loses every digit for x close to 0. x is taken at most
    −tiny (the dtype's smallest normal), so a log-probability of exactly 0 (a sequence without any counted token, or
    a probability that rounds to 1) gives finite odds and no gradient through the bound, not ∞ − ∞ = NaN."""
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    ln2 = 0.6931471805599453
    # each branch evaluated only where its form is finite (an inf in the unused branch's backward would be NaN)
    near = torch.log(-torch.expm1(torch.clamp(x, min=-ln2)))
    far = torch.log1p(-torch.exp(torch.clamp(x, max=-ln2)))
    return torch.where(x > -ln2, near, far)


def preference_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Optional[Tensor] = None,
                    ref_rejected_logps: Optional[Tensor] = None, *, loss_type: str = "sigmoid", beta: float = 0.1,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                    reduction: str = "mean") -> Tuple[Tensor, Tensor, Tensor]:
    """The pairwise preference loss of `loss_type` from per-sequence log-probabilities (TRL's formulas).

    With h = (chosen_logps − rejected_logps) − (ref_chosen_logps − ref_rejected_logps) (DPO's types), σ the
    sigmoid and ε = label_smoothing:

        "sigmoid" (DPO, Rafailov et al. 2023; cDPO with ε):  −(1 − ε) log σ(β h) − ε log σ(−β h)
        "robust" (Chowdhury et al. 2024):                   (−(1 − ε) log σ(β h) + ε log σ(−β h)) / (1 − 2ε)
        "hinge" (SLiC, Zhao et al. 2023):                   max(0, 1 − β h)
        "ipo" (Azar et al. 2023):                           (h − 1 / (2β))², on mean per-token log-probabilities
        "simpo" (Meng et al. 2024), u = chosen − rejected:   −(1 − ε) log σ(β u − γ) − ε log σ(−(β u − γ)), γ =
                                                            simpo_gamma, on mean per-token log-probabilities
        "cpo" (Xu et al. 2024):                             −(1 − ε) log σ(β u) − ε log σ(−β u) (add cpo_alpha ×
                                                            the chosen NLL: `linear_preference_loss`)
        "orpo" (Hong et al. 2024):                          −β log σ(log odds_c − log odds_r), log odds = l −
                                                            log(1 − eˡ), on mean per-token log-probabilities (add
                                                            the chosen NLL: `linear_preference_loss`)

    The caller gives the log-probabilities the type is defined on: summed (`sequence_log_probs`) for "sigmoid",
    "robust", "hinge" and "cpo", averaged over the tokens (`average_log_prob=True`) for "ipo", "simpo" and "orpo";
    `linear_preference_loss` picks it.

    Args:
        chosen_logps: `(B,)` floating. The policy's log-probabilities of the chosen responses.
        rejected_logps: `(B,)` floating. Of the rejected responses.
        ref_chosen_logps: `(B,)` floating or None. The reference model's, for "sigmoid", "robust", "hinge", "ipo"
            (required there; detached). Default: None.
        ref_rejected_logps: `(B,)` floating or None. As ref_chosen_logps. Default: None.
        loss_type: str. One of `PREFERENCE_LOSS_TYPES`. Default: "sigmoid".
        beta: float > 0. Default: 0.1.
        label_smoothing: float in [0, 0.5). The assumed label-flip rate ε ("sigmoid", "robust", "simpo",
            "cpo"). Default: 0.0.
        simpo_gamma: float. SimPO's target reward margin γ. Default: 0.5.
        reduction: str. "mean", "sum" or "none" over the pairs. Default: "mean".

    Returns:
        (loss, chosen_rewards, rejected_rewards): the loss reduced over the B pairs; the detached `(B,)` rewards TRL
            logs (β (logps − ref_logps) with a reference, β logps without).

    Raises:
        ValueError: an unknown loss_type or reduction; a reference missing for a type that needs one; beta ≤ 0;
            label_smoothing outside [0, 0.5); chosen/rejected/reference shapes that differ.

    Source: TRL's `DPOTrainer.dpo_loss`, `CPOTrainer.cpo_loss`, `ORPOTrainer.odds_ratio_loss` (the formulas above);
    ORPO's log(1 − eˡ) is computed without cancellation (log(−expm1(l)) near l = 0, where the naive
    log1p(−exp(l)) gives −inf and NaN gradients), with l at most −tiny (finite at l = 0: a sequence without any
    counted token).
    """
    op = "preference_loss"
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"opforge::{op}: expected loss_type to be one of {', '.join(PREFERENCE_LOSS_TYPES)}, but got "
                         f"\"{loss_type}\"")
    if not beta > 0:
        raise ValueError(f"opforge::{op}: expected beta > 0, but got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"opforge::{op}: expected label_smoothing in [0, 0.5), but got {label_smoothing}")
    if chosen_logps.shape != rejected_logps.shape:
        raise ValueError(f"opforge::{op}: expected rejected_logps of chosen_logps's shape {list(chosen_logps.shape)}, "
                         f"but got {list(rejected_logps.shape)}")
    eps = label_smoothing
    if loss_type in _REFERENCE:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"opforge::{op}: expected ref_chosen_logps and ref_rejected_logps for loss_type "
                             f"\"{loss_type}\", but got None")
        for name, r in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if r.shape != chosen_logps.shape:
                raise ValueError(f"opforge::{op}: expected {name} of chosen_logps's shape {list(chosen_logps.shape)}, "
                                 f"but got {list(r.shape)}")
        ref_c, ref_r = ref_chosen_logps.detach(), ref_rejected_logps.detach()
        h = (chosen_logps - rejected_logps) - (ref_c - ref_r)
        if loss_type == "sigmoid":
            losses = -(1 - eps) * TF.logsigmoid(beta * h) - eps * TF.logsigmoid(-beta * h)
        elif loss_type == "robust":
            losses = (-(1 - eps) * TF.logsigmoid(beta * h) + eps * TF.logsigmoid(-beta * h)) / (1 - 2 * eps)
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * h)
        else:  # ipo
            losses = (h - 1 / (2 * beta)) ** 2
        chosen_rewards = beta * (chosen_logps - ref_c).detach()
        rejected_rewards = beta * (rejected_logps - ref_r).detach()
    else:
        u = chosen_logps - rejected_logps
        if loss_type == "simpo":
            a = beta * u - simpo_gamma
            losses = -(1 - eps) * TF.logsigmoid(a) - eps * TF.logsigmoid(-a)
        elif loss_type == "cpo":
            losses = -(1 - eps) * TF.logsigmoid(beta * u) - eps * TF.logsigmoid(-beta * u)
        else:  # orpo
            log_odds = u - (_log1mexp(chosen_logps) - _log1mexp(rejected_logps))
            losses = -beta * TF.logsigmoid(log_odds)
        chosen_rewards = beta * chosen_logps.detach()
        rejected_rewards = beta * rejected_logps.detach()
    return _reduce(losses, reduction, op), chosen_rewards, rejected_rewards


def kto_loss(chosen_logps: Tensor, rejected_logps: Tensor, kl_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, ref_kl_logps: Tensor, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> Tuple[Tensor, Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024): desirable and undesirable examples, unpaired, against a KL reference point.

        z0 = max(0, mean(kl_logps − ref_kl_logps))   (detached: the reference point)
        loss = mean over the examples of [w_d (1 − σ(β (r_c − z0))) for each desirable one,
                                          w_u (1 − σ(β (z0 − r_r))) for each undesirable one],
        r = logps − ref_logps.

    Args:
        chosen_logps: `(Bc,)` floating. The policy's summed log-probabilities of the desirable examples (may be
            empty).
        rejected_logps: `(Br,)` floating. Of the undesirable examples (may be empty).
        kl_logps: `(Bk,)` floating. Of the mismatched (prompt, completion) pairs of the KL estimate.
        ref_chosen_logps, ref_rejected_logps, ref_kl_logps: the reference model's, same shapes (detached).
        beta: float > 0. Default: 0.1.
        desirable_weight: float. w_d. Default: 1.0.
        undesirable_weight: float. w_u. Default: 1.0.

    Returns:
        (loss, chosen_rewards, rejected_rewards): the mean loss (0 without any example, with zero gradients: never
            0/0) and the detached rewards β r.

    Raises:
        ValueError: beta ≤ 0; a policy/reference shape mismatch.

    Source: TRL's `KTOTrainer.kto_loss` (the formula above; TRL takes the mean with nanmean, which is NaN without
    any example).
    """
    op = "kto_loss"
    if not beta > 0:
        raise ValueError(f"opforge::{op}: expected beta > 0, but got {beta}")
    for name, a, b in (("ref_chosen_logps", chosen_logps, ref_chosen_logps),
                       ("ref_rejected_logps", rejected_logps, ref_rejected_logps),
                       ("ref_kl_logps", kl_logps, ref_kl_logps)):
        if a.shape != b.shape:
            raise ValueError(f"opforge::{op}: expected {name} of shape {list(a.shape)}, but got {list(b.shape)}")
    if kl_logps.numel():
        z0 = (kl_logps - ref_kl_logps).mean().clamp(min=0).detach()
    else:
        z0 = kl_logps.new_zeros(())
    rc = chosen_logps - ref_chosen_logps.detach()
    rr = rejected_logps - ref_rejected_logps.detach()
    losses = torch.cat([desirable_weight * (1 - torch.sigmoid(beta * (rc - z0))),
                        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rr)))])
    loss = losses.sum() / max(losses.numel(), 1)
    return loss, beta * rc.detach(), beta * rr.detach()


def linear_preference_loss(input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Optional[Tensor] = None,
                           *, ref_input: Optional[Tensor] = None, ref_linear_weight: Optional[Tensor] = None,
                           ref_linear_bias: Optional[Tensor] = None, ref_chosen_logps: Optional[Tensor] = None,
                           ref_rejected_logps: Optional[Tensor] = None, loss_type: str = "sigmoid",
                           beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                           cpo_alpha: float = 1.0, temperature: float = 1.0, ignore_index: int = -100,
                           chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """`preference_loss` from a policy head's hidden states, fused: loss = mean_pairs f(l_c, l_r) (+ the chosen NLL).

    The batch holds the B chosen sequences first, then the B rejected ones (TRL's concatenated forward). The
    reference log-probabilities (types "sigmoid", "robust", "hinge", "ipo") are the given ref_chosen_logps /
    ref_rejected_logps, or computed here without gradients from `ref_input` (the reference model's hidden states,
    default: `input`) and `ref_linear_weight` / `ref_linear_bias`. "cpo" adds cpo_alpha × the chosen sequences'
    NLL, "orpo" the chosen NLL (each the mean over the chosen tokens, as TRL's; 0 when no chosen token counts).

    One native op (csrc/ops/linear_cross_entropy/linear_preference.cpp) runs linear_log_probs's chunk loop over
    whole (chosen, rejected) pairs and computes the gradient in the forward: per chunk the policy's logits GEMM, the
    per-token log-probabilities summed per sequence, the reference head's logits GEMM (no gradient), the pair loss's
    closed-form derivative in each sequence's log-probability broadcast to its tokens, then the logit gradient from
    the same logits and its dX, dW GEMMs: 3 GEMMs per chunk for the policy and 1 for a reference head, where
    composing `linear_log_probs` with `preference_loss` recomputes each chunk's logits in backward (4 + 1). The
    `(*, V)` logits never exist. With DTensor arguments (`opforge.parallel`) the loss is that composition, whose
    `linear_log_probs` is vocabulary-parallel for a Shard(0) head.

    Args:
        input: `(2B, T, H)` floating. The policy's final hidden states, aligned with target.
        linear_weight: `(V, H)` floating. The policy's lm_head weight.
        target: `(2B, T)` int64. Token ids, ignore_index on prompt and padding.
        linear_bias: `(V,)` floating or None. Default: None.
        ref_input: `(2B, T, Hr)` floating or None. The reference model's hidden states (converted to input's
            dtype). Default: None (input).
        ref_linear_weight: `(V, Hr)` floating or None. The reference lm_head. Default: None.
        ref_linear_bias: `(V,)` floating or None. Default: None.
        ref_chosen_logps: `(B,)` floating or None. Precomputed reference log-probabilities (summed, or averaged for
            "ipo", as the policy's). Default: None.
        ref_rejected_logps: `(B,)` floating or None. Default: None.
        loss_type, beta, label_smoothing, simpo_gamma: as `preference_loss`.
        cpo_alpha: float. The NLL weight of "cpo". Default: 1.0.
        temperature, ignore_index, chunk_size: as `linear_log_probs` (chunk_size in tokens, rounded down to whole
            pairs of 2T tokens; the default budget too, at least one pair; a chunk_size below 2T keeps its memory
            and recomputes the logits in a second sweep instead).

    Returns:
        (loss, chosen_rewards, rejected_rewards) as `preference_loss` (reduction "mean"): the `()` loss in float32
            (float64 for float64 input); the rewards `(B,)`, detached.

    Raises:
        ValueError: target not `(2B, T)` (an odd batch); a type that needs a reference given neither reference
            log-probabilities nor a reference head, or only one of ref_chosen_logps / ref_rejected_logps; shapes
            that do not match; beta <= 0; label_smoothing outside [0, 0.5); as `linear_log_probs`.
        TypeError: a non-floating input, weight, bias or reference; a target that is not int64.
        RuntimeError: tensors on different devices.

    Source: TRL's `DPOTrainer` (concatenated forward, `dpo_loss`), `CPOTrainer.cpo_loss`,
    `ORPOTrainer.odds_ratio_loss`; the papers under `preference_loss`.
    """
    if _any_dtensor(input, linear_weight, linear_bias, ref_input, ref_linear_weight, ref_linear_bias):
        return _linear_preference_loss_composed(
            input, linear_weight, target, linear_bias, ref_input=ref_input, ref_linear_weight=ref_linear_weight,
            ref_linear_bias=ref_linear_bias, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
            loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
            cpo_alpha=cpo_alpha, temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size)
    loss, logps, ref_logps = _linear_preference_op(
        input, linear_weight, target, linear_bias, ref_input, ref_linear_weight, ref_linear_bias, ref_chosen_logps,
        ref_rejected_logps, loss_type, beta, label_smoothing, simpo_gamma, cpo_alpha, temperature, ignore_index,
        chunk_size)
    b = logps.shape[0] // 2
    if loss_type in _REFERENCE:
        if ref_chosen_logps is not None:
            ref_c, ref_r = ref_chosen_logps.detach(), ref_rejected_logps.detach()
        else:
            ref_c, ref_r = ref_logps[:b], ref_logps[b:]
        return loss, beta * (logps[:b] - ref_c), beta * (logps[b:] - ref_r)
    return loss, beta * logps[:b], beta * logps[b:]


_linear_preference_op = torch.ops.opforge._linear_preference_loss.default


def _any_dtensor(*tensors) -> bool:
    return _DTensor is not None and any(isinstance(t, _DTensor) for t in tensors)


def _linear_preference_loss_composed(input: Tensor, linear_weight: Tensor, target: Tensor,
                                     linear_bias: Optional[Tensor] = None, *, ref_input: Optional[Tensor] = None,
                                     ref_linear_weight: Optional[Tensor] = None,
                                     ref_linear_bias: Optional[Tensor] = None,
                                     ref_chosen_logps: Optional[Tensor] = None,
                                     ref_rejected_logps: Optional[Tensor] = None, loss_type: str = "sigmoid",
                                     beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5,
                                     cpo_alpha: float = 1.0, temperature: float = 1.0, ignore_index: int = -100,
                                     chunk_size: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """`linear_preference_loss` composed of `linear_log_probs` and `preference_loss` (autograd differentiates the
    composition: each chunk's logits recomputed in backward); the DTensor path (a vocabulary-parallel
    `linear_log_probs`) and the fused op's cross-check in the tests. Same arguments, returns and errors."""
    op = "linear_preference_loss"
    if target.dim() != 2 or target.shape[0] % 2:
        raise ValueError(f"opforge::{op}: expected a batch of 2B sequences (chosen, then rejected): target of shape "
                         f"(2B, T), but got target of shape {list(target.shape)}")
    avg = loss_type in _AVERAGED
    kw = dict(temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size)
    lp = linear_log_probs(input, linear_weight, target, linear_bias, **kw)  # (2B, T)
    valid = target != ignore_index
    count = valid.sum(-1)
    logps = lp.sum(-1)
    if avg:
        logps = logps / count.clamp(min=1).to(logps.dtype)
    b = target.shape[0] // 2
    chosen, rejected = logps[:b], logps[b:]
    if loss_type in _REFERENCE and ref_chosen_logps is None and ref_rejected_logps is None:
        if ref_linear_weight is None:
            raise ValueError(f"opforge::{op}: expected ref_chosen_logps / ref_rejected_logps or ref_linear_weight for "
                             f"loss_type \"{loss_type}\", but got None")
        with torch.no_grad():
            ref = sequence_log_probs(input if ref_input is None else ref_input, ref_linear_weight, target,
                                     ref_linear_bias, average_log_prob=avg, **kw)
        ref_chosen_logps, ref_rejected_logps = ref[:b], ref[b:]
    loss, cr, rr = preference_loss(chosen, rejected, ref_chosen_logps, ref_rejected_logps, loss_type=loss_type,
                                   beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma)
    if loss_type in ("cpo", "orpo"):
        # the chosen tokens' mean NLL; every chosen token ignored: 0 and zero gradients (not 0/0)
        nll = -lp[:b].sum() / count[:b].sum().clamp(min=1).to(lp.dtype)
        loss = loss + (cpo_alpha if loss_type == "cpo" else 1.0) * nll
    return loss, cr, rr


def grpo_loss(log_probs: Tensor, advantages: Tensor, mask: Tensor, old_log_probs: Optional[Tensor] = None,
              ref_log_probs: Optional[Tensor] = None, *, loss_type: str = "dapo", beta: float = 0.0,
              epsilon_low: float = 0.2, epsilon_high: Optional[float] = None, delta: Optional[float] = None,
              importance_sampling_level: str = "token", max_completion_length: Optional[int] = None,
              num_items_in_batch: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GRPO's clipped surrogate loss (Shao et al. 2024) on per-token log-probabilities, as TRL's `GRPOTrainer`.

    Per token t of sequence b (m the mask, A_b the sequence's advantage, ε_l / ε_h the clip range):

        log w = lp − old_lp                              (importance_sampling_level "token")
        log w = Σ_t m (lp − old_lp) / max(Σ_t m, 1)      per sequence ("sequence": GSPO, Zheng et al. 2025)
        c1 = w (min(w, delta) with `delta`: two-sided clipping), c2 = clip(w, 1 − ε_l, 1 + ε_h)
        ℓ = −min(c1 A_b, c2 A_b) + β k3,   k3 = exp(ref_lp − lp) − (ref_lp − lp) − 1   (β ≠ 0)

    then normalised by `loss_type` (`GRPO_LOSS_TYPES`) over the counted tokens:

        "grpo":     mean_b [Σ_t m ℓ / max(Σ_t m, 1)]
        "bnpo":     Σ m ℓ / max(Σ m, 1)
        "dr_grpo":  Σ m ℓ / (B · max_completion_length)          (Liu et al. 2025)
        "dapo":     Σ m ℓ / max(num_items_in_batch, 1)          (Yu et al. 2025; default Σ m)

    Tokens outside the mask contribute exactly 0 and get a zero gradient (a `where`, not a product: a non-finite
    per-token value there cannot leak in); a batch without any counted token gives 0 and zero gradients. The loss
    is the one step's; TRL further divides by the gradient-accumulation steps, which the caller does.

    Args:
        log_probs: `(B, T)` floating. The policy's per-token log-probabilities (`opforge.linear_log_probs`).
        advantages: `(B,)` floating. Each completion's advantage (detached).
        mask: `(B, T)` bool or floating (0/1). The completion tokens that count.
        old_log_probs: `(B, T)` floating or None. The sampling policy's (detached); None: log_probs detached (one
            optimisation step per generation, w = 1). Default: None.
        ref_log_probs: `(B, T)` floating or None. The reference model's, required when beta ≠ 0 (detached).
            Default: None.
        loss_type: str. One of `GRPO_LOSS_TYPES`. Default: "dapo" (TRL's).
        beta: float >= 0. The KL coefficient. Default: 0.0 (TRL's: no reference needed).
        epsilon_low: float >= 0. Default: 0.2.
        epsilon_high: float >= 0 or None. Default: None (epsilon_low).
        delta: float > 1 or None. The upper bound of c1 (two-sided clipping, INTELLECT-2). Default: None.
        importance_sampling_level: str. "token" or "sequence". Default: "token".
        max_completion_length: int or None. "dr_grpo"'s constant. Default: None (T).
        num_items_in_batch: int, `()` tensor or None. "dapo"'s normaliser: the counted tokens of the whole batch
            (all ranks and accumulation steps, divided as the caller's loss scaling needs). Default: None (Σ mask).

    Returns:
        (loss, stats): the `()` loss in log_probs's dtype; stats, detached `()` tensors: "clip_ratio_low",
            "clip_ratio_high", "clip_ratio" (the fractions of counted tokens whose ratio was clipped below with a
            negative advantage, above with a positive one, either: TRL's) and, with beta ≠ 0, "kl" (the mean k3 over
            the counted tokens).

    Raises:
        ValueError: an unknown loss_type or importance_sampling_level; log_probs not 2-D; advantages not `(B,)`;
            mask / old_log_probs / ref_log_probs not of log_probs's shape; beta < 0 or beta ≠ 0 without
            ref_log_probs; epsilon_low or epsilon_high < 0; delta ≤ 1; max_completion_length < 1.

    Source: TRL's `GRPOTrainer._compute_loss` (the formulas above), Shao et al. 2024 ("DeepSeekMath"), Yu et al. 2025
    ("DAPO"), Liu et al. 2025 ("Understanding R1-Zero-Like Training"), Zheng et al. 2025 ("GSPO").
    """
    op = "grpo_loss"
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"opforge::{op}: expected loss_type to be one of {', '.join(GRPO_LOSS_TYPES)}, but got "
                         f"\"{loss_type}\"")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"opforge::{op}: expected importance_sampling_level to be one of token, sequence, but got "
                         f"\"{importance_sampling_level}\"")
    if log_probs.dim() != 2:
        raise ValueError(f"opforge::{op}: expected log_probs of shape (B, T), but got {list(log_probs.shape)}")
    B, T = log_probs.shape
    if advantages.shape != (B,):
        raise ValueError(f"opforge::{op}: expected advantages of shape [{B}], but got {list(advantages.shape)}")
    for name, t in (("mask", mask), ("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs)):
        if t is not None and t.shape != log_probs.shape:
            raise ValueError(f"opforge::{op}: expected {name} of log_probs's shape {list(log_probs.shape)}, but got "
                             f"{list(t.shape)}")
    if not beta >= 0:
        raise ValueError(f"opforge::{op}: expected beta >= 0, but got {beta}")
    if beta != 0 and ref_log_probs is None:
        raise ValueError(f"opforge::{op}: expected ref_log_probs with beta = {beta} (the KL penalty), but got None")
    eps_low = epsilon_low
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"opforge::{op}: expected epsilon_low, epsilon_high >= 0, but got {eps_low}, {eps_high}")
    if delta is not None and not delta > 1:
        raise ValueError(f"opforge::{op}: expected delta > 1 (or None), but got {delta}")
    if max_completion_length is not None and max_completion_length < 1:
        raise ValueError(f"opforge::{op}: expected max_completion_length >= 1, but got {max_completion_length}")
    m = mask.bool()
    zero = log_probs.new_zeros(())
    old = log_probs.detach() if old_log_probs is None else old_log_probs.detach()
    adv = advantages.detach().to(log_probs.dtype).unsqueeze(-1)  # (B, 1)
    log_ratio = torch.where(m, log_probs - old, zero)
    seq_count = m.sum(-1, keepdim=True).clamp(min=1).to(log_probs.dtype)  # (B, 1)
    if importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = (log_ratio.sum(-1, keepdim=True) / seq_count).expand(B, T)
    c1 = torch.exp(log_w)
    c2 = torch.clamp(c1, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        c1 = torch.clamp(c1, max=delta)
    per_token = -torch.minimum(c1 * adv, c2 * adv)
    stats: Dict[str, Tensor] = {}
    if beta != 0:
        d = ref_log_probs.detach().to(log_probs.dtype) - log_probs
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    per_token = torch.where(m, per_token, zero)
    total_count = m.sum().clamp(min=1).to(log_probs.dtype)
    if loss_type == "grpo":
        loss = (per_token.sum(-1, keepdim=True) / seq_count).mean() if B else per_token.sum()
    elif loss_type == "bnpo":
        loss = per_token.sum() / total_count
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (B * (T if max_completion_length is None else max_completion_length) or 1)
    else:  # dapo
        n = m.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=log_probs.device)
        loss = per_token.sum() / n.clamp(min=1).to(log_probs.dtype)
    with torch.no_grad():
        w = torch.exp(log_w)
        low = m & (w < 1 - eps_low) & (adv < 0)
        high = m & (w > 1 + eps_high) & (adv > 0)
        stats["clip_ratio_low"] = low.sum() / total_count
        stats["clip_ratio_high"] = high.sum() / total_count
        stats["clip_ratio"] = (low | high).sum() / total_count
        if beta != 0:
            stats["kl"] = torch.where(m, kl, zero).sum() / total_count
    return loss, stats


def linear_grpo_loss(input: Tensor, linear_weight: Tensor, target: Tensor, advantages: Tensor,
                     linear_bias: Optional[Tensor] = None, *, old_log_probs: Optional[Tensor] = None,
                     ref_log_probs: Optional[Tensor] = None, ref_input: Optional[Tensor] = None,
                     ref_linear_weight: Optional[Tensor] = None, ref_linear_bias: Optional[Tensor] = None,
                     loss_type: str = "dapo", beta: float = 0.0, epsilon_low: float = 0.2,
                     epsilon_high: Optional[float] = None, delta: Optional[float] = None,
                     importance_sampling_level: str = "token", max_completion_length: Optional[int] = None,
                     num_items_in_batch: Optional[Tensor] = None, temperature: float = 1.0,
                     ignore_index: int = -100, chunk_size: Optional[int] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """`grpo_loss` from a policy head's hidden states: the per-token log-probabilities fused (`linear_log_probs`).

    The mask is `target != ignore_index` (prompt and padding tokens ignored). With beta ≠ 0 the reference's
    per-token log-probabilities are the given ref_log_probs, or computed here without gradients from `ref_input`
    (the reference model's hidden states, default: `input`) and `ref_linear_weight` / `ref_linear_bias`.

    Args:
        input: `(B, T, H)` floating. The policy's final hidden states of the completions, aligned with target.
        linear_weight: `(V, H)` floating. The policy's lm_head weight.
        target: `(B, T)` int64. The completion token ids, ignore_index where a token does not count.
        advantages: `(B,)` floating. Each completion's advantage.
        linear_bias: `(V,)` floating or None. Default: None.
        old_log_probs, ref_log_probs: `(B, T)` floating or None. As `grpo_loss`. Default: None.
        ref_input: `(B, T, Hr)` floating or None. The reference model's hidden states. Default: None (input).
        ref_linear_weight: `(V, Hr)` floating or None. The reference lm_head. Default: None.
        ref_linear_bias: `(V,)` floating or None. Default: None.
        loss_type, beta, epsilon_low, epsilon_high, delta, importance_sampling_level, max_completion_length,
            num_items_in_batch: as `grpo_loss`.
        temperature: float > 0. The sampling temperature the logits are divided by (TRL's). Default: 1.0.
        ignore_index, chunk_size: as `linear_log_probs`.

    Returns:
        (loss, stats) as `grpo_loss`; the loss in float32 (float64 for float64 input).

    Raises:
        ValueError: target not 2-D; beta ≠ 0 given neither ref_log_probs nor ref_linear_weight; as `grpo_loss` and
            `linear_log_probs`.
    """
    op = "linear_grpo_loss"
    if target.dim() != 2:
        raise ValueError(f"opforge::{op}: expected target of shape (B, T), but got {list(target.shape)}")
    kw = dict(temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size)
    lp = linear_log_probs(input, linear_weight, target, linear_bias, **kw)
    if beta != 0 and ref_log_probs is None:
        if ref_linear_weight is None:
            raise ValueError(f"opforge::{op}: expected ref_log_probs or ref_linear_weight with beta = {beta}, but "
                             f"got None")
        with torch.no_grad():
            ref_log_probs = linear_log_probs(input if ref_input is None else ref_input, ref_linear_weight, target,
                                             ref_linear_bias, **kw)
    return grpo_loss(lp, advantages, target != ignore_index, old_log_probs, ref_log_probs, loss_type=loss_type,
                     beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                     importance_sampling_level=importance_sampling_level,
                     max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch)
