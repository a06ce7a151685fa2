"""opforge.patch.apply is never silently wrong: each test reproduces a way a patched model could have computed
something else than transformers' without a word (a dropped logit scale, a self-check that looked at the logits
only, a tuple with a field missing, hooks that no longer ran, a half-patched model left behind by an error),
on tiny random configs (nothing downloaded), float32.

Tolerances: the patched model computes the same math with other kernels, so values differ by float32 rounding
only (measured ≤ 1e-6 relative on losses, ≤ 1e-5 on gradients); the bounds are 1e-5 and 1e-4 relative."""
import copy
import warnings

import pytest
import torch

from opforge import patch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def _ids(batch=2, seq=9, vocab=97, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), patch.gradients_by_name(model)


def _assert_same_training(model, ref, ids):
    loss, grads = _loss_and_grads(model, ids)
    loss_ref, grads_ref = _loss_and_grads(ref, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def _granite(**kw):
    cfg = transformers.GraniteConfig(**COMMON, logits_scaling=8.0, **kw)
    torch.manual_seed(1)
    return transformers.GraniteForCausalLM(cfg).float()


@pytest.mark.parametrize("decoder", [True, False])
def test_granite_logits_scaling_is_kept(decoder):
    # Was: the fused loss used lm_head(h) where Granite computes lm_head(h) / logits_scaling; nothing was reported.
    ref = _granite()
    model = copy.deepcopy(ref)
    patch.apply(model, decoder=decoder)
    _assert_same_training(model, ref, _ids())


def test_granite_multipliers_are_kept():
    # residual, attention and embedding multipliers other than one
    ref = _granite(residual_multiplier=0.3, attention_multiplier=0.05, embedding_multiplier=4.0)
    model = copy.deepcopy(ref)
    patch.apply(model)
    _assert_same_training(model, ref, _ids())


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).float()


def _assert_untouched(model, ref):
    assert not patch.is_patched(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in ref.modules()]
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=0, atol=0, msg=k)


def test_self_check_catches_a_wrong_gradient(monkeypatch):
    # Was: the self-check compared logits without labels only; a patch with right values and a wrong gradient
    # passed it.
    from opforge.patch import _layers

    real = _layers.gated_act

    def wrong_backward(owner, gu):  # the right value, 1.5 times the gradient
        y = real(owner, gu)
        return y + 0.5 * (y - y.detach())

    monkeypatch.setattr(_layers, "gated_act", wrong_backward)
    ref = _llama()
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    with pytest.warns(UserWarning, match="gradient"):
        report = patch.apply(model)
    assert not report.patched and "gradient" in report.skipped[0][2]
    _assert_untouched(model, ref)
    assert all(dict(model.named_parameters())[n] is p for n, p in params.items())  # the same Parameter objects
    with pytest.raises(RuntimeError, match="gradient"):
        patch.apply(model, strict=True)
    _assert_untouched(model, ref)


def test_self_check_catches_a_wrong_loss(monkeypatch):
    from opforge.patch import _layers

    real = _layers.linear_cross_entropy
    monkeypatch.setattr(_layers, "linear_cross_entropy", lambda *a, **k: real(*a, **k) * 1.01)
    ref = _llama()
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="loss"):
        report = patch.apply(model)
    assert not report.patched and "loss" in report.skipped[0][2]
    _assert_untouched(model, ref)


def test_self_check_leaves_gradients_and_modes_alone():
    ref = _llama()
    model = copy.deepcopy(ref)
    model.train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    patch.apply(model)
    assert model.training and all(m.training for m in model.modules())
    grads = patch.gradients_by_name(model)
    assert all(torch.equal(g, torch.full_like(g, 3.0)) for g in grads.values())


