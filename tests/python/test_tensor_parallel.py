"""Tensor parallelism (opforge.parallel): DTensor sharding rules of every op, the vocabulary-parallel
linear_cross_entropy, and a tiny patched Llama under TP + SP (+ FSDP2) against the single-process run.

The distributed checks run in tests/python/tensor_parallel_worker.py under torchrun: gloo on CPU ranks (CI), and
nccl on 2 GPUs where this machine has them (scripts/multi_gpu_check.sh). Per launch: every op under each placement
its rules support (values and gradients within 1e-5 relative of the single process, fp32; each DTensor gradient in
its tensor's placements), the vocabulary-parallel loss with every option (against opforge.linear_cross_entropy on one
process) and its per-rank memory (at most 0.55x one rank's on 2 ranks), odd shapes (tokens, heads, vocabulary not
divisible by the ranks), ignored targets, every reduction and autocast, the model's training losses (1e-5 relative;
measured at most 2.1e-7 on 2 and 4 ranks and with FSDP2 on 2 x 2, CPU), every gradient, the logits without labels
and, on the 1-D mesh, the exact count of collectives of one step. Every op of torch.ops.opforge must be dispatched on
DTensors by these suites. The same ops, loss and edge suites run on bf16 inputs (the worker's rounding rule).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import opforge
import opforge.parallel as par
from opforge.parallel.loss import vocab_parallel_backward, vocab_parallel_forward, vocab_slice

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _torchrun(ranks: int, device: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--standalone", str(WORKER),
           *args, "--device", device]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    out = p.stdout
    print(out[-6000:])
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n" + "\n".join(
        line for line in out.splitlines() if line.startswith(("FAIL", "SUITE"))) + f"\n{p.stderr[-4000:]}"
    return out


def _tensor_ops():
    """Every op registered in the torch.ops.opforge namespace that takes a tensor (not the build's knob setters)."""
    ops = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("opforge::"))
    tensor_ops = [n for n in ops if any("Tensor" in str(a.type)
                                        for a in getattr(torch.ops.opforge, n).default._schema.arguments)]
    assert len(tensor_ops) >= 40, f"the opforge namespace lists only {tensor_ops}"
    return tensor_ops


def _exercised(out: str) -> set:
    lines = [line for line in out.splitlines() if line.startswith("EXERCISED ")]
    assert lines, "the worker printed no EXERCISED line"
    return set(lines[-1].split()[1:])


SUITES = ("ops", "loss", "edges", "model")


@pytest.mark.parametrize("ranks, args", [(2, SUITES), (4, (*SUITES, "--dp", "2"))], ids=["2-ranks", "4-ranks-dp2-tp2"])
def test_gloo(ranks, args):
    out = _torchrun(ranks, "cpu", *args)
    for suite in SUITES:
        assert f"SUITE {suite} on {ranks} ranks (cpu, float32): 0 failure(s)" in out
    # every op of the namespace (public, private forward, backward) ran on DTensors in the suites
    missing = sorted(set(_tensor_ops()) - _exercised(out))
    assert not missing, f"opforge ops no distributed check dispatched on DTensors: {missing}"


def test_gloo_bfloat16():
    """The ops and the vocabulary-parallel loss with bf16 inputs, 2 ranks, against one process in bf16 (the worker's
    rounding rule: `tolerances`)."""
    out = _torchrun(2, "cpu", "ops", "loss", "edges", "--dtype", "bfloat16")
    for suite in ("ops", "loss", "edges"):
        assert f"SUITE {suite} on 2 ranks (cpu, bfloat16): 0 failure(s)" in out


@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs (nccl)")
def test_nccl_cuda_two_gpus():
    out = _torchrun(2, "cuda", *SUITES)
    for suite in SUITES:
        assert f"SUITE {suite} on 2 ranks (cuda, float32): 0 failure(s)" in out


@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs (nccl)")
def test_nccl_cuda_two_gpus_bfloat16():
    out = _torchrun(2, "cuda", "ops", "loss", "edges", "--dtype", "bfloat16")
    for suite in ("ops", "loss", "edges"):
        assert f"SUITE {suite} on 2 ranks (cuda, bfloat16): 0 failure(s)" in out


def test_every_op_has_a_sharding_rule():
    missing = sorted(set(_tensor_ops()) - set(par.covered_ops()))
    assert not missing, f"opforge ops without a DTensor sharding rule or handler: {missing}"
    registered = set(DTensor._op_dispatcher._custom_op_handlers) | set(
        DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs)
    unregistered = [n for n in _tensor_ops() if getattr(torch.ops.opforge, n).default not in registered]
    assert not unregistered, f"opforge ops whose rule or handler DTensor does not know: {unregistered}"


