"""opforge.patch.apply on the Llama family of Hugging Face transformers (Llama, Mistral, Qwen2, Qwen3), tiny
random configs, nothing downloaded: the decoder-layer fusion (fused add+norm, one q/k/v GEMM, one gate/up GEMM,
RoPE), the fused loss, revert, state_dict/checkpoint round trips, generate(), activation checkpointing,
torch.compile per decoder layer, and DDP/FSDP2 on 2 CPU ranks (gloo).

Tolerances (float32): the patched model computes the same math with other kernels (fused GEMM instead of three,
opforge's norm and loss kernels), so values differ by float32 rounding only: measured ≤ 1e-6 relative on logits
and ≤ 1e-5 on gradients; the bounds (1e-5 / 1e-4 relative) leave a 10x margin.
"""
import copy
import os
import subprocess
import sys

import pytest
import torch

from opforge import patch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**COMMON)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON)),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, head_dim=32)),  # q/k norms
}


# tiny models: one thread (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _model(family="llama", seed=0):
    torch.manual_seed(seed)
    return FAMILIES[family]().float()


def _patched(family="llama", **kw):
    ref = _model(family)
    model = copy.deepcopy(ref)
    report = patch.apply(model, **kw)
    return ref, model, report


def _hf_grads(model):
    """Gradients under transformers' parameter names (the fused ones split by the slices' sizes)."""
    out = {}
    for name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if p.grad is None:
                continue
            fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
            leaf = name.rpartition(".")[2]
            if leaf in fused:
                parent = model.get_submodule(name.rpartition(".")[0])
                sizes = [getattr(parent, n).out_features for n in fused[leaf]]
                for n, g in zip(fused[leaf], p.grad.split(sizes, 0)):
                    out[f"{name.rpartition('.')[0]}.{n}.{pname}"] = g
            else:
                out[f"{name}.{pname}" if name else pname] = p.grad
    return out


def _ids(batch=2, seq=11, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_patched_matches_unpatched(family):
    ref, model, report = _patched(family)
    assert report.ok, str(report)
    kinds = report.counts()
    cls = type(ref.model.layers[0]).__name__
    assert kinds[f"{cls} -> opforge decoder layer ({family}: rms_norm, fused_add_rms_norm)"] == 2
    assert sum(v for k, v in kinds.items() if k.endswith("opforge loss (linear_cross_entropy; logits None when labels are given)")) == 1
    layer = model.model.layers[0]
    assert isinstance(layer, type(ref.model.layers[0]))  # a subclass: isinstance checks still hold
    assert isinstance(layer.self_attn.qkv_proj, torch.nn.Linear) and isinstance(layer.mlp.gate_up_proj, torch.nn.Linear)
    # state_dict: transformers' keys, order and values
    sd_ref, sd = ref.state_dict(), model.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=0, atol=0, msg=k)

    ids = _ids()
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions
    model.train(), ref.train()
    out_ref = ref(input_ids=ids, labels=labels)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # the fused loss never builds them
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    out.loss.backward()
    out_ref.loss.backward()
    g, g_ref = _hf_grads(model), _hf_grads(ref)
    assert g.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    # without labels: the usual logits
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_loss_options_follow_transformers():
    ref, model, _ = _patched()
    ids = _ids(seq=9)
    labels = ids.clone()
    labels[1, 4:] = -100
    n = torch.tensor(7)
    for kw in ({"num_items_in_batch": n}, {"shift_labels": torch.roll(labels, -1, 1)}, {"return_dict": False}):
        a = model(input_ids=ids, labels=labels, **kw)
        b = ref(input_ids=ids, labels=labels, **kw)
        la, lb = (a[0], b[0]) if isinstance(a, tuple) else (a.loss, b.loss)
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=0, msg=str(kw))
    # without labels, logits_to_keep is transformers' own path
    out = model(input_ids=ids, logits_to_keep=3)
    assert out.logits.shape == (2, 3, 128)


def test_tied_embeddings_stay_tied():
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)).float()
    model = copy.deepcopy(ref)
    patch.apply(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, ref.lm_head.weight.grad, rtol=1e-4, atol=1e-6)


def test_revert_restores_transformers_modules_with_current_values():
    ref, model, _ = _patched()
    q_before = model.model.layers[0].self_attn._opforge_stash["q_proj"].weight  # the original Parameter object
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built after patching: steps the fused parameters
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"], ref.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert patch.is_patched(model)
    assert patch.revert(model) > 0
    assert not patch.is_patched(model)
    assert type(model) is type(ref) and type(model.model.layers[0]) is type(ref.model.layers[0])
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is torch.nn.Linear and attn.q_proj.weight is q_before and not hasattr(attn, "qkv_proj")
    assert type(model.model.norm) is type(ref.model.norm) and type(model.lm_head) is torch.nn.Linear
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    sd = model.state_dict()
    assert list(sd) == list(trained)
    for k in trained:
        torch.testing.assert_close(sd[k], trained[k], rtol=0, atol=0, msg=k)
    out = model(input_ids=ids, labels=ids)  # transformers' forward again: logits present
    assert out.logits is not None and out.loss is not None


