"""Fused projections: q/k/v (gate/up) weights concatenated once into one Linear, the originals standing by as
parameter-less slices, transformers' state_dict keys on the way out and in."""
from __future__ import annotations

import warnings
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn.functional as TF

class FusedProjectionSlice(torch.nn.Linear):
    """Rows [start, stop) of a fused projection, standing where `q_proj` (`k_proj`, ...) was.

    Holds no parameter: `weight`/`bias` are `Parameter`s sharing the storage of rows of the fused
    `torch.nn.Linear`'s (reads and in-place writes reach it; so does replacing `weight.data`, as PEFT's safe merge
    does: the new rows are written into the fused weight before the next forward or state_dict). Their `.grad` is
    the fused gradient's rows. `requires_grad_(False)` on the slice (or `weight.requires_grad = False`, seen at the
    next forward) freezes these rows: the fused GEMM then reads them detached (a zero gradient there), and a
    `torch.optim` optimizer's step puts their values back (weight decay, momentum); once every slice of the fused
    projection is frozen the fused Parameter itself has requires_grad False. Assigning a tensor to `weight`/`bias`
    (what `torch.func.functional_call` does with transformers' keys) makes the fused GEMM read that tensor in these
    rows until the slice's own Parameter is assigned back. Calling the slice computes y = x · weightᵀ + bias for
    these rows alone, with gradients to the fused parameters. The patched forwards do not call it: they run the
    fused GEMM once and take column views of its output. A `torch.nn.Linear` subclass, so that PEFT can wrap it in
    a LoRA layer.

    Shape: `(*, in_features)` -> `(*, out_features)`.
    """

    def __init__(self, fused: torch.nn.Linear, start: int, stop: int, index: int = 0):
        torch.nn.Module.__init__(self)
        object.__setattr__(self, "_fused", fused)  # not a submodule: its parameters belong to the fused module
        self.start, self.stop = int(start), int(stop)
        self.index = int(index)
        self.in_features, self.out_features = fused.in_features, self.stop - self.start

    def _alias(self, name: str) -> Optional[torch.Tensor]:
        """The tensor standing for this slice's `name`: an assigned one, else a Parameter sharing the rows' storage
        (no autograd link; requires_grad and .grad kept in step with the fused parameter's rows), made again when
        the fused one moved."""
        over = self.__dict__.get("_opforge_override")
        if over and name in over:
            return over[name]
        full = getattr(self._fused, name)
        if full is None:
            return None
        if not isinstance(full, torch.nn.Parameter):  # a tensor functional_call put in the fused one's place
            return full[self.start:self.stop]
        cached = self.__dict__.get("_opforge_alias_" + name)
        if cached is not None and cached[1] is full:
            alias = cached[0]
            if alias.requires_grad != cached[4] and isinstance(full, torch.nn.Parameter):
                set_rows_trainable(self._fused, name, self.index, alias.requires_grad)  # set on the alias by the user
            if cached[2] == full.data_ptr():
                if alias.data_ptr() == cached[3]:
                    return self._in_step(name, alias, full, cached)
                with torch.no_grad():  # alias.data was replaced: its values are the new rows
                    full.data[self.start:self.stop].copy_(alias.data)
        rows = full.data[self.start:self.stop]
        alias = torch.nn.Parameter(rows, requires_grad=False)
        cached = [alias, full, full.data_ptr(), alias.data_ptr(), False]
        _ALIASED.add(self)
        self.__dict__["_opforge_alias_" + name] = cached
        return self._in_step(name, alias, full, cached)

    def _in_step(self, name, alias, full, cached):
        flags = rows_trainable(self._fused, name)
        if flags is not None:
            _track(full, self._fused, name)  # (a copy or unpickled model is tracked from its first forward)
        rg = bool(flags[self.index]) if flags is not None else full.requires_grad
        if alias.requires_grad != rg:
            alias.requires_grad_(rg)
        cached[4] = rg
        if torch._C._functorch.maybe_current_level() is not None:
            return alias  # inside a torch.func transform: tensor ops here would be transformed; .grad left as it is
        g = full.grad if rg else None
        if g is not None and type(g) is not torch.Tensor:
            return alias  # a distributed (DTensor) gradient: its rows are not this slice's rows
        if g is None:
            if alias.grad is not None:
                alias.grad = None
        elif alias.grad is None or alias.grad.data_ptr() != g[self.start:self.stop].data_ptr():
            alias.grad = g[self.start:self.stop]
        return alias

    @property
    def weight(self) -> torch.Tensor:
        return self._alias("weight")

    @weight.setter
    def weight(self, value) -> None:
        self._assign("weight", value)

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self._alias("bias")

    @bias.setter
    def bias(self, value) -> None:
        self._assign("bias", value)

    def __setattr__(self, name, value) -> None:
        if name in ("weight", "bias"):  # torch.nn.Module.__setattr__ would register a Parameter under the name
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def _assign(self, name: str, value) -> None:
        cached = self.__dict__.get("_opforge_alias_" + name)
        over = self.__dict__.setdefault("_opforge_override", {})
        if value is None or (cached is not None and value is cached[0]):
            over.pop(name, None)  # its own Parameter back (functional_call restoring it)
            return
        full = getattr(self._fused, name)
        if not isinstance(value, torch.Tensor) or full is None \
                or tuple(value.shape) != (self.stop - self.start,) + tuple(full.shape[1:]):
            what = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"opforge.patch: {name} of a fused projection's slice (rows [{self.start}, {self.stop}) "
                             f"of the fused {name}) takes a tensor of shape "
                             f"{(self.stop - self.start,) + (tuple(full.shape[1:]) if full is not None else ())}, "
                             f"but got {what}")
        over[name] = value

    def requires_grad_(self, requires_grad: bool = True) -> "FusedProjectionSlice":
        """Train (or freeze) these rows of the fused projection, as `requires_grad_` does on a Linear."""
        for name in ("weight", "bias"):
            if isinstance(self._fused._parameters.get(name), torch.nn.Parameter):
                set_rows_trainable(self._fused, name, self.index, requires_grad)
                self._alias(name)
        return self

    def __getstate__(self):
        state = torch.nn.Module.__getstate__(self) if hasattr(torch.nn.Module, "__getstate__") else self.__dict__
        return {k: v for k, v in state.items() if not k.startswith("_opforge_alias_")}  # made again on use

    def sync(self) -> None:
        """Write rows whose `.data` was replaced into the fused parameters; take requires_grad set on the
        Parameters standing for the rows."""
        self._alias("weight")
        self._alias("bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.sync()
        w, b = (_operand_rows(self._fused, n, self) for n in ("weight", "bias"))
        return TF.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{self.start}, {self.stop}) of the fused projection"


