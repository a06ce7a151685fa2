"""opforge.patch with PEFT LoRA, in both orders (get_peft_model then apply; apply then get_peft_model), tiny random
Llama and Phi-3 (checkpoint-fused qkv_proj / gate_up_proj) configs, float32: the base projections stay fused and the
adapters run beside them; loss, adapter gradients and two optimizer steps match the unpatched PEFT model; the full
and the adapter-only state_dict, save_pretrained / from_pretrained of the adapter, merge / unmerge (also PEFT's safe
merge), disable_adapter and merge_and_unload work; layers PEFT builds otherwise (DoRA) are refused with the reason.

Tolerances: as test_hf_llama.py (float32 rounding of other kernels: 1e-5 relative on losses and logits, 1e-4
relative + 1e-6 absolute on gradients)."""
import copy

import pytest
import torch

from opforge import patch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

pytestmark = pytest.mark.usefixtures("one_thread")

V = 97
C = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MODELS = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**C)),
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**C)),
             ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
}


def _config(targets, **kw):
    # init_lora_weights=False: B is random too, so the adapters change the output from the first step
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0,
                           task_type="CAUSAL_LM", **kw)


def _pair(family, order, **kw):
    """(reference PEFT model, patched PEFT model) with the same base weights and adapters."""
    make, targets = MODELS[family]
    torch.manual_seed(0)
    base = make().float()
    ref = peft.get_peft_model(copy.deepcopy(base), _config(targets, **kw))
    if order == "peft_then_apply":
        model = peft.get_peft_model(copy.deepcopy(base), _config(targets, **kw))
        with torch.no_grad():
            ref_params = dict(ref.named_parameters())
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(ref_params[n])
        report = patch.apply(model)
    else:
        inner = copy.deepcopy(base)
        report = patch.apply(inner)
        model = peft.get_peft_model(inner, _config(targets, **kw))
        with torch.no_grad():
            ref_params = dict(ref.named_parameters())
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(ref_params[n])
    assert report.ok, str(report)
    return base, ref, model


def _ids(seed=1, batch=2, seq=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, seq), generator=g)


ORDERS = ["peft_then_apply", "apply_then_peft"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("family", sorted(MODELS))
def test_lora_trains_as_unpatched_peft(family, order):
    _, ref, model = _pair(family, order)
    inner = model.get_base_model()
    attn = inner.model.layers[0].self_attn
    assert type(attn).__name__.startswith("Opforge")  # patched, not left to transformers
    assert type(attn.qkv_proj.base_layer if family == "phi3" else attn.qkv_proj) is torch.nn.Linear
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in ref.named_parameters() if p.requires_grad] and trainable
    assert all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        ids = _ids(seed=step)
        with _no_fallback():
            loss = model(input_ids=ids, labels=ids).loss
        loss_ref = ref(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
        loss.backward()
        loss_ref.backward()
        g = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        g_ref = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        assert g.keys() == g_ref.keys()
        for k in g_ref:
            torch.testing.assert_close(g[k], g_ref[k], rtol=1e-4, atol=1e-6, msg=k)
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()


class _no_fallback:
    """No 'running transformers' forward' warning: the patched forwards ran."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self._w = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        assert not [w for w in self._w if "transformers' forward" in str(w.message)]


@pytest.mark.parametrize("order", ORDERS)
def test_lora_state_dicts_and_save_pretrained(order, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    base, ref, model = _pair("llama", order)
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)  # ...q_proj.base_layer.weight, ...q_proj.lora_A.default.weight, ...
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=0, atol=0, msg=k)
    a, a_ref = get_peft_model_state_dict(model), get_peft_model_state_dict(ref)
    assert list(a) == list(a_ref) and all(torch.equal(a[k], a_ref[k]) for k in a_ref)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("safe_merge", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_lora_merge_unmerge_disable(order, safe_merge):
    base, ref, model = _pair("llama", order)
    ids = _ids()
    with torch.no_grad():
        before = ref(input_ids=ids).logits
        model.merge_adapter(safe_merge=safe_merge)
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
        # the merge reached the fused weight: the state_dict's base weight is base + B·A·scaling
        q = model.get_base_model().model.layers[0].self_attn.q_proj
        merged = base.model.layers[0].self_attn.q_proj.weight + q.get_delta_weight("default")
        key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
        torch.testing.assert_close(model.state_dict()[key], merged, rtol=1e-6, atol=1e-6)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        plain = model.merge_and_unload()
        torch.testing.assert_close(plain(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
        assert patch.is_patched(plain)
        patch.revert(plain)
        torch.testing.assert_close(plain(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)


def test_dora_is_refused_with_the_reason():
    make, targets = MODELS["llama"]
    torch.manual_seed(0)
    model = peft.get_peft_model(make().float(), _config(targets, use_dora=True))
    with pytest.warns(UserWarning, match="DoRA"):
        report = patch.apply(model)
    assert any("DoRA" in r for _, _, r in report.skipped)
    assert not any(k.startswith("opforge decoder layer") for _, _, k in report.patched)


def test_lora_on_lm_head_keeps_transformers_loss():
    make, targets = MODELS["llama"]
    torch.manual_seed(0)
    base = make().float()
    inner = copy.deepcopy(base)
    patch.apply(inner)
    model = peft.get_peft_model(inner, _config(targets + ["lm_head"]))
    ref = peft.get_peft_model(copy.deepcopy(base), _config(targets + ["lm_head"]))
    with torch.no_grad():
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(ref_params[n])
    ids = _ids()
    with pytest.warns(UserWarning, match="lm_head"):
        loss = model(input_ids=ids, labels=ids).loss  # the fused loss would skip the adapter: transformers' instead
    torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=0)
