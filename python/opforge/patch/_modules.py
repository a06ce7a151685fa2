"""Module-by-module swaps for what is outside the patched decoder layers (and everything with decoder=False):
Llama-style RMSNorms, SiLU-gated MLPs and plain torch.nn.Linear modules become opforge.nn modules holding the same
Parameter objects, each checked on a random input first; a module whose math differs is left alone and reported."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import nn as onn
from . import _families as FAM
from . import _layers as L
from ._report import PatchReport

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
    """Replace submodule `name` by `new`, remembering the old module for revert: on its parent, and on `new` itself
    (`_opforge_original`), for a parent that leaves the model with `new` kept (PEFT's merge_and_unload puts a LoRA
    layer's base layer in the LoRA layer's place)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    swapped = parent.__dict__.setdefault("_opforge_swapped", {})
    swapped.setdefault(child, parent._modules[child])
    new.__dict__["_opforge_original"] = swapped[child]
    parent._modules[child] = new


def restore(parent: torch.nn.Module, child: str, old: torch.nn.Module) -> None:
    """Put `old` back as `parent`'s submodule `child`, with the current Parameters of the module it replaced (those
    the optimizer, `.to()` or a load have since). Where a wrapper took that module's place since (PEFT's
    get_peft_model after apply puts a LoRA layer in the slot, holding the module as its base_layer), `old` goes back
    where the module is now, under the wrapper."""
    new = parent._modules[child]
    if new is not None and new.__dict__.get("_opforge_original") is not old:
        for holder in new.modules():
            name = next((n for n, sub in holder._modules.items()
                         if sub is not None and sub.__dict__.get("_opforge_original") is old), None)
            if name is not None:
                parent, child, new = holder, name, holder._modules[name]
                break
    for pname, p in new.named_parameters():
        owner, _, leaf = pname.rpartition(".")
        setattr(old.get_submodule(owner) if owner else old, leaf, p)
    parent._modules[child] = old


def apply_modules(model: torch.nn.Module, report: PatchReport, done: set, *, linear: bool, rms_norm: bool,
                   mlp: bool) -> None:
    """Module-by-module swaps (RMSNorm, gated MLP, Linear) for everything outside the patched decoder layers."""
    for name, m in list(model.named_modules()):
        if name in done or any(name.startswith(d + ".") for d in done) or L.is_patched_class(m):
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
            fam = FAM.family_of(m)
            if fam is not None and fam.offset:  # x·(1 + weight): the module keeps its class, with opforge's forward
                w = getattr(m, "weight", None)
                reason = FAM.norm_reason(m, w.shape[-1], fam) if isinstance(w, torch.nn.Parameter) and w.dim() == 1 \
                    else "not an RMSNorm with a 1-D weight"
                if reason:
                    report.skipped.append((name, cls, reason))
                    continue
                swap_norm(m, fam, False)
                report.patched.append((name, cls, "opforge RMSNorm (rms_norm of 1 + weight)"))
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



def swap_norm(m: torch.nn.Module, family, inductor_math: bool) -> None:
    """A norm outside the patched layers keeps its module and gets opforge.rms_norm as its forward (torch math
    under compile with inductor_math, so Inductor fuses the last residual add into it)."""
    L.swap_class(m, "norm", inductor_math)
    m._opforge_offset = bool(family is not None and family.offset)
    m._opforge_scale_first = bool(family is not None and family.scale_first)
