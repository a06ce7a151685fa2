"""opforge.patch.apply(fp8_activations=True): the gate/up output that a patched MLP's gated activation keeps for
backward is stored as rowwise float8_e4m3fn (one float32 scale per token) and dequantized in backward. Tiny random
transformers configs (Llama: SwiGLU; Gemma: GeGLU, tanh approximation), nothing downloaded, CPU.

What is checked:
* bytes: one decoder layer keeps exactly T·2I·(e − 1) − 4·T bytes less after its forward (apply's formula), with
  and without recompute and FP8 projections; the forward's output is bitwise fp8_activations=False's;
* numerics, one MLP: its gradients meet the float64-reference tolerance rule (`assert_matches_reference`) against
  the float64 backward with gu replaced by its rowwise e4m3 round trip data / scale, and differ from the
  unquantized float64 gradients by at most the bound that e4m3's rounding implies (derived in `_e4m3_error` and
  `_gradient_bound`);
* a whole training step: the loss is bitwise the default's; the gradients are bitwise those of the model whose
  activation's backward reads torchao's rowwise e4m3 round trip of gu, composed of torch ops
  (`opforge.testing.quantize_fp8_reference`); with recompute=True only down_proj's weight gradients differ from
  recompute=False's (they read the activation of the rounded gu: the one-MLP test bounds them);
* off where the recipes are off: no_grad, inference_mode, a user's saved-tensor hooks, non-reentrant activation
  checkpointing, torch.func.grad — bitwise fp8_activations=False there;
* a layer whose gu needs no gradient (gate/up frozen, input without grad) with recompute=True: down_proj's recipe
  reads the FP8 copy there too (the same drop), and no dequantized gu is left waiting;
* fp8_activations that is not a bool ("false", "rowwise", 1, None, ...) is refused, the model unchanged;
* the checks can fail: a dequantization that skips the division by the scale, or a copy of gu kept beside the FP8
  form, is caught (`test_the_checks_catch_a_broken_path`).
"""
import copy
import functools

import pytest
import torch

from opforge import patch
from opforge.patch import _fp8 as patch_fp8
from opforge.patch import _layers as patch_layers
from opforge.patch import _recompute as patch_recompute
from opforge.testing import assert_matches_reference, quantize_fp8_reference, relative_error

from conformance import LiveStorages, decoder_layer_inputs, decoder_layer_live_bytes

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)),  # SwiGLU
    "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**COMMON, head_dim=16)),  # GeGLU (tanh)
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _models(family="llama", dtype=torch.float32, fp8=None, recompute=True, variants=(False, True)):
    """Patched copies of one random model, one per entry of `variants` (fp8_activations, or (fp8_activations,
    recompute)), in train mode."""
    torch.manual_seed(0)
    base = FAMILIES[family]().to(dtype)
    out = []
    for v in variants:
        on, rec = v if isinstance(v, tuple) else (v, recompute)
        m = copy.deepcopy(base)
        patch.apply(m, fp8=fp8, recompute=rec, fp8_activations=on)
        out.append(m.train())
    return out


def _ids(batch=2, seq=11, vocab=128, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_bitwise(a, b, skip=()):
    (loss_a, g_a), (loss_b, g_b) = a, b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        if not any(s in n for s in skip):
            assert g_a[n] is not None and torch.equal(g_a[n], g_b[n]), n


def _layer_live_bytes(model, dtype):
    """(bytes one decoder layer's forward leaves alive: its output and what its graph keeps; the output)."""
    return decoder_layer_live_bytes(model, dtype)[:2]


def _formula(model, dtype, T=2 * 16):
    """apply's formula: T·2I·(e − 1) − 4·T bytes (gu's 2I elements a token at e bytes become one byte each plus one
    float32 scale a token)."""
    e, I = torch.finfo(dtype).bits // 8, model.config.intermediate_size
    return T * 2 * I * (e - 1) - 4 * T


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "norecompute"])
@pytest.mark.parametrize("dtype, fp8", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "tensorwise"),
                                        (torch.bfloat16, "tensorwise")], ids=str)
