"""opforge.patch.apply on the families beyond the Llama four (those are in test_hf_llama.py): Gemma, Gemma 2, Gemma 3
text, Phi-3, Granite, OLMo 2, Mixtral, Qwen2-MoE, Qwen3-MoE, each from a tiny random config (nothing downloaded),
float32: the loss and every gradient with labels against the unpatched model, state_dict, save/load, greedy
generate, gradient checkpointing, torch.compile per decoder layer, revert.

Tolerances: the patched model computes the same math with other kernels (fused GEMMs, opforge's norm, activation,
expert and loss kernels, another summation order of the experts' outputs), so values differ by float32 rounding
only: measured ≤ 1e-6 relative on losses and ≤ 2e-6 of each gradient's largest value; the bounds (1e-5 relative
on losses, 1e-4 relative + 1e-6 absolute elementwise on gradients) leave a margin of ten."""
import copy

import pytest
import torch

from opforge import patch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
T = transformers

pytestmark = pytest.mark.usefixtures("one_thread")

V = 97
C = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
FAMILIES = {
    # (1 + weight) norms, GeGLU (tanh)
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**C, head_dim=16)),
    # sandwich norms, attention and final logit soft-capping, sliding windows on every other layer
    "gemma2": lambda: T.Gemma2ForCausalLM(T.Gemma2Config(
        **C, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0, attn_implementation="eager")),
    # sandwich norms, per-head (1 + weight) q/k norms, local and global RoPE
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **C, head_dim=16, query_pre_attn_scalar=16, sliding_window=4, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"])),
    # checkpoint-fused qkv_proj / gate_up_proj, partial rotary, residual dropouts
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**C, partial_rotary_factor=0.5)),
    # embedding / residual / attention / logit multipliers
    "granite": lambda: T.GraniteForCausalLM(T.GraniteConfig(
        **C, logits_scaling=8.0, residual_multiplier=0.3, attention_multiplier=0.05, embedding_multiplier=4.0)),
    # post-norms, q/k norms over the whole projection
    "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**C)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**C, num_local_experts=4, **MOE)),
    # a shared expert beside the routed ones, and a dense layer (mlp_only_layers)
    "qwen2_moe": lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **C, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1], **MOE)),
    "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        **C, head_dim=16, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, **MOE)),
}
NAMES = sorted(FAMILIES)


def _model(family, seed=0):
    torch.manual_seed(seed)
    return FAMILIES[family]().float()


def _patched(family, **kw):
    ref = _model(family)
    model = copy.deepcopy(ref)
    report = patch.apply(model, **kw)
    return ref, model, report


def _ids(batch=2, seq=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, seq), generator=g)


