"""What a user does to a model with plain PyTorch works the same after opforge.patch.apply, although the q/k/v and
gate/up projections are one fused Parameter each and q_proj, ..., up_proj parameter-less slices of it: freezing a
slice (`q_proj.requires_grad_(False)`, `q_proj.weight.requires_grad = False`), `state_dict(keep_vars=True)`,
`torch.func.functional_call` and `torch.func.grad` with transformers' keys; an optimizer built before `apply`
(whose Parameters are no longer in the model) is refused at its first step instead of silently training nothing.
Tiny random Llama, float32, against the unpatched model.

Tolerances: the patched model computes the same math with other kernels, so values differ by float32 rounding
only (measured ≤ 1e-6 relative on losses, ≤ 1e-5 on gradients); the bounds are 1e-5 and 1e-4 relative (+ 1e-6
absolute on gradients and on weights after two SGD steps)."""
import copy
import warnings

import pytest
import torch

from opforge import patch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).float()


def _ids(seed=1):
    return torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(seed))


def _patched():
    ref = _llama()
    model = copy.deepcopy(ref)
    patch.apply(model)
    return ref, model


def _assert_same_grads(model, ref, ids):
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss_ref = ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    loss.backward()
    loss_ref.backward()
    grads, grads_ref = patch.gradients_by_name(model), patch.gradients_by_name(ref)
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def _assert_same_state(model, ref):
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref)
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def _freeze_module(m):
    m.model.layers[0].self_attn.q_proj.requires_grad_(False)
    m.model.layers[1].mlp.up_proj.requires_grad_(False)


def _freeze_weight(m):
    m.model.layers[0].self_attn.k_proj.weight.requires_grad = False
    m.model.layers[1].mlp.gate_proj.weight.requires_grad = False


def _freeze_all_then_unfreeze(m):
    m.requires_grad_(False)
    m.model.layers[0].self_attn.v_proj.requires_grad_(True)
    m.model.layers[1].mlp.down_proj.requires_grad_(True)


@pytest.mark.parametrize("freeze", [_freeze_module, _freeze_weight, _freeze_all_then_unfreeze])
def test_frozen_slice_trains_like_a_frozen_linear(freeze):
    # Was: requires_grad on q_proj (a slice of the fused weight) had no effect: the fused weight trained those rows.
    ref, model = _patched()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning on partly frozen fused weights (tested below)
        for m in (model, ref):
            freeze(m)
    _assert_same_grads(model, ref, _ids())
    # SGD (linear in the gradients: Adam's g / sqrt(g²) would magnify rounding of near-zero gradients) with
    # momentum and weight decay, which the frozen rows must not see
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9, weight_decay=0.1)
            for m in (model, ref)]
    for step in range(2):
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            ids = _ids(seed=2 + step)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
    _assert_same_state(model, ref)
    for name, p in ref.named_parameters():  # requires_grad read back through the slices
        got = model.get_parameter(name) if "proj" not in name or "o_proj" in name or "down_proj" in name \
            else model.get_submodule(name.rpartition(".")[0]).weight
        assert got.requires_grad == p.requires_grad, name


def test_partly_frozen_fused_weight_warns():
    _, model = _patched()
    with pytest.warns(UserWarning, match="frozen while others train"):
        model.model.layers[0].self_attn.q_proj.requires_grad_(False)
    assert model.model.layers[0].self_attn.qkv_proj.weight.requires_grad
    for n in ("q_proj", "k_proj", "v_proj"):  # all of them: the fused Parameter itself is frozen, no warning
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.model.layers[1].self_attn.get_submodule(n).requires_grad_(False)
    assert not model.model.layers[1].self_attn.qkv_proj.weight.requires_grad


def test_projection_frozen_before_apply_is_fused_and_stays_frozen():
    # Was: a layer whose q_proj was frozen apart from k/v was left unpatched ("differ in requires_grad").
    ref = _llama()
    ref.model.layers[0].self_attn.q_proj.requires_grad_(False)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = patch.apply(model, strict=True)
    assert not report.skipped
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    _assert_same_grads(model, ref, _ids())
    patch.revert(model)
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad
    assert model.model.layers[0].self_attn.k_proj.weight.requires_grad