def test_saved_bytes_per_layer_drop_by_the_formula(dtype, fp8, recompute):
    """With recompute=True no full-precision gu outlives the forward: down_proj's recipe computes its input from the
    FP8 copy too (else the drop would be T·2I·e smaller: gu kept by that recipe). Tensorwise on the CPU, SwiGLU hands
    its amax to down_proj (`_swiglu_packed_amax`), under the FP8 hooks as well."""
    off, on = _models("llama", dtype, fp8=fp8, recompute=recompute)
    if fp8 == "tensorwise":
        assert patch_fp8.amax_on(on.model.layers[0].mlp)
    live_off, y_off = _layer_live_bytes(off, dtype)
    live_on, y_on = _layer_live_bytes(on, dtype)
    print(f"\n{dtype} fp8={fp8} recompute={recompute}: live bytes {live_off} -> {live_on}")
    assert live_off - live_on == _formula(on, dtype), (live_off, live_on, _formula(on, dtype))
    assert torch.equal(y_on, y_off)


# ---- numerics of one MLP -----------------------------------------------------------------------------------

#: Lipschitz constants of the activations (max |f'| = L1, max |f''| = L2 over the reals), rounded up; checked on a
#: dense grid by `test_activation_constants`. SiLU: f'(x) = σ(x)(1 + x(1 − σ(x))) peaks at 1.0998 (x ≈ 2.40);
#: f''(x) = σ(x)(1 − σ(x))(2 + x(1 − 2σ(x))) has its largest magnitude 1/2 at x = 0. GELU (tanh form): f' peaks at
#: 1.1289 (x ≈ 1.42); |f''| is largest at x = 0, where it is √(2/π) = 0.7979.
LIPSCHITZ = {"silu": (1.1, 0.501), "gelu_tanh": (1.13, 0.8)}


def _act64(kind, g, u):
    f = torch.nn.functional.silu(g) if kind == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
    return f * u


def test_activation_constants():
    x = torch.linspace(-30, 30, 600001, dtype=torch.float64, requires_grad=True)
    for kind, (l1, l2) in LIPSCHITZ.items():
        f = _act64(kind, x, torch.ones_like(x))
        d1, = torch.autograd.grad(f.sum(), x, create_graph=True)
        d2, = torch.autograd.grad(d1.sum(), x)
        # at an interior maximum of |f'| (of |f''|) the slope f'' (f''') is 0, so the grid (step h = 1e-4) misses it
        # by at most h²/8 times max |f'''| (max |f''''|), both below 2 here: under 1e-8; beyond ±30, f' is within
        # 1e-11 of 0 or 1 and f'' of 0
        assert d1.abs().max().item() + 1e-8 <= l1 and d2.abs().max().item() + 1e-8 <= l2, kind


def _e4m3_error(gu64, scale):
    """Elementwise bound on |data / scale − gu| for (data, scale) = quantize_fp8(gu, e4m3, "rowwise"), gu exact in
    float64: data = rne_e4m3(fl32(gu · s)). e4m3 has 3 mantissa bits, so rounding to nearest errs by at most 2^-4 of
    the value in its normal range and by half the subnormal spacing 2^-9, i.e. 2^-10, below it (values past 448 are
    clamped to 448, within that same half spacing 16 = 2^-4 · 256); the float32 product adds 2^-24 of the value, so
    |data − gu·s| ≤ (2^-4 + 2^-23)·|gu·s| + 2^-10, and dividing by s (exact in float64 up to 2^-53):
    |data / scale − gu| ≤ (2^-4 + 2^-22)·|gu| + 2^-10 / scale."""
    return (2.0 ** -4 + 2.0 ** -22) * gu64.abs() + 2.0 ** -10 / scale.double()


