"""Tensor and sequence parallelism of a patched Llama-family model (`opforge.patch.apply`) on a 1-D device mesh.

`parallelize(model, tp_mesh)` shards it in place, Megatron style with sequence parallelism:

| module | placement |
| --- | --- |
| `embed_tokens` | row-wise (vocabulary `Shard(0)`), output `Shard(1)`: tokens sharded along the sequence |
| `input_layernorm`, `post_attention_layernorm`, final `norm` | weight `Replicate`; run on the sequence-sharded activations (opforge's rms_norm / fused_add_rms_norm rules) |
| `self_attn.qkv_proj` (fused q/k/v) | column-wise, each rank its q, k and v heads (below) |
| `self_attn.o_proj` | row-wise, output reduce-scattered to `Shard(1)` |
| `mlp.gate_up_proj` (fused gate/up) | column-wise, each rank its gate and up rows |
| `mlp.down_proj` | row-wise, output reduce-scattered to `Shard(1)` |
| `lm_head` | column-wise (vocabulary `Shard(0)`): the loss is vocabulary-parallel (opforge.parallel.loss); without labels the logits are gathered |

The fused projections: a contiguous `Shard(0)` slice of `[q | k | v]` would give rank 0 all of q and none of v.
The plan reorders the fused weight's rows once, to `[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]` (q_r: rank r's query heads),
so that the `Shard(0)` slice of rank r is its own `[q_r | k_r | v_r]` (likewise `[gate_r | up_r]`), and sets the
attention's split sizes to the local widths. The attention and the MLP then run on local tensors (the heads and
the intermediate columns of this rank): their input, gathered from the sequence shards, enters as a local tensor
whose gradient is a partial sum (reduce-scattered on the way back), and the patched forwards read the fused
projections through a `LocalView`: their local weight shard, with its gradient.

The parameters are DTensors: build the optimizer after `parallelize`, and compose with FSDP2 on a 2-D mesh
(`fully_shard(layer, mesh=mesh["dp"])` per decoder layer and on the root, after `parallelize(model, mesh["tp"])`).
`state_dict()` and `load_state_dict` keep transformers' keys and values: hooks that run before opforge.patch's split
(join) put the fused weights back in `[q | k | v]` order (in the plan's order), so a parallelized model saves and
loads the checkpoints of the unparallelized one (its q/k/v/gate/up values as gathered `Replicate` DTensors).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

__all__ = ["tensor_parallel_plan", "parallelize", "permute_fused", "unpermute_fused"]


def permute_fused(weight: torch.Tensor, sizes: Sequence[int], ranks: int) -> torch.Tensor:
    """Rows of a fused weight `[p_0 | p_1 | ...]` reordered so that the r-th `Shard(0)` slice of `ranks` is
    `[p_0's r-th slice | p_1's r-th slice | ...]`.

    Args:
        weight: `(Σ sizes, *)` any dtype. A fused weight (or bias) in `[p_0 | p_1 | ...]` row order.
        sizes: the parts' row counts (q, k, v widths; gate, up widths).
        ranks: int. The tensor-parallel size.

    Returns:
        `(Σ sizes, *)`, a new tensor in the plan's row order.

    Raises:
        ValueError: a size not divisible by `ranks`.
    """
    for s in sizes:
        if s % ranks:
            raise ValueError(f"opforge.parallel: expected every part of the fused projection ({list(sizes)}) to be "
                             f"divisible by the tensor-parallel size {ranks}")
    parts = weight.split(list(sizes), 0)
    return torch.cat([p.chunk(ranks, 0)[r] for r in range(ranks) for p in parts], 0)


def unpermute_fused(weight: torch.Tensor, sizes: Sequence[int], ranks: int) -> torch.Tensor:
    """The inverse of `permute_fused`: a fused weight (gathered, `(Σ sizes, *)`) in the plan's row order back in
    `[p_0 | p_1 | ...]` order. Args as `permute_fused`; returns a new tensor."""
    local = [s // ranks for s in sizes]
    blocks = [b.split(local, 0) for b in weight.chunk(ranks, 0)]
    return torch.cat([torch.cat([blocks[r][i] for r in range(ranks)], 0) for i in range(len(sizes))], 0)


class LocalView:
    """What the patched attention and MLP see as a fused projection (or a per-head norm) under the plan: the module's
    weight and bias as local tensors of their DTensor parameters, with their gradients. A fused projection's local
    shard is exact (its gradient `Shard(0)`); a replicated per-head norm's weight, run on this rank's heads only,
    gets a partial gradient (`grad_partial`). Any other attribute is the module's."""

    __slots__ = ("module", "grad_partial")

    def __init__(self, module: torch.nn.Module, grad_partial: bool):
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "grad_partial", grad_partial)

    def _local(self, p):
        if not isinstance(p, DTensor):
            return p
        return p.to_local(grad_placements=[Partial()] if self.grad_partial else None)

    @property
    def weight(self):
        return self._local(self.module.weight)

    @property
    def bias(self):
        return self._local(getattr(self.module, "bias", None))

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