# ---------------------------------------------------------------------------------------------------------
# Trainable rows. A fused parameter's rows per slice: stored as (the parameter's requires_grad when they were set,
# one flag per slice); when the parameter's own requires_grad has changed since (model.requires_grad_(...),
# PEFT freezing the base), every slice follows it.

def rows_trainable(fused: torch.nn.Linear, name: str) -> Optional[tuple]:
    """One requires_grad flag per slice of fused.<name>, or None when they all follow the parameter's."""
    p = fused._parameters.get(name)
    st = getattr(fused, "_opforge_rows_rg", None)  # an attribute read: torch.compile guards on it (recompiles)
    cur = st.get(name) if st else None
    if p is None or cur is None or not isinstance(p, torch.nn.Parameter) or cur[0] != p.requires_grad:
        return None
    return cur[1]


def set_rows_trainable(fused: torch.nn.Linear, name: str, index: int, value: bool) -> None:
    p = fused._parameters[name]
    n = len(fused.__dict__["_opforge_rows"])
    flags = list(rows_trainable(fused, name) or (p.requires_grad,) * n)
    flags[index] = bool(value)
    p.requires_grad_(any(flags))
    st = fused.__dict__.setdefault("_opforge_rows_rg", {})
    if all(flags) or not any(flags):
        st.pop(name, None)
        _PARTIAL.pop(id(p), None)
        return
    st[name] = (p.requires_grad, tuple(flags))
    _track(p, fused, name)
    warnings.warn(f"opforge.patch: some rows of a fused projection are frozen while others train ({name} "
                  f"requires_grad per slice {tuple(flags)}): the fused Parameter trains, the frozen rows get a zero "
                  f"gradient and a torch.optim optimizer's step puts their values back (other code that writes into "
                  f"the fused weight, or an optimizer outside torch.optim, changes them)", stacklevel=3)
    _install_optimizer_hooks()