def test_grad_placements_rule():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from opforge.parallel.sharding import grad_placements

    R, P, S0 = Replicate(), Partial(), Shard(0)
    assert grad_placements((S0,), (R,)) == (S0,)  # a gathered parameter's gradient back to its shard
    assert grad_placements((S0,), (P,)) == (S0,)
    assert grad_placements((R,), (P,)) == (P,)    # a pending sum into a replicated parameter stays pending
    assert grad_placements((R, S0), (S0, P)) == (R, S0)


def test_permute_fused_gives_each_rank_its_parts():
    sizes, ranks = [8, 4, 4], 2  # q, k, v widths
    w = torch.arange(16.0).unsqueeze(1)
    p = par.permute_fused(w, sizes, ranks)
    r0, r1 = p.chunk(ranks, 0)
    assert r0.squeeze(1).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]  # q_0, k_0, v_0
    assert r1.squeeze(1).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert torch.equal(par.unpermute_fused(p, sizes, ranks), w)
    with pytest.raises(ValueError, match="divisible"):
        par.permute_fused(w, [9, 3, 4], 2)


@pytest.mark.parametrize("vocab, ranks", [(11, 2), (12, 4), (3, 4)])
def test_vocab_slice_is_shard0s_split(vocab, ranks):
    parts = torch.arange(vocab).chunk(ranks)
    for r in range(ranks):
        start, size = vocab_slice(vocab, ranks, r)
        got = list(range(start, start + size))
        assert got == (parts[r].tolist() if r < len(parts) else [])


OPTIONS = [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1, "z_loss": 1e-3},
           {"softcap": 4.0, "reduction": "none"}, {"class_weights": True, "label_smoothing": 0.3}]