def _gradient_bound(kind, x, w_gu, w_d, dy, gu64, ghat64, scale, recompute):
    """Elementwise bounds on how far the float64 gradients (x, gate/up weight, down weight) with gu replaced by ĝu =
    data / scale can be from those with gu itself. With f the activation, (g, u) = gu's halves, E = `_e4m3_error`
    (so |ĝ − g| ≤ E_g, |û − u| ≤ E_u) and dh = dy · W_d (the same in both):
      dup = dh · f(g):      |Δdup| ≤ |dh| · L1 · E_g;
      dgate = dh · u · f'(g) = dh · (û f'(ĝ) − Δu f'(ĝ) − u (f'(ĝ) − f'(g))):  |Δdgate| ≤ |dh| · (L1 · E_u + |u| · L2 · E_g);
      dW_gu = dguᵀ x, dx = dgu · W_gu: their differences are at most |Δdgu|ᵀ |x| and |Δdgu| · |W_gu|;
      dW_d = dyᵀ h with h read in backward: recompute=True reads f(ĝ) û, whose difference from f(g) u is at most
      |f(ĝ)| · E_u + |u| · L1 · E_g; recompute=False reads the forward's h (no difference)."""
    L1, L2 = LIPSCHITZ[kind]
    E = _e4m3_error(gu64, scale)
    g, u = gu64.chunk(2, -1)
    Eg, Eu = E.chunk(2, -1)
    dh = dy @ w_d
    ddgu = torch.cat([dh.abs() * (L1 * Eu + u.abs() * L2 * Eg), dh.abs() * L1 * Eg], -1)
    flat = ddgu.reshape(-1, ddgu.shape[-1])
    b_x = ddgu @ w_gu.abs()
    b_wgu = flat.T @ x.reshape(-1, x.shape[-1]).abs()
    if recompute:
        fhat = _act64(kind, ghat64.chunk(2, -1)[0], torch.ones_like(u))
        dh_h = fhat.abs() * Eu + u.abs() * L1 * Eg
        b_wd = dy.reshape(-1, dy.shape[-1]).abs().T @ dh_h.reshape(-1, dh_h.shape[-1])
    else:
        b_wd = torch.zeros(w_d.shape, dtype=torch.float64)
    return b_x, b_wgu, b_wd


def _mlp_grads64(kind, x, w_gu, w_d, dy, gu_fwd, gu_bwd):
    """Float64 gradients (x, W_gu, W_d) of y = f(g) u · W_dᵀ, gu = x · W_guᵀ, whose activation's backward reads
    `gu_bwd` and whose down_proj's backward reads f(gu_fwd)."""
    x, w_gu, w_d = (t.detach().double().requires_grad_() for t in (x, w_gu, w_d))
    dy = dy.double()
    gu = (x @ w_gu.T)
    dgu = torch.autograd.functional.vjp(lambda t: _act64(kind, *t.chunk(2, -1)), gu_bwd.double(), dy @ w_d.detach())[1]
    gx, gwgu = torch.autograd.grad(gu, (x, w_gu), dgu)
    h = _act64(kind, *gu_fwd.double().chunk(2, -1))
    gwd = dy.reshape(-1, dy.shape[-1]).T @ h.reshape(-1, h.shape[-1])
    return gx, gwgu, gwd