def _track(p: torch.nn.Parameter, fused: torch.nn.Linear, name: str) -> None:
    """Have torch.optim steps keep the frozen rows of `p` (see _step_pre_hook)."""
    e = _PARTIAL.get(id(p))
    if e is None or e[0]() is not p or e[1]() is not fused:
        key = id(p)  # the entry goes with the Parameter (else every later step of every optimizer looks it up)
        _PARTIAL[key] = (weakref.ref(p, lambda r, k=key: _drop(_PARTIAL, k, r)), weakref.ref(fused), name)
        _install_optimizer_hooks()


def _drop(table: dict, key: int, ref) -> None:
    """Weakref callback: forget `key` when its entry is still the one of the Parameter that died."""
    e = table.get(key)
    if e is not None and e[0] is ref:
        del table[key]


def _operand_rows(fused: torch.nn.Linear, name: str, sl: "FusedProjectionSlice") -> Optional[torch.Tensor]:
    over = sl.__dict__.get("_opforge_override")
    if over and name in over:
        return over[name]
    full = getattr(fused, name)
    if full is None:
        return None
    t = full[sl.start:sl.stop]
    flags = rows_trainable(fused, name) if isinstance(full, torch.nn.Parameter) else None
    trains = _flag_set_on_alias(sl, name, full)
    if trains is None:
        trains = flags is None or flags[sl.index]
    return t if trains else t.detach()


def _flag_set_on_alias(sl: "FusedProjectionSlice", name: str, full) -> Optional[bool]:
    """Under torch.compile, where the slices are not synced: requires_grad set on the Parameter standing for the
    rows since the last sync (`q_proj.weight.requires_grad = False`), else None. Dynamo guards on that flag; the
    next optimizer step records it (see _step_pre_hook)."""
    if not torch.compiler.is_compiling() or not isinstance(full, torch.nn.Parameter):
        return None
    _TRACED[0] = True  # a store, no read (no guard): the optimizer pre-hook looks at the slices from now on
    cached = sl.__dict__.get("_opforge_alias_" + name)
    if cached is None or cached[1] is not full or cached[0].requires_grad == cached[4]:
        return None
    return bool(cached[0].requires_grad)


class _Operand:
    """weight and bias of a fused GEMM read with frozen rows detached or assigned tensors in their rows."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


def gemm_operand(module: torch.nn.Module, fused_name: str, base):
    """`base` (the fused Linear), or an object with the weight and bias the fused GEMM must read instead: frozen
    slices' rows detached, tensors assigned to slices (functional_call) in their rows."""
    entry = module.__dict__.get("_opforge_fused", {}).get(fused_name)
    if entry is None or entry[0] is not base:
        return base
    fused, parts = entry
    out, changed = [], False
    for name in ("weight", "bias"):
        full = getattr(fused, name)
        special = full is not None and (
            (isinstance(full, torch.nn.Parameter) and rows_trainable(fused, name) is not None)
            or any(_flag_set_on_alias(sl, name, full) is not None for _, _, _, sl in parts)
            or any(name in (sl.__dict__.get("_opforge_override") or ()) for _, _, _, sl in parts))
        if not special:
            out.append(full)
            continue
        changed = True
        out.append(torch.cat([_operand_rows(fused, name, sl) for _, _, _, sl in parts], 0))
    return _Operand(*out) if changed else base


