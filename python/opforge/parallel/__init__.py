"""Tensor parallelism for opforge: DTensor sharding rules of every op, the vocabulary-parallel
linear_cross_entropy and the plan of a patched Llama-family model (docs/distributed.md).

Importing this package registers the sharding rules (`register_sharding_rules`); then any opforge op accepts
DTensors (`torch.distributed.tensor`), with gradients.

* `parallelize(model, tp_mesh)`: tensor + sequence parallelism of an `opforge.patch.apply`-patched model;
  `tensor_parallel_plan(model)`: its `parallelize_module` plan.
* `opforge.linear_cross_entropy(x, w, target)` with `w` a `Shard(0)` DTensor: the vocabulary-parallel loss
  (`opforge.parallel.loss`); `vocab_parallel_forward` / `vocab_parallel_backward`: the same on local tensors.
  `opforge.linear_log_probs` and `opforge.linear_jsd` likewise (`vocab_parallel_log_probs_forward` / `_backward`,
  `vocab_parallel_jsd_forward`).
* A parameter's gradient comes back in the parameter's placements (`sharding.keep_param_placements`).
"""
from __future__ import annotations

from .loss import (vocab_parallel_backward, vocab_parallel_forward, vocab_parallel_jsd_forward,
                   vocab_parallel_log_probs_backward, vocab_parallel_log_probs_forward, vocab_slice)
from .plan import FusedColwiseParallel, parallelize, permute_fused, tensor_parallel_plan, unpermute_fused
from .sharding import covered_ops, register_sharding_rules

__all__ = ["FusedColwiseParallel", "covered_ops", "parallelize", "permute_fused", "register_sharding_rules",
           "tensor_parallel_plan", "unpermute_fused", "vocab_parallel_backward", "vocab_parallel_forward",
           "vocab_parallel_jsd_forward", "vocab_parallel_log_probs_backward", "vocab_parallel_log_probs_forward",
           "vocab_slice"]

register_sharding_rules()
