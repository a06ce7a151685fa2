"""Fused projections: q/k/v (gate/up) weights concatenated once into one Linear, the originals standing by as
parameter-less slices, transformers' state_dict keys on the way out and in."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as TF

class FusedProjectionSlice(torch.nn.Linear):
    """Rows [start, stop) of a fused projection, standing where `q_proj` (`k_proj`, ...) was.

    Holds no parameter: `weight`/`bias` alias rows of the fused `torch.nn.Linear`'s (reads and in-place writes
    reach it; so does replacing `weight.data`, as PEFT's safe merge does: the new rows are written into the fused
    weight before the next forward or state_dict); calling it computes y = x · weightᵀ + bias for this slice alone,
    with gradients to the fused parameters. The patched forwards do not call it: they run the fused GEMM once and
    take column views of its output. A `torch.nn.Linear` subclass, so that PEFT can wrap it in a LoRA layer.

    Shape: `(*, in_features)` -> `(*, out_features)`.
    """

    def __init__(self, fused: torch.nn.Linear, start: int, stop: int):
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "_fused", fused)  # not a submodule: its parameters belong to the fused module
        self.start, self.stop = int(start), int(stop)
        self.in_features, self.out_features = fused.in_features, self.stop - self.start

    def _alias(self, name: str) -> Optional[torch.Tensor]:
        """A Parameter sharing the rows' storage (no autograd link), made again when the fused one moved."""
        full = getattr(self._fused, name)
        if full is None:
            return None
        cached = self.__dict__.get("_opforge_alias_" + name)
        if cached is not None and cached[1] is full and cached[2] == full.data_ptr():
            alias = cached[0]
            if alias.data_ptr() == cached[3]:
                return alias
            with torch.no_grad():  # alias.data was replaced: its values are the new rows
                full.data[self.start:self.stop].copy_(alias.data)
        rows = full.data[self.start:self.stop]
        alias = torch.nn.Parameter(rows, requires_grad=False)
        self.__dict__["_opforge_alias_" + name] = (alias, full, full.data_ptr(), alias.data_ptr())
        return alias

    @property
    def weight(self) -> torch.Tensor:
        return self._alias("weight")

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self._alias("bias")

    def __getstate__(self):
        state = torch.nn.Module.__getstate__(self) if hasattr(torch.nn.Module, "__getstate__") else self.__dict__
        return {k: v for k, v in state.items() if not k.startswith("_opforge_alias_")}  # made again on use

    def sync(self) -> None:
        """Write rows whose `.data` was replaced into the fused parameters."""
        self._alias("weight")
        self._alias("bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sync()
        b = self._fused.bias
        return TF.linear(x, self._fused.weight[self.start:self.stop], None if b is None else b[self.start:self.stop])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{self.start}, {self.stop}) of the fused projection"


def _path_of(module: torch.nn.Module, obj: torch.nn.Module) -> Optional[str]:
    """Where `obj` is now inside `module` (PEFT may have wrapped it: `q_proj.base_layer`)."""
    for name, sub in module.named_modules():
        if sub is obj:
            return name
    return None


def fused_parts(module: torch.nn.Module):
    """[(fused Linear, its path now, [(slice path now, start, stop, original path)])] of a module fuse() changed."""
    out = []
    for fused_name, (fused, parts) in module.__dict__.get("_opforge_fused", {}).items():
        fpath = _path_of(module, fused) or fused_name
        out.append((fused, fpath, [(_path_of(module, sl) or n, a, b, n) for n, a, b, sl in parts]))
    return out


def sync_slices(module: torch.nn.Module) -> None:
    for _, (_, parts) in module.__dict__.get("_opforge_fused", {}).items():
        for _, _, _, sl in parts:
            sl.sync()


def _split_state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the fused weights come out under transformers' keys (PEFT's, when wrapped), in the
    order the unfused module gives them: each slice's keys where the slice sits."""
    sync_slices(module)
    mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
    split = {}
    for fused, fpath, parts in fused_parts(module):
        for p in ("weight", "bias"):
            t = mine.pop(f"{prefix}{fpath}.{p}", None)
            if t is None:
                continue
            for path, a, b, _ in parts:  # contiguous copies: save_pretrained/safetensors refuse shared storage
                split[f"{prefix}{path}.{p}"] = t[a:b].clone()
    slices = {id(sl) for _, (_, parts) in module._opforge_fused.items() for _, _, _, sl in parts}
    fused_objs = {id(f) for _, (f, _) in module._opforge_fused.items()}
    for name, sub in module.named_modules():
        base = f"{prefix}{name}." if name else prefix
        if id(sub) in fused_objs:
            continue
        if id(sub) in slices:
            for p in ("weight", "bias"):
                if base + p in split:
                    state_dict[base + p] = split.pop(base + p)
            continue
        for k in [k for k in mine if k.startswith(base) and "." not in k[len(base):]]:
            state_dict[k] = mine.pop(k)
    state_dict.update(split)
    state_dict.update(mine)