_LOCAL_CLASSES: Dict[tuple, type] = {}


def _local_children(module: torch.nn.Module, children: Dict[str, bool]) -> None:
    """Swaps module's class for a subclass whose attributes `children` (name -> grad_partial) read as `LocalView`s
    of those submodules (their parameters and registration unchanged: FSDP2 and state_dict see the modules)."""
    key = (type(module), tuple(sorted(children.items())))
    if key not in _LOCAL_CLASSES:
        ns = {n: property(lambda self, n=n, g=g: LocalView(self._modules[n], g)) for n, g in children.items()}
        _LOCAL_CLASSES[key] = type(f"TensorParallel{type(module).__name__}", (type(module),), ns)
    module.__class__ = _LOCAL_CLASSES[key]


class LocalReplicated(SequenceParallel):
    """Replicates a module's parameters on the mesh; the module is run on local tensors through `LocalView`
    (q_norm/k_norm on this rank's heads)."""

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Replicate()]),
                                                              requires_grad=p.requires_grad)
        return module


class FusedColwiseParallel(ColwiseParallel):
    """Column-wise parallelism of a fused projection (`[q | k | v]`, `[gate | up]`): rows reordered (see
    `permute_fused`) so each rank's `Shard(0)` slice holds its part of every piece (the patched attention and MLP
    read it through `LocalView` and run it on local tensors)."""

    def __init__(self, sizes: Sequence[int]):
        super().__init__()
        self.sizes = list(sizes)

    def _apply(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
        ranks = device_mesh.size()
        for name in ("weight", "bias"):
            p = module._parameters.get(name)
            if p is None:
                continue
            full = permute_fused(p.detach(), self.sizes, ranks)
            module._parameters[name] = torch.nn.Parameter(distribute_tensor(full, device_mesh, [Shard(0)]),
                                                          requires_grad=p.requires_grad)
        return module


def _slice_rows(sl, name: str, grad: bool):
    """Rows of a fused projection's slice (`q_proj`, `up_proj`...) as a DTensor of transformers' rows, or None where
    the fused parameter is not a DTensor.

    Under the plan rank r's shard of the fused weight is `[p_0's r-th chunk | p_1's | ...]`, so a part starting at
    row `start` sits at local row `start / ranks`: a `Shard(0)` view of the local rows, without a collective (grad:
    with its gradient to the fused parameter). Where the fused parameter is another DTensor (FSDP2's sharded one
    between steps) the rows come from the gathered weight put back in transformers' order, as a `Replicate` DTensor
    (not with grad: FSDP2 gathers the parameter for a forward)."""
    full = getattr(sl._fused, name)
    if not isinstance(full, DTensor):
        return None
    mesh = full.device_mesh
    if mesh.ndim == 1 and tuple(full.placements) == (Shard(0),):
        ranks = mesh.size()
        local = full.to_local() if grad else full._local_tensor.detach()
        rows = local[sl.start // ranks:sl.stop // ranks]
        shape = torch.Size((sl.stop - sl.start, *full.shape[1:]))
        return DTensor.from_local(rows, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
    if grad:
        raise NotImplementedError(
            f"opforge.parallel: calling the slice of rows [{sl.start}, {sl.stop}) of a fused projection needs its "
            f"{name} as the plan's Shard(0) DTensor of the tensor-parallel mesh, but it is {tuple(full.placements)} "
            f"on a {mesh.ndim}-D mesh (FSDP2's sharded parameter between steps): call it inside the model's forward")
    sizes = [b - a for a, b in sl._opforge_tp_parts]
    rows = unpermute_fused(full.detach().full_tensor(), sizes, sl._opforge_tp_size)[sl.start:sl.stop]
    return DTensor.from_local(rows, mesh, [Replicate()] * mesh.ndim, run_check=False)


class TensorParallelSlice:
    """Mixed into the class of a fused projection's slice under the plan (`self_attn.q_proj`, `mlp.up_proj`...):
    its `weight`/`bias` are DTensors of transformers' rows of the part (`_slice_rows`: a slice of the row-reordered
    fused DTensor would gather the whole part to every rank, cached there, and take the wrong rows); calling it
    computes that part column-wise. Freezing the part alone is refused: the plan trains a fused projection as one
    parameter."""

    def _alias(self, name: str):
        over = self.__dict__.get("_opforge_override")
        if over and name in over:
            return over[name]
        full = getattr(self._fused, name)
        if not isinstance(full, DTensor):
            return super()._alias(name)
        local = full._local_tensor
        key = (local.data_ptr(), local._version if full.device_mesh.ndim > 1 else 0)
        cached = self.__dict__.get("_opforge_tp_alias_" + name)
        if cached is not None and cached[1] is full and cached[3] == key:
            alias = cached[0]
            if alias.requires_grad != cached[2]:
                raise NotImplementedError(
                    f"opforge.parallel: freezing {name} of one part (rows [{self.start}, {self.stop})) of a fused "
                    "projection is not supported under tensor parallelism; set requires_grad on the fused "
                    "projection (qkv_proj, gate_up_proj) instead")
            if alias.requires_grad != full.requires_grad:
                alias.requires_grad_(full.requires_grad)
                cached[2] = full.requires_grad
            return alias
        alias = torch.nn.Parameter(_slice_rows(self, name, grad=False), requires_grad=full.requires_grad)
        self.__dict__["_opforge_tp_alias_" + name] = [alias, full, full.requires_grad, key]
        return alias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _slice_rows(self, "weight", grad=True)
        if w is None:
            return super().forward(x)
        b = _slice_rows(self, "bias", grad=True) if getattr(self._fused, "bias", None) is not None else None
        return torch.nn.functional.linear(x, w, b)


_SLICE_CLASSES: Dict[type, type] = {}


def _tensor_parallel_slices(module: torch.nn.Module) -> None:
    """Swaps the class of every slice of module's fused projections for one with `TensorParallelSlice` mixed in."""
    for _, (_, parts) in module.__dict__.get("_opforge_fused", {}).items():
        for _, _, _, sl in parts:
            cls = type(sl)
            if issubclass(cls, TensorParallelSlice):
                continue
            if cls not in _SLICE_CLASSES:
                _SLICE_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelSlice, cls), {})
            sl.__class__ = _SLICE_CLASSES[cls]
            sl._opforge_tp_size = module._opforge_tp_ranks
            sl._opforge_tp_parts = [(a, b) for _, a, b, _ in parts]
            for name in ("weight", "bias"):  # a cached alias of the unsharded weight
                sl.__dict__.pop("_opforge_alias_" + name, None)


def _local_input(mesh, name: str):
    """A forward pre-hook: the module's input `name` (positional 0 or keyword), a `Shard(1)` DTensor, gathered to
    every rank and passed on as the local tensor; its gradient goes back as a partial sum (each rank's heads or
    columns contribute a part), reduce-scattered to the sequence shards."""

    def convert(x):
        if isinstance(x, DTensor):
            return x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        return x

    def hook(module, args, kwargs):
        if name in kwargs:
            kwargs[name] = convert(kwargs[name])
        elif args:
            args = (convert(args[0]), *args[1:])
        return args, kwargs

    return hook


def _fused_parts(module: torch.nn.Module) -> Dict[str, list]:
    """{fused module name: [(part name, first row, end row), ...]} as opforge.patch recorded the fusion."""
    return {name: [(n, a, b) for n, a, b, _ in parts]
            for name, (_, parts) in module.__dict__.get("_opforge_fused", {}).items()}


def _state_dict_in_order(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook that runs before opforge.patch's split: the fused weights back in `[q | k | v]`
    (`[gate | up]`) order, as a `Replicate` DTensor of the gathered weight, so that the split gives transformers'
    q/k/v (gate/up) values."""
    ranks = module._opforge_tp_ranks
    for fused_name, parts in _fused_parts(module).items():
        sizes = [b - a for _, a, b in parts]
        for p in ("weight", "bias"):
            key = f"{prefix}{fused_name}.{p}"
            t = state_dict.get(key)
            if isinstance(t, DTensor):
                full = unpermute_fused(t.full_tensor(), sizes, ranks)
                state_dict[key] = DTensor.from_local(full, t.device_mesh, [Replicate()] * t.device_mesh.ndim,
                                                     run_check=False)


def _load_in_order(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                   error_msgs) -> None:
    """load_state_dict pre-hook that runs before opforge.patch's join: transformers' q/k/v (gate/up) keys joined
    here, in the plan's row order and distributed as the fused parameter is (the join then has nothing to do)."""
    ranks = module._opforge_tp_ranks
    for fused_name, parts in _fused_parts(module).items():
        fused = module._modules[fused_name]
        sizes = [b - a for _, a, b in parts]
        for p in ("weight", "bias"):
            param = fused._parameters.get(p)
            keys = [f"{prefix}{n}.{p}" for n, _, _ in parts]
            if not isinstance(param, DTensor) or not all(k in state_dict for k in keys):
                continue  # partial or absent: opforge.patch's join reports it
            pieces = [state_dict.pop(k) for k in keys]
            pieces = [x.full_tensor() if isinstance(x, DTensor) else x for x in pieces]
            full = permute_fused(torch.cat([x.to(param.device) for x in pieces], 0), sizes, ranks)
            state_dict[f"{prefix}{fused_name}.{p}"] = distribute_tensor(full, param.device_mesh, param.placements)


def _hooks_first(module: torch.nn.Module) -> None:
    """Registers the two hooks above ahead of opforge.patch's (hooks run in registration order)."""
    h = module.register_state_dict_post_hook(_state_dict_in_order)
    module._state_dict_hooks.move_to_end(h.id, last=False)
    h = module.register_load_state_dict_pre_hook(_load_in_order)
    module._load_state_dict_pre_hooks.move_to_end(h.id, last=False)


def _layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if getattr(m, "_opforge_kind", None) == "decoder"]


def _check_patched(model: torch.nn.Module) -> None:
    layers = _layers(model)
    if not layers:
        raise ValueError("opforge.parallel: expected a model patched by opforge.patch.apply (decoder layers of the "
                         "Llama family), but found no patched decoder layer")
    for layer in layers:
        moe = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if moe is not None and hasattr(moe, "experts"):
            raise ValueError(f"opforge.parallel: expected decoder layers with a dense MLP, but "
                             f"{type(layer).__name__}'s is a mixture of experts ({type(moe).__name__}, e.g. Mixtral, "
                             "Qwen2-MoE, Qwen3-MoE): not supported by the tensor-parallel plan")
        if not hasattr(layer.self_attn, "qkv_proj") or not hasattr(layer.mlp, "gate_up_proj"):
            raise ValueError("opforge.parallel: expected patched decoder layers with self_attn.qkv_proj and "
                             "mlp.gate_up_proj (opforge.patch.apply(model) with decoder=True)")
        # What the plan does not cover is refused, never run: checkpoint-fused projections (Phi-3: no record of
        # the parts, so state_dict could not undo the row reordering), norms other than the two the plan shards
        # (Gemma 2/3 and OLMo 2's sandwich norms), q/k norms over the whole projection width (OLMo 2) rather
        # than per head, mixture-of-experts MLPs and FP8 projections.
        for part in (layer.self_attn, layer.mlp):
            fp8 = part.__dict__.get("_opforge_fp8")
            if fp8:
                raise ValueError(f"opforge.parallel: expected projections in the model's precision, but "
                                 f"{type(part).__name__} runs FP8 projections (opforge.patch.apply(model, "
                                 f"fp8={fp8!r})): fp8_linear has no row-wise sharding (its scales span whole rows), "
                                 "so o_proj and down_proj would be gathered to every rank at every step, and a "
                                 "tensorwise scale of a weight shard is not the whole weight's: not supported by the "
                                 "tensor-parallel plan")
            if not _fused_parts(part):
                raise ValueError(f"opforge.parallel: expected {type(part).__name__}'s fused projection to be fused "
                                 "by opforge.patch from separate checkpoint projections (Llama, Mistral, Qwen2, "
                                 "Qwen3, Gemma, Granite), but it was fused in the checkpoint (e.g. Phi-3): not "
                                 "supported by the tensor-parallel plan")
        extra = [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if hasattr(layer, n)]
        if extra or not hasattr(layer, "input_layernorm"):
            raise ValueError(f"opforge.parallel: expected a decoder layer with input_layernorm and "
                             f"post_attention_layernorm only, but {type(layer).__name__} has "
                             f"{', '.join(extra) or 'no input_layernorm'} (sandwich norms, e.g. Gemma 2/3, OLMo 2): "
                             "not supported by the tensor-parallel plan")
        hd = getattr(layer.self_attn, "head_dim", None)
        for n in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, n, None)
            w = getattr(norm, "weight", None)
            if w is not None and hd is not None and w.shape[-1] != hd:
                raise ValueError(f"opforge.parallel: expected self_attn.{n} to normalise each head (weight of "
                                 f"{hd} = head_dim), but its weight has {w.shape[-1]} (a norm over the whole "
                                 "projection, e.g. OLMo 2): not supported by the tensor-parallel plan")


