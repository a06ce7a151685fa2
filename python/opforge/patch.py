"""Swap the modules of an existing model (e.g. a Hugging Face transformers Llama) for opforge modules.

``opforge.patch.apply(model)`` walks ``model`` and replaces, in place:

* every gated MLP (a module with ``gate_proj``, ``up_proj``, ``down_proj`` linears and a SiLU ``act_fn``,
  as transformers' ``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``) by :class:`opforge.nn.GatedMLP`
  (fused :func:`opforge.functional.swiglu`);
* every Llama-style RMSNorm (a module with a 1-D ``weight`` and a float ``variance_epsilon``, computing
  x / sqrt(mean(x²) + eps) · weight, as ``LlamaRMSNorm``) by :class:`opforge.nn.RMSNorm`;
* every plain :class:`torch.nn.Linear` (exact type, so quantized or LoRA subclasses are left alone) by
  :class:`opforge.nn.Linear`.

The new modules hold the *same* ``Parameter`` objects (no copy: tied weights stay tied, an optimizer
built before patching keeps working, ``state_dict`` keys are unchanged) and the old modules' hooks.
Before a norm or an MLP is swapped, both versions run on a small random input and must agree; a module
whose math differs (e.g. Gemma's x·(1 + weight) RMSNorm, a GELU MLP) is left as it is and reported.

Returns a :class:`PatchReport` naming what was patched and what was not (and why).

Numerics: in float32 the patched model matches the original to rounding. In bfloat16/float16,
opforge's RMSNorm multiplies by the weight before rounding to the input dtype (transformers rounds
first), so outputs differ by about one ulp of that dtype.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from . import nn as onn

__all__ = ["PatchReport", "apply"]


@dataclass
class PatchReport:
    """What :func:`apply` did.

    Attributes:
        patched: (qualified name, old class name, new class name) for each module swapped.
        skipped: (qualified name, class name, reason) for each module that looked patchable, or that opforge
            has no op for (LayerNorm, GPT-2's Conv1D, non-SiLU MLPs, unrecognised norms), left unchanged.
    """

    patched: List[Tuple[str, str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when something was patched and nothing was skipped."""
        return bool(self.patched) and not self.skipped

    def counts(self) -> dict:
        """{"OldClass -> NewClass": count} over the patched modules."""
        out: dict = {}
        for _, old, new in self.patched:
            key = f"{old} -> {new}"
            out[key] = out.get(key, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"opforge.patch: patched {len(self.patched)} module(s), could not patch {len(self.skipped)}"]
        for key, n in sorted(self.counts().items()):
            lines.append(f"  patched {n:4d} x {key}")
        for name, cls, reason in self.skipped:
            lines.append(f"  not patched: {name or '<root>'} ({cls}): {reason}")
        return "\n".join(lines)


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation") or act is torch.nn.functional.silu


def _probe_device_dtype(module: torch.nn.Module) -> Optional[Tuple[torch.device, torch.dtype]]:
    p = next(module.parameters(), None)
    if p is None or p.device.type == "meta" or not p.is_floating_point():
        return None
    return p.device, p.dtype


def _agree(old: torch.nn.Module, new: torch.nn.Module, feature_shape) -> Optional[str]:
    """None if old and new compute the same on a small random input of shape (3, *feature_shape), else the
    reason they do not."""
    dd = _probe_device_dtype(old)
    if dd is None:
        return None  # meta / parameterless: trust the structural match
    device, dtype = dd
    if isinstance(feature_shape, int):
        feature_shape = (feature_shape,)
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(3, *feature_shape, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        try:
            a = old(x)
            b = new(x)
        except Exception as e:  # noqa: BLE001
            return f"probe failed: {type(e).__name__}: {e}"
    a, b = a.float(), b.float()
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    err = (a - b).abs().max().item() / max(a.abs().max().item(), 1e-6)
    if not err <= tol:
        return f"its output differs from opforge's (max relative difference {err:.2e} > {tol:g}): different math"
    return None


def _copy_hooks(old: torch.nn.Module, new: torch.nn.Module) -> None:
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    new.train(old.training)


def _linear(old: torch.nn.Linear) -> onn.Linear:
    new = onn.Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta")
    new.weight = old.weight
    new.bias = old.bias
    _copy_hooks(old, new)
    return new


def _rms_norm(old: torch.nn.Module) -> onn.RMSNorm:
    w = old.weight
    new = onn.RMSNorm(tuple(w.shape), eps=float(old.variance_epsilon), device="meta")
    new.weight = w
    _copy_hooks(old, new)
    return new


def _gated_mlp(old: torch.nn.Module) -> onn.GatedMLP:
    g = old.gate_proj
    new = onn.GatedMLP(g.in_features, g.out_features, bias=g.bias is not None, device="meta")
    new.gate_proj = _linear(old.gate_proj)
    new.up_proj = _linear(old.up_proj)
    new.down_proj = _linear(old.down_proj)
    for attr in ("config", "hidden_size", "intermediate_size"):
        if attr in old.__dict__:
            setattr(new, attr, old.__dict__[attr])
    _copy_hooks(old, new)
    return new


def _looks_gated_mlp(m: torch.nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))


def _looks_rms_norm(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") or isinstance(m, torch.nn.RMSNorm)


def _set(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def apply(model: torch.nn.Module, *, linear: bool = True, rms_norm: bool = True, mlp: bool = True,
          strict: bool = False, verbose: bool = False) -> PatchReport:
    """Replace ``model``'s RMSNorm, gated-MLP and Linear modules by opforge's, in place, keeping weights.

    Args:
        model: a torch.nn.Module, typically a transformers ``LlamaForCausalLM`` (or Mistral, Qwen2, ...).
        linear: patch plain torch.nn.Linear modules. Default: True.
        rms_norm: patch Llama-style RMSNorm modules. Default: True.
        mlp: patch SiLU-gated MLPs (gate_proj/up_proj/down_proj + act_fn). Default: True.
        strict: raise instead of warning when some module could not be patched. Default: False.
        verbose: print the report. Default: False.

    Returns:
        :class:`PatchReport`: the patched modules and those left unchanged, with the reason.

    Raises:
        TypeError: model is not a torch.nn.Module.
        ValueError: strict=True and some module could not be patched, or nothing at all was patchable.

    Warns:
        UserWarning: (strict=False) naming the modules that could not be patched.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.patch.apply: expected a torch.nn.Module, but got {type(model).__name__}")
    report = PatchReport()
    done: set = set()  # names whose subtree is already handled
    for name, m in list(model.named_modules()):
        if any(name.startswith(d + ".") for d in done):
            continue
        cls = type(m).__name__
        if isinstance(m, (onn.Linear, onn.RMSNorm, onn.GatedMLP, onn.FusedAddRMSNorm)):
            continue
        if _looks_gated_mlp(m):
            if not mlp:
                continue
            act = getattr(m, "act_fn", None)
            if not _is_silu(act):
                report.skipped.append((name, cls, f"activation {type(act).__name__} is not SiLU: opforge's gated MLP is swiglu; "
                                                  "its Linear layers are patched one by one"))
                continue
            projs = [getattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")]
            odd = [n for n, p in zip(("gate_proj", "up_proj", "down_proj"), projs) if type(p) is not torch.nn.Linear]
            if odd:  # e.g. LoRA or quantized Linear subclasses: GatedMLP would drop their extra parameters and math
                report.skipped.append((name, cls, f"{', '.join(odd)} not a plain torch.nn.Linear (a subclass's forward and "
                                                  "parameters would be lost); its Linear layers are patched one by one"))
                continue
            proj_params = {id(p) for q in projs for p in q.parameters()}
            extra = [n for n, p in m.named_parameters() if id(p) not in proj_params]
            if extra:  # parameters outside the three projections would be dropped by GatedMLP
                report.skipped.append((name, cls, f"has parameters outside gate_proj/up_proj/down_proj ({', '.join(extra)}); "
                                                  "its Linear layers are patched one by one"))
                continue
            if not name:
                report.skipped.append((name, cls, "the root module cannot be replaced in place"))
                continue
            new = _gated_mlp(m)
            reason = _agree(m, new, m.gate_proj.in_features)
            if reason:
                report.skipped.append((name, cls, reason + "; its Linear layers are patched one by one"))
                continue
            _set(model, name, new)
            report.patched.append((name, cls, "opforge.nn.GatedMLP"))
            done.add(name)
            continue
        if _looks_rms_norm(m):
            if not rms_norm:
                continue
            w = getattr(m, "weight", None)
            eps = getattr(m, "variance_epsilon", None)
            if isinstance(m, torch.nn.RMSNorm):
                eps = m.eps
            eps_ok = isinstance(eps, (float, int)) or (isinstance(m, torch.nn.RMSNorm) and eps is None)
            if not isinstance(w, torch.nn.Parameter) or not eps_ok or list(m.children()) \
                    or len(list(m.parameters(recurse=False))) != 1:
                report.skipped.append((name, cls, "not a Llama-style RMSNorm (expected exactly a `weight` parameter and a "
                                                  "float `variance_epsilon`)"))
                continue
            if not name:
                report.skipped.append((name, cls, "the root module cannot be replaced in place"))
                continue
            if isinstance(m, torch.nn.RMSNorm):
                new = onn.RMSNorm(m.normalized_shape, eps=m.eps, elementwise_affine=True, device="meta")
                new.weight = w
                _copy_hooks(m, new)
            else:
                new = _rms_norm(m)
            # Probed for every weight shape: a norm with a multi-dim weight that normalizes over its last dim only
            # (or computes x·(1 + weight)) must not be swapped unchecked.
            reason = _agree(m, new, tuple(w.shape))
            if reason:
                report.skipped.append((name, cls, reason))
                continue
            _set(model, name, new)
            report.patched.append((name, cls, "opforge.nn.RMSNorm"))
            continue
        if type(m) is torch.nn.Linear:
            if linear:
                if not name:
                    report.skipped.append((name, cls, "the root module cannot be replaced in place"))
                    continue
                _set(model, name, _linear(m))
                report.patched.append((name, cls, "opforge.nn.Linear"))
            continue
        if isinstance(m, torch.nn.Linear):
            report.skipped.append((name, cls, "a subclass of torch.nn.Linear (its forward may differ); left unchanged"))
            continue
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
            report.skipped.append((name, cls, "opforge has no LayerNorm/GroupNorm op"))
            continue
        if cls == "Conv1D" and hasattr(m, "nf"):
            report.skipped.append((name, cls, "GPT-2-style Conv1D (weight stored transposed) is not patched"))
            continue
        if cls.endswith("MLP") and any(isinstance(c, torch.nn.Module) for c in m.children()) and not _looks_gated_mlp(m):
            report.skipped.append((name, cls, "not a gated MLP (expected gate_proj, up_proj, down_proj and a SiLU act_fn)"))
            continue
    if verbose:
        print(report)
    if not report.patched:
        msg = f"opforge.patch.apply: found nothing to patch in {type(model).__name__}\n{report}"
        if strict:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    elif report.skipped:
        if strict:
            raise ValueError(f"opforge.patch.apply: could not patch every module of {type(model).__name__}\n{report}")
        warnings.warn(f"opforge.patch.apply: could not patch {len(report.skipped)} module(s) of {type(model).__name__}:\n"
                      + "\n".join(f"  {n or '<root>'} ({c}): {r}" for n, c, r in report.skipped), stacklevel=2)
    return report