def test_state_dict_and_checkpoint_round_trip(tmp_path):
    ref, model, _ = _patched()
    # transformers' state_dict loads strictly into the patched model, the patched one into a plain model
    other = _model(seed=5)
    patch.apply(other)
    missing, unexpected = other.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(other.state_dict()[k], v, rtol=0, atol=0, msg=k)
    plain = _model(seed=6)
    plain.load_state_dict(model.state_dict(), strict=True)
    # a partial state_dict reports the transformers key it lacks
    partial = {k: v for k, v in ref.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
    res = other.load_state_dict(partial, strict=False)
    assert res.missing_keys == ["model.layers.1.self_attn.k_proj.weight"]
    # save_pretrained (safetensors) from the patched model, from_pretrained into a plain one
    model.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path).float()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_matches_unpatched(family):
    ref, model, _ = _patched(family)
    ids = _ids(batch=1, seq=5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    a = model.generate(ids, **kw)
    b = ref.generate(ids, **kw)
    assert torch.equal(a, b)


def test_gradient_checkpointing():
    ref, model, _ = _patched()
    for m in (ref, model):
        m.gradient_checkpointing_enable()
        m.train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    g, g_ref = _hf_grads(model), _hf_grads(ref)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def test_compile_decoder_layer_fullgraph_no_graph_breaks():
    import torch._dynamo

    ref, model, _ = _patched()
    torch._dynamo.reset()
    ids = _ids()
    # every decoder layer compiled with fullgraph=True (Dynamo would raise on a graph break)
    for layer in model.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    g, g_ref = _hf_grads(model), _hf_grads(ref)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    # a second step with another sequence length: no recompile beyond the dynamic-shape one
    torch._dynamo.reset()


@pytest.mark.parametrize("inductor_math", [False, True])
def test_compile_per_layer_one_graph_no_recompiles(inductor_math):
    """Every patched decoder layer compiled (fullgraph=True), two training steps with use_cache=False (as
    benchmarks/bench_hf_llama.py trains): one graph shared by all layers, no graph break, no recompile, with the
    opforge ops opaque (the default) and as torch math (inductor_math=True). (With
    transformers' default use_cache=True the cache object's per-layer state recompiles once per layer, patched or
    not; the benchmark prints these counters for its +compile variants.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 3})).float()
    patch.apply(model, inductor_math=inductor_math)
    for layer in model.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters())
    for seed in (1, 2):
        ids = _ids(seed=seed)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert not any(guard_failures.values()), {c.co_name: r[:1] for c, r in guard_failures.items()}
    torch._dynamo.reset()


@pytest.mark.parametrize("inductor_math", [False, True])
def test_compile_inductor_layer_matches_eager(inductor_math):
    """Inductor on one patched decoder layer equals eager, with opforge's ops opaque in the graph (the default) and
    with the norms/SwiGLU/GEMMs as torch math (inductor_math=True)."""
    import torch._dynamo

    torch._dynamo.reset()
    _, model, _ = _patched(inductor_math=inductor_math)
    layer = model.model.layers[0]
    x = torch.randn(2, 8, 64, requires_grad=True)
    pos = torch.arange(8).unsqueeze(0)
    cos_sin = model.model.rotary_emb(x, pos)
    kw = dict(attention_mask=None, position_ids=pos, position_embeddings=cos_sin)
    y_eager = layer(x, **kw)
    compiled = torch.compile(layer, fullgraph=True)
    y = compiled(x, **kw)
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    explain = torch._dynamo.explain(layer)(x, **kw)
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()


def test_mismatch_is_caught_and_reverted(monkeypatch):
    ref = _model()
    model = copy.deepcopy(ref)
    from opforge.patch import _layers

    monkeypatch.setattr(_layers, "rope", lambda q, k, cos, sin: (q, k))  # a broken RoPE
    with pytest.warns(UserWarning, match="different logits"):
        report = patch.apply(model)
    assert not report.patched and not patch.is_patched(model)
    assert type(model.model.layers[0]) is type(ref.model.layers[0])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=0, atol=0)


def test_unknown_decoder_layer_is_left_alone():
    ref = _model()
    model = copy.deepcopy(ref)
    model.model.layers[1].extra_norm = torch.nn.LayerNorm(64)  # a layer this patch does not know
    with pytest.warns(UserWarning, match="could not patch"):
        report = patch.apply(model, check=False)
    skipped = {n: r for n, _, r in report.skipped}
    assert "model.layers.1" in skipped and "submodules" in skipped["model.layers.1"]
    assert patch._is_patched_class(model.model.layers[0]) and not patch._is_patched_class(model.model.layers[1])


# ---- DDP and FSDP2, 2 ranks, gloo (CPU) --------------------------------------------------------------------

def _train_losses(model, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        ids = _ids(batch=4, seq=12, seed=100 + s)
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        shard = ids.chunk(world)[rank]
        loss = model(input_ids=shard, labels=shard).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        full = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(full)
            full /= world
        losses.append(full.item())
    return losses


def _worker(mode, out):
    import json

    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    model = _model()
    patch.apply(model)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    losses = _train_losses(model)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(losses, f)
    # every rank past its last collective (FSDP2's reduce-scatters included) before gloo's threads are torn down: a
    # rank that tore down early aborted now and then with "terminate called without an active exception"
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_distributed_two_ranks_gloo(mode, tmp_path):
    import json

    out = tmp_path / f"{mode}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), *sys.path]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__, mode, str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{mode} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    dist_losses = json.loads(out.read_text())
    # the same 3 steps in one process, full batch (the 2 ranks average equal-size halves: the same gradient)
    model = _model()
    patch.apply(model)
    single = _train_losses(model)
    for a, b in zip(dist_losses, single):
        assert abs(a - b) <= 1e-4 * abs(b), (dist_losses, single)


if __name__ == "__main__":  # torchrun worker: python test_hf_llama.py {ddp|fsdp2} OUT
    _worker(sys.argv[1], sys.argv[2])


def test_bench_hf_llama_smoke(tmp_path):
    """benchmarks/bench_hf_llama.py --smoke: HF eager and HF + opforge on the CPU, one process each, same losses."""
    import csv
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf_llama.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "hf_llama.csv").open()))
    assert [r["variant"] for r in rows] == ["hf", "opforge"] and all(r["status"] == "ok" for r in rows), rows
    assert float(rows[1]["max_rel_loss_diff_vs_hf"]) <= 1e-4, rows  # fp32: the same losses to rounding
    assert float(rows[0]["tokens_per_s"]) > 0 and float(rows[1]["peak_mem_gib"]) > 0
    assert "HF + opforge.patch.apply" in p.stdout


def test_bench_hf_llama_variant_environment(tmp_path):
    """bench_hf_llama's opforge-dwbf16-c2048 variant runs (CPU smoke config) with its VARIANT_ENV in its own process:
    the worker reports OPFORGE_LCE_DW_ACCUM=1 and OPFORGE_LCE_CHUNK_SIZE=2048; every VARIANT_ENV and VARIANT_KNOBS key
    is a variant."""
    import re
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf_llama.py"
    sys.path.insert(0, str(script.parent))
    import bench_hf_llama

    assert set(bench_hf_llama.VARIANT_ENV) | set(bench_hf_llama.VARIANT_KNOBS) <= set(bench_hf_llama.VARIANTS)
    env = {k: v for k, v in os.environ.items() if k not in ("OPFORGE_LCE_DW_ACCUM", "OPFORGE_LCE_CHUNK_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, str(script), "--smoke", "--no-save", "--variants", "opforge-dwbf16-c2048"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "opforge-dwbf16-c2048: env OPFORGE_LCE_DW_ACCUM=1 OPFORGE_LCE_CHUNK_SIZE=2048" in p.stdout, p.stdout
    assert re.search(r"^\s+opforge-dwbf16-c2048\s+ok\b", p.stdout, re.M), p.stdout  # the worker's status


def test_bench_hf_llama_seed_spread_bound():
    """bench_hf_llama's loss bound from the seed spread: the mean relative distance of the hf-seed1 run's losses from
    HF eager's, per step (float64 reference written out), and an error for runs with no logged loss."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_hf_llama

    a, b = [11.5, 11.0, 10.0], [11.615, 10.89, 10.3]
    want = (0.115 / 11.5 + 0.11 / 11.0 + 0.3 / 10.0) / 3
    assert abs(bench_hf_llama.seed_spread_bound(a, b) - want) <= 1e-12
    assert bench_hf_llama.seed_spread_bound(a, a) == 0.0
    with pytest.raises(ValueError, match="seed_spread_bound"):
        bench_hf_llama.seed_spread_bound([], [])
    assert "hf-seed1" in bench_hf_llama.VARIANTS
