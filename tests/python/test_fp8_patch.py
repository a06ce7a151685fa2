"""opforge.patch.apply(model, fp8=...) on a tiny Llama: every decoder-layer projection runs fp8_linear (lm_head and
the loss do not), the loss, logits and every gradient are within the FP8 tolerance rule of the unpatched model,
revert gives the model back, activation checkpointing and torch.compile give the eager FP8 model's values, training
tracks bf16 within the two-seed spread, and DDP / FSDP2 (gloo) average the per-rank FP8 gradients.

The FP8 tolerance rule: against the unpatched float32 model, the patched FP8 model's norm-relative error (of the
logits, of the loss, of each parameter's gradient) is at most 2 × that of torch's own composition of the same FP8
math (each decoder-layer projection of the unpatched model replaced by conformance.py's torch composition of
fp8_linear: the recipe's cast by torch ops, torch._scaled_mm for the three GEMMs, as torchao composes them), plus 2⁻⁴ · 10⁻² (a hundredth of an e4m3
rounding: room for the fused q/k/v and gate/up weights' tensorwise scales, which the separate projections of torch's
composition do not share). The rule's own check that FP8 is in effect: the error is at least 10⁻⁴ (e4m3 rounds
each operand by up to 2⁻⁴; an unquantized model is within 10⁻⁶).
"""
import copy

import pytest
import torch

import opforge
from conftest import spawn_gloo
from opforge import patch
from opforge import testing as T
from opforge.patch import _fp8 as FP8_PATCH

from conformance import _fp8_linear_baseline

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GRANS = ["tensorwise", "rowwise"]
SLACK = 2 ** -4 * 1e-2

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama(device):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).float().to(device).train()


def _ids(device):
    return torch.randint(0, TINY_LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1)).to(device)


def _torch_fp8(model, granularity):
    """The unpatched model with each decoder-layer projection computed by torch's composition of the FP8 math."""
    for layer in model.model.layers:
        for mod in (layer.self_attn, layer.mlp):
            for n in PROJECTIONS:
                lin = mod._modules.get(n)
                if lin is not None:
                    lin.forward = (lambda x, lin=lin: _fp8_linear_baseline(x, lin.weight, lin.bias,
                                                                           granularity=granularity))
    return model


def _step(model, ids):
    """(logits without labels, loss with labels, gradients under transformers' names)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return logits, loss.detach().float(), {n: g.detach().float().clone() for n, g in patch.gradients_by_name(model).items()}


def _errors(run, ref):
    logits, loss, grads = run
    rl, rloss, rg = ref
    out = {"logits": T.relative_error(logits, rl), "loss": T.relative_error(loss, rloss)}
    out.update({n: T.relative_error(grads[n], rg[n]) for n in rg})
    return out


#: the ops an FP8 projection's forward dispatches below autograd: fp8_linear, or with the weight's cached operands
#: _fp8_linear_quantized, or (tensorwise, the weight trained) the private forward that also returns q(inputᵀ)
FORWARD_OPS = ("opforge::fp8_linear", "opforge::_fp8_linear_quantized", "opforge::_fp8_linear_forward")


class _CountFP8(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in FORWARD_OPS:
            self.shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


#: the producers' private ops that also write max |output| for the FP8 GEMM reading it
PRODUCER_OPS = ("opforge::_rms_norm_forward_amax", "opforge::_fused_add_rms_norm_forward_amax",
                "opforge::_swiglu_packed_amax")


class _Owner(torch.nn.Module):
    """A module as a patched attention / MLP with tensorwise FP8 projections looks to `_fp8.amax_on`."""

    def __init__(self):
        super().__init__()
        self._opforge_fp8 = "tensorwise"


class _AmaxUse(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the producers that ran and, per FP8 GEMM op, (weight's shape, whether it was handed input_amax)."""

    def __init__(self):
        super().__init__()
        self.producers, self.gemms = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if name in PRODUCER_OPS:
            self.producers.append(name)
        elif name in FORWARD_OPS[1:] or name == "opforge::_fp8_linear_quantized_backward":
            weight = args[1] if name != "opforge::_fp8_linear_quantized_backward" else args[4]
            self.gemms.append((name, tuple(weight.shape), kwargs.get("input_amax") is not None))
        return func(*args, **kwargs)


