"""opforge.patch.apply(recompute=True): selective activation recomputation in the patched decoder layers. Tiny random
transformers configs, nothing downloaded.

What is checked: the gradients and the loss equal recompute=False's bitwise (the recomputed tensors are bitwise the
forward's: same op and arguments, or for the post-attention norm the kernels' own last step from the saved rstd, so
every backward sees the same values); the bytes kept alive for backward by one decoder layer drop by exactly the
formula of apply's docstring; the recipe is off under activation checkpointing, other saved-tensor hooks,
torch.compile, torch.func and no-grad inference; an in-place change of a tensor a recipe reads raises. On CUDA (run
on the GPU machine): the recomputation of the post-attention norm is bitwise the fused kernel's output for every
kernel variant, and the peak memory of a training step is lower by about the formula, with gradients that meet the
float64-reference tolerance rule (CUDA's attention backward is not bitwise reproducible, so no bitwise claim there).
"""
import copy

import pytest
import torch

from opforge import patch
from opforge.patch import _fp8 as patch_fp8
from opforge.testing import assert_matches_reference

from conformance import decoder_layer_inputs, decoder_layer_live_bytes

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=64)
FAMILIES = {
    "llama": lambda **kw: transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **kw})),
    "qwen2": lambda **kw: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**COMMON, **kw})),  # biases
    "qwen3": lambda **kw: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**COMMON, "head_dim": 32, **kw})),
}
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.usefixtures("one_thread")


def _pair(family="llama", dtype=torch.float32, device="cpu", fp8=None, **cfg):
    """(recompute=False, recompute=True) patched copies of one random model (FP8 projections with `fp8`), in train
    mode."""
    torch.manual_seed(0)
    base = FAMILIES[family](**cfg).to(device=device, dtype=dtype)
    off, on = copy.deepcopy(base), copy.deepcopy(base)
    patch.apply(off, recompute=False, fp8=fp8)
    patch.apply(on, fp8=fp8)  # recompute: the default
    return off.train(), on.train()