def test_tuple_output_keeps_transformers_positions():
    # Was: with labels and return_dict=False the patched model returned (loss, cache), transformers (loss, logits,
    # cache): the cache sat where callers read the logits.
    ref = _llama()
    model = copy.deepcopy(ref)
    patch.apply(model)
    ids = _ids()
    a = model(input_ids=ids, labels=ids, return_dict=False)
    b = ref(input_ids=ids, labels=ids, return_dict=False)
    assert len(a) == len(b)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=0)
    assert a[1] is None and b[1].shape == (2, 9, 97)  # the fused loss builds no logits
    assert type(a[2]) is type(b[2])
    # use_cache=False, hidden states asked for: the same fields in the same places
    kw = dict(return_dict=False, use_cache=False, output_hidden_states=True)
    a = model(input_ids=ids, labels=ids, **kw)
    b = ref(input_ids=ids, labels=ids, **kw)
    assert len(a) == len(b) and a[1] is None
    for x, y in zip(a[2], b[2]):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _hooks(model, calls):
    layer = model.model.layers[0]

    def double(name):
        def hook(mod, args, out):
            calls.append(name)
            return out * 2

        return hook

    def pre(mod, args):
        calls.append("pre")
        return (args[0] * 0.5,)

    return [layer.self_attn.q_proj.register_forward_hook(double("q_proj")),
            layer.mlp.up_proj.register_forward_hook(double("up_proj")),
            layer.input_layernorm.register_forward_hook(double("input_layernorm")),
            layer.post_attention_layernorm.register_forward_pre_hook(pre),
            model.lm_head.register_forward_hook(double("lm_head"))]


def test_hooks_registered_after_apply_run():
    # Was: the patched layer computed q/k/v, gate/up and the norms without calling those modules, so hooks
    # registered on them after apply never ran, silently.
    ref = _llama()
    model = copy.deepcopy(ref)
    patch.apply(model)
    calls, calls_ref = [], []
    handles = _hooks(model, calls) + _hooks(ref, calls_ref)
    ids = _ids()
    with pytest.warns(UserWarning, match="hooks"):
        loss = model(input_ids=ids, labels=ids).loss
    loss_ref = ref(input_ids=ids, labels=ids).loss
    assert sorted(calls) == sorted(calls_ref) and len(calls) == 5
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    loss.backward()
    loss_ref.backward()
    g, g_ref = patch.gradients_by_name(model), patch.gradients_by_name(ref)
    for k in g_ref:
        torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    for h in handles:
        h.remove()
    calls.clear()
    model(input_ids=ids, labels=ids)  # hooks gone: opforge's forwards again, no warning
    assert not calls


def test_global_forward_hook_runs():
    ref = _llama()
    model = copy.deepcopy(ref)
    patch.apply(model)
    seen = []
    h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        with pytest.warns(UserWarning, match="hooks"):
            model(input_ids=_ids())
    finally:
        h.remove()
    assert "LlamaRMSNorm" in seen and "FusedProjectionSlice" in seen


def test_hooks_present_at_apply_leave_the_layer_alone():
    ref = _llama()
    model = copy.deepcopy(ref)
    model.model.layers[1].mlp.up_proj.register_forward_hook(lambda m, a, o: o)
    with pytest.warns(UserWarning, match="hooks"):
        report = patch.apply(model)
    skipped = {n: r for n, _, r in report.skipped}
    assert "model.layers.1" in skipped and "hooks" in skipped["model.layers.1"]


def _unknown_layer_llama():
    model = _llama()
    model.model.layers[1].extra_norm = torch.nn.LayerNorm(64)  # a layer no family adapter knows
    return model


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("make", [_unknown_layer_llama, _gpt2])
def test_strict_failure_leaves_the_model_as_it_was(make):
    # Was: apply(strict=True) raised on a model it could patch in part, and left it half patched.
    ref = make()
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="could not patch"):
        patch.apply(model, strict=True)
    _assert_untouched(model, ref)
    assert all(dict(model.named_parameters())[n] is p for n, p in params.items())


def test_transformers_version_is_checked(monkeypatch):
    from opforge.patch import _apply

    monkeypatch.setattr(_apply, "_transformers_version", lambda: "4.40.0")
    ref = _llama()
    model = copy.deepcopy(ref)
    with pytest.raises(RuntimeError, match="but got transformers 4.40.0"):
        patch.apply(model)
    _assert_untouched(model, ref)


# A bf16 Mixtral whose router has a near-tie on the self-check's probe batch: the patched model's hidden states
# differ from transformers' by bf16 rounding, enough for one token's top-2 to pick another expert. Measured on
# 12 seeds of this config against a float64 run (eager experts): transformers' bf16 model itself is 6e-3 .. 1.9e-1
# of the largest logit away from float64 (0.11, 0.08, 0.12, 0.19 on the four seeds where it picks another expert
# than float64), the patched model 6e-3 .. 2.0e-1; seed 5 flips in the patched model only (8.6e-2 against
# transformers' bf16, bound 5e-2). The self-check replays the unpatched run's expert choices in the patched run.
_MIXTRAL_BF16 = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64, num_local_experts=8,
                     num_experts_per_tok=2)