@pytest.mark.parametrize("recompute", [True, False])
def test_fp8_producers_hand_their_amax_to_the_gemms(device, recompute, monkeypatch):
    """Tensorwise, eager: input_layernorm, the fused residual add + post_attention_layernorm and the SwiGLU write
    max |output| beside their output, and the q/k/v, gate/up and down_proj GEMMs take it (input_amax: forward, and
    the backward's quantization of inputᵀ under recompute) instead of their own amax pass; o_proj (input from the
    attention) computes its own. Loss, logits and every gradient are bit-identical to the GEMMs computing every amax
    themselves (the test hook PRODUCER_AMAX = False)."""
    monkeypatch.setattr(FP8_PATCH, "PRODUCER_AMAX_DEVICES", {"cpu", "cuda"})  # CUDA's hand-off proven here
    assert FP8_PATCH.amax_on(_Owner()), "the patch does not hand the producers' amax on (ops missing from the build?)"
    model = _llama(device)
    assert patch.apply(model, fp8="tensorwise", recompute=recompute).ok
    ids = _ids(device)
    cfg = model.config
    with _AmaxUse() as rec:
        model(input_ids=ids, labels=ids).loss.backward()
    layers = cfg.num_hidden_layers
    assert sorted(rec.producers) == sorted(PRODUCER_OPS[1:] * layers + PRODUCER_OPS[:1] * layers)
    hd = cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    handed = {(qkv, cfg.hidden_size), (2 * cfg.intermediate_size, cfg.hidden_size),
              (cfg.hidden_size, cfg.intermediate_size)}
    forward = [g for g in rec.gemms if g[0] != "opforge::_fp8_linear_quantized_backward"]
    assert len(forward) == 4 * layers
    for _, shape, given in forward:
        assert given == (shape in handed), shape
    backward = [g for g in rec.gemms if g[0] == "opforge::_fp8_linear_quantized_backward"]
    if recompute:  # the saved (dropped, recomputed) inputs are quantized again with the producers' amax
        assert sum(given for *_, given in backward) == 3 * layers
    model.zero_grad(set_to_none=True)
    fused = _step(model, ids)
    FP8_PATCH.PRODUCER_AMAX = False
    try:
        model.zero_grad(set_to_none=True)
        plain = _step(model, ids)
    finally:
        FP8_PATCH.PRODUCER_AMAX = True
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    assert fused[2].keys() == plain[2].keys() and all(torch.equal(fused[2][n], plain[2][n]) for n in plain[2])


@pytest.mark.parametrize("recompute", [True, False])
def test_fp8_patch_under_inference_mode(device, recompute):
    """torch.inference_mode(): the norms' outputs are inference tensors (no version counter), so the producers hand no
    amax on; the logits are those under torch.no_grad(), bit for bit, training mode or not, and generate() runs."""
    model = _llama(device)
    assert patch.apply(model, fp8="tensorwise", recompute=recompute).ok
    ids = _ids(device)
    for train in (True, False):
        model.train(train)
        with torch.no_grad():
            want = model(input_ids=ids).logits
        with torch.inference_mode():
            assert not FP8_PATCH.amax_on(model.model.layers[0].mlp)
            assert torch.equal(model(input_ids=ids).logits, want)
    with torch.inference_mode():
        out = model.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_new_tokens=3,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (2, 7)


