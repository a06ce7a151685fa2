"""Fused projections: q/k/v (gate/up) weights concatenated once into one Linear, the originals standing by as
parameter-less slices, transformers' state_dict keys on the way out and in."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as TF

class FusedProjectionSlice(torch.nn.Module):
    """Rows [start, stop) of a fused projection, standing where `q_proj` (`k_proj`, ...) was.

    Holds no parameter: `weight`/`bias` are views of the fused `torch.nn.Linear`'s (reads and
    in-place writes reach it); calling it computes y = x · weightᵀ + bias for this slice alone. The patched
    forwards never call it: they run the fused GEMM once and take column views of its output.

    Shape: `(*, in_features)` -> `(*, out_features)`.
    """

    def __init__(self, fused: torch.nn.Linear, start: int, stop: int):
        super().__init__()
        object.__setattr__(self, "_fused", fused)  # not a submodule: its parameters belong to the fused module
        self.start, self.stop = int(start), int(stop)
        self.in_features, self.out_features = fused.in_features, self.stop - self.start

    @property
    def weight(self) -> torch.Tensor:
        return self._fused.weight[self.start:self.stop]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        b = self._fused.bias
        return None if b is None else b[self.start:self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TF.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{self.start}, {self.stop}) of the fused projection"


def _split_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the fused weights come out under transformers' keys, in transformers' order."""
    mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    for fused_name, parts in module._opforge_fused.items():
        for p in ("weight", "bias"):
            t = mine.pop(f"{prefix}{fused_name}.{p}", None)
            if t is None:
                continue
            for name, a, b in parts:  # contiguous copies: save_pretrained/safetensors refuse shared storage
                mine[f"{prefix}{name}.{p}"] = t[a:b].clone()
    for k in module._opforge_key_order:
        if prefix + k in mine:
            state_dict[prefix + k] = mine.pop(prefix + k)
    state_dict.update(mine)


def _join_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    """load_state_dict pre-hook: transformers' q/k/v (gate/up) keys are concatenated into the fused key."""
    for fused_name, parts in module._opforge_fused.items():
        fused = module._modules[fused_name]
        for p in ("weight", "bias"):
            names = [f"{prefix}{n}.{p}" for n, _, _ in parts]
            cur = getattr(fused, p)
            if cur is None or not any(n in state_dict for n in names):
                continue
            pieces = []
            for n, (_, a, b) in zip(names, parts):
                if n in state_dict:
                    pieces.append(state_dict.pop(n).to(cur.device))
                else:
                    missing_keys.append(n)
                    pieces.append(cur.detach()[a:b])
            state_dict[f"{prefix}{fused_name}.{p}"] = torch.cat(pieces, 0)


def register_sd_hooks(module: torch.nn.Module) -> list:
    post = getattr(module, "register_state_dict_post_hook", None)
    h1 = post(_split_state_dict_hook) if post is not None else module._register_state_dict_hook(_split_state_dict_hook)
    pre = getattr(module, "register_load_state_dict_pre_hook", None)
    h2 = pre(_join_load_pre_hook) if pre is not None else \
        module._register_load_state_dict_pre_hook(_join_load_pre_hook, with_module=True)
    return [h1, h2]


def fuse(module: torch.nn.Module, names: List[str], fused_name: str) -> List[int]:
    """Concatenate module.<names> (plain torch.nn.Linear, same input) into one Linear module.<fused_name>;
    the originals are kept aside (storage freed) for revert, FusedProjectionSlice views stand in their place."""
    lins = [module._modules[n] for n in names]
    w0 = lins[0].weight
    with torch.no_grad():
        w = torch.cat([l.weight.detach() for l in lins], 0)
        b = torch.cat([l.bias.detach() for l in lins], 0) if lins[0].bias is not None else None
    fused = torch.nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    fused.weight = torch.nn.Parameter(w, requires_grad=w0.requires_grad)
    if b is not None:
        fused.bias = torch.nn.Parameter(b, requires_grad=lins[0].bias.requires_grad)
    with torch.no_grad():  # accumulated gradients travel with the weights
        if all(l.weight.grad is not None for l in lins):
            fused.weight.grad = torch.cat([l.weight.grad for l in lins], 0)
        if b is not None and all(l.bias.grad is not None for l in lins):
            fused.bias.grad = torch.cat([l.bias.grad for l in lins], 0)
    if "_opforge_key_order" not in module.__dict__:
        module._opforge_key_order = [k for k in module.state_dict(keep_vars=True)]
        module._opforge_fused = {}
        module._opforge_stash = {}
    parts, sizes, off = [], [], 0
    for n, l in zip(names, lins):
        parts.append((n, off, off + l.out_features))
        module._modules[n] = FusedProjectionSlice(fused, off, off + l.out_features)  # same position
        module._opforge_stash[n] = l
        for p in l.parameters(recurse=False):  # free the original storage; revert refills it
            p.data = p.data.new_empty(0)
            p.grad = None
        sizes.append(l.out_features)
        off += l.out_features
    module.add_module(fused_name, fused)
    module._opforge_fused[fused_name] = parts
    return sizes


def unfuse(module: torch.nn.Module) -> None:
    for fused_name, parts in module.__dict__.get("_opforge_fused", {}).items():
        fused = module._modules.pop(fused_name)
        for n, a, b in parts:
            lin = module._opforge_stash[n]
            with torch.no_grad():
                lin.weight.data = fused.weight.detach()[a:b].clone()
                if lin.bias is not None:
                    lin.bias.data = fused.bias.detach()[a:b].clone()
            lin.weight.requires_grad_(fused.weight.requires_grad)
            if fused.weight.grad is not None:
                lin.weight.grad = fused.weight.grad[a:b].clone()
            if lin.bias is not None and fused.bias.grad is not None:
                lin.bias.grad = fused.bias.grad[a:b].clone()
            module._modules[n] = lin
    for h in module.__dict__.get("_opforge_hooks", []):
        h.remove()
    for attr in ("_opforge_fused", "_opforge_stash", "_opforge_key_order", "_opforge_hooks"):
        module.__dict__.pop(attr, None)



def split_gradients(model: torch.nn.Module) -> dict:
    """{transformers' parameter name: gradient} over the parameters of `model` that have one, the fused q/k/v and
    gate/up gradients split into their projections' rows (views)."""
    out = {}
    for name, mod in model.named_modules():
        fused = mod.__dict__.get("_opforge_fused", {})
        prefix = f"{name}." if name else ""
        for pname, p in mod.named_parameters(recurse=False):
            if p.grad is not None:
                out[prefix + pname] = p.grad
        for fused_name, parts in fused.items():
            lin = mod._modules[fused_name]
            for pname in ("weight", "bias"):
                p = getattr(lin, pname)
                if p is None or p.grad is None:
                    continue
                for n, a, b in parts:
                    out[f"{prefix}{n}.{pname}"] = p.grad[a:b]
    # the fused modules' own entries (qkv_proj.weight ...) are not transformers' names
    for name, mod in model.named_modules():
        for fused_name in mod.__dict__.get("_opforge_fused", {}):
            prefix = f"{name}.{fused_name}." if name else f"{fused_name}."
            for pname in ("weight", "bias"):
                out.pop(prefix + pname, None)
    return out