# ---------------------------------------------------------------------------------------------------------
# Optimizers. Parameters that apply took out of the model (the q/k/v and gate/up weights now in a fused one) and
# those revert took out (the fused ones) train nothing; an optimizer holding them would step them silently without
# a gradient. A global torch.optim step pre-hook refuses such an optimizer; it also keeps frozen rows of a fused
# parameter (see set_rows_trainable) at their values across the step.

_ALIASED: "weakref.WeakSet" = weakref.WeakSet()  # slices whose rows' Parameters were handed out
_TRACED = [False]  # Dynamo has traced a patched forward reading fused rows in this process
_RETIRED: Dict[int, tuple] = {}   # id -> (weakref to the Parameter, what it was)
_PARTIAL: Dict[int, tuple] = {}   # id -> (weakref to the fused Parameter, weakref to its Linear, name)
_GENERATION = [0]
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_HOOKS: list = []


def retire(p: torch.nn.Parameter, what: str) -> None:
    key = id(p)
    _RETIRED[key] = (weakref.ref(p, lambda r, k=key: _drop(_RETIRED, k, r)), what)
    _GENERATION[0] += 1
    _install_optimizer_hooks()


def unretire(p: torch.nn.Parameter) -> None:
    e = _RETIRED.get(id(p))
    if e is not None and e[0]() is p:
        del _RETIRED[id(p)]
        _GENERATION[0] += 1


