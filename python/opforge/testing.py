"""Float64 references and the tolerance rule, shared by the tests and the benchmarks.

Each `*_reference` function is the readable eager version of an opforge op, evaluated in float64.

The tolerance rule (every test's): an opforge result in dtype `d` passes when its error against the
float64 reference is at most twice the error of the same math done by PyTorch in `d`, plus one unit
of `d`'s rounding (`torch.finfo(d).eps`) to cover results PyTorch happens to get exact. The rule
is applied twice: to the norm-relative error (a global bound) and to the largest elementwise error
(so one wrong element among millions cannot hide).

float64 results are the exception: there the "same math in d" *is* the float64 reference, so its
error is zero by construction and a correct kernel that rounds differently (an fma, another order of
products) would fail. A float64 result instead passes when every element is within
`FLOAT64_TOLERANCE` × max(1, max |reference|) of the reference.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "fused_add_rms_norm_reference",
    "linear_reference",
    "activation_reference",
    "rms_norm_reference",
    "sigmoid_reference",
    "square_reference",
    "square_add_reference",
    "swiglu_reference",
    "swiglu_packed_reference",
    "swiglu_linear_reference",
    "geglu_reference",
    "geglu_packed_reference",
    "assert_matches_reference",
    "relative_error",
    "gemm_error_bound",
    "FLOAT64_TOLERANCE",
]
__all__ += ["linear_cat_reference", "indexed_linear_reference", "experts_present"]  # linear variants
__all__ += ["linear_leaves", "same_bits"]

#: Elementwise bound for float64 results, relative to max(1, the reference's largest magnitude).
FLOAT64_TOLERANCE = 1e-12


def linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    """act(input · weightᵀ + bias) in float64.

    Args:
        input: `(*, K)` floating. The rows.
        weight: `(N, K)` floating. The weight.
        bias: `(N,)` floating or None. The bias. Default: None.
        activation: str. `"none"`, `"relu"`, `"gelu"` (erf form), `"gelu_tanh"` (tanh approximation) or
            `"silu"`, as `torch.nn.functional` computes them. Default: `"none"`.

    Returns:
        `(*, N)` float64.

    Raises:
        ValueError: an unknown activation.
    """
    y = input.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return activation_reference(y, activation)


def linear_leaves(M: int, K: int, N: int, device, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """(input, weight, bias): standard-normal leaf tensors that require grad, the problem of a linear-family test.

    Args:
        M: int. Rows of input.
        K: int. in_features.
        N: int. out_features.
        device: torch.device or str. Where the tensors live.
        dtype: torch.dtype. Their dtype. Default: float32.

    Returns:
        input `(M, K)`, weight `(N, K)`, bias `(N,)`, drawn in that order from the current generator.
    """
    return tuple(torch.randn(*shape, device=device, dtype=dtype, requires_grad=True) for shape in ((M, K), (N, K), (N,)))


def activation_reference(z: Tensor, activation: str) -> Tensor:
    """act(z): the activation of `opforge.linear` through `torch.nn.functional`.

    Args:
        z: `(*)` floating. The pre-activation.
        activation: str. `"none"`, `"relu"`, `"gelu"`, `"gelu_tanh"` or `"silu"`.

    Returns:
        Tensor of z's shape and dtype.

    Raises:
        ValueError: an unknown activation.
    """
    if activation == "none":
        return z
    if activation == "relu":
        return torch.nn.functional.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(z)
    raise ValueError(f"activation_reference: unknown activation {activation!r}")


def rms_norm_reference(input: Tensor, normalized_shape, weight: Optional[Tensor] = None,
                       eps: Optional[float] = None) -> Tensor:
    """input / sqrt(mean(input², over the trailing len(normalized_shape) dims) + eps) · weight in float64.

    Args:
        input: `(*, *normalized_shape)` floating. The values.
        normalized_shape: int or sequence of ints. The trailing dims normalized over.
        weight: `(*normalized_shape)` floating or None. The scale. Default: None.
        eps: float or None. Default: None: float32's machine epsilon for float32/float16/bfloat16 input,
            float64's for float64 (as `torch.nn.functional.rms_norm` computes).

    Returns:
        float64 tensor of input's shape.
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if eps is None:
        eps = torch.finfo(torch.float64 if input.dtype == torch.float64 else torch.float32).eps
    x = input.double()
    dims = tuple(range(-len(normalized_shape), 0))
    y = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    return y * weight.double() if weight is not None else y


def fused_add_rms_norm_reference(input: Tensor, residual: Tensor, normalized_shape, weight: Optional[Tensor] = None,
                                 eps: Optional[float] = None) -> tuple:
    """(rms_norm_reference(input + residual), input + residual), both float64.

    The sum is taken in float64 (not rounded to input's dtype first), so it is the exact math.

    Args:
        input: `(*, *normalized_shape)` floating. The new values.
        residual: input's shape, floating. The residual stream.
        normalized_shape: int or sequence of ints. The trailing dims normalized over.
        weight: `(*normalized_shape)` floating or None. The scale. Default: None.
        eps: float or None. As in `rms_norm_reference`. Default: None.

    Returns:
        (output, residual_out): float64 tensors of input's shape.
    """
    z = input.double() + residual.double()
    if eps is None:
        eps = torch.finfo(torch.float64 if input.dtype == torch.float64 else torch.float32).eps
    return rms_norm_reference(z, normalized_shape, weight, eps), z


def sigmoid_reference(input: Tensor) -> Tensor:
    """1 / (1 + exp(−input)) in float64.

    Args:
        input: `(*)` floating. The values.

    Returns:
        float64 tensor of input's shape.
    """
    return torch.sigmoid(input.double())


def square_reference(input: Tensor) -> Tensor:
    """input² in float64.

    Args:
        input: `(*)` floating. The values.

    Returns:
        float64 tensor of input's shape.
    """
    return input.double() ** 2


def square_add_reference(input: Tensor, other: Tensor) -> Tensor:
    """input² + other in float64.

    Args:
        input: `(*)` floating. The squared term.
        other: any shape that broadcasts to input's, floating. The added term.

    Returns:
        float64 tensor of input's shape.
    """
    return input.double() ** 2 + other.double()


def relative_error(actual: Tensor, reference: Tensor) -> float:
    """‖actual − reference‖₂ / ‖reference‖₂ in float64 (absolute error when the reference is all zeros).

    Args:
        actual: `(*)` floating. The result to judge.
        reference: actual's shape, floating. The reference.

    Returns:
        float.
    """
    a, r = actual.double(), reference.double()
    num = torch.linalg.vector_norm(a - r).item()
    den = torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num


def same_bits(actual: Optional[Tensor], expected: Optional[Tensor]) -> bool:
    """True when the two tensors have the same dtype, shape and bit patterns (NaN payloads, signed zeros and FP8
    bytes included: the test of a kernel that must reproduce another bit for bit), or are both None.

    Args:
        actual: a tensor of any floating dtype (FP8 included), or None.
        expected: the same, or None.

    Returns:
        bool.
    """
    if actual is None or expected is None:
        return actual is None and expected is None
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
    view = ints.get(actual.dtype)
    return torch.equal(actual.view(view), expected.view(view)) if view is not None else torch.equal(actual, expected)