@pytest.mark.parametrize("granularity", GRANS)
def test_fp8_patch_within_the_rule_of_the_unpatched_model(device, granularity):
    ref = _llama(device)
    ours = copy.deepcopy(ref)
    report = patch.apply(ours, fp8=granularity)
    assert report.ok, str(report)
    base = _torch_fp8(copy.deepcopy(ref), granularity)
    ids = _ids(device)
    r = _step(ref, ids)
    e_ours, e_base = _errors(_step(ours, ids), r), _errors(_step(base, ids), r)
    assert e_ours.keys() == e_base.keys() and len(e_ours) == 2 + len(dict(ref.named_parameters()))
    for what, e in e_ours.items():
        assert e <= 2 * e_base[what] + SLACK, f"{what}: error {e:.3g} > 2 × torch's FP8 composition's {e_base[what]:.3g}"
    assert e_ours["logits"] >= 1e-4, "no FP8 rounding in the logits: FP8 not in effect"


@pytest.mark.parametrize("granularity", GRANS)
def test_fp8_patch_covers_the_decoder_projections_only(device, granularity):
    model = _llama(device)
    names_before = set(model.state_dict())
    patch.apply(model, fp8=granularity)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, opforge.nn.Linear) and layer.self_attn.o_proj.fp8 == granularity
    assert isinstance(layer.mlp.down_proj, opforge.nn.Linear) and layer.mlp.down_proj.fp8 == granularity
    assert getattr(model.lm_head, "fp8", None) is None
    assert set(model.state_dict()) == names_before
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    with _CountFP8() as rec:
        model(input_ids=_ids(device), labels=_ids(device)).loss.backward()
    per_layer = [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_attention_heads * hd),
                 (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    assert sorted(rec.shapes) == sorted(per_layer * cfg.num_hidden_layers)  # no lm_head (loss: linear_cross_entropy)


def test_fp8_revert_gives_the_unpatched_model_back(device):
    ref = _llama(device)
    model = copy.deepcopy(ref)
    patch.apply(model, fp8="rowwise")
    patch.revert(model)
    assert not patch.is_patched(model)
    assert type(model.model.layers[0].self_attn.o_proj) is torch.nn.Linear
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    ids = _ids(device)
    a, b = _step(model, ids), _step(ref, ids)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    for n in b[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-4, atol=1e-6, msg=n)


def test_fp8_bad_granularity_leaves_the_model_unchanged():
    model = _llama("cpu")
    with pytest.raises(ValueError, match=r"opforge.patch.apply: expected fp8 to be None, 'tensorwise' or 'rowwise', "
                                         r"but got 'blockwise'"):
        patch.apply(model, fp8="blockwise")
    assert not patch.is_patched(model)


def _assert_same_fp8_run(a, b):
    """Compiled against eager: the glue around the opaque FP8 ops may round differently (Inductor), which can move
    an element across an e4m3 rounding boundary (a 2⁻³ step of that element): norm-relative errors at most 10⁻³
    (1/60 of e4m3's half-ulp 2⁻⁴), where a wrong graph is off by O(1)."""
    for what, x, y in [("logits", a[0], b[0]), ("loss", a[1], b[1])] + [(n, a[2][n], b[2][n]) for n in b[2]]:
        e = T.relative_error(x, y)
        assert e <= 1e-3, f"{what}: compiled vs eager {e:.3g}"


@pytest.mark.parametrize("reentrant", [True, False])
def test_fp8_activation_checkpointing(device, reentrant):
    """Checkpointed layers run the same FP8 forward again in backward: the same values as without."""
    plain = _llama(device)
    patch.apply(plain, fp8="tensorwise")
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = _ids(device)
    a, b = _step(ckpt, ids), _step(plain, ids)
    assert torch.equal(a[1], b[1])
    for n in b[2]:
        assert torch.equal(a[2][n], b[2][n]), n


def test_fp8_compile_decoder_layers_fullgraph(device):
    """torch.compile(fullgraph=True) of each FP8 decoder layer: fp8_linear stays one op in the graph, the values are
    eager's."""
    import torch._dynamo

    eager = _llama(device)
    patch.apply(eager, fp8="rowwise")
    comp = copy.deepcopy(eager)
    torch._dynamo.reset()
    for layer in comp.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    _assert_same_fp8_run(_step(comp, _ids(device)), _step(eager, _ids(device)))
    torch._dynamo.reset()


# ---- convergence: a tiny byte-level Llama trained on the demo's bundled text -----------------------------------

CONV = dict(TINY_LLAMA, vocab_size=256)
CONV_STEPS, LOG_EVERY = 60, 5


def _train(seed: int, fp8):
    """The logged losses (every LOG_EVERY steps) of CONV_STEPS AdamW steps under bfloat16 autocast, init seed `seed`,
    the demo's data order (seed 0): the same batches for every run."""
    from opforge.demo.data import make_batches

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONV)).float().train()
    patch.apply(model, fp8=fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = make_batches(CONV_STEPS, 8, 64, seed=0)
    logged = []
    for s in range(CONV_STEPS):
        x, _ = data.get(data.train_offsets[s], "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if s % LOG_EVERY == 0:
            logged.append(loss.item())
    return torch.tensor(logged, dtype=torch.float64)


def test_fp8_training_tracks_bf16_within_the_seed_spread():
    """Every logged FP8 loss (tensorwise and rowwise) is within the bound B of the bf16 run from the same init: B is
    the mean, over the logged steps, of the distance between two bf16 runs from two init seeds (two equally good
    runs; about 0.06 nats at this size, where the FP8 runs stay within 0.03). A wrong FP8 gradient or scale drifts
    by tenths of a nat within these steps."""
    bf16, other = _train(0, None), _train(1, None)
    bound = (bf16 - other).abs()[1:].mean().item()
    assert bound > 0
    for g in GRANS:
        diff = (_train(0, g) - bf16).abs()
        assert bool((diff <= bound).all()), f"{g}: logged losses {diff.tolist()} past the seed spread {bound:.4f}"
    assert bf16[-1] < bf16[0] - 1.0  # it trains


# ---- DDP and FSDP2 (gloo, 2 processes on the CPU) --------------------------------------------------------------

def _ranks_worker(rank, world, granularity, out):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = _llama("cpu")
    patch.apply(base, fp8=granularity)
    ids = _ids("cpu")[rank::world]  # this rank's half of the batch
    res = {}
    ddp = DDP(copy.deepcopy(base))
    ddp(input_ids=ids, labels=ids).loss.backward()
    res["ddp"] = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    fsdp = copy.deepcopy(base)
    for layer in fsdp.model.layers:
        fully_shard(layer)
    fully_shard(fsdp)
    fsdp(input_ids=ids, labels=ids).loss.backward()
    res["fsdp"] = {n: p.grad.full_tensor().clone() for n, p in fsdp.named_parameters()}
    if rank == 0:
        torch.save(res, out)


@pytest.mark.parametrize("granularity", GRANS)
def test_fp8_ddp_and_fsdp2_gloo(tmp_path, granularity):
    """Each rank quantizes its own tokens (current scaling is per rank's tensors); DDP's and FSDP2's gradients are the
    mean of the per-rank FP8 gradients that one process computes from the same halves of the batch."""
    out = tmp_path / "grads.pt"
    spawn_gloo(tmp_path, _ranks_worker, granularity, str(out))
    got = torch.load(out)
    model = _llama("cpu")
    patch.apply(model, fp8=granularity)
    ids = _ids("cpu")
    per_rank = []
    for r in range(2):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids[r::2], labels=ids[r::2]).loss.backward()
        per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for kind in ("ddp", "fsdp"):
        assert got[kind].keys() == per_rank[0].keys()
        for n, g in got[kind].items():
            torch.testing.assert_close(g, (per_rank[0][n] + per_rank[1][n]) / 2, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=n, kind=kind: f"{kind} {n}: {m}")


def test_fp8_compile_whole_model(device):
    """torch.compile(model) of the FP8-patched model (Inductor): the loss and gradients of eager, to rounding."""
    import torch._dynamo

    eager = _llama(device)
    patch.apply(eager, fp8="tensorwise")
    comp = copy.deepcopy(eager)
    torch._dynamo.reset()
    comp.compile()
    _assert_same_fp8_run(_step(comp, _ids(device)), _step(eager, _ids(device)))
    torch._dynamo.reset()