def _assert_grads(model, ref):
    g, g_ref = patch.gradients_by_name(model), patch.gradients_by_name(ref)
    assert g.keys() == g_ref.keys() and len(g) == len(dict(ref.named_parameters(remove_duplicate=False)))
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def _assert_same_state(model, ref):
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("family", NAMES)
def test_family_trains_as_transformers(family):
    ref, model, report = _patched(family)
    assert report.ok, str(report)
    kinds = [k for _, _, k in report.patched]
    assert sum(k.startswith("opforge decoder layer") for k in kinds) == 2
    assert sum(k.startswith("opforge loss") for k in kinds) == 1
    if family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        assert any(k.startswith("opforge experts") for k in kinds)
    layer = model.model.layers[0]
    assert isinstance(layer, type(ref.model.layers[0]))
    assert isinstance(layer.self_attn.qkv_proj, torch.nn.Linear)
    _assert_same_state(model, ref)

    ids = _ids()
    labels = ids.clone()
    labels[0, :3] = -100
    model.train(), ref.train()
    out = model(input_ids=ids, labels=labels)
    out_ref = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    if hasattr(out_ref, "aux_loss"):  # the router's auxiliary loss, as transformers computes it (and adds it)
        torch.testing.assert_close(out.aux_loss, out_ref.aux_loss, rtol=1e-5, atol=0)
    out.loss.backward()
    out_ref.loss.backward()
    _assert_grads(model, ref)
    # the tuple: transformers' positions, None where the logits would be
    a = model(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    b = ref(input_ids=ids, labels=labels, return_dict=False, use_cache=False)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(y, torch.Tensor) and y.dim() == 3 and y.shape[-1] == V:
            assert x is None
        elif isinstance(y, torch.Tensor):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    # without labels: the usual logits
    with torch.no_grad():
        model.eval(), ref.eval()
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)

    # revert: transformers' modules, the trained values
    assert patch.revert(model) > 0 and not patch.is_patched(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    _assert_same_state(model, ref)


@pytest.mark.parametrize("family", NAMES)
def test_family_state_dict_and_save_load(family, tmp_path):
    ref, model, _ = _patched(family)
    other = _model(family, seed=5)
    patch.apply(other)
    missing, unexpected = other.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    _assert_same_state(other, ref)
    model.save_pretrained(tmp_path)
    loaded = type(ref).from_pretrained(tmp_path).float()
    _assert_same_state(loaded, ref)
    patch.apply(loaded)  # patching a loaded checkpoint, and its state_dict again
    _assert_same_state(loaded, ref)


@pytest.mark.parametrize("family", NAMES)
def test_family_generate(family):
    ref, model, _ = _patched(family)
    ids = _ids(batch=1, seq=5)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("family", NAMES)
def test_family_gradient_checkpointing(family):
    ref, model, _ = _patched(family)
    for m in (ref, model):
        m.gradient_checkpointing_enable()
        m.train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    _assert_grads(model, ref)


@pytest.mark.parametrize("family", NAMES)
def test_family_compile_per_layer(family):
    import torch._dynamo

    torch._dynamo.reset()
    ref, model, _ = _patched(family)
    # fullgraph: a graph break raises. Not with the routers' outputs recorded (mixture of experts): transformers'
    # output-capturing hook on the attention reads a ContextVar, which Dynamo cannot trace, patched or not.
    moe = family in ("mixtral", "qwen2_moe", "qwen3_moe")
    for layer in model.model.layers:
        layer.compile(fullgraph=not moe, backend="aot_eager")
    ids = _ids()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    out_ref = ref(input_ids=ids, labels=ids, use_cache=False)
    out_ref.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    _assert_grads(model, ref)
    torch._dynamo.reset()


def test_gemma_norm_weight_is_stored_without_the_offset():
    ref, model, _ = _patched("gemma")
    norm = model.model.layers[0].input_layernorm
    assert norm.weight is dict(model.named_parameters())["model.layers.0.input_layernorm.weight"]
    torch.testing.assert_close(norm.weight, ref.model.layers[0].input_layernorm.weight, rtol=0, atol=0)
    with torch.no_grad():
        x = torch.randn(3, 64)
        torch.testing.assert_close(model.model.norm(x), ref.model.norm(x), rtol=1e-6, atol=1e-6)


def test_unknown_family_is_refused_with_the_reason():
    cfg = T.CohereConfig(**C)  # Llama-like layers, but a logit scale and LayerNorms: no adapter
    torch.manual_seed(0)
    ref = T.CohereForCausalLM(cfg).float()
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="could not patch"):
        report = patch.apply(model)
    reasons = {n: r for n, _, r in report.skipped}
    assert "no opforge.patch adapter" in reasons["model.layers.0"]
    assert "no opforge.patch adapter" in reasons[""]
    ids = _ids()
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)


def test_moe_router_jitter_is_refused():
    torch.manual_seed(0)
    model = T.MixtralForCausalLM(T.MixtralConfig(**C, num_local_experts=4, router_jitter_noise=0.1, **MOE)).float()
    with pytest.warns(UserWarning, match="jitter"):
        report = patch.apply(model)
    assert any("jitter" in r for _, _, r in report.skipped)


@pytest.mark.parametrize("family", ["gemma2", "qwen2_moe"])
def test_bench_family_smoke(family, tmp_path):
    """benchmarks/bench_hf_llama.py --family <name> --smoke: HF eager and HF + opforge of that family on the CPU,
    one process each, the same losses (float32), rows in hf_<family>.csv."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf_llama.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script), "--smoke", "--family", family, "--out", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / f"hf_{family}.csv").open()))
    assert [r["variant"] for r in rows] == ["hf", "opforge"] and all(r["status"] == "ok" for r in rows), rows
    assert float(rows[1]["max_rel_loss_diff_vs_hf"]) <= 1e-4, rows
    assert f"{family} layers=2" in p.stdout and "could not patch 0" in p.stdout