def gemm_error_bound(input: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """K · u · (|input| · |weight|ᵀ), u = eps(dtype) / 2: bounds the rounding error of input·weightᵀ in `dtype`.

    It holds for any summation order (Higham, "Accuracy and Stability of Numerical Algorithms", §3.5, γ_K ≈ K·u
    to first order). A correct GEMM always meets it; an indexing or accumulation bug misses it by orders of
    magnitude.

    Args:
        input: `(*, K)` floating. The rows.
        weight: `(N, K)` floating. The weight.
        dtype: torch.dtype. The dtype the product is computed in.

    Returns:
        `(*, N)` float64, elementwise.
    """
    u = torch.finfo(dtype).eps / 2
    K = input.shape[-1]
    return K * u * (input.detach().double().abs() @ weight.detach().double().abs().t())


def assert_matches_reference(actual: Tensor, reference: Tensor, baseline: Tensor, *, what: str = "output",
                             factor: float = 2.0, bound: Optional[Tensor] = None) -> None:
    """Asserts the tolerance rule for `actual` (opforge, dtype d) against `reference` (float64).

    Args:
        actual: `(*)` floating. opforge's result.
        reference: actual's shape, float64. The float64 reference of the same math.
        baseline: actual's shape and dtype. PyTorch's result of the same math in d (the achievable error).
        what: str. Name used in the failure message. Default: `"output"`.
        factor: float. Allowed ratio to the baseline's error. Default: 2.0.
        bound: broadcastable to actual's shape, floating, or None. An elementwise a-priori error bound (e.g.
            `gemm_error_bound`): an element within it passes even when PyTorch's own result happens to be more
            accurate (a different, equally valid summation order). Default: None.

    Raises:
        AssertionError: shape/dtype mismatch, non-finite where the reference is finite, or an error
            above `factor` × baseline error + eps(d) (norm-relative or elementwise-max); for
            float64, an element further than `FLOAT64_TOLERANCE` × max(1, max |reference|) from the reference.
    """
    assert actual.shape == reference.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference.shape)}"
    assert actual.dtype == baseline.dtype, f"{what}: dtype {actual.dtype} != {baseline.dtype}"
    if actual.numel() == 0:
        return
    a = actual.detach().double().cpu()
    r = reference.detach().double().cpu()
    b = baseline.detach().double().cpu()
    if actual.dtype == torch.float64:  # the baseline is the reference itself: a fixed bound instead
        finite_r = r[torch.isfinite(r)]
        bound = FLOAT64_TOLERANCE * max(1.0, finite_r.abs().max().item() if finite_r.numel() else 0.0)
        torch.testing.assert_close(a, r, rtol=0, atol=bound, equal_nan=True, msg=lambda m: f"{what}: {m}")
        return
    finite = torch.isfinite(r)
    assert torch.equal(torch.isfinite(a), finite), f"{what}: non-finite values where the reference is finite (or v.v.)"
    assert torch.equal(a[~finite], r[~finite]) or torch.isnan(r[~finite]).any(), f"{what}: wrong infinities"
    if bound is not None:
        within = ((a - r).abs() <= bound.detach().double().cpu().expand_as(r)) | ~finite
        if bool(within.all()):
            return
    a, r, b = a[finite], r[finite], b[finite]
    eps = torch.finfo(actual.dtype).eps
    e_ours, e_base = relative_error(a, r), relative_error(b, r)
    assert e_ours <= factor * e_base + eps, (
        f"{what}: norm-relative error {e_ours:.3e} exceeds {factor} x PyTorch's {e_base:.3e} + eps {eps:.1e}")
    scale = r.abs().max().item() if r.numel() else 0.0
    m_ours = (a - r).abs().max().item() if r.numel() else 0.0
    m_base = (b - r).abs().max().item() if r.numel() else 0.0
    assert m_ours <= factor * m_base + eps * max(scale, 1e-30), (
        f"{what}: max elementwise error {m_ours:.3e} exceeds {factor} x PyTorch's {m_base:.3e} + eps x {scale:.3e}")


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) · up in float64.

    Args:
        gate: `(*)` floating. The pre-activation.
        up: gate's shape, floating. The value.

    Returns:
        float64 tensor of gate's shape.
    """
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def swiglu_packed_reference(input: Tensor) -> Tensor:
    """silu(input[..., :I]) · input[..., I:] in float64.

    Args:
        input: `(*, 2I)` floating. gate and up side by side.

    Returns:
        `(*, I)` float64.
    """
    gate, up = input.double().chunk(2, dim=-1)
    return swiglu_reference(gate, up)


def geglu_reference(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) · up in float64, gelu written out (not torch's kernel).

    Args:
        gate: `(*)` floating. The pre-activation.
        up: gate's shape, floating. The value.
        approximate: str. `"none"`: gelu(g) = g/2 · (1 + erf(g/√2)); `"tanh"`:
            gelu(g) = g/2 · (1 + tanh(√(2/π) · (g + 0.044715 · g³))).

    Returns:
        float64 tensor of gate's shape.

    Raises:
        ValueError: approximate not `"none"` or `"tanh"`.
    """
    g = gate.double()
    if approximate == "none":
        act = 0.5 * g * (1.0 + torch.erf(g * math.sqrt(0.5)))
    elif approximate == "tanh":
        act = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)))
    else:
        raise ValueError(f"geglu_reference: expected approximate to be 'none' or 'tanh', but got {approximate!r}")
    return act * up.double()


def geglu_packed_reference(input: Tensor, approximate: str = "none") -> Tensor:
    """gelu(input[..., :I]) · input[..., I:] in float64.

    Args:
        input: `(*, 2I)` floating. gate and up side by side.
        approximate: str. `"none"` or `"tanh"`, as `geglu_reference`.

    Returns:
        `(*, I)` float64.
    """
    gate, up = input.double().chunk(2, dim=-1)
    return geglu_reference(gate, up, approximate)


def swiglu_linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """silu(z[..., 0::2]) · z[..., 1::2] with z = input · weightᵀ + bias, in float64.

    Args:
        input: `(*, K)` floating. The rows.
        weight: `(2I, K)` floating. The gate's and the up projection's rows interleaved (row 2j gate, 2j + 1 up).
        bias: `(2I,)` floating or None, interleaved as weight. Default: None.

    Returns:
        `(*, I)` float64.
    """
    z = linear_reference(input, weight, bias)
    return swiglu_reference(z[..., 0::2], z[..., 1::2])


# ---- linear_cross_entropy ----------------------------------------------------------------------------------

__all__ += ["linear_cross_entropy_reference"]


