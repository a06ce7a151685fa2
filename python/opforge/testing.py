"""Float64 references and the tolerance rule, shared by the tests and the benchmarks.

Each ``*_reference`` function is the readable eager version of an opforge op, evaluated in float64.

The tolerance rule (DESIGN.md §5): an opforge result in dtype ``d`` passes when its error against the
float64 reference is at most twice the error of the same math done by PyTorch in ``d``, plus one unit
of ``d``'s rounding (``torch.finfo(d).eps``) to cover results PyTorch happens to get exact. The rule
is applied twice: to the norm-relative error (a global bound) and to the largest elementwise error
(so one wrong element among millions cannot hide).

float64 results are the exception: there the "same math in d" *is* the float64 reference, so its
error is zero by construction and a correct kernel that rounds differently (an fma, another order of
products) would fail. A float64 result instead passes when every element is within
``FLOAT64_TOLERANCE`` × max(1, max |reference|) of the reference.
"""
from __future__ import annotations

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
    "assert_matches_reference",
    "relative_error",
    "gemm_error_bound",
    "FLOAT64_TOLERANCE",
]

#: Elementwise bound for float64 results, relative to max(1, the reference's largest magnitude).
FLOAT64_TOLERANCE = 1e-12


def linear_reference(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: str = "none") -> Tensor:
    """act(input · weightᵀ + bias) in float64. input (*, K), weight (N, K), bias (N,) -> (*, N) float64.

    activation: "none", "relu", "gelu" (erf form), "gelu_tanh" (tanh approximation) or "silu", as
    torch.nn.functional computes them.
    """
    y = input.double() @ weight.double().t()
    if bias is not None:
        y = y + bias.double()
    return activation_reference(y, activation)


def activation_reference(z: Tensor, activation: str) -> Tensor:
    """The activation of opforge.linear applied to z, through torch.nn.functional (z's dtype and shape)."""
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

    eps=None: float32's machine epsilon for float32/float16/bfloat16 input, float64's for float64 (as
    torch.nn.functional.rms_norm computes). Returns input's shape, float64.
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
    """
    z = input.double() + residual.double()
    if eps is None:
        eps = torch.finfo(torch.float64 if input.dtype == torch.float64 else torch.float32).eps
    return rms_norm_reference(z, normalized_shape, weight, eps), z


def sigmoid_reference(input: Tensor) -> Tensor:
    """1 / (1 + exp(−input)) in float64, any shape."""
    return torch.sigmoid(input.double())


def square_reference(input: Tensor) -> Tensor:
    """input² in float64, any shape."""
    return input.double() ** 2


def square_add_reference(input: Tensor, other: Tensor) -> Tensor:
    """input² + other (broadcast) in float64; input's shape."""
    return input.double() ** 2 + other.double()


def relative_error(actual: Tensor, reference: Tensor) -> float:
    """‖actual − reference‖₂ / ‖reference‖₂ in float64 (absolute error when the reference is all zeros)."""
    a, r = actual.double(), reference.double()
    num = torch.linalg.vector_norm(a - r).item()
    den = torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num


def gemm_error_bound(input: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """Elementwise bound on the rounding error of input · weightᵀ computed in ``dtype`` with any summation
    order: K · u · (|input| · |weight|ᵀ), u = eps(dtype) / 2 (Higham, "Accuracy and Stability of Numerical
    Algorithms", §3.5, γ_K ≈ K·u to first order). Float64, shape (*, N). A correct GEMM always meets it; an
    indexing or accumulation bug misses it by orders of magnitude."""
    u = torch.finfo(dtype).eps / 2
    K = input.shape[-1]
    return K * u * (input.detach().double().abs() @ weight.detach().double().abs().t())


def assert_matches_reference(actual: Tensor, reference: Tensor, baseline: Tensor, *, what: str = "output",
                             factor: float = 2.0, bound: Optional[Tensor] = None) -> None:
    """Assert the tolerance rule for ``actual`` (opforge, dtype d) against ``reference`` (float64).

    Args:
        actual: opforge's result.
        reference: the float64 reference of the same math.
        baseline: PyTorch's result of the same math in ``actual``'s dtype (the achievable error).
        what: name used in the failure message.
        factor: allowed ratio to the baseline's error. Default 2.
        bound: optional elementwise a-priori error bound (e.g. gemm_error_bound): an element within it
            passes even when PyTorch's own result happens to be more accurate (a different, equally
            valid summation order).

    Raises:
        AssertionError: shape/dtype mismatch, non-finite where the reference is finite, or an error
            above ``factor`` × baseline error + eps(d) (norm-relative or elementwise-max); for
            float64, an element further than ``FLOAT64_TOLERANCE`` × max(1, max |reference|) from the reference.
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
    """silu(gate) · up in float64, gate's shape."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


# ---- linear_cross_entropy (issue 10) -----------------------------------------------------------------------

__all__ += ["linear_cross_entropy_reference"]


def linear_cross_entropy_reference(input: Tensor, linear_weight: Tensor, target: Tensor, *,
                                   linear_bias: Optional[Tensor] = None, weight: Optional[Tensor] = None,
                                   reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                                   z_loss: float = 0.0, softcap: Optional[float] = None,
                                   compute_dtype: torch.dtype = torch.float64) -> Tensor:
    """opforge.linear_cross_entropy in float64 (or ``compute_dtype``: the same math in another dtype, the
    baseline of the tolerance rule), from the full logits (differentiable: gradients by autograd).

    logits = cap(input · linear_weightᵀ + linear_bias); loss = F.cross_entropy(logits, target, weight,
    ignore_index, label_smoothing, reduction) + z_loss · Σ_valid lse² (divided like the cross-entropy sum:
    by Σ_valid weight[t] for mean). Returns float64 of the loss's shape."""
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
