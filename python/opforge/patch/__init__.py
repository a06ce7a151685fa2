"""Patch an existing model (a Hugging Face transformers causal LM) to run on opforge ops.

`opforge.patch.apply(model)` changes `model` in place and returns a `PatchReport`;
`opforge.patch.revert(model)` undoes it. Families with an adapter (transformers 5.17 <= version < 6): Llama,
Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text), Phi-3, Granite, OLMo 2, Mixtral, Qwen2-MoE, Qwen3-MoE;
docs/patching.md lists what is fused in each and what is left to transformers. Anything else is refused, module
by module, with the reason.

Layout of the package: `_layers` holds the shared patched forwards (the attention with one q/k/v GEMM and RoPE,
the gated MLP with one gate/up GEMM, the decoder layer's residual adds and norms in the "pre", "sandwich" and
"post" layouts, the experts of a mixture-of-experts block, the loss); `_families` one adapter per family (a
`Family` record of what differs from Llama, and the checks that a module is what its adapter states); `_fused`
the fused projections and their state_dict hooks; `_recompute` the selective activation recomputation; `_modules`
the module-by-module swaps; `_apply` apply, revert and the self-check.

**Decoder layers** (a family's layer whose structure and forward are what its adapter states): the layer, its
attention and its MLP get an opforge `forward` (their class is swapped for a subclass, so `isinstance` checks
still hold; signature, keyword arguments, return type and KV-cache handling are transformers'):

* norms: `opforge.rms_norm`; each residual add followed by a norm: one `opforge.fused_add_rms_norm`; Gemma's
  x·(1 + weight) norms scale by 1 + weight (state_dict keeps the stored weight);
* q/k/v projections as **one GEMM** and gate/up as **one GEMM**: the three (two) weights are concatenated
  once, at patch time, into one `Parameter` (`self_attn.qkv_proj.weight`, `mlp.gate_up_proj.weight`; Phi-3 stores
  them so already); q/k/v (gate/up) are then column views of the GEMM's output, never copied;
* RoPE: `opforge.rope` on the q/k views of the fused projection (partial rotary included); q/k norms per head
  (Qwen3, Gemma 3) or over the whole projection (OLMo 2) by `opforge.rms_norm`;
* the gated activation: `opforge.swiglu_packed` (SiLU) or `opforge.geglu_packed` (GELU, tanh) on the fused
  gate/up output (its gradient is one tensor: no cat);
* mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the experts' two GEMMs on `opforge.indexed_linear`; the
  router (top-k, weights, auxiliary loss) is transformers';
* saved activations (`recompute=True`, eager training; `fp8_activations=True`: the gate/up output kept in FP8 for
  the activation's backward): see `apply`.

**The loss** of a `*ForCausalLM` whose `loss_function` is transformers' `ForCausalLMLoss`: with `labels`, the loss
is `opforge.linear_cross_entropy` of the final hidden states and `lm_head.weight` (labels shifted by one,
`ignore_index` −100, `shift_labels` and `num_items_in_batch` as transformers; Granite's `logits_scaling` divides
the hidden states, Gemma 2/3's final soft-cap is the op's `softcap`; the routers' auxiliary loss added as
transformers adds it), so the (tokens × vocab) logits are never materialised, and **`outputs.logits` is None**
(`return_dict=False`: transformers' tuple with None in the logits' place). Without `labels` (inference,
`generate()`) the forward is transformers' own and `outputs.logits` are the usual logits.

**Hooks**: the patched forwards compute the norms, q/k/v, gate/up, the activation and lm_head without calling
those modules. A layer whose bypassed modules carry hooks at `apply` is left alone; hooks registered later (or
global module hooks) are noticed at each forward (a look at the modules' hook dicts), and that module then runs
transformers' forward, so that they run, with a warning.

**The final norm** (with the decoder layers patched and `inductor_math=True`): an RMSNorm outside the layers keeps
its module and gets a forward that is `opforge.rms_norm` in eager and torch math under compile (so Inductor fuses
the last residual add into it). With the default `inductor_math=False` it is swapped like the norms below.

**Everything else** (any model): Llama-style RMSNorms, SiLU-gated MLPs and plain `torch.nn.Linear` modules outside
the patched layers are swapped for `opforge.nn.RMSNorm`, `opforge.nn.GatedMLP` and `opforge.nn.Linear` holding the
same `Parameter` objects; a module whose math differs (a GELU MLP, GPT-2's Conv1D, LayerNorm) is left alone and
reported.

**The self-check** (`check=True`): the model's logits, loss and gradients on a probe batch before and after
patching must agree, or the whole model is reverted and the report says why (`strict=True`: raises, and the model
is left as it was, as for every error of `apply`).

Parameters, state_dict, optimizer (the trade-off of the fused projections): `model.state_dict()` has exactly
transformers' keys (`...self_attn.q_proj.weight` etc.; a state-dict hook splits the fused weights, as contiguous
copies so that safetensors/`save_pretrained` see no shared storage) and `load_state_dict`/`from`-checkpoint
loading accept transformers' keys (a load pre-hook concatenates them). `model.parameters()`/`named_parameters()`
show the fused `qkv_proj.weight` and `gate_up_proj.weight` instead of the separate ones, so **build the optimizer
after patching** (a torch.optim optimizer holding the replaced Parameters raises at its first step); its state is
per fused parameter (Adam's moments of q, k and v are rows of one tensor). `q_proj` etc. stay reachable as
parameter-less modules whose `weight` is a Parameter sharing the fused rows' storage (reads and in-place writes go
to it, `.grad` is the fused gradient's rows, `requires_grad_(False)` on the module or the weight freezes the rows;
`state_dict(keep_vars=True)` gives these Parameters, `state_dict()` copies). `gradients_by_name(model)` gives the gradients under transformers' names. Tied weights (`lm_head` and
`embed_tokens`) are untouched. `revert` puts back the original `torch.nn.Linear` modules, with their original
`Parameter` objects holding the current values.

torch.compile: by default (`inductor_math=False`) every opforge op stays in the compiled graph as one custom op
(no graph break); Inductor compiles what is around them. `inductor_math=True` runs the norms, the gated activation
and the projections as torch math while Dynamo traces, so Inductor fuses them with their neighbours; the fused
projections, RoPE and the fused loss stay. Measured on the H200 (benchmarks/bench_hf_llama.py's Llama,
docs/patching.md): the opaque ops give 2.9 % less GPU time a step (120.1 against 123.7 ms) and 0.7–1.4 % more
tokens/s in three runs: Inductor's SwiGLU backward of the packed projection writes the two halves' gradients and
then a `cat` (5.2 ms a step), where opforge's kernel writes both halves in place. Nothing in the patched forwards
breaks a graph (`torch.compile(layer, fullgraph=True)` works per decoder layer).

Numerics: in float32 the patched model matches the original to rounding. In bfloat16/float16, opforge's RMSNorm
multiplies by the weight before rounding to the input dtype (Llama rounds first; Gemma and OLMo 2 also multiply
first, but Gemma's 1 + weight is rounded to the input dtype here), the fused residual add+norm rounds the sum to
the input dtype and normalises that (as transformers does), and the loss accumulates in fp32 without rounding the
logits to bf16 first: outputs differ by about one ulp of that dtype per layer.
"""
from __future__ import annotations

from ._apply import TRANSFORMERS_RANGE, apply, gradients_by_name, is_patched, revert
from ._families import FAMILIES, Family
from ._fused import FusedProjectionSlice
from ._layers import is_patched_class as _is_patched_class
from ._recompute import norm_from_rstd as _norm_from_rstd
from ._report import PatchReport

__all__ = ["PatchReport", "apply", "revert", "is_patched", "gradients_by_name", "FAMILIES", "Family",
           "FusedProjectionSlice", "TRANSFORMERS_RANGE"]