@pytest.mark.parametrize("opts", OPTIONS, ids=str)
def test_local_math_equals_the_op(opts):
    """vocab_parallel_forward/backward on one rank (the whole vocabulary) equal opforge.linear_cross_entropy: loss,
    stats and gradients (the distributed launches compare the sliced runs)."""
    opts = dict(opts)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(9, 6, generator=g), torch.randn(13, 6, generator=g), torch.randn(13, generator=g)
    t = torch.randint(0, 13, (9,), generator=g)
    t[2] = -100
    if opts.pop("class_weights", False):
        opts["weight"] = torch.rand(13, generator=g) + 0.5
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    ref = opforge.linear_cross_entropy(xr, wr, t, linear_bias=br, **opts)
    cot = torch.randn(ref.shape, generator=g)
    (ref * cot).sum().backward()
    red = opts.get("reduction", "mean")
    args = dict(linear_bias=b, weight=opts.get("weight"), reduction=red,
                label_smoothing=opts.get("label_smoothing", 0.0),
                z_loss=opts.get("z_loss", 0.0), softcap=opts.get("softcap"), chunk_size=4)
    loss, stats, *_ = vocab_parallel_forward(x, w, t, **args)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    gi, gw, gb = vocab_parallel_backward(cot, x, w, t, stats, args["linear_bias"], args["weight"], red, -100,
                                         args["label_smoothing"], args["z_loss"], args["softcap"], [True, True, True],
                                         4)
    for got, want in ((gi, xr.grad), (gw, wr.grad), (gb, br.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if red != "none":  # the gradient-in-forward path: gradients of loss.sum(), scaled by the scalar cotangent
        *_, gi2, gw2, gb2 = vocab_parallel_forward(x, w, t, **args, grad_mask=(True, True, True))
        for got, want in ((gi2 * cot, xr.grad), (gw2 * cot, wr.grad), (gb2 * cot, br.grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_local_math_bfloat16_equals_the_op():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 16, generator=g).bfloat16()
    w = torch.randn(21, 16, generator=g).bfloat16()
    t = torch.randint(0, 21, (17,), generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = opforge.linear_cross_entropy(xr, wr, t, label_smoothing=0.1)
    ref.backward()
    loss, stats, gi, gw, _ = vocab_parallel_forward(x, w, t, label_smoothing=0.1, chunk_size=5,
                                                    grad_mask=(True, True, False))
    assert loss.dtype == torch.float32 and gi.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)  # float32 math from the same bf16 values
    torch.testing.assert_close(gi, xr.grad, rtol=1e-2, atol=1e-3)  # one bf16 rounding of each gradient
    torch.testing.assert_close(gw, wr.grad, rtol=1e-2, atol=1e-3)


def test_local_math_errors():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(IndexError, match="expected targets in"):
        vocab_parallel_forward(x, w, torch.tensor([0, 7, 1]))
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_forward(x, w, torch.tensor([0, 1, 1]), reduction="avg")
    with pytest.raises(TypeError, match="int64"):
        vocab_parallel_forward(x, w, torch.tensor([0, 1, 1], dtype=torch.int32))


def test_parallelize_refuses_an_unpatched_model():
    with pytest.raises(ValueError, match="patched"):
        par.tensor_parallel_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("family, match, extra", [
    ("Phi3", "fused in the checkpoint", {}),        # checkpoint-fused qkv_proj / gate_up_proj
    ("Gemma2", "sandwich norms", {}),               # pre/post feed-forward norms
    ("Olmo2", "sandwich norms", {}),                # no input_layernorm; q/k norms over the whole projection
    ("Mixtral", "mixture of experts", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Qwen3Moe", "mixture of experts", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
])
def test_parallelize_refuses_the_families_its_plan_does_not_cover(family, match, extra):
    transformers = pytest.importorskip("transformers")
    from opforge import patch

    if not hasattr(transformers, f"{family}Config"):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    cfg = getattr(transformers, f"{family}Config")(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                    head_dim=8, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    patch.apply(model, strict=True)
    with pytest.raises(ValueError, match=match):
        par.tensor_parallel_plan(model)


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_parallelize_refuses_fp8_projections(fp8):
    """FP8 projections (apply(model, fp8=...)) are refused with the reason: fp8_linear has no row-wise sharding, so
    the plan's o_proj and down_proj would be gathered at every step."""
    transformers = pytest.importorskip("transformers")
    from opforge import patch

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    patch.apply(model, fp8=fp8)
    with pytest.raises(ValueError, match="FP8 projections"):
        par.tensor_parallel_plan(model)


@pytest.mark.parametrize("opts", [{}, {"temperature": 0.7, "return_entropy": True},
                                  {"softcap": 3.0, "return_entropy": True}, {"ignore_index": 2}], ids=str)
def test_local_log_probs_math_equals_the_op(opts):
    """vocab_parallel_log_probs_forward/backward on one rank equal opforge.linear_log_probs: outputs and gradients, in
    float64 (the same math; in float32 the entropy gradient's (z − m) − (r − H) cancels to a few ulps of the op's)."""
    from opforge.parallel.loss import vocab_parallel_log_probs_backward, vocab_parallel_log_probs_forward

    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((9, 6), (13, 6), (13,)))
    t = torch.randint(0, 13, (9,), generator=g)
    t[2] = opts.get("ignore_index", -100)
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    ref = opforge.linear_log_probs(xr, wr, t, br, **opts)
    ref = ref if isinstance(ref, tuple) else (ref,)  # without return_entropy: the log-probs alone
    ent = opts.get("return_entropy", False)
    cots = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in ref[:1 + ent]]
    sum((r * c).sum() for r, c in zip(ref, cots)).backward()
    lp, h, stats = vocab_parallel_log_probs_forward(x, w, t, b, chunk_size=4, **opts)
    torch.testing.assert_close(lp, ref[0].detach(), rtol=1e-10, atol=1e-12)
    if ent:
        torch.testing.assert_close(h, ref[1].detach(), rtol=1e-10, atol=1e-12)
    grads = vocab_parallel_log_probs_backward(cots[0], cots[1] if ent else None, x, w, t, stats, h, b,
                                              opts.get("temperature", 1.0), opts.get("ignore_index", -100),
                                              opts.get("softcap"), [True, True, True], 4)
    for got, want in zip(grads, (xr.grad, wr.grad, br.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("opts", [{}, {"beta": 0.0}, {"beta": 1.0, "reduction": "sum"}, {"beta": 0.3, "temperature": 0.7},
                                  {"target": True}], ids=str)
def test_local_jsd_math_equals_the_op(opts):
    """vocab_parallel_jsd_forward on one rank equals opforge.linear_jsd in float64: loss and the student's
    gradients."""
    from opforge.parallel.loss import vocab_parallel_jsd_forward

    opts = dict(opts)
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((9, 6), (13, 6), (13,)))
    xt, wt = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(13, 5, generator=g, dtype=torch.float64)
    t = None
    if opts.pop("target", False):
        t = torch.randint(0, 13, (9,), generator=g)
        t[1:3] = -100
    xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
    ref = opforge.linear_jsd(xr, wr, xt, wt, t, linear_bias=br, **opts)
    ref.backward()
    loss, gi, gw, gb = vocab_parallel_jsd_forward(x, w, xt, wt, t, b, None, chunk_size=4,
                                                  grad_mask=(True, True, True), **opts)
    for got, want in ((loss, ref.detach()), (gi, xr.grad), (gw, wr.grad), (gb, br.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_revert_refuses_a_parallelized_model():
    """revert of a model parallelize sharded raises (its fused weights are shards in the plan's row order; un-fusing
    them would build wrong Linears), and leaves the model patched."""
    transformers = pytest.importorskip("transformers")
    from opforge import patch

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.LlamaForCausalLM(cfg)
    patch.apply(model)
    model.model.layers[0].self_attn._opforge_tp_ranks = 2  # what parallelize marks on each layer it shards
    with pytest.raises(RuntimeError, match="opforge.patch.revert: expected a model not sharded"):
        patch.revert(model)
    assert patch.is_patched(model)