def _mixtral_bf16(seed=5):
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**_MIXTRAL_BF16)).to(torch.bfloat16)


def _probe_logits(model):
    ids = torch.randint(0, _MIXTRAL_BF16["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(4321))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def test_self_check_keeps_a_bf16_moe_whose_router_flips_a_near_tie():
    ref = _mixtral_bf16()
    model = copy.deepcopy(ref)
    patch.apply(model, check=False)
    a, b = _probe_logits(model), _probe_logits(ref)
    err = ((a - b).abs().max() / b.abs().max()).item()
    if err <= 5e-2:
        pytest.skip(f"no router near-tie flips on this build's kernels (max difference {err:.2e})")
    model = copy.deepcopy(ref)
    report = patch.apply(model, strict=True)
    assert patch.is_patched(model) and not report.skipped


def test_self_check_still_reverts_a_wrong_bf16_moe_adapter(monkeypatch):
    # experts that take each token to the next expert of the bank: an indexing bug the replayed routing must not hide
    from opforge.patch import _layers

    real = _layers.experts_forward

    def shifted(self, h, index, weights):
        return real(self, h, (index + 1) % self.gate_up_proj.shape[0], weights)

    monkeypatch.setitem(_layers.FORWARDS, "experts", shifted)
    monkeypatch.setattr(_layers, "_SUBCLASSES", {})
    ref = _mixtral_bf16(seed=0)
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="different logits"):
        report = patch.apply(model)
    assert not report.patched
    _assert_untouched(model, ref)


def test_granite_multipliers_changed_after_apply_are_read():
    # Was: the residual multiplier was copied at apply; a value set on the layer afterwards was ignored.
    ref = _granite(residual_multiplier=0.3)
    model = copy.deepcopy(ref)
    patch.apply(model)
    for m in (model, ref):
        for layer in m.model.layers:
            layer.residual_multiplier = 0.7
        m.config.logits_scaling = 3.0
        m.model.layers[0].self_attn.scaling = 0.11
    _assert_same_training(model, ref, _ids())


def _mixtral():
    # (without output_router_logits: transformers' output-capturing hook, installed by a forward that records them,
    # is a local function, which makes the unpatched model unpicklable too)
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg).float()


@pytest.mark.parametrize("make", [_llama, _mixtral])
@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_patched_model_pickles(make, how, tmp_path):
    # Was: PicklingError (the opforge subclasses are made at run time and have no importable name).
    import pickle

    ref = make()
    model = copy.deepcopy(ref)
    patch.apply(model)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        torch.save(model, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert patch.is_patched(loaded)
    assert [type(m).__name__ for m in loaded.modules()] == [type(m).__name__ for m in model.modules()]
    _assert_same_training(loaded, ref, _ids())
    with torch.no_grad():  # the loaded slices are rows of the loaded fused weight, not of the original's
        loaded.model.layers[0].self_attn.k_proj.weight.zero_()
    assert loaded.model.layers[0].self_attn.qkv_proj.weight.abs().sum() > 0
    assert model.model.layers[0].self_attn.k_proj.weight.abs().sum() > 0
    assert loaded.model.layers[0].self_attn.k_proj.weight.abs().sum() == 0
    patch.revert(loaded)
    assert not patch.is_patched(loaded)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in ref.modules()]
    sd, sd_ref = loaded.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_self_check_keeps_bf16_moe_on_cuda():
    # The GPU's bf16 kernels (GEMMs, transformers' grouped experts) flip other near-ties than the CPU's: twelve
    # seeds of the config above, each patched with strict=True.
    for seed in range(12):
        model = _mixtral_bf16(seed).cuda()
        report = patch.apply(model, strict=True)
        assert patch.is_patched(model) and not report.skipped, seed