class _Recorder(patch_recompute.Fp8Saved):
    """Fp8Saved that also records the gu it was made from and its (data, scale)."""

    made = []

    def __init__(self, gu):
        super().__init__(gu)
        _Recorder.made.append((gu.detach().clone(), *self.args))


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "norecompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlp_gradients_within_the_rule_and_the_e4m3_bound(family, dtype, recompute, monkeypatch):
    """(1) The patched MLP's gradients against the float64 backward that reads ĝu = data / scale (the FP8 copy
    exactly): the tolerance rule, with as baseline torch's composition of that math in the model's dtype. (2) Against
    the unquantized float64 gradients: within ‖bound‖ (`_gradient_bound`) plus the model dtype's own error from (1)
    (triangle inequality, norm-wise). The forward's output is bitwise fp8_activations=False's."""
    off, on = _models(family, dtype, recompute=recompute)
    kind = on.model.layers[0].mlp._opforge_act
    torch.manual_seed(5)
    x = torch.randn(2, 9, COMMON["hidden_size"], dtype=dtype)
    dy = torch.randn(2, 9, COMMON["hidden_size"], dtype=dtype)
    _Recorder.made = []
    monkeypatch.setattr(patch_recompute, "Fp8Saved", _Recorder)
    outs = []
    for model in (off, on):
        mlp = model.model.layers[0].mlp
        xi = x.clone().requires_grad_()
        y = mlp(xi)
        y.backward(dy)
        outs.append((y.detach(), xi.grad, mlp.gate_up_proj.weight.grad, mlp.down_proj.weight.grad))
    assert torch.equal(outs[0][0], outs[1][0])
    (gu, data, scale), = _Recorder.made
    mlp = on.model.layers[0].mlp
    w_gu, w_d = mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach()
    ghat64 = data.double() / scale.double()
    ref = _mlp_grads64(kind, x, w_gu, w_d, dy, ghat64 if recompute else gu, ghat64)
    # baseline: the same math in the model's dtype (ĝu rounded to it once, as the dequantization does)
    ghat = (data.float() / scale).to(dtype)
    xb = x.clone().requires_grad_()
    wb_gu, wb_d = w_gu.clone().requires_grad_(), w_d.clone().requires_grad_()
    gub = xb @ wb_gu.T
    dgu = torch.autograd.functional.vjp(lambda t: _act64(kind, *t.chunk(2, -1)), ghat, dy @ w_d)[1]
    gxb, gwgub = torch.autograd.grad(gub, (xb, wb_gu), dgu)
    hb = _act64(kind, *(ghat if recompute else gu).chunk(2, -1))
    gwdb = dy.reshape(-1, dy.shape[-1]).T @ hb.reshape(-1, hb.shape[-1])
    names = ("x.grad", "gate_up_proj.weight.grad", "down_proj.weight.grad")
    for what, a, r, b in zip(names, outs[1][1:], ref, (gxb, gwgub, gwdb)):
        assert_matches_reference(a, r, b, what=what)
    # (2): against the unquantized gradients
    unq = _mlp_grads64(kind, x, w_gu, w_d, dy, gu, gu)
    bounds = _gradient_bound(kind, x.double(), w_gu.double(), w_d.double(), dy.double(), gu.double(), ghat64, scale,
                             recompute)
    eps = torch.finfo(dtype).eps
    for what, a, r, b, u, bd in zip(names, outs[1][1:], ref, (gxb, gwgub, gwdb), unq, bounds):
        assert bool(((r - u).abs() <= bd * (1 + 1e-9)).all()), what  # the derivation itself, in float64
        rounding = 2 * relative_error(b, r) * r.norm().item() + eps * r.norm().item()  # the rule of (1), absolute
        err = (a.double() - u).norm().item()
        assert err <= bd.norm().item() + rounding, (what, err, bd.norm().item(), rounding)
    # the bound says something: gradients read from the FP8 data not divided by its scale (the broken path of
    # `test_the_checks_catch_a_broken_path`) are outside it
    broken = _mlp_grads64(kind, x, w_gu, w_d, dy, data.double() if recompute else gu, data.double())
    for what, a, u, bd in zip(names, broken, unq, bounds):
        if what != "down_proj.weight.grad" or recompute:
            assert not bool(((a - u).abs() <= bd).all()), what
    assert not torch.equal(outs[0][2], outs[1][2])  # gate/up weight's gradient: gu was rounded in backward


# ---- a whole training step ------------------------------------------------------------------------------------

class _ActAtRoundTrip(torch.autograd.Function):
    """act(gu) whose backward is act's at torchao's rowwise e4m3 round trip of gu, (data.float() / scale) rounded to
    gu's dtype: the math fp8_activations=True promises, composed of torch ops."""

    @staticmethod
    def forward(ctx, gu, act):
        ctx.save_for_backward(gu)
        ctx.act = act
        return act(gu)

    @staticmethod
    def backward(ctx, dh):
        gu, = ctx.saved_tensors
        data, scale = quantize_fp8_reference(gu, torch.float8_e4m3fn, "rowwise")
        g = (data.float() / scale).to(gu.dtype).requires_grad_()
        with torch.enable_grad():
            out = ctx.act(g)
        return torch.autograd.grad(out, g, dh)[0], None