def linear_cross_entropy_reference(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                                   linear_bias: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                                   reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                                   z_loss: float = 0.0, softcap: Optional[float] = None,
                                   compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """`opforge.linear_cross_entropy` from the full logits, in float64 or `compute_dtype` (differentiable).

    logits = cap(input · linear_weightᵀ + linear_bias); loss = `F.cross_entropy(logits, target, weight,
    ignore_index, label_smoothing, reduction)` + z_loss · Σ_valid lse² (divided like the cross-entropy sum:
    by Σ_valid weight[t] for mean). Gradients by autograd.

    Args:
        input: `(*, H)` floating. The hidden states.
        linear_weight: `(V, H)` floating. The lm_head weight.
        target: `(*)` int64. Class indices, or ignore_index.
        linear_bias: `(V,)` floating or None. Default: None.
        weight: `(V,)` floating or None. Class weights. Default: None.
        reduction: str. `"mean"`, `"sum"` or `"none"`. Default: `"mean"`.
        ignore_index: int. Default: -100.
        label_smoothing: float. Default: 0.0.
        z_loss: float. Default: 0.0.
        softcap: float or None. Default: None.
        compute_dtype: torch.dtype. float64 for the reference, another dtype for the same math in it (the
            baseline of the tolerance rule). Default: float64.

    Returns:
        The loss in compute_dtype: `()` for mean/sum, target's shape for none.
    """
    cd = compute_dtype
    z = input.to(cd) @ linear_weight.to(cd).t()
    if linear_bias is not None:
        z = z + linear_bias.to(cd)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, z.shape[-1])
    t = target.reshape(-1)
    w = None if weight is None else weight.to(cd)
    per_token = torch.nn.functional.cross_entropy(z, t, weight=w, ignore_index=ignore_index, reduction="none",
                                                  label_smoothing=label_smoothing)
    valid = t != ignore_index
    if z_loss:
        lse = torch.logsumexp(z, dim=-1)
        per_token = per_token + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return per_token.reshape(target.shape)
    if reduction == "sum":
        return per_token.sum()
    wt = torch.ones_like(per_token) if w is None else w[t.clamp(0, z.shape[-1] - 1)]
    return per_token.sum() / torch.where(valid, wt, torch.zeros_like(wt)).sum()

# ---- linear_log_probs -----------------------------------------------------------------------------------

__all__ += ["linear_log_probs_reference"]


def linear_log_probs_reference(input: Tensor, linear_weight: Tensor, target: Tensor,
                               linear_bias: Optional[Tensor] = None, *, temperature: float = 1.0,
                               ignore_index: int = -100, softcap: Optional[float] = None,
                               return_entropy: bool = False, compute_dtype: torch.dtype = torch.float64):
    """`opforge.linear_log_probs` from the full logits, in float64 or `compute_dtype` (differentiable).

    z = cap(input · linear_weightᵀ + linear_bias) / temperature; log_probs = log_softmax(z)[target] (TRL's
    `selective_log_softmax`), entropy = −Σ softmax(z) · log_softmax(z) (TRL's `entropy_from_logits`); both 0 where
    target == ignore_index. Gradients by autograd.

    Args:
        input: `(*, H)` floating. The hidden states.
        linear_weight: `(V, H)` floating. The lm_head weight.
        target: `(*)` int64. Token ids, or ignore_index.
        linear_bias: `(V,)` floating or None. Default: None.
        temperature: float. Default: 1.0.
        ignore_index: int. Default: -100.
        softcap: float or None. Default: None.
        return_entropy: bool. Default: False.
        compute_dtype: torch.dtype. Default: float64.

    Returns:
        log_probs `(*)`, or (log_probs, entropy), in compute_dtype.
    """
    cd = compute_dtype
    z = input.to(cd) @ linear_weight.to(cd).t()
    if linear_bias is not None:
        z = z + linear_bias.to(cd)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    lp = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    if not return_entropy:
        return lp
    ent = -(logp.exp() * logp).sum(-1)
    return lp, torch.where(valid, ent, torch.zeros_like(ent))


# ---- linear_jsd ------------------------------------------------------------------------------------------

__all__ += ["linear_jsd_reference"]