def tensor_parallel_plan(model: torch.nn.Module) -> Dict[str, object]:
    """The `parallelize_module` plan of a patched Llama-family model: {qualified module name: ParallelStyle}.

    Covers the embedding, every decoder layer's norms and projections, the final norm and the lm_head (see the
    module docstring's table). The fused projections get `FusedColwiseParallel` (row reordering); the attention's
    and MLP's own inputs are converted by `parallelize`'s hooks (not a ParallelStyle: their gradient is a partial
    sum), so use `parallelize` rather than this plan alone.

    Args:
        model: a model patched by `opforge.patch.apply` (a transformers `*ForCausalLM` or its base model).

    Returns:
        dict of module name -> `torch.distributed.tensor.parallel.ParallelStyle`.

    Raises:
        ValueError: the model has no patched decoder layer.
    """
    _check_patched(model)
    plan: Dict[str, object] = {}
    names = {m: n for n, m in model.named_modules()}
    for layer in _layers(model):
        p = names[layer]
        attn, mlp = layer.self_attn, layer.mlp
        plan[f"{p}.input_layernorm"] = SequenceParallel()
        plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
        plan[f"{p}.self_attn.qkv_proj"] = FusedColwiseParallel(attn._opforge_sizes)
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        for n in ("q_norm", "k_norm"):  # per-head norms, run on the local heads: weight replicated, read locally
            if n in attn._modules:
                plan[f"{p}.self_attn.{n}"] = LocalReplicated()
        plan[f"{p}.mlp.gate_up_proj"] = FusedColwiseParallel([mlp.gate_up_proj.out_features // 2] * 2)
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    inside = tuple(names[layer] + "." for layer in _layers(model))
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and n.endswith("embed_tokens"):
            plan[n] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        elif n.rsplit(".", 1)[-1] == "norm" and not n.startswith(inside) and isinstance(
                getattr(m, "weight", None), torch.Tensor):
            plan[n] = SequenceParallel(use_local_output=False)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    if head is not None:
        plan[names[head]] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def parallelize(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    """Shards a patched Llama-family model in place over `tp_mesh` (1-D) with `tensor_parallel_plan`, sequence
    parallel between the blocks, and returns it.

    The number of attention heads, key/value heads and the intermediate size must be divisible by the mesh size.
    With labels the loss runs vocabulary-parallel (`opforge.linear_cross_entropy` of the `Shard(0)` lm_head weight)
    and is a `Replicate` DTensor; the sequence length must be divisible by the mesh size.

    Args:
        model: a model patched by `opforge.patch.apply`.
        tp_mesh: a 1-D `DeviceMesh` (e.g. `init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))["tp"]`).

    Returns:
        model, its parameters now DTensors on tp_mesh.

    Raises:
        ValueError: not a patched model; heads or widths not divisible by the mesh size; tied embeddings; a parameter
            already a DTensor (parallelized twice, or after fully_shard).
    """
    from .sharding import keep_param_placements, register_sharding_rules

    register_sharding_rules()
    if tp_mesh.ndim != 1:
        raise ValueError(f"opforge.parallel.parallelize: expected a 1-D tensor-parallel mesh, but got {tp_mesh.ndim}-D")
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"opforge.parallel.parallelize: expected a model of plain-tensor parameters (parallelize "
                             f"it once, before fully_shard), but {name} is already a DTensor {tuple(p.placements)}")
    plan = tensor_parallel_plan(model)
    ranks = tp_mesh.size()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None and embed is not None and head.weight is embed.weight:
        raise ValueError("opforge.parallel.parallelize: tied input and output embeddings are not supported (each is "
                         "distributed as its own Shard(0) parameter, which would untie them)")
    for layer in _layers(model):
        attn = layer.self_attn
        if any(s % (ranks * attn.head_dim) for s in attn._opforge_sizes):
            raise ValueError(f"opforge.parallel.parallelize: expected the q/k/v widths {attn._opforge_sizes} to be "
                             f"whole heads ({attn.head_dim}) per rank of {ranks}")
    parallelize_module(model, tp_mesh, plan)
    # every parameter's gradient in the parameter's own placements (what opforge's ops do for the tensors they get):
    # torch's embedding backward computes the Shard(0) embedding's gradient replicated; its hook takes the local rows
    keep_param_placements(list(model.parameters()))
    for m in model.modules():
        # the plan's own hooks: the patched forwards do their layout work on DTensors
        m._opforge_plan_hooks = frozenset([*m._forward_hooks, *m._forward_pre_hooks])
        if getattr(m, "_opforge_kind", None) is not None:
            m._opforge_tp_ranks = ranks  # transformers' forward cannot run here any more (opforge.patch reads it)
    for layer in _layers(model):
        attn, mlp = layer.self_attn, layer.mlp
        attn._opforge_sizes = [s // ranks for s in attn._opforge_sizes]
        attn.register_forward_pre_hook(_local_input(tp_mesh, "hidden_states"), with_kwargs=True)
        mlp.register_forward_pre_hook(_local_input(tp_mesh, "x"), with_kwargs=True)
        _local_children(attn, {"qkv_proj": False, **{n: True for n in ("q_norm", "k_norm") if n in attn._modules}})
        _local_children(mlp, {"gate_up_proj": False})
        for m in (attn, mlp):
            m._opforge_tp_ranks = ranks
            if _fused_parts(m):
                _hooks_first(m)
                _tensor_parallel_slices(m)
    return model