def _ids(batch=2, seq=11, vocab=128, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_bitwise(a, b):
    (loss_a, g_a), (loss_b, g_b) = a, b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert g_a.keys() == g_b.keys()
    for n in g_a:
        assert g_a[n] is not None and torch.equal(g_a[n], g_b[n]), n


def _pending_left(model):
    return [n for n, m in model.named_modules() if "_opforge_pending" in m.__dict__]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_bitwise_equal(family, dtype):
    off, on = _pair(family, dtype)
    assert all(m.__dict__.get("_opforge_recompute") for m in on.modules() if "_opforge_sizes" in m.__dict__)
    ids = _ids()
    _assert_bitwise(_step(on, ids), _step(off, ids))
    assert not _pending_left(on)
    # a second step (the recipes do not outlive their graph; nothing is stale)
    _assert_bitwise(_step(on, _ids(seed=2)), _step(off, _ids(seed=2)))


@pytest.mark.parametrize("dtype, fp8", [(torch.float32, None), (torch.bfloat16, None),
                                        (torch.bfloat16, "tensorwise"), (torch.bfloat16, "rowwise")], ids=str)
def test_saved_bytes_per_layer_drop_by_the_formula(dtype, fp8):
    """The bytes one layer keeps for backward drop by the formula; output and gradients bit-identical. With FP8
    projections, what the GEMMs would keep of the two norm outputs and swiglu's output: tensorwise their FP8
    q(inputᵀ) (the GEMM saves the input under the recipe hooks and quantizes inputᵀ again in backward), rowwise the
    inputs themselves; and tensorwise, o_proj's q(inputᵀ) and its scale (o_proj saves the attention's output,
    which the attention keeps for its own backward). Where the norms and SwiGLU hand their amax to the GEMMs, the
    GEMMs keep that float32 instead of q(inputᵀ)'s scale."""
    off, on = _pair("llama", dtype, fp8=fp8)
    live_off, y_off, gx_off, g_off = decoder_layer_live_bytes(off, dtype)
    live_on, y_on, gx_on, g_on = decoder_layer_live_bytes(on, dtype)
    cfg, T, e = on.config, 2 * 16, torch.finfo(dtype).bits // 8
    D, I = cfg.hidden_size, cfg.intermediate_size
    hd = D // cfg.num_attention_heads
    Dq, Dkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    # bytes per element the GEMMs keep of the two norm outputs and swiglu's output without recompute, and their
    # scales (FP8 tensorwise: one float32 each); and the fused q/k/v output less the copy of v
    kept, scales = (1, 3 * 4) if fp8 == "tensorwise" else (e, 0)
    if fp8 == "tensorwise" and patch_fp8.amax_on(on.model.layers[0].mlp):
        scales -= 3 * 4  # the three GEMMs keep instead the amax their producers handed them (float32 each)
    o_proj = T * Dq + 4 if fp8 == "tensorwise" else 0
    assert live_off - live_on == T * ((2 * D + I) * kept + (Dq + Dkv) * e) + scales + o_proj, (live_off, live_on)
    assert torch.equal(y_on, y_off) and torch.equal(gx_on, gx_off)
    assert all(torch.equal(g_on[n], g_off[n]) for n in g_off)
    if fp8 is not None:
        ids = _ids()
        _assert_bitwise(_step(on, ids), _step(off, ids))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(reentrant):
    off, on = _pair()
    on.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = _ids()
    # checkpointed recompute=True against the plain recompute=False model (no checkpointing): same values
    _assert_bitwise(_step(on, ids), _step(off, ids))
    assert not _pending_left(on)


def test_other_saved_tensor_hooks_see_every_tensor():
    """Under a user's saved-tensor hooks the recipes are off: the user's pack sees the same tensors as with
    recompute=False."""
    counts = {}
    for name, model in zip(("off", "on"), _pair()):
        seen = []

        def pack(t):
            seen.append(t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=_ids(), labels=_ids(), use_cache=False).loss
        loss.backward()
        counts[name] = sorted(seen)
    assert counts["on"] == counts["off"] and counts["off"]


def test_inplace_change_of_a_recipe_input_raises():
    _, on = _pair()
    layer = on.model.layers[0]
    x, pe = decoder_layer_inputs(on, torch.float32)
    h = x * 1  # a non-leaf layer input, changed in place after the forward
    y = layer(h, position_embeddings=pe, attention_mask=None)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: opforge.patch recomputes input_layernorm's output"):
        y.sum().backward()


class _InplaceAfterSave(torch.nn.Module):
    """Stands in for down_proj: saves its input for backward (through the linear), then changes it in place."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, h):
        y = torch.nn.functional.linear(h, self.lin.weight)
        with torch.no_grad():
            h.mul_(2)
        return y


def test_inplace_change_of_the_dropped_tensor_after_saving_raises():
    """As autograd raises for a saved tensor changed in place, so does a recipe whose tensor was changed after the
    GEMM saved it (the recipe would give the value before the change)."""
    for model in _pair():
        mlp = model.model.layers[0].mlp
        mlp.down_proj = _InplaceAfterSave(mlp.down_proj)
        loss = model(input_ids=_ids(), labels=_ids(), use_cache=False).loss
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_double_backward_equal():
    """create_graph=True through a patched MLP (swiglu's output recomputed): the recomputed tensor is attached to
    the forward's graph, so a gradient of a gradient is recompute=False's. (The norms have no double backward.)"""
    outs = []
    for model in _pair():
        mlp = model.model.layers[0].mlp
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
        params = [mlp.gate_up_proj.weight, mlp.down_proj.weight]
        grads = torch.autograd.grad(mlp(x).square().sum(), [x, *params], create_graph=True)
        outs.append(torch.autograd.grad(sum((g * g).sum() for g in grads), [x, *params]))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_no_grad_inference_and_generate_unaffected():
    off, on = _pair()
    off.eval(), on.eval()
    ids = _ids()
    with torch.no_grad():
        a = on(input_ids=ids).logits
        b = off(input_ids=ids).logits
    assert torch.equal(a, b) and not _pending_left(on)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(on.generate(ids[:1, :5], **kw), off.generate(ids[:1, :5], **kw))
    # eval mode with grad enabled (autograd records): recompute on, same values
    _assert_bitwise(_step(on, ids), _step(off, ids))


def test_torch_func_falls_back():
    """torch.func.grad refuses saved-tensor hooks; inside it the layer takes the plain path."""
    off, on = _pair()
    outs = []
    for model in (off, on):
        layer = model.model.layers[0]
        x, pe = decoder_layer_inputs(model, torch.float32)
        outs.append(torch.func.grad(lambda t: layer(t, position_embeddings=pe, attention_mask=None).sum())(x.detach()))
    assert torch.equal(outs[0], outs[1])


def test_revert_and_reapply_keep_the_choice():
    _, on = _pair()
    layer = on.model.layers[0]
    assert layer._opforge_recompute and layer.mlp._opforge_recompute and layer.self_attn._opforge_recompute
    patch.revert(on)
    assert "_opforge_recompute" not in layer.__dict__ and "_opforge_recompute" not in layer.mlp.__dict__
    patch.apply(on, recompute=False)
    assert not layer._opforge_recompute and not layer.mlp._opforge_recompute


def test_compile_decoder_layer_fullgraph():
    """torch.compile(fullgraph=True) of recompute=True layers: Dynamo traces the plain path (no graph break)."""
    import torch._dynamo

    off, on = _pair()
    torch._dynamo.reset()
    for layer in on.model.layers:
        layer.compile(fullgraph=True, backend="aot_eager")
    ids = _ids()
    loss_on, g_on = _step(on, ids)
    loss_off, g_off = _step(off, ids)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=0)
    for n in g_off:
        torch.testing.assert_close(g_on[n], g_off[n], rtol=1e-4, atol=1e-6, msg=n)
    torch._dynamo.reset()


# ---- CUDA (the GPU machine) --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(7, 64), (8, 4096), (300, 2048), (4096, 2048), (64, 16384), (5, 33)], ids=str)
def test_norm_from_rstd_is_the_fused_kernels_output(device, dtype, shape):
    """The post-attention norm's recipe (residual · rstd · weight) is bitwise fused_add_rms_norm's output, for the
    shapes that pick each kernel variant (few rows, many rows, long rows, odd widths)."""
    M, N = shape
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(M, N, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(device=device, dtype=dtype)
    y, z, rstd = torch.ops.opforge._fused_add_rms_norm_forward.default(x, r, [N], w, 1e-6)
    assert torch.equal(patch._norm_from_rstd(z, rstd, w), y)
    # and the plain forward's, with and without a weight, through a 3-D input (two normalized dims)
    y2, rstd2 = torch.ops.opforge._rms_norm_forward.default(x, [N], w, 1e-6)
    assert torch.equal(torch.ops.opforge._rms_norm_apply(x, rstd2, w), y2)
    y3, rstd3 = torch.ops.opforge._rms_norm_forward.default(x, [N], None, 1e-6)
    assert torch.equal(torch.ops.opforge._rms_norm_apply(x, rstd3), y3)
    if N % 2 == 0:
        x4 = x.reshape(M, 2, N // 2)
        y4, rstd4 = torch.ops.opforge._rms_norm_forward.default(x4, [2, N // 2], w.reshape(2, N // 2), 1e-6)
        assert torch.equal(torch.ops.opforge._rms_norm_apply(x4, rstd4, w.reshape(2, N // 2)), y4)
    # an input at an odd storage offset (contiguous but not 16-byte aligned: the CUDA kernel's scalar path)
    xo = torch.empty(M * N + 1, device=device, dtype=dtype)[1:].view(M, N).copy_(x)
    assert torch.equal(torch.ops.opforge._rms_norm_apply(xo, rstd2, w), y2)


def test_rms_norm_apply_checks_and_meta(device):
    """_rms_norm_apply's argument errors name it; its Meta kernel gives input's shape and dtype; opcheck passes."""
    x = torch.randn(4, 6, device=device)
    rstd = torch.rand(4, device=device) + 0.5
    w = torch.randn(6, device=device)
    with pytest.raises(ValueError, match="opforge::_rms_norm_apply: expected rstd of input's leading dims"):
        torch.ops.opforge._rms_norm_apply(x, rstd[:3], w)
    with pytest.raises(ValueError, match="opforge::_rms_norm_apply: expected weight of shape"):
        torch.ops.opforge._rms_norm_apply(x, rstd, w[:5])
    with pytest.raises(TypeError, match="opforge::_rms_norm_apply: expected rstd of dtype"):
        torch.ops.opforge._rms_norm_apply(x, rstd.double(), w)
    m = torch.ops.opforge._rms_norm_apply(x.to("meta"), rstd.to("meta"), w.to("meta"))
    assert m.shape == x.shape and m.dtype == x.dtype
    torch.library.opcheck(torch.ops.opforge._rms_norm_apply.default, (x, rstd, w))
    ref = (x.double() * rstd.double()[:, None] * w.double()).float()
    torch.testing.assert_close(torch.ops.opforge._rms_norm_apply(x, rstd, w), ref, rtol=2e-7, atol=1e-6)


def _cuda_step(model, ids):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = _step(model, ids)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_peak_memory_lower_and_gradients_within_the_rule():
    cfg = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024)
    B, S = 4, 512
    ids = _ids(batch=B, seq=S, vocab=512, device="cuda")
    off, on = _pair("llama", torch.bfloat16, "cuda", **cfg)
    _step(off, ids), _step(on, ids)  # warm-up: workspaces, lazy init
    (loss_off, g_off), peak_off = _cuda_step(off, ids)
    (loss_on, g_on), peak_on = _cuda_step(on, ids)
    hd = 256 // 4
    per_layer = B * S * (2 * 256 + 1024 + 4 * hd + 2 * hd) * 2
    print(f"peak: recompute=False {peak_off / 2**20:.1f} MiB, recompute=True {peak_on / 2**20:.1f} MiB, "
          f"formula {2 * per_layer / 2**20:.1f} MiB")
    assert peak_off - peak_on >= 0.5 * 2 * per_layer, (peak_off, peak_on, per_layer)
    # accuracy: recompute=True is within the tolerance rule of recompute=False against a float64 run
    ref = _pair("llama", torch.float64, "cuda", **cfg)[0]
    loss_ref, g_ref = _step(ref, ids)
    assert_matches_reference(loss_on.float(), loss_ref, loss_off.float(), what="loss")
    for n in g_ref:
        assert_matches_reference(g_on[n], g_ref[n], g_off[n], what=n)


# ---- from the break-it pass (2026-12-01): in-place changes, hooks, compiled autograd -----------------------

@pytest.mark.parametrize("which", ["mlp.gate_up_proj", "self_attn.qkv_proj"])
def test_weight_changed_in_place_before_backward_raises(which):
    """The saved-tensor hooks bypass autograd's version check of what the GEMM keeps: the patch checks it itself,
    so a weight changed in place between forward and backward raises as with recompute=False (not a wrong gradient)."""
    for model in _pair():
        loss = model(input_ids=_ids(), labels=_ids(), use_cache=False).loss
        w = model.model.layers[0].get_submodule(which).weight
        with torch.no_grad():
            w.mul_(3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("where", ["mlp", "self_attn"])
def test_pre_hook_changing_the_norm_output_in_place(where):
    """A forward pre-hook that changes a norm's output in place before its GEMM: the recipe (which would give the
    value before the change) is not used, and the gradients are recompute=False's, bitwise."""
    off, on = _pair()

    def double(m, args, kwargs=None):
        (args[0] if args else kwargs["hidden_states"]).mul_(2.0)

    for model in (off, on):
        model.model.layers[0].get_submodule(where).register_forward_pre_hook(double, with_kwargs=True)
    _assert_bitwise(_step(on, _ids()), _step(off, _ids()))


@pytest.mark.parametrize("sub", ["input_layernorm", "post_attention_layernorm", "mlp.act_fn"])
def test_hooks_on_norms_or_act_fn_leave_the_layer_unpatched(sub):
    """The patched layer computes its norms and SwiGLU without calling those modules, so a layer whose norm or act_fn
    has a hook is left as it is (with the reason in the report), and the hook keeps firing."""
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    calls = []
    model.model.layers[0].get_submodule(sub).register_forward_hook(lambda m, a, o: calls.append(1))
    report = patch.apply(model)
    assert any("hooks" in why for _, _, why in report.skipped), report
    model(input_ids=_ids(), use_cache=False)
    assert calls


def test_compiled_autograd_fullgraph_over_an_eager_forward():
    """Compiled autograd (fullgraph) over the eager forward of a recompute=True model: the recipes' version checks are
    not traced; gradients equal the eager backward's within float32 rounding."""
    from torch._dynamo import compiled_autograd

    off, on = _pair(num_hidden_layers=1)
    ref = _step(on, _ids())
    on.zero_grad(set_to_none=True)
    loss = on(input_ids=_ids(), labels=_ids(), use_cache=False).loss
    torch._dynamo.reset()
    try:
        with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
            loss.backward()
    finally:
        torch._dynamo.reset()
    for n, p in on.named_parameters():
        torch.testing.assert_close(p.grad, ref[1][n], rtol=1e-5, atol=1e-6, msg=n)


def test_rms_norm_apply_refuses_to_be_differentiated():
    x = torch.randn(3, 8, requires_grad=True)
    y, rstd = torch.ops.opforge._rms_norm_forward(x.detach(), [8], None, 1e-6)
    out = torch.ops.opforge._rms_norm_apply(x, rstd)
    assert torch.equal(out, y)
    with pytest.raises(RuntimeError, match="opforge::_rms_norm_apply: this private op is not differentiable"):
        out.sum().backward()