def _params(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def _step_pre_hook(opt, args, kwargs) -> None:
    for sl in list(_ALIASED) if _TRACED[0] else ():  # requires_grad set on a slice's Parameter that no eager
        # forward has seen (compiled forwards do not sync the slices)
        for name in ("weight", "bias"):
            cached = sl.__dict__.get("_opforge_alias_" + name)
            if cached is not None and cached[0].requires_grad != cached[4]:
                sl.sync()
    if _RETIRED:
        key = (_GENERATION[0], sum(len(g["params"]) for g in opt.param_groups))
        if _CHECKED.get(opt) != key:
            found = []
            for p in _params(opt):
                e = _RETIRED.get(id(p))
                if e is not None and e[0]() is p:
                    found.append(e[1])
            if found:
                raise RuntimeError(
                    f"opforge.patch: this {type(opt).__name__} holds {len(found)} Parameter(s) that are no longer "
                    f"in the model ({', '.join(found[:3])}{' ...' if len(found) > 3 else ''}): opforge.patch.apply "
                    f"replaced the q/k/v and gate/up projections' Parameters by fused ones (revert replaces the "
                    f"fused ones by the originals), so a step would never train them. Build the optimizer after "
                    f"apply (or after revert): torch.optim.AdamW(model.parameters(), ...)")
            _CHECKED[opt] = key
    saved = []
    if _PARTIAL:
        for p in _params(opt):
            e = _PARTIAL.get(id(p))
            if e is None or e[0]() is not p or e[1]() is None:
                continue
            fused, name = e[1](), e[2]
            flags = rows_trainable(fused, name)
            if flags is None:
                continue
            for (a, b), f in zip(fused.__dict__["_opforge_rows"], flags):
                if not f and type(p.data) is torch.Tensor:
                    saved.append((p, a, b, p.detach()[a:b].clone()))
    opt.__dict__["_opforge_frozen_rows"] = saved


def _step_post_hook(opt, args, kwargs) -> None:
    saved = opt.__dict__.pop("_opforge_frozen_rows", None)
    with torch.no_grad():
        for p, a, b, rows in saved or ():
            p[a:b].copy_(rows)


def _install_optimizer_hooks() -> None:
    if not _HOOKS:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOKS.append(register_optimizer_step_pre_hook(_step_pre_hook))
        _HOOKS.append(register_optimizer_step_post_hook(_step_post_hook))


def _path_of(module: torch.nn.Module, obj: torch.nn.Module) -> Optional[str]:
    """Where `obj` is now inside `module` (PEFT may have wrapped it: `q_proj.base_layer`)."""
    for name, sub in module.named_modules():
        if sub is obj:
            return name
    return None


def fused_parts(module: torch.nn.Module):
    """[(fused Linear, its path now, [(slice path now, start, stop, original path, slice)])] of a module fuse()
    changed."""
    out = []
    for fused_name, (fused, parts) in module.__dict__.get("_opforge_fused", {}).items():
        fpath = _path_of(module, fused) or fused_name
        out.append((fused, fpath, [(_path_of(module, sl) or n, a, b, n, sl) for n, a, b, sl in parts]))
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
            for path, a, b, _, sl in parts:
                # keep_vars=True: the Parameters standing for the rows (their storage, requires_grad, .grad);
                # else contiguous copies: save_pretrained/safetensors refuse tensors sharing storage
                split[f"{prefix}{path}.{p}"] = getattr(sl, p) if isinstance(t, torch.nn.Parameter) else t[a:b].clone()
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
            names = [f"{prefix}{path}.{p}" for path, _, _, _, _ in parts]
            cur = getattr(fused, p)
            if cur is None or not any(n in state_dict for n in names):
                continue
            pieces = []
            for n, (_, a, b, _, _) in zip(names, parts):
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
    fused._opforge_rows = []
    fused._opforge_rows_rg = {}  # per-slice flags where they differ (see rows_trainable); present: a plain read
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
        sl = FusedProjectionSlice(fused, off, off + l.out_features, len(parts))
        parts.append((n, off, off + l.out_features, sl))
        fused._opforge_rows.append((off, off + l.out_features))
        _set_path(module, n, sl)  # same position
        module._opforge_stash[n] = l
        for pn, p in l.named_parameters(recurse=False):  # free the original storage; revert refills it
            p.data = p.data.new_empty(0)
            p.grad = None
            retire(p, f"{type(module).__name__}.{n}.{pn}")
        sizes.append(l.out_features)
        off += l.out_features
    module.add_module(fused_name, fused)
    module._opforge_fused[fused_name] = (fused, parts)
    for pn in ("weight", "bias"):  # projections frozen apart: those rows frozen in the fused parameter
        flags = [getattr(l, pn).requires_grad for l in lins if getattr(l, pn) is not None]
        if len(flags) == len(lins) and any(flags) and not all(flags):
            getattr(fused, pn).requires_grad_(True)
            for i, f in enumerate(flags):
                if not f:
                    set_rows_trainable(fused, pn, i, False)
    return sizes


def unfuse(module: torch.nn.Module) -> None:
    sync_slices(module)
    for fused, fpath, parts in fused_parts(module):
        for path, a, b, orig, sl in parts:
            lin = module._opforge_stash[orig]
            for pn in ("weight", "bias"):
                p, full = getattr(lin, pn), getattr(fused, pn)
                if p is None:
                    continue
                flags = rows_trainable(fused, pn)
                rg = bool(flags[sl.index]) if flags is not None else full.requires_grad
                with torch.no_grad():
                    p.data = full.detach()[a:b].clone()
                p.requires_grad_(rg)
                if full.grad is not None and rg:
                    p.grad = full.grad[a:b].clone()
                unretire(p)
            _set_path(module, path, lin)
        for pn, full in fused.named_parameters(recurse=False):
            _PARTIAL.pop(id(full), None)
            retire(full, f"{type(module).__name__}.{fpath}.{pn}")
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
                flags = rows_trainable(fused, pname)
                for path, a, b, _, sl in parts:
                    if flags is None or flags[sl.index]:  # a frozen slice has no gradient, as a frozen Linear
                        out[f"{prefix}{path}.{pname}"] = p.grad[a:b]
    for name, mod in model.named_modules():
        if id(mod) in fused_ids:
            continue
        prefix = f"{name}." if name else ""
        for pname, p in mod.named_parameters(recurse=False):
            if p.grad is not None:
                out[prefix + pname] = p.grad
    return out