def test_slice_gradient_is_the_fused_gradient_rows():
    ref, model = _patched()
    _assert_same_grads(model, ref, _ids())
    for n in ("q_proj", "k_proj", "v_proj"):
        g = model.model.layers[0].self_attn.get_submodule(n).weight.grad
        torch.testing.assert_close(g, ref.model.layers[0].self_attn.get_submodule(n).weight.grad, rtol=1e-4,
                                   atol=1e-6)


def test_optimizer_built_before_apply_is_refused():
    # Was: it kept the replaced q/k/v and gate/up Parameters and silently never trained them.
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    patch.apply(model)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(RuntimeError, match="no longer in the model.*q_proj.weight.*after apply"):
        opt.step()
    patch.revert(model)  # its Parameters are the model's again
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    after = torch.optim.SGD(model.parameters(), lr=1e-3)
    patch.apply(model)
    fresh = torch.optim.SGD(model.parameters(), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    fresh.step()
    with pytest.raises(RuntimeError, match="no longer in the model"):
        after.step()
    patch.revert(model)  # the fused Parameters leave the model: an optimizer over them is refused too
    with pytest.raises(RuntimeError, match="qkv_proj.weight"):
        fresh.step()


def test_state_dict_keep_vars_gives_the_rows_parameters():
    # Was: keep_vars=True gave copies of the fused rows: requires_grad_ and in-place edits on them did nothing.
    ref, model = _patched()
    sd, sd_ref = model.state_dict(keep_vars=True), ref.state_dict(keep_vars=True)
    assert list(sd) == list(sd_ref)
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    fused = model.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad
    assert q.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    for m, d in ((model, sd), (ref, sd_ref)):
        with torch.no_grad():
            d["model.layers.0.self_attn.q_proj.weight"].mul_(0.5)
        d["model.layers.1.mlp.up_proj.weight"].requires_grad_(False)
    _assert_same_grads(model, ref, _ids())
    _assert_same_state(model, ref)
    copy_sd = model.state_dict()  # keep_vars=False: contiguous copies (save_pretrained refuses shared storage)
    assert copy_sd["model.layers.0.self_attn.q_proj.weight"].untyped_storage().data_ptr() != \
        fused.untyped_storage().data_ptr()


@pytest.mark.parametrize("keys", ["state_dict", "named_parameters"])
def test_functional_call_with_the_models_keys(keys):
    # Was: functional_call with transformers' keys (q_proj.weight, ...) raised: the slices have no weight to set.
    ref, model = _patched()
    ids = _ids()
    if keys == "state_dict":
        params = {k: v.detach() * 1.01 for k, v in ref.state_dict().items()}
        params_model = params
    else:
        params_model = {k: v.detach() * 1.01 for k, v in model.named_parameters()}
        params = {k: v.detach() * 1.01 for k, v in ref.named_parameters()}
    out = torch.func.functional_call(model, params_model, (ids,), {"labels": ids})
    out_ref = torch.func.functional_call(ref, params, (ids,), {"labels": ids})
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=0)
    _assert_same_grads(model, ref, ids)  # the model's own weights are back

    def loss_of(m):
        return lambda p: torch.func.functional_call(m, p, (ids,), {"labels": ids}).loss

    if keys == "state_dict":
        grads, grads_ref = torch.func.grad(loss_of(model))(params), torch.func.grad(loss_of(ref))(params)
        assert grads.keys() == grads_ref.keys()
        for k in grads_ref:
            torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-4, atol=1e-6, msg=k)
    else:
        grads = torch.func.grad(loss_of(model))(params_model)
        grads_ref = torch.func.grad(loss_of(ref))(params)
        fused = grads["model.layers.0.self_attn.qkv_proj.weight"]
        split = torch.cat([grads_ref[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"], 0)
        torch.testing.assert_close(fused, split, rtol=1e-4, atol=1e-6)


def test_assigning_a_wrong_shape_to_a_slice_is_refused():
    _, model = _patched()
    with pytest.raises(ValueError, match="slice.*takes a tensor of shape"):
        model.model.layers[0].self_attn.q_proj.weight = torch.zeros(3, 3)


def test_frozen_rows_of_a_copied_model_stay_frozen():
    _, model = _patched()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.model.layers[0].self_attn.q_proj.requires_grad_(False)
    model = copy.deepcopy(model)
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight.detach().clone(), attn.k_proj.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert torch.equal(attn.q_proj.weight, q)  # weight decay would have scaled it by 0.95
    assert not torch.equal(attn.k_proj.weight, k)


def test_patched_forwards_keep_transformers_signatures():
    """Code reading a forward's parameter names sees transformers' (the HF Trainer keeps only the dataset columns
    the model's forward names: with `(*args, **kwargs)` it dropped input_ids and labels and refused the batch)."""
    import inspect

    ref, model = _patched()
    pairs = [(model, ref), (model.model.layers[0], ref.model.layers[0]),
             (model.model.layers[0].self_attn, ref.model.layers[0].self_attn),
             (model.model.layers[0].mlp, ref.model.layers[0].mlp)]
    for m, r in pairs:
        assert type(m) is not type(r)  # patched
        assert inspect.signature(m.forward) == inspect.signature(r.forward), type(r).__name__
    names = list(inspect.signature(model.forward).parameters)
    assert "input_ids" in names and "labels" in names
    ids = _ids()
    torch.testing.assert_close(model(ids, labels=ids).loss, ref(ids, labels=ids).loss, rtol=1e-5, atol=0)


def test_freezing_a_slice_of_a_compiled_model_recompiles():
    """A slice frozen after the first compiled call: Dynamo guards on the rows' flags, so the next call recompiles
    and reads those rows detached (zero gradient, as eager)."""
    ref, model = _patched()
    compiled = torch.compile(model, backend="eager")  # the guards are Dynamo's: no Inductor needed
    ids = _ids()
    compiled(input_ids=ids, labels=ids).loss.backward()
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.model.layers[0].self_attn.q_proj.requires_grad_(False)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss_ref = ref(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    loss.backward()
    loss_ref.backward()
    fused = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.count_nonzero(fused.grad[:64]) == 0
    grads, grads_ref = patch.gradients_by_name(model), patch.gradients_by_name(ref)
    assert grads.keys() == grads_ref.keys()
    for k in grads_ref:
        torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-4, atol=1e-6, msg=k)


def test_frozen_rows_are_forgotten_with_their_model():
    """The optimizer hooks' record of partly frozen fused Parameters goes with the model (no per-step look-ups left
    behind for other optimizers)."""
    import gc

    from opforge.patch import _fused

    _, model = _patched()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.model.layers[0].self_attn.q_proj.requires_grad_(False)
    key = id(model.model.layers[0].self_attn.qkv_proj.weight)
    assert key in _fused._PARTIAL
    del model
    gc.collect()
    assert key not in _fused._PARTIAL


def test_weight_flag_set_before_a_compiled_model_runs_freezes_the_rows():
    """`k_proj.weight.requires_grad = False`, then only compiled forwards (no eager one syncs the slices): the rows
    are read detached under compile and kept through SGD with momentum and weight decay, as the frozen Linear."""
    ref, model = _patched()
    for m in (model, ref):
        m.model.layers[0].self_attn.k_proj.weight.requires_grad = False
    compiled = torch.compile(model, backend="eager")
    runs = []
    for m, fwd in ((ref, ref), (model, compiled)):
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5, momentum=0.9,
                              weight_decay=0.1)
        for seed in (1, 2):
            opt.zero_grad()
            ids = _ids(seed)
            fwd(input_ids=ids, labels=ids).loss.backward()
            runs.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9))  # the gradient norm clipping reads
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
    torch.testing.assert_close(runs[2:], runs[:2], rtol=1e-4, atol=0)
    _assert_same_state(model, ref)