def _reference_step(model, ids, monkeypatch):
    """_step of a patched model (fp8_activations=False, recompute=False) whose MLP activations back-propagate at the
    e4m3 round trip (`_ActAtRoundTrip`; SwiGLU computes its own amax there, the same bits)."""
    act = patch_layers.gated_act
    with monkeypatch.context() as mp:
        mp.setattr(patch_layers, "gated_act", lambda owner, gu: _ActAtRoundTrip.apply(gu, functools.partial(act, owner)))
        mp.setattr(patch_fp8, "PRODUCER_AMAX", False)
        return _step(model, ids)


@pytest.mark.parametrize("fp8", [None, "tensorwise"], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_step(family, dtype, fp8, monkeypatch):
    """The loss is bitwise the default's (the forward is unchanged) and finite; the gradients are finite and bitwise
    those of `_reference_step` (recompute=False; the quantization is the op's, bit-identical to torchao's recipe);
    with recompute=True (the default) every gradient but down_proj's weight is recompute=False's bitwise (dgu reads
    the same ĝu and down_proj's output gradient, not its input); down_proj's weight gradient then reads f(ĝu): the
    one-MLP test bounds it. The difference from the default is that of the e4m3 round trip, bounded per MLP there."""
    default, ref, on_norec, on = _models(family, dtype, fp8=fp8,
                                         variants=((False, True), (False, False), (True, False), (True, True)))
    ids = _ids()
    base = _step(default, ids)
    got_norec, got = _step(on_norec, ids), _step(on, ids)
    assert torch.isfinite(got[0]) and all(torch.isfinite(g).all() for g in got[1].values())
    assert torch.equal(got[0], base[0]) and torch.equal(got_norec[0], base[0])
    _assert_bitwise(got_norec, _reference_step(ref, ids, monkeypatch))
    _assert_bitwise(got, got_norec, skip=("down_proj",))
    assert not torch.equal(got[1]["model.layers.0.mlp.gate_up_proj.weight"],
                           base[1]["model.layers.0.mlp.gate_up_proj.weight"])
    for n, g in base[1].items():
        # close to the default: a sanity check, not the bound (the exact relation is the bitwise one above, and the
        # one-MLP test bounds it): within 4 · 2^-4, four times e4m3's relative rounding of each gate/up element
        assert relative_error(got[1][n].double(), g.double()) <= 4 * 2.0 ** -4, n


def test_one_dequantization_a_layer_and_recorded_option(monkeypatch):
    """down_proj's recipe hands the dequantized gu to the activation's backward: one dequantization per layer a
    step, recompute or not; the option is recorded on the patched MLPs and revert removes it."""
    calls = []
    real = patch_recompute.dequantize_fp8
    monkeypatch.setattr(patch_recompute, "dequantize_fp8", lambda *a: calls.append(1) or real(*a))
    for recompute in (True, False):
        on, = _models(recompute=recompute, variants=(True,))
        calls.clear()
        _step(on, _ids())
        assert len(calls) == COMMON["num_hidden_layers"], recompute
    mlp = on.model.layers[0].mlp
    assert mlp._opforge_fp8_activations is True
    torch.manual_seed(0)
    base = FAMILIES["llama"]()
    patch.revert(on)
    assert "_opforge_fp8_activations" not in mlp.__dict__ and not patch.is_patched(on)
    with torch.no_grad():
        assert torch.equal(on(input_ids=_ids()).logits, base(input_ids=_ids()).logits)
    patch.apply(on)
    assert mlp._opforge_fp8_activations is False
    patch.revert(on)
    report = patch.apply(on, fp8_activations=True)
    assert mlp._opforge_fp8_activations is True and report.ok
    assert any("fp8_activations: 2 patched MLP(s)" in n for n in report.notes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_self_check_judges_the_structure(dtype, monkeypatch):
    """The self-check runs before the option is switched on (as for fp8): a bf16 or float32 model is patched (the
    e4m3 rounding in backward does not make it revert), and a wrong activation is still caught."""
    torch.manual_seed(0)
    base = FAMILIES["llama"]().to(dtype)
    good = copy.deepcopy(base)
    assert patch.apply(good, fp8_activations=True, strict=True).ok
    act = patch_layers.gated_act
    monkeypatch.setattr(patch_layers, "gated_act", lambda owner, gu: act(owner, gu) * 1.5)
    bad = copy.deepcopy(base)
    with pytest.warns(UserWarning, match="left unpatched"):
        patch.apply(bad, fp8_activations=True)
    assert not patch.is_patched(bad)


# ---- where it is off ----------------------------------------------------------------------------------------------

def test_off_without_grad_and_under_inference_mode():
    off, on = _models()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(on(input_ids=ids).logits, off(input_ids=ids).logits)
    with torch.inference_mode():
        assert torch.equal(on(input_ids=ids).logits, off(input_ids=ids).logits)


def test_off_under_other_saved_tensor_hooks():
    """Under a user's hooks the pack sees the tensors of fp8_activations=False (gu among them), gradients bitwise."""
    seen, runs = {}, {}
    for name, model in zip(("off", "on"), _models()):
        sizes = []

        def pack(t):
            sizes.append((t.dtype, t.untyped_storage().nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            runs[name] = _step(model, _ids())
        seen[name] = sorted(sizes, key=str)
    assert seen["on"] == seen["off"] and not any(d == torch.float8_e4m3fn for d, _ in seen["on"])
    _assert_bitwise(runs["on"], runs["off"])


def test_off_under_non_reentrant_checkpointing():
    off, on = _models()
    for m in (off, on):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _assert_bitwise(_step(on, _ids()), _step(off, _ids()))


def test_off_inside_torch_func():
    outs = []
    for model in _models():
        layer = model.model.layers[0]
        x, pe = decoder_layer_inputs(model, torch.float32)
        outs.append(torch.func.grad(lambda t: layer(t, position_embeddings=pe, attention_mask=None).sum())(x.detach()))
    assert torch.equal(outs[0], outs[1])


# ---- the checks can fail ----------------------------------------------------------------------------------------

def test_the_checks_catch_a_broken_path(monkeypatch):
    """Two broken forms of the option, each caught by a check above: (a) a dequantization that forgets to divide by
    the scale hands backward gu · scale (≈ 448 / amax times too large): the gradients are no longer the reference
    step's, which `test_training_step` requires bitwise; (b) an Fp8Saved that also keeps gu (as a recipe built from
    gu.detach() would) keeps T·2I·e bytes more, so the drop `test_saved_bytes_per_layer_drop_by_the_formula` requires
    is not met."""
    default, ref, on = _models(variants=(False, False, True))
    ids = _ids()
    with monkeypatch.context() as mp:
        mp.setattr(patch_recompute, "dequantize_fp8", lambda data, scale, dtype: data.to(dtype))
        broken = _step(on, ids)
    expected = _reference_step(ref, ids, monkeypatch)
    assert not torch.equal(broken[1]["model.layers.0.mlp.gate_up_proj.weight"],
                           expected[1]["model.layers.0.mlp.gate_up_proj.weight"])

    class _KeepsGu(patch_recompute.Fp8Saved):
        __slots__ = ("gu",)

        def __init__(self, gu):
            super().__init__(gu)
            self.gu = gu.detach()

    live_off, _ = _layer_live_bytes(default, torch.float32)
    with monkeypatch.context() as mp:
        mp.setattr(patch_recompute, "Fp8Saved", _KeepsGu)
        live_broken, _ = _layer_live_bytes(on, torch.float32)
    assert live_off - live_broken != _formula(on, torch.float32)


def test_lora_on_gate_and_up(monkeypatch):
    """PEFT LoRA adapters on gate_proj / up_proj (get_peft_model, then apply): the activation's input is the sum
    [gate + Δgate | up + Δup], kept in FP8 as well; the adapters' gradients are bitwise those of the reference step
    (`_reference_step`), and each layer dequantizes once."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = FAMILIES["llama"]()
    models = []
    for on in (False, True):
        torch.manual_seed(1)
        m = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj"], init_lora_weights=False, lora_dropout=0.0))
        patch.apply(m, recompute=False, fp8_activations=on)
        models.append(m.train())
    ref, on = models
    calls = []
    real = patch_recompute.dequantize_fp8
    with monkeypatch.context() as mp:
        mp.setattr(patch_recompute, "dequantize_fp8", lambda *a: calls.append(1) or real(*a))
        got = _step(on, _ids())
    assert len(calls) == COMMON["num_hidden_layers"]
    expected = _reference_step(ref, _ids(), monkeypatch)
    assert torch.equal(got[0], expected[0])
    lora = [n for n, g in got[1].items() if "lora_" in n]
    assert lora and all(torch.isfinite(got[1][n]).all() and torch.equal(got[1][n], expected[1][n]) for n in lora)


# ---- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["false", "rowwise", 1, 0, None, [False], torch.tensor(True)], ids=repr)
def test_fp8_activations_must_be_a_bool(value):
    """A value that is not a bool is refused before anything changes: bool("false") and bool("rowwise") (a mix-up
    with fp8=) are True, and would turn on a lossy backward silently."""
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    with pytest.raises(TypeError, match=r"opforge\.patch\.apply: expected fp8_activations to be a bool"):
        patch.apply(model, fp8_activations=value)
    assert not patch.is_patched(model)
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())


def test_gate_up_without_gradient_keeps_no_full_precision_copy(monkeypatch):
    """gate/up frozen and an input without grad (adapters on down_proj alone; the layers before the first adapter):
    gu needs no gradient, the activation keeps nothing, but with recompute=True down_proj's recipe still stands
    for its input. It computes that input from the FP8 copy (the drop of the formula, as where gu needs a
    gradient), so down_proj's weight gradient is dyᵀ·act(ĝu) (bitwise, through the same GEMM), and no dequantized
    gu is left waiting for an activation's recipe that does not exist."""
    made = []

    class _Keeps(patch_recompute.Fp8Saved):
        def __init__(self, gu):
            super().__init__(gu)
            made.append(self)

    monkeypatch.setattr(patch_recompute, "Fp8Saved", _Keeps)
    live = {}
    for model in _models():
        for n, p in model.named_parameters():
            p.requires_grad_("down_proj" in n)
        layer = model.model.layers[0]
        x, pe = decoder_layer_inputs(model, torch.float32)
        x = x.detach()
        made.clear()
        with LiveStorages([*model.parameters(), x, *pe]) as mode:
            y = layer(x, position_embeddings=pe, attention_mask=None)
        live[model.model.layers[0].mlp._opforge_fp8_activations] = mode.live_bytes()
        y.backward(torch.ones_like(y), retain_graph=True)
    assert live[False] - live[True] == _formula(model, torch.float32)
    saved, = made
    assert saved._full is None  # nothing waits for a recipe that does not exist
    mlp = model.model.layers[0].mlp
    got = mlp.down_proj.weight.grad.clone()
    # the reference: down_proj's weight gradient at act(ĝu), ĝu the dequantized FP8 copy the forward made
    ghat = (saved.args[0].float() / saved.args[1]).to(torch.float32)
    h = patch_layers.gated_act(mlp, ghat)
    # down_proj's output gradient: the layer's output is r + down_proj(h) (no norm after the MLP in Llama): ones
    out = mlp.down_proj(h)
    ref, = torch.autograd.grad(out, mlp.down_proj.weight, torch.ones_like(out))
    assert torch.equal(got, ref)
