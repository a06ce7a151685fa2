"""opforge.models.llama: both backends share parameters and compute the same model; compile works."""
import pytest
import torch

from opforge.models.llama import Llama, LlamaConfig

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)


def _pair(**kw):
    cfg = LlamaConfig(**{**TINY, **kw})
    torch.manual_seed(0)
    ref = Llama(cfg, backend="torch")
    ours = Llama(cfg, backend="opforge")
    ours.load_state_dict(ref.state_dict())
    return cfg, ours, ref


def test_same_parameter_names_and_shapes():
    _, ours, ref = _pair()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert not any("bias" in k for k in ref.state_dict())


def test_same_seed_gives_same_weights():
    cfg = LlamaConfig(**TINY)
    torch.manual_seed(3)
    a = Llama(cfg, backend="torch").state_dict()
    torch.manual_seed(3)
    b = Llama(cfg, backend="opforge").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("n_kv_heads", [None, 2])
def test_backends_agree_forward_and_backward(n_kv_heads):
    cfg, ours, ref = _pair(n_kv_heads=n_kv_heads)
    tokens = torch.randint(0, cfg.vocab_size, (3, 11))
    targets = torch.randint(0, cfg.vocab_size, (3, 11))
    la, lb = ours.loss(tokens, targets), ref.loss(tokens, targets)
    torch.testing.assert_close(ours(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
    la.backward()
    lb.backward()
    gb = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, gb[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rejects_bad_backend_and_long_input():
    with pytest.raises(ValueError, match="expected backend"):
        Llama(LlamaConfig(**TINY), backend="jax")
    with pytest.raises(ValueError, match="divisible by n_heads"):
        LlamaConfig(d_model=30, n_heads=4)
    m = Llama(LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="at most 16 tokens"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_compile_fullgraph_forward_backward_matches_eager():
    cfg, ours, _ = _pair()
    torch._dynamo.reset()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    eager = ours.loss(tokens, targets)
    eager.backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad(set_to_none=True)
    compiled = torch.compile(ours, fullgraph=True)
    logits = compiled(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-6)
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