def linear_jsd_reference(input: Tensor, linear_weight: Tensor, teacher_input: Tensor, teacher_linear_weight: Tensor,
                         target: Optional[Tensor] = None, *, linear_bias: Optional[Tensor] = None,
                         teacher_linear_bias: Optional[Tensor] = None, beta: float = 0.5, temperature: float = 1.0,
                         ignore_index: int = -100, reduction: str = "mean",
                         compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """`opforge.linear_jsd` from the full logits, in float64 or `compute_dtype` (differentiable in the student).

    The divergences from their definitions on the probabilities: KL(P ‖ Q) = Σ P (log P − log Q) with
    m = β p_t + (1 − β) p_s formed as probabilities (not log-add-exp); the teacher detached.

    Returns:
        `()` in compute_dtype: the per-token divergences summed over the counted tokens, divided by their number
        for "mean".
    """
    cd = compute_dtype
    zs = input.to(cd) @ linear_weight.to(cd).t()
    zt = teacher_input.detach().to(cd) @ teacher_linear_weight.detach().to(cd).t()
    if linear_bias is not None:
        zs = zs + linear_bias.to(cd)
    if teacher_linear_bias is not None:
        zt = zt + teacher_linear_bias.detach().to(cd)
    return linear_jsd_from_logits(zs, zt, target, beta=beta, temperature=temperature, ignore_index=ignore_index,
                                  reduction=reduction)


__all__ += ["linear_jsd_from_logits"]


def linear_jsd_from_logits(zs: Tensor, zt: Tensor, target: Optional[Tensor] = None, *, beta: float = 0.5,
                           temperature: float = 1.0, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """linear_jsd's value from both heads' logits `zs`, `zt` `(N, V)` (biases included; differentiable in both).

    The divergences from their definitions on the probabilities: KL(P ‖ Q) = Σ P (log P − log Q) with
    m = β p_t + (1 − β) p_s formed as probabilities (not log-add-exp); β = 0 is KL(teacher ‖ student), β = 1
    KL(student ‖ teacher).

    Returns:
        `()` in the logits' dtype: the per-token divergences summed over the tokens whose target is not
        ignore_index (every token when target is None), divided by their number for "mean".
    """
    ls, lt = torch.log_softmax(zs / temperature, -1), torch.log_softmax(zt / temperature, -1)
    ps, pt = ls.exp(), lt.exp()

    def kl(p, lp, lq):
        return (p * (lp - lq)).sum(-1)

    if beta == 0:
        per = kl(pt, lt, ls)
    elif beta == 1:
        per = kl(ps, ls, lt)
    else:
        lm = torch.log(beta * pt + (1 - beta) * ps)
        per = beta * kl(pt, lt, lm) + (1 - beta) * kl(ps, ls, lm)
    valid = torch.ones_like(per, dtype=torch.bool) if target is None else target != ignore_index
    per = torch.where(valid, per, torch.zeros_like(per))
    total = per.sum()
    return total if reduction == "sum" else total / valid.sum()


__all__ += ["linear_jsd_error_bound", "linear_jsd_grad_error_bounds"]


def _jsd_bound_terms(input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias,
                     teacher_linear_bias, temperature, ignore_index, reduction):
    """The float64 logits of both heads as (N, V) rows, the per-token magnitude max |z_s| / τ + max |z_t| / τ + log V,
    the counted tokens and the mean's divisor, shared by the two bounds below."""
    def rows(t):
        return t.detach().double().flatten(0, -2) if t.dim() >= 2 else t.detach().double().unsqueeze(0)

    def logits(a, m, b):
        z = a @ m.detach().double().t()
        return z if b is None else z + b.detach().double()
    x2, xt2 = rows(input), rows(teacher_input)
    zs, zt = logits(x2, linear_weight, linear_bias), logits(xt2, teacher_linear_weight, teacher_linear_bias)
    mag = (zs.abs().amax(-1) + zt.abs().amax(-1)) / temperature + math.log(linear_weight.shape[0])
    valid = (torch.ones(zs.shape[0], dtype=torch.bool, device=zs.device) if target is None
             else (target.reshape(-1) != ignore_index).to(zs.device))
    count = valid.sum().clamp(min=1) if reduction == "mean" else 1
    return x2, xt2, zs, zt, mag, valid, count


def linear_jsd_error_bound(input: Tensor, linear_weight: Tensor, teacher_input: Tensor, teacher_linear_weight: Tensor,
                           target: Optional[Tensor] = None, *, linear_bias: Optional[Tensor] = None,
                           teacher_linear_bias: Optional[Tensor] = None, temperature: float = 1.0,
                           ignore_index: int = -100, reduction: str = "mean",
                           reference: Optional[Tensor] = None) -> Tensor:
    """|loss − loss₆₄| ≤ Σ_valid 2 (2 δz + 4 u' (max |z_s| + max |z_t| + log V)) / T + u' |loss₆₄|: an a-priori bound
    of the float32 rounding of `opforge.linear_jsd`'s loss (any β), u' = eps(float32), δz the per-token largest
    `gemm_error_bound` of both heads' logits in float32, z / τ the logits.

    Every path (opforge's kernels and the eager float32 reference) forms the logits and the log-softmaxes in float32:
    each logit carries the GEMM's rounding (products of 16-bit inputs are exact in float32, the sum is not) and
    each log-probability a few float32 roundings of its magnitude (≤ max |z| + log V); the divergence weighs them
    by probabilities that sum to 1 with coefficients ≤ 2, so one token's value is off by at most
    2 (2 δz + 4 u' mag); the mean divides by the T counted tokens, and the final rounding adds u' |loss|.

    Args:
        input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias, teacher_linear_bias,
            temperature, ignore_index, reduction: as `opforge.linear_jsd`.
        reference: `()` floating or None. The float64 loss (`linear_jsd_reference`) for the last term. Default:
            None (no last term).

    Returns:
        `()` float64.
    """
    f32 = torch.float32
    eps = torch.finfo(f32).eps
    x2, xt2, _, _, mag, valid, count = _jsd_bound_terms(input, linear_weight, teacher_input, teacher_linear_weight,
                                                        target, linear_bias, teacher_linear_bias, temperature,
                                                        ignore_index, reduction)
    dz = (gemm_error_bound(x2, linear_weight, f32).amax(-1)
          + gemm_error_bound(xt2, teacher_linear_weight, f32).amax(-1)) / temperature
    per = 2 * (2 * dz + 4 * eps * mag)
    bound = torch.where(valid, per, torch.zeros_like(per)).sum() / count
    if reference is not None:
        bound = bound + eps * reference.detach().double().abs().to(bound.device)
    return bound


def linear_jsd_grad_error_bounds(input: Tensor, linear_weight: Tensor, teacher_input: Tensor,
                                 teacher_linear_weight: Tensor, grad_output: Tensor, target: Optional[Tensor] = None,
                                 *, linear_bias: Optional[Tensor] = None, teacher_linear_bias: Optional[Tensor] = None,
                                 beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                                 reduction: str = "mean", return_bias: bool = False) -> tuple[Tensor, ...]:
    """Elementwise a-priori bounds of the float32 rounding of `opforge.linear_jsd`'s gradients in input and
    linear_weight (and linear_bias): the logit gradient dz = (1 − β) p_s ((ls − lm) − K) g / T (its float64 value from
    `linear_jsd_reference`) is off by at most 8 u' g p_s mag / T + u' |dz| per logit (mag as in
    `linear_jsd_error_bound`), carried through |W| and |X|, plus the two gradient GEMMs' own rounding
    (`gemm_error_bound` of |dz| and the other operand in float32); the bias gradient's bound is the column sum of
    the per-logit bounds plus N · eps · Σ_n |dz| (a sum of N terms in any order). Materialises (N, V) and (V, V):
    small shapes only.

    Args:
        input, linear_weight, teacher_input, teacher_linear_weight, target, linear_bias, teacher_linear_bias, beta,
            temperature, ignore_index, reduction: as `opforge.linear_jsd`.
        grad_output: `()` floating. The loss's incoming gradient g.
        return_bias: bool. Also return the bias gradient's bound. Default: False.

    Returns:
        (input's shape, linear_weight's shape), float64; with return_bias also `(V,)`.
    """
    f32 = torch.float32
    eps = torch.finfo(f32).eps
    x2, _, zs, zt, mag, valid, count = _jsd_bound_terms(input, linear_weight, teacher_input, teacher_linear_weight,
                                                        target, linear_bias, teacher_linear_bias, temperature,
                                                        ignore_index, reduction)
    V = linear_weight.shape[0]
    zl = zs.clone().requires_grad_()
    eye = torch.eye(V, dtype=torch.float64, device=zs.device)
    with torch.enable_grad():
        loss = linear_jsd_reference(zl, eye, zt, eye, None if target is None else target.reshape(-1), beta=beta,
                                    temperature=temperature, ignore_index=ignore_index, reduction=reduction)
        (dz,) = torch.autograd.grad(loss, zl)
    g = grad_output.detach().double().abs().to(zs.device)
    dz = dz.abs() * g
    ps = torch.softmax(zs / temperature, -1)
    err = 8 * eps * g * ps * mag.unsqueeze(-1) / temperature / count + eps * dz  # [N, V]
    err = torch.where(valid.unsqueeze(-1), err, torch.zeros_like(err))
    w = linear_weight.detach().double()
    grad_input = (err @ w.abs() + gemm_error_bound(dz, linear_weight.detach().t(), f32)).reshape(input.shape)
    grad_weight = err.t() @ x2.abs() + gemm_error_bound(dz.t(), x2.t(), f32)
    if not return_bias:
        return grad_input, grad_weight
    # the bias gradient Σ_n dz[n, v]: each term's error, plus the sum's own rounding in any order (γ_N, Higham §3.1)
    grad_bias = err.sum(0) + dz.shape[0] * eps * dz.sum(0)
    return grad_input, grad_weight, grad_bias


# ---- post-training losses (opforge.losses) ---------------------------------------------------------------

__all__ += ["preference_loss_reference", "kto_loss_reference"]


def _log_sigmoid64(x: Tensor) -> Tensor:
    """log σ(x) = −log(1 + e^(−x)) in float64, written as min(x, 0) − log(1 + e^(−|x|)) (no overflow)."""
    x = x.double()
    return torch.minimum(x, torch.zeros_like(x)) - torch.log1p(torch.exp(-x.abs()))


def preference_loss_reference(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Optional[Tensor] = None,
                              ref_rejected_logps: Optional[Tensor] = None, *, loss_type: str = "sigmoid",
                              beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> Tensor:
    """The per-pair losses of `opforge.preference_loss` in float64, from the papers' formulas (differentiable).

    DPO (Rafailov et al. 2023, eq. 7) with the conservative labels of cDPO: −(1 − ε) log σ(β h) − ε log σ(−β h),
    h = log π(y_w)/π_ref(y_w) − log π(y_l)/π_ref(y_l); robust DPO (Chowdhury et al. 2024, eq. 8): the unbiased
    ((1 − ε) ℓ(β h) − ε ℓ(−β h)) / (1 − 2ε) with ℓ = −log σ; IPO (Azar et al. 2023, eq. 17): (h − 1/(2β))²;
    SLiC hinge (Zhao et al. 2023): max(0, 1 − β h); SimPO (Meng et al. 2024, eq. 6): −log σ(β u − γ) with u the
    difference of mean log-probabilities (and ε as cDPO); CPO (Xu et al. 2024, eq. 3, without its NLL term):
    −log σ(β u); ORPO (Hong et al. 2024, eqs. 4-7, without its NLL term): −β log σ(log(odds_w / odds_l)),
    odds = P / (1 − P), P = exp(mean log-probability).

    Args:
        chosen_logps, rejected_logps: `(B,)` floating.
        ref_chosen_logps, ref_rejected_logps: `(B,)` floating or None (the DPO types).
        loss_type, beta, label_smoothing, simpo_gamma: as `opforge.preference_loss`.

    Returns:
        `(B,)` float64: the unreduced losses.
    """
    c, r = chosen_logps.double(), rejected_logps.double()
    eps = label_smoothing
    if loss_type in ("sigmoid", "robust", "hinge", "ipo"):
        h = (c - ref_chosen_logps.double().detach()) - (r - ref_rejected_logps.double().detach())
        if loss_type == "sigmoid":
            return -(1 - eps) * _log_sigmoid64(beta * h) - eps * _log_sigmoid64(-beta * h)
        if loss_type == "robust":
            return ((1 - eps) * -_log_sigmoid64(beta * h) - eps * -_log_sigmoid64(-beta * h)) / (1 - 2 * eps)
        if loss_type == "hinge":
            return torch.clamp(1 - beta * h, min=0)
        return (h - 1 / (2 * beta)) ** 2
    u = c - r
    if loss_type == "simpo":
        a = beta * u - simpo_gamma
        return -(1 - eps) * _log_sigmoid64(a) - eps * _log_sigmoid64(-a)
    if loss_type == "cpo":
        return -(1 - eps) * _log_sigmoid64(beta * u) - eps * _log_sigmoid64(-beta * u)
    if loss_type == "orpo":
        pc, pr = c.exp(), r.exp()
        log_odds_ratio = torch.log(pc / (1 - pc)) - torch.log(pr / (1 - pr))
        return -beta * _log_sigmoid64(log_odds_ratio)
    raise ValueError(f"unknown loss_type {loss_type!r}")


def kto_loss_reference(chosen_logps: Tensor, rejected_logps: Tensor, kl_logps: Tensor, ref_chosen_logps: Tensor,
                       ref_rejected_logps: Tensor, ref_kl_logps: Tensor, *, beta: float = 0.1,
                       desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> Tensor:
    """`opforge.kto_loss`'s loss in float64 from KTO's value function (Ethayarajh et al. 2024, eq. 8).

    v(x, y) = λ_D σ(β (r(x, y) − z0)) for a desirable y, λ_U σ(β (z0 − r(x, y))) for an undesirable one, with
    r = log π/π_ref and the reference point z0 = max(0, E[log π/π_ref] over the mismatched pairs), not
    differentiated; loss = mean over the examples of (λ_y − v(x, y)). 0 without any example.

    Returns:
        `()` float64.
    """
    z0 = torch.clamp((kl_logps.double() - ref_kl_logps.double()).mean(), min=0).detach() if kl_logps.numel() else 0.0
    rc = chosen_logps.double() - ref_chosen_logps.double()
    rr = rejected_logps.double() - ref_rejected_logps.double()
    vd = desirable_weight * torch.sigmoid(beta * (rc - z0))
    vu = undesirable_weight * torch.sigmoid(beta * (z0 - rr))
    terms = torch.cat([desirable_weight - vd, undesirable_weight - vu])
    return terms.sum() / max(terms.numel(), 1)


__all__ += ["grpo_loss_reference"]


def grpo_loss_reference(log_probs: Tensor, advantages: Tensor, mask: Tensor, old_log_probs: Optional[Tensor] = None,
                        ref_log_probs: Optional[Tensor] = None, *, loss_type: str = "dapo", beta: float = 0.0,
                        epsilon_low: float = 0.2, epsilon_high: Optional[float] = None, delta: Optional[float] = None,
                        importance_sampling_level: str = "token", max_completion_length: Optional[int] = None,
                        num_items_in_batch=None) -> Tensor:
    """`opforge.grpo_loss`'s loss in float64, sequence by sequence from the PPO-clip objective (differentiable in
    log_probs).

    For each sequence b its counted tokens only (mask true): the importance ratio ρ = π/π_old per token (or, at the
    sequence level, the geometric mean exp(mean(log π − log π_old)) over its tokens), the clipped surrogate
    min(ρ' A, clip(ρ, 1 − ε_l, 1 + ε_h) A) with ρ' = min(ρ, delta) (or ρ), minus β times the k3 estimate
    π_ref/π − log(π_ref/π) − 1 of KL(π ‖ π_ref); the loss is the negated objective: per sequence its token mean
    averaged over the sequences ("grpo"), or the sum over every counted token divided by their number ("bnpo"), by
    B · max_completion_length ("dr_grpo"), by num_items_in_batch ("dapo"; each count at least 1).

    Returns:
        `()` float64.
    """
    eh = epsilon_low if epsilon_high is None else epsilon_high
    B, T = log_probs.shape
    lp = log_probs.double()
    old = lp.detach() if old_log_probs is None else old_log_probs.double().detach()
    m = mask.bool()
    per_seq, total = [], lp.new_zeros(())
    for b in range(B):
        idx = m[b].nonzero().flatten()
        x, xo = lp[b, idx], old[b, idx]
        a = float(advantages[b])
        if importance_sampling_level == "sequence":
            rho = torch.exp((x - xo).mean()).expand(len(idx)) if len(idx) else x
        else:
            rho = torch.exp(x - xo)
        rho1 = rho if delta is None else torch.clamp(rho, max=delta)
        surrogate = torch.minimum(rho1 * a, torch.clamp(rho, 1 - epsilon_low, 1 + eh) * a)
        if beta != 0:
            r = torch.exp(ref_log_probs.double().detach()[b, idx] - x)  # π_ref / π
            surrogate = surrogate - beta * (r - torch.log(r) - 1)
        terms = -surrogate
        per_seq.append(terms.sum() / max(len(idx), 1))
        total = total + terms.sum()
    count = int(m.sum())
    if loss_type == "grpo":
        return torch.stack(per_seq).mean() if B else total
    if loss_type == "bnpo":
        return total / max(count, 1)
    if loss_type == "dr_grpo":
        return total / max(B * (T if max_completion_length is None else max_completion_length), 1)
    n = count if num_items_in_batch is None else float(num_items_in_batch)
    return total / max(n, 1)


# ---- fake_quant_linear ---------------------------------------------------------------------------------
__all__ += ["fake_quant_qparams_reference", "fake_quantize_weight_reference", "fake_quantize_per_token_reference",
            "fake_quant_linear_reference"]


def fake_quant_qparams_reference(mn: Tensor, mx: Tensor, qmin: int, qmax: int, symmetric: bool):
    """(scale, zero_point) from min/max, as torch's MinMaxObserver and torchao's `choose_qparams_affine` compute them.

    Args:
        mn: `(G,)` floating (converted to float32). Each group's minimum.
        mx: `(G,)` floating (converted to float32). Each group's maximum.
        qmin: int. The smallest integer.
        qmax: int. The largest integer.
        symmetric: bool. Zero point 0 and scale = max(−lo, hi) / ((qmax − qmin) / 2), else the asymmetric pair.

    Returns:
        scale `(G,)` float32 (at least float32's machine epsilon) and zero_point `(G,)` int32.
    """
    mn, mx = mn.float(), mx.float()
    zero = torch.zeros_like(mn)
    lo, hi = torch.minimum(mn, zero), torch.maximum(mx, zero)
    eps = torch.tensor(torch.finfo(torch.float32).eps, dtype=torch.float32)
    # The divisors are tensors on mn's device, not Python numbers: ATen's CUDA division by a scalar multiplies by
    # its fp32 reciprocal (1 / 7.5 is inexact), which moves the scale by an ulp from the observer's CPU value.
    if symmetric:
        scale = torch.maximum(torch.maximum(-lo, hi) / torch.full_like(lo, (qmax - qmin) / 2), eps)
        zp = torch.zeros_like(scale, dtype=torch.int32)
    else:
        scale = torch.maximum((hi - lo) / torch.full_like(lo, float(qmax - qmin)), eps)
        zp = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax).to(torch.int32)
    return scale, zp


def _fq_mask(x: Tensor, fq) -> Tensor:
    """torch's own straight-through mask of the fake-quantize function `fq` at x: d(sum fq(x))/dx != 0."""
    xr = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(fq(xr).sum(), xr)
    return g != 0


def fake_quantize_weight_reference(weight: Tensor, bits: int = 4, group_size: int = -1, symmetric: bool = True):
    """(fq_w, mask, scale, zero_point) through `torch.fake_quantize_per_tensor_affine` / `_per_channel_affine`.

    The weight is upcast to float32 (float64 stays float64). A float64 weight per tensor goes through the
    per-channel function with one channel: torch's per-tensor kernel rounds a float64 result to float32.

    Args:
        weight: `(N, K)` floating. The weight.
        bits: int in [2, 8]. Default: 4.
        group_size: int. −1 per channel, 0 per tensor, g per group of g columns. Default: −1.
        symmetric: bool. Default: True.

    Returns:
        fq_w `(N, K)` in weight's dtype, mask `(N, K)` bool, scale float32 and zero_point int32 of shape `(1, 1)`,
            `(N, 1)` or `(N, K // g)`.
    """
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    N, K = weight.shape
    w = weight.detach().double() if weight.dtype == torch.float64 else weight.detach().float()
    if group_size == 0:
        if w.numel():
            mn, mx = w.min().float().reshape(1, 1), w.max().float().reshape(1, 1)
        else:
            mn, mx = torch.zeros(1, 1), torch.zeros(1, 1)
        scale, zp = fake_quant_qparams_reference(mn, mx, qmin, qmax, symmetric)
        if w.dtype == torch.float64:
            # torch's per-tensor kernel rounds a float64 result to float32 precision, its per-channel kernel does
            # not: float64 follows the per-channel kernel (one channel), as opforge does for every grouping
            fq = lambda t: torch.fake_quantize_per_channel_affine(  # noqa: E731
                t.reshape(1, -1), scale.reshape(1), zp.reshape(1), 0, qmin, qmax).reshape(t.shape)
        else:
            fq = lambda t: torch.fake_quantize_per_tensor_affine(t, scale.item(), int(zp.item()), qmin, qmax)  # noqa: E731
        out = fq(w)
        mask = _fq_mask(w, fq) if w.numel() else torch.zeros_like(w, dtype=torch.bool)
        return out.to(weight.dtype), mask, scale, zp
    g = K if group_size < 0 else group_size
    wg = w.reshape(-1, g) if w.numel() else w.reshape(0, max(g, 1))
    if wg.numel():
        scale, zp = fake_quant_qparams_reference(wg.amin(1), wg.amax(1), qmin, qmax, symmetric)
    else:
        scale, zp = torch.zeros(wg.shape[0]), torch.zeros(wg.shape[0], dtype=torch.int32)
    fq = lambda t: torch.fake_quantize_per_channel_affine(t, scale, zp, 0, qmin, qmax)  # noqa: E731
    out = fq(wg) if wg.numel() else wg
    mask = _fq_mask(wg, fq) if wg.numel() else torch.zeros_like(wg, dtype=torch.bool)
    cols = K // g if g else 0
    return (out.reshape(N, K).to(weight.dtype), mask.reshape(N, K), scale.reshape(N, cols), zp.reshape(N, cols))


def fake_quantize_per_token_reference(input: Tensor):
    """(fq_a(input), mask): each row over the last dim fake-quantized to int8 [−128, 127], asymmetric.

    Through `torch.fake_quantize_per_channel_affine` (axis 0 of the flattened rows).

    Args:
        input: `(*, K)` floating. The tokens.

    Returns:
        fq_a in input's dtype and shape, mask bool of input's shape.
    """
    K = input.shape[-1]
    x = input.detach().reshape(-1, K)
    x = x.double() if input.dtype == torch.float64 else x.float()
    if x.numel() == 0:
        return input.detach().clone(), torch.zeros(input.shape, dtype=torch.bool)
    scale, zp = fake_quant_qparams_reference(x.amin(1), x.amax(1), -128, 127, False)
    fq = lambda t: torch.fake_quantize_per_channel_affine(t, scale, zp, 0, -128, 127)  # noqa: E731
    return fq(x).to(input.dtype).reshape(input.shape), _fq_mask(x, fq).reshape(input.shape)


def fake_quant_linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, weight_bits: int = 4,
                                group_size: int = -1, symmetric: bool = True, act_quant: bool = False) -> Tensor:
    """fq_a(input) · fq_w(weight)ᵀ + bias in float64, the fake quantization done by torch's fake_quantize functions.

    fq_w (`fake_quantize_weight_reference`) is converted to input's dtype first, as the op's GEMM sees it; fq_a
    is `fake_quantize_per_token_reference`.

    Args:
        input: `(*, K)` floating. The rows.
        weight: `(N, K)` floating. The weight.
        bias: `(N,)` floating or None. Default: None.
        weight_bits: int. Default: 4.
        group_size: int. Default: −1.
        symmetric: bool. Default: True.
        act_quant: bool. Default: False.

    Returns:
        `(*, N)` float64.
    """
    wq = fake_quantize_weight_reference(weight, weight_bits, group_size, symmetric)[0].to(input.dtype)
    xq = fake_quantize_per_token_reference(input)[0] if act_quant else input.detach()
    return linear_reference(xq, wq, bias)
# ---- fp8: quantize_fp8, fp8_linear --------------------------------------------------------------------------
__all__ += ["quantize_fp8_reference", "fp8_linear_reference", "fp8_gemm_bound"]


def quantize_fp8_reference(input: Tensor, dtype: Optional[torch.dtype] = None,
                           granularity: str = "tensorwise"):
    """(data, scale) of `opforge.quantize_fp8` composed of torch ops: torchao's current-scaling recipe.

    amax = max |input| (tensor or each row of the last dim; 0 for an empty group), scale =
    float32(fp8_max / clamp(float64(amax), min=1e-12)), data = (float32(input) · scale).clamp(±fp8_max).to(dtype),
    every NaN written as the positive NaN (bits 0x7F: the sign of inf · 0's NaN differs between CPUs and GPUs).
    Returns data of input's shape and scale of shape () or (*, 1), float32.
    """
    dtype = torch.float8_e4m3fn if dtype is None else dtype
    fmax = torch.finfo(dtype).max
    x = input.detach()
    if granularity == "tensorwise":
        amax = x.abs().amax() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)
    elif x.shape[-1] == 0:
        amax = torch.zeros((*x.shape[:-1], 1), dtype=x.dtype, device=x.device)
    else:
        amax = x.abs().amax(-1, keepdim=True)
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    v = (x.float() * scale).clamp(-fmax, fmax)
    return torch.where(v.isnan(), float("nan"), v).to(dtype), scale


def fp8_gemm_bound(a: Tensor, b: Tensor, out_dtype: torch.dtype, rowwise: bool, cuda: bool,
                   fast_accum: bool = False) -> Tensor:
    """|scaled FP8 GEMM − deq(a) · deq(b)ᵀ| ≤ this, elementwise: the a-priori rounding bound of `opforge.fp8_linear`'s
    GEMMs (torch._scaled_mm, use_fast_accum=False) on their dequantized operands.

    bound = (C·u₃₂ + 2·u₃₂ + u_prod + u_out + tc)·(|a|·|b|ᵀ): the fp32 accumulation over the contraction C (any
    order), the fp32 dequantization (the product of the two scales, then the sum times it), the rounding of the
    GEMM's output type (u_prod: bfloat16 for rowwise scales, else out_dtype, float32 for float64) and of out_dtype
    (u_out). tc, CUDA only: the FP8 tensor cores of sm_89/sm_90 add each step's products to the partial sum with a
    truncating accumulator of 13 fraction bits (e8m13), every addend aligned to the step's largest, which loses
    less than 2⁻¹³ of that addend's magnitude per addend; cuBLAS moves the partial sum to fp32 every 128 products,
    and every addend is at most Σ|a_k·b_k| over its block of 128. With t = min(C rounded up to 16, 128) products
    and at most t/16 partial sums per block, tc = (t + t/16)·2⁻¹³. Measured on an H200 (torch 2.11, cuBLAS of CUDA
    13): a product 2⁻¹⁴ of the block's largest is dropped (2⁻¹³ kept, 3·2⁻¹⁵ truncated to 2·2⁻¹⁵), one in the next
    block of 128 kept at fp32 precision. With fast accumulation (use_fast_accum=True, OPFORGE_FP8_FAST_ACCUM) the
    partial sum never moves to fp32: one block of all C products, t = C rounded up to 16.

    Args:
        a: `(R_a, C)` float64. The dequantized first operand (its rows along the output's rows).
        b: `(R_b, C)` float64. The dequantized second operand.
        out_dtype: torch.dtype. The dtype the op returns (float64, float32, float16 or bfloat16).
        rowwise: bool. Rowwise scales (the GEMM writes bfloat16).
        cuda: bool. The GEMM ran on a CUDA device (the tensor-core term).
        fast_accum: bool. The GEMM ran with fast accumulation (CUDA). Default: False.

    Returns:
        `(R_a, R_b)` float64.

    Source: Khattak and Mikaitis 2025, "Accurate Models of NVIDIA Tensor Cores" (the H100's FP8 accumulator);
    DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" §3.3.2 (about 14 bits kept; promotion to fp32 every 128).
    """
    prod = a.abs() @ b.abs().t()
    gemm_dt = torch.float32 if out_dtype == torch.float64 else out_dtype
    u = torch.finfo(torch.float32).eps / 2
    ur = torch.finfo(torch.bfloat16 if rowwise else gemm_dt).eps / 2
    uo = torch.finfo(gemm_dt).eps / 2
    C = a.shape[1]
    t = -(-C // 16) * 16 if fast_accum else min(-(-C // 16) * 16, 128)
    tc = (t + t // 16) * 2.0 ** -13 if cuda else 0.0
    return (C * u + 2 * u + ur + uo + tc) * prod


def _fp8_gemm(a: Tensor, b: Tensor, dtype_a: torch.dtype, dtype_b: torch.dtype, rowwise: bool,
                       compute: torch.dtype = torch.float64) -> Tensor:
    """deq(q(a)) · deq(q(b))ᵀ for a (R_a, C), b (R_b, C): each quantized along its rows (the contraction C last) by
    `quantize_fp8_reference`, dequantized as the scaled GEMM does (data · float32(1 / scale)) and multiplied in
    `compute`."""
    g = "rowwise" if rowwise else "tensorwise"
    qa, sa = quantize_fp8_reference(a, dtype_a, g)
    qb, sb = quantize_fp8_reference(b, dtype_b, g)
    da = qa.to(compute) * sa.reciprocal().to(compute)
    db = qb.to(compute) * sb.reciprocal().to(compute)
    return da @ db.t()


def _fp8_grad_dtype(granularity: str, grad_dtype: Optional[torch.dtype]) -> torch.dtype:
    if grad_dtype is not None:
        return grad_dtype
    return torch.float8_e4m3fn if granularity == "rowwise" else torch.float8_e5m2


def _fp8_rows(t: Tensor) -> Tensor:
    """t (*, C) as (prod(*), C): the rows of a GEMM operand, also for zero sizes."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def fp8_linear_forward_with(gemm, input: Tensor, weight: Tensor, bias: Optional[Tensor], granularity: str) -> Tensor:
    """fp8_linear's forward through `gemm(a, b, dtype_a, dtype_b, rowwise, out_dtype)`, an FP8 product of a (R_a, C)
    and b (R_b, C) along C: the float64 reference's (`_fp8_gemm`) or a torch composition's."""
    e4m3 = torch.float8_e4m3fn
    y = gemm(_fp8_rows(input), weight, e4m3, e4m3, granularity == "rowwise", input.dtype)
    if bias is not None:
        y = y + bias.to(input.dtype)
    return y.reshape(*input.shape[:-1], weight.shape[0])


def fp8_linear_setup_context(ctx, inputs, output) -> None:
    """The autograd.Function context of fp8_linear's forward: the high-precision input and weight, the options."""
    input, weight, bias, granularity, grad_dtype = inputs
    ctx.save_for_backward(input, weight)
    ctx.granularity, ctx.grad_dtype = granularity, grad_dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def fp8_linear_backward_with(gemm, ctx, grad: Tensor, weight_grad_in_input_dtype: bool):
    """fp8_linear's gradients through `gemm` (as `fp8_linear_forward_with`): grad_input = q(grad) · q(weightᵀ)ᵀ,
    grad_weight = q(gradᵀ) · q(inputᵀ)ᵀ (computed in input's dtype and then rounded to weight's, or in weight's
    dtype directly), grad_bias = Σ grad in fp32 (fp64 for float64)."""
    input, weight = ctx.saved_tensors
    rowwise = ctx.granularity == "rowwise"
    gdt, e4m3 = _fp8_grad_dtype(ctx.granularity, ctx.grad_dtype), torch.float8_e4m3fn
    g2, x2 = _fp8_rows(grad), _fp8_rows(input)
    gi = gw = gb = None
    if ctx.needs_input_grad[0]:
        gi = gemm(g2, weight.t(), gdt, e4m3, rowwise, input.dtype).reshape(input.shape)
    if ctx.needs_input_grad[1]:
        gw_dtype = input.dtype if weight_grad_in_input_dtype else weight.dtype
        gw = gemm(g2.t(), x2.t(), gdt, e4m3, rowwise, gw_dtype).to(weight.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        gb = g2.sum(0, dtype=torch.float64 if g2.dtype == torch.float64 else torch.float32).to(ctx.bias_dtype)
    return gi, gw, gb, None, None


class _FP8LinearReference(torch.autograd.Function):
    """fp8_linear's quantized math in the input's dtype with its FP8 gradients (torch.func-ready)."""

    @staticmethod
    def forward(input, weight, bias, granularity, grad_dtype):
        return fp8_linear_forward_with(_fp8_gemm, input, weight, bias, granularity)

    setup_context = staticmethod(fp8_linear_setup_context)

    @staticmethod
    def backward(ctx, grad):
        return fp8_linear_backward_with(_fp8_gemm, ctx, grad, weight_grad_in_input_dtype=True)

    generate_vmap_rule = True


def fp8_linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                         granularity: str = "tensorwise", grad_dtype: Optional[torch.dtype] = None) -> Tensor:
    """fp8_linear's math on dequantized operands, computed in input's dtype (float64 for float64 args, the
    reference): y = deq(q(input)) · deq(q(weight))ᵀ + bias, with the gradients of the same quantized math:
    grad_input = deq(q(grad)) · deq(q(weightᵀ))ᵀ, grad_weight = deq(q(gradᵀ)) · deq(q(inputᵀ))ᵀ (rowwise scales
    along each GEMM's contraction's complement), grad_bias = Σ grad. The FP8 roundings are not differentiated."""
    return _FP8LinearReference.apply(input, weight, bias, granularity, grad_dtype)


# ---- linear variants ----------------------------------------------------------------------------------------

def linear_cat_reference(inputs, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """linear(cat(inputs, -1), weight, bias) in float64.

    Args:
        inputs: sequence of `(*, K_i)` floating tensors. The pieces.
        weight: `(N, ΣK_i)` floating. The weight.
        bias: `(N,)` floating or None. Default: None.

    Returns:
        `(*, N)` float64.
    """
    x = torch.cat([t.double() for t in inputs], -1)
    y = x @ weight.double().t()
    return y + bias.double() if bias is not None else y


def experts_present(index: Tensor, E: int) -> list:
    """The distinct values of `index` in [0, E), ascending (one host synchronisation, not one per expert).

    Args:
        index: `(T,)` int64. The experts chosen per token (−1: none).
        E: int. The number of experts.

    Returns:
        list of int.
    """
    return index[(index >= 0) & (index < E)].unique().tolist()


def indexed_linear_reference(input: Tensor, weight: Tensor, index: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y[t] = input[t] · weight[index[t]]ᵀ + bias[index[t]] in float64, a loop over experts (differentiable).

    Args:
        input: `(T, K)` floating. The tokens.
        weight: `(E, N, K)` floating. The bank.
        index: `(T,)` int64. The expert of each token; rows with index −1 are zero.
        bias: `(E, N)` floating or None. Default: None.

    Returns:
        `(T, N)` float64, connected to every input (zero gradients even where no row selects a weight).
    """
    x, w = input.double(), weight.double()
    # zeros connected to every input (zero gradients even when no row selects a weight)
    y = x.new_zeros(x.shape[0], w.shape[1]) + 0 * (x.sum() + w.sum() + (bias.double().sum() if bias is not None else 0))
    for e in experts_present(index, w.shape[0]):
        rows = (index == e).nonzero().flatten()
        ye = x[rows] @ w[e].t()
        if bias is not None:
            ye = ye + bias[e].double()
        y = y.index_copy(0, rows, ye)
    return y
# ---- rope --------------------------------------------------------------------------------------------------
__all__ += ["rope_cos_sin_reference", "rope_reference", "rope_from_positions_reference"]


def rope_cos_sin_reference(position_ids: Tensor, rotary_dim: int, base: float = 10000.0, *,
                           interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """cos, sin tables in float64 as transformers builds them: θ_i = position · base^(−2i/R), i < R/2.

    Args:
        position_ids: `(S,)` or `(B, S)` integer. The positions.
        rotary_dim: int. R, even.
        base: float. The RoPE base. Default: 10000.
        interleaved: bool. GPT-J's layout [θ_0, θ_0, θ_1, θ_1, …] (`repeat_interleave(…, 2)`) instead of
            rotate-half's [θ_0 … θ_{R/2−1}, θ_0 … θ_{R/2−1}] (transformers' `cat((freqs, freqs), -1)`).
            Default: False.

    Returns:
        cos, sin: float64 of shape `(*position_ids.shape, R)`.
    """
    R = rotary_dim
    inv_freq = torch.tensor(float(base), dtype=torch.float64) ** (
        -torch.arange(0, R, 2, dtype=torch.float64, device=position_ids.device) / R)
    theta = position_ids.to(torch.float64)[..., None] * inv_freq  # (*, R/2)
    full = theta.repeat_interleave(2, dim=-1) if interleaved else torch.cat((theta, theta), dim=-1)
    return torch.cos(full), torch.sin(full)


def _rotate(x: Tensor, interleaved: bool) -> Tensor:
    """rotate-half (−x[h:], x[:h]) or interleaved (−x[2i+1], x[2i]) of the last dim."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
                   rotary_dim: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(q_out, k_out) of `opforge.rope` in float64: x[..., :R]·cos + rotate(x[..., :R])·sin, x[..., R:] unchanged.

    Args:
        q: `(B, Hq, S, D)` floating. The queries.
        k: `(B, Hk, S, D)` floating. The keys.
        cos: `(S, R)`, `(B or 1, S, R)` or `(B or 1, 1, S, R)` floating, broadcast over heads.
        sin: cos's shape, floating.
        interleaved: bool. GPT-J's pairs instead of rotate-half's. Default: False.
        rotary_dim: int or None. R. Default: None, meaning `cos.size(-1)`.

    Returns:
        (q_out, k_out) float64 of q's and k's shapes, differentiable in q and k.
    """
    c, s = cos.double(), sin.double()
    if c.dim() == 2:
        c, s = c[None], s[None]
    if c.dim() == 3:
        c, s = c[:, None], s[:, None]
    R = c.shape[-1] if rotary_dim is None else rotary_dim

    def one(x: Tensor) -> Tensor:
        x = x.double()
        xr, xp = x[..., :R], x[..., R:]
        return torch.cat((xr * c + _rotate(xr, interleaved) * s, xp), dim=-1)

    return one(q), one(k)


def rope_from_positions_reference(q: Tensor, k: Tensor, position_ids: Tensor, base: float = 10000.0, *,
                                  interleaved: bool = False, rotary_dim: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """(q_out, k_out) of `opforge.rope_from_positions` in float64: `rope_reference` on `rope_cos_sin_reference`.

    Args:
        q: `(B, Hq, S, D)` floating. The queries.
        k: `(B, Hk, S, D)` floating. The keys.
        position_ids: `(S,)` or `(B, S)` integer. The positions.
        base: float. The RoPE base. Default: 10000.
        interleaved: bool. Default: False.
        rotary_dim: int or None. R. Default: None, meaning D.

    Returns:
        (q_out, k_out) float64 of q's and k's shapes.
    """
    R = q.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = rope_cos_sin_reference(position_ids, R, base, interleaved=interleaved)
    return rope_reference(q, k, cos, sin, interleaved=interleaved, rotary_dim=R)