def _qwen3_moe_bf16(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def test_self_check_judges_a_16bit_gradient_difference_against_float32(monkeypatch):
    # A 16-bit gradient bound the patched model's rounding exceeds (made tight here; a router's gradient on the
    # H200's 1.5B Qwen3-MoE did): the check then runs the unpatched model in float32 and keeps the patch when the
    # patched gradients are no farther from it than transformers' own 16-bit ones (the model is patched again).
    from opforge.patch import _apply

    monkeypatch.setitem(_apply._BOUNDS, "16-bit", {**_apply._BOUNDS["16-bit"], "grad": 1e-6})
    ref = _qwen3_moe_bf16()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = patch.apply(model, strict=True)
    assert patch.is_patched(model) and report.patched and not report.skipped
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model(input_ids=ids, labels=ids).loss.double()
        b = ref(input_ids=ids, labels=ids).loss.double()
    assert abs(a - b) <= 2e-2 * abs(b)  # the 16-bit loss bound of the check itself


def test_self_check_against_float32_still_reverts_a_wrong_16bit_gradient(monkeypatch):
    # The float32 verdict must not excuse an error: a gate/up gradient scaled by 1.5 in backward (the forward, the
    # logits and the loss unchanged) is reverted with the float32 comparison in the reason.
    from opforge.patch import _apply, _layers

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return 1.5 * g

    real = _layers.FORWARDS["experts"]

    def wrong(self, h, index, weights):
        return real(self, ScaleGrad.apply(h), index, weights)

    monkeypatch.setitem(_layers.FORWARDS, "experts", wrong)
    monkeypatch.setattr(_layers, "_SUBCLASSES", {})
    ref = _qwen3_moe_bf16()
    model = copy.deepcopy(ref)
    with pytest.warns(UserWarning, match="farther from a float32 run"):
        report = patch.apply(model)
    assert not report.patched
    _assert_untouched(model, ref)


def test_self_check_without_room_for_a_float32_copy_keeps_the_16bit_verdict(monkeypatch):
    # No memory for the float32 copy (reported by the room check): no copy is attempted and the 16-bit verdict
    # stands, the model reverted with the 16-bit reason.
    from opforge.patch import _apply

    monkeypatch.setitem(_apply._BOUNDS, "16-bit", {**_apply._BOUNDS["16-bit"], "grad": 1e-6})
    ref = _qwen3_moe_bf16()
    model = copy.deepcopy(ref)
    monkeypatch.setattr(_apply, "_room_for_float32_copy", lambda model: False)
    monkeypatch.setattr(_apply.copy, "deepcopy", lambda *a, **k: pytest.fail("a copy was attempted"))
    with pytest.warns(UserWarning, match="different gradients with labels \\(max difference"):
        report = patch.apply(model)
    assert not report.patched
    _assert_untouched(model, ref)


def test_room_for_a_float32_copy_counts_ten_bytes_a_parameter():
    from opforge.patch import _apply

    small = torch.nn.Linear(4, 4)
    assert _apply._room_for_float32_copy(small)
    assert not _apply._room_for_float32_copy(torch.nn.Linear(4, 4, device="meta"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_self_check_keeps_one_gradient_copy_in_the_model_dtype(dtype):
    """The self-check's probe keeps each run's gradients in the parameters' own dtype and storage, not float32
    copies: a 16-bit model's probe holds 2 bytes a trainable parameter (a float32 copy would be 4, plus the 2 of
    the gradient it was taken from while backward ran), so apply's transient stays about twice the gradients
    (before and after) instead of five times. The verdict is unchanged: the same model passes, and the wrong
    gradients of the other self-check tests are still caught (they run through the same probe)."""
    from opforge.patch import _apply

    model = _llama().to(dtype)
    res = _apply._probe(model)
    grads = res["grads"]
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert all(g.dtype == dtype for g in grads.values())
    assert sum(g.numel() * g.element_size() for g in grads.values()) == trainable
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradient in the model
    # the errors are taken in float32 (float64 for float64), one parameter at a time: a bf16 difference of 2^-8
    # relative that a bf16 subtraction would round is seen
    a = {"w": torch.tensor([1.0, 2.0], dtype=dtype)}
    b = {"w": torch.tensor([1.0 + 2 ** -7, 2.0], dtype=dtype)}
    assert _apply._grad_errors(b, a)["w"] == pytest.approx(2 ** -7 / 2.0)
    assert patch.apply(model).ok
