"""opforge.patch.apply's module-by-module swaps on Hugging Face transformers models built from a config (nothing
downloaded): with the decoder-layer and loss patches off, a tiny Llama patched in place gives the unpatched model's
logits and gradients (fp32) and keeps its Parameter objects; revert puts transformers' modules back; an unsupported
model (GPT-2) reports what could not be patched. The Llama-family decoder-layer patch is tested in test_hf_llama.py."""
import copy

import pytest
import torch

import opforge
from opforge import patch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)


def _llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    return model.float().eval()


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_llama_patched_matches_unpatched():
    ref = _llama()
    model = copy.deepcopy(ref)
    params_before = {n: p for n, p in model.named_parameters()}
    report = patch.apply(model, decoder=False, loss=False)
    assert report.ok, str(report)
    counts = report.counts()
    assert counts["LlamaMLP -> opforge.nn.GatedMLP"] == 2
    assert counts["LlamaRMSNorm -> opforge.nn.RMSNorm"] == 2 * 2 + 1
    assert counts["Linear -> opforge.nn.Linear"] == 4 * 2 + 1  # q, k, v, o per layer + lm_head (MLP linears inside GatedMLP)
    assert isinstance(model.model.layers[0].mlp, opforge.nn.GatedMLP)
    assert isinstance(model.model.layers[0].mlp.gate_proj, opforge.nn.Linear)
    assert isinstance(model.model.layers[1].input_layernorm, opforge.nn.RMSNorm)
    assert isinstance(model.lm_head, opforge.nn.Linear)
    assert model.model.norm.eps == ref.model.norm.variance_epsilon
    # Same Parameter objects under the same names: weights kept, nothing copied, state_dict keys unchanged.
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is p for n, p in params_before.items())
    assert model.state_dict().keys() == ref.state_dict().keys()

    ids = torch.randint(0, 128, (2, 9))
    logits_ref, grads_ref = _logits_and_grads(ref, ids)
    logits, grads = _logits_and_grads(model, ids)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(params_before)
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-4, atol=1e-6, msg=n)

    # revert: transformers' modules again, holding the same Parameter objects
    assert patch.revert(model) == len(report.patched)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP" and type(model.lm_head) is torch.nn.Linear
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert all(dict(model.named_parameters())[n] is p for n, p in params_before.items())
    assert not patch.is_patched(model) and patch.revert(model) == 0


def test_patching_twice_is_a_no_op():
    model = _llama()
    patch.apply(model)
    with pytest.warns(UserWarning, match="found nothing to patch"):
        second = patch.apply(model)
    assert not second.patched and not second.skipped


def test_unsupported_model_reports_what_it_could_not_patch():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    pristine = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="could not patch"):
        report = patch.apply(model)
    skipped = {name: reason for name, _, reason in report.skipped}
    assert "transformer.h.0.ln_1" in skipped and "LayerNorm" in skipped["transformer.h.0.ln_1"]
    assert "transformer.h.0.mlp" in skipped and "not a gated MLP" in skipped["transformer.h.0.mlp"]
    assert "transformer.h.0.attn.c_attn" in skipped and "Conv1D" in skipped["transformer.h.0.attn.c_attn"]
    assert not report.ok
    text = str(report)
    assert "not patched: transformer.h.1.mlp" in text
    with pytest.raises(ValueError, match="could not patch every module"):
        patch.apply(pristine, strict=True)


def test_different_math_is_detected_and_left_alone():
    class OffsetRMSNorm(torch.nn.Module):  # Gemma-style x·(1 + weight): same attributes, different math
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(n))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    class GeluMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(8, 16), torch.nn.Linear(8, 16),
                                                            torch.nn.Linear(16, 8))
            self.act_fn = torch.nn.GELU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    model = torch.nn.Sequential(OffsetRMSNorm(8), GeluMLP())
    x = torch.randn(3, 8)
    before = model(x)
    with pytest.warns(UserWarning):
        report = patch.apply(model)
    skipped = {n: r for n, _, r in report.skipped}
    assert "differs" in skipped["0"] and "not SiLU" in skipped["1"]
    assert {n for n, _, _ in report.patched} == {"1.gate_proj", "1.up_proj", "1.down_proj"}
    torch.testing.assert_close(model(x), before)


def test_rejects_non_module():
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        patch.apply("model")