def _join_load_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                        error_msgs) -> None:
    """load_state_dict pre-hook: transformers' q/k/v (gate/up) keys are concatenated into the fused key."""
    for fused, fpath, parts in fused_parts(module):
        for p in ("weight", "bias"):
            names = [f"{prefix}{path}.{p}" for path, _, _, _ in parts]
            cur = getattr(fused, p)
            if cur is None or not any(n in state_dict for n in names):
                continue
            pieces = []
            for n, (_, a, b, _) in zip(names, parts):
                if n in state_dict:
                    pieces.append(state_dict.pop(n).to(cur.device))
                else:
                    missing_keys.append(n)
                    pieces.append(cur.detach()[a:b])
            state_dict[f"{prefix}{fpath}.{p}"] = torch.cat(pieces, 0)


def register_sd_hooks(module: torch.nn.Module) -> list:
    post = getattr(module, "register_state_dict_post_hook", None)
    h1 = post(_split_state_dict_hook) if post is not None else module._register_state_dict_hook(_split_state_dict_hook)
    pre = getattr(module, "register_load_state_dict_pre_hook", None)
    h2 = pre(_join_load_pre_hook) if pre is not None else \
        module._register_load_state_dict_pre_hook(_join_load_pre_hook, with_module=True)
    return [h1, h2]


def _set_path(module: torch.nn.Module, path: str, new: torch.nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    (module.get_submodule(parent) if parent else module)._modules[leaf] = new


def fuse(module: torch.nn.Module, names: List[str], fused_name: str) -> List[int]:
    """Concatenate module.<names> (plain torch.nn.Linear, same input; a path such as `q_proj.base_layer` inside a
    PEFT LoRA layer) into one Linear module.<fused_name>; the originals are kept aside (storage freed) for revert,
    FusedProjectionSlice views stand in their place."""
    lins = [module.get_submodule(n) for n in names]
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
    if "_opforge_fused" not in module.__dict__:
        module._opforge_fused = {}
        module._opforge_stash = {}
    parts, sizes, off = [], [], 0
    for n, l in zip(names, lins):
        sl = FusedProjectionSlice(fused, off, off + l.out_features)
        parts.append((n, off, off + l.out_features, sl))
        _set_path(module, n, sl)  # same position
        module._opforge_stash[n] = l
        for p in l.parameters(recurse=False):  # free the original storage; revert refills it
            p.data = p.data.new_empty(0)
            p.grad = None
        sizes.append(l.out_features)
        off += l.out_features
    module.add_module(fused_name, fused)
    module._opforge_fused[fused_name] = (fused, parts)
    return sizes


def unfuse(module: torch.nn.Module) -> None:
    sync_slices(module)
    for fused, fpath, parts in fused_parts(module):
        for path, a, b, orig in parts:
            lin = module._opforge_stash[orig]
            with torch.no_grad():
                lin.weight.data = fused.weight.detach()[a:b].clone()
                if lin.bias is not None:
                    lin.bias.data = fused.bias.detach()[a:b].clone()
            lin.weight.requires_grad_(fused.weight.requires_grad)
            if fused.weight.grad is not None:
                lin.weight.grad = fused.weight.grad[a:b].clone()
            if lin.bias is not None and fused.bias.grad is not None:
                lin.bias.grad = fused.bias.grad[a:b].clone()
            _set_path(module, path, lin)
        parent, _, leaf = fpath.rpartition(".")
        (module.get_submodule(parent) if parent else module)._modules.pop(leaf)
    for h in module.__dict__.get("_opforge_hooks", []):
        h.remove()
    for attr in ("_opforge_fused", "_opforge_stash", "_opforge_hooks"):
        module.__dict__.pop(attr, None)


def split_gradients(model: torch.nn.Module) -> dict:
    """{transformers' parameter name: gradient} over the parameters of `model` that have one, the fused q/k/v and
    gate/up gradients split into their projections' rows (views)."""
    out = {}
    fused_ids = set()
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        for fused, fpath, parts in fused_parts(mod):
            fused_ids.add(id(fused))
            for pname in ("weight", "bias"):
                p = getattr(fused, pname)
                if p is None or p.grad is None:
                    continue
                for path, a, b, _ in parts:
                    out[f"{prefix}{path}.{pname}"] = p.grad[a:b]
    for name, mod in model.named_modules():
        if id(mod) in fused_ids:
            continue
        prefix = f"{name}." if name else ""
        for pname, p in mod.named_parameters(recurse=False):
            if p.grad is not None:
                out[prefix + pname] = p.grad
    return out
