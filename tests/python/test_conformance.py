"""The conformance suite: every entry of conformance.ENTRIES (one per public op) and the backward and private
ops its gradient calls, through the same checks (tolerances: opforge.testing).

Op-specific cases (bug reports, big tensors, CUDA graphs, mixed dtypes, activations) stay in test_<op>.py.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import opforge  # noqa: F401
from conformance import (ENTRIES, as_tuple, differentiable, mask_variants, on_meta, on_meta_kwargs, prepare,
                         recorded_calls, run_forward_backward)
from opforge.testing import assert_matches_reference

BACKWARD_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
DTYPE_IDS = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
# (entry, case, device) for each device where the case is an error (Bad.devices)
BAD_CASES = [pytest.param(e, b.name, d, id=f"{d}-{e.name}-{b.name}", marks=[_NO_CUDA] if d == "cuda" else [])
             for e in ENTRIES for b in e.bad_inputs("cpu") for d in b.devices]


def entry_params(test: str) -> list:
    """ENTRIES as parameters of `test`, an entry's known failure of it (OpEntry.known_failures) a strict xfail."""
    return [pytest.param(e, id=e.name, marks=[pytest.mark.xfail(strict=True, reason=e.known_failures[test])]
                         if test in e.known_failures else []) for e in ENTRIES]


def _float32(args):
    return tuple(a.float() if differentiable(a) else a for a in args)


def _float32_kwargs(kwargs):
    return {k: (v.float() if differentiable(v) else v) for k, v in kwargs.items()}


def _bind(fn, kwargs):
    """fn with a sample's by-name arguments (Sample.kwargs, never differentiated) bound."""
    return functools.partial(fn, **kwargs) if kwargs else fn


def _close(a, b, what, **kw):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one is None"
        return
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **kw)


# ---- forward and gradients against float64 ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("entry", entry_params("test_forward_and_gradients_match_float64"))
def test_forward_and_gradients_match_float64(device, entry, dtype):
    if dtype not in entry.dtypes:
        pytest.skip(f"{entry.name} does not support {dtype}")
    check = entry.check or (lambda what, o, r, b, args, gouts, **kw: assert_matches_reference(o, r, b, what=what))
    for s in entry.samples(device, dtype):
        ours, ours_g, gouts = run_forward_backward(_bind(entry.op, s.kwargs), s.args, strided=s.grad_strided)
        ref, ref_g, _ = run_forward_backward(_bind(entry.ref(dtype), s.kwargs), s.args, gouts, cast=lambda t: t.double())
        base, base_g, _ = run_forward_backward(_bind(entry.baseline, s.kwargs), s.args, gouts)
        assert len(ours) == len(ref) == len(base), s.name
        for i, (o, r, b) in enumerate(zip(ours, ref, base)):
            assert o.shape == b.shape and o.dtype == b.dtype and o.device == b.device, \
                f"{s.name}: output {i}: {o.shape} {o.dtype} vs torch's {b.shape} {b.dtype}"
            check(f"output {i}", o, r, b, s.args, gouts, **s.kwargs)
        diff = [a for a in s.args if differentiable(a)]
        for j, (a, g, r, b) in enumerate(zip(diff, ours_g, ref_g, base_g)):
            z = torch.zeros_like(a)
            g, r, b = (g if g is not None else z), (r if r is not None else z.double()), (b if b is not None else z)
            assert g.shape == a.shape and g.dtype == a.dtype, f"{s.name}: grad {j}: {g.shape} {g.dtype}, arg {a.shape} {a.dtype}"
            try:
                check(f"grad {j}", g, r, b, s.args, gouts, **s.kwargs)
            except AssertionError as e:
                raise AssertionError(f"sample {s.name}: {e}") from None


# ---- opcheck: the public op, its private forward and backward ops ----------------------------------------------


@pytest.mark.parametrize("entry", entry_params("test_opcheck"))
def test_opcheck(device, entry):
    public = getattr(torch.ops.opforge, entry.name).default
    for s in entry.small_samples(device):
        args, _ = prepare(_float32(s.args))
        # schema_args: the sample's positional args in the schema's form (linear_cat's pieces as one Tensor[])
        opcheck(public, entry.schema_args(args) if entry.schema_args else args, _float32_kwargs(s.kwargs))
    for name, calls in recorded_calls(entry, device).items():
        if name == f"opforge::{entry.name}":
            continue
        for func, args, kwargs in calls[:2]:
            if name.endswith("_backward"):  # not differentiable (lazy error): schema, fake tensor, AOT dispatch
                # (not test_schema where an argument is FP8: torch's schema check compares each argument before and
                # after the call with allclose, which has no float8 kernel)
                fp8_arg = any(isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                              for a in args)
                utils = tuple(u for u in BACKWARD_UTILS if not (fp8_arg and u == "test_schema"))
                for variant in mask_variants(args):
                    opcheck(func, variant, kwargs, test_utils=utils)
            elif name.split("::")[1] in entry.gradient_ops:  # computes gradients: every mask, on detached args
                for variant in mask_variants(args):
                    opcheck(func, variant, kwargs)
            else:  # a private forward op: differentiable like the public one
                opcheck(func, prepare(args)[0], kwargs)


# ---- Meta against the real kernels -----------------------------------------------------------------------------


def _flat(outs) -> tuple:
    """outputs with a Tensor[] output (linear_cat_backward's grad_inputs) spread out."""
    return tuple(t for o in as_tuple(outs) for t in (o if isinstance(o, (list, tuple)) else (o,)))


def _meta_matches(func, args, kwargs, what):
    real = _flat(func(*args, **kwargs))
    meta = _flat(func(*on_meta(args), **on_meta_kwargs(kwargs)))
    assert len(real) == len(meta), what
    for i, (r, m) in enumerate(zip(real, meta)):
        if r is None or m is None:
            assert r is None and m is None, f"{what}: output {i}: {r} vs meta {m}"
            continue
        assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride()), \
            f"{what}: output {i}: meta {m.shape} {m.dtype} {m.stride()} vs real {r.shape} {r.dtype} {r.stride()}"


@pytest.mark.parametrize("entry", entry_params("test_meta_matches_real"))
def test_meta_matches_real(device, entry):
    for dtype in (torch.float32, torch.bfloat16):
        for s in entry.samples(device, dtype):
            with torch.no_grad():
                _meta_matches(entry.op, s.args, s.kwargs, f"{entry.name} {s.name} {dtype}")
    for name, calls in recorded_calls(entry, device).items():
        for func, args, kwargs in calls[:2]:
            for variant in mask_variants(args):
                with torch.no_grad():
                    _meta_matches(func, variant, kwargs, f"{name} {variant}")


# ---- bad inputs: each raises its own message and leaves the inputs unchanged -----------------------------------


@pytest.mark.parametrize("entry,case,device", BAD_CASES)
def test_bad_input(entry, case, device):
    (bad,) = [b for b in entry.bad_inputs(device) if b.name == case]
    fn, args = bad.make(device)
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type != "meta" else None for a in args]
    with pytest.raises(bad.exc, match=bad.match):
        fn(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if b is not None:
            assert torch.equal(a, b), f"{entry.name} {case}: argument {i} changed"


@pytest.mark.parametrize("entry", entry_params("test_bad_input_table_is_complete"))
def test_bad_input_table_is_complete(entry):
    cases = entry.bad_inputs("cpu")
    assert len(cases) >= 10, f"{entry.name}: {len(cases)} bad inputs in conformance.py, at least 10 wanted"
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"{entry.name}: duplicate bad-input names"
    assert len({c.match for c in cases}) >= len(cases) - 2, f"{entry.name}: bad inputs should raise distinct messages"


# ---- gradcheck, and gradgradcheck or the lazy double-backward error ---------------------------------------------


def _diff_fn(fn, args, only=None):
    """(g, diff): g(*diff) calls fn with the floating args of `args` (those of index in `only`, if given) replaced
    by diff."""
    pos = [i for i, a in enumerate(args) if differentiable(a) and (only is None or i in only)]

    def g(*diff):
        a = list(args)
        for i, d in zip(pos, diff):
            a[i] = d
        return fn(*a)
    return g, [args[i].detach().requires_grad_() for i in pos]


def _assert_no_history(entry, device):
    """An op documented as not differentiable (OpEntry.differentiable=False): its outputs carry no autograd history
    even when its floating inputs require grad."""
    for s in entry.small_samples(device):
        args, _ = prepare(s.args)
        for i, o in enumerate(as_tuple(_bind(entry.op, s.kwargs)(*args))):
            assert not o.requires_grad and o.grad_fn is None, f"{entry.name} {s.name}: output {i} has a history"


@pytest.mark.parametrize("entry", entry_params("test_gradcheck_and_double_backward"))
def test_gradcheck_and_double_backward(device, entry):
    if not entry.differentiable:
        return _assert_no_history(entry, device)
    checked = 0
    for s in entry.small_samples(device):
        op = _bind(entry.op, s.kwargs)
        # gradcheck_args: the args whose gradient is the derivative (a straight-through estimator's is not)
        gc, gc_diff = _diff_fn(op, s.args, entry.gradcheck_args)
        if gc_diff:
            assert torch.autograd.gradcheck(gc, gc_diff), s.name
            checked += 1
        g, diff = _diff_fn(op, s.args)
        if entry.double_backward:
            assert torch.autograd.gradgradcheck(g, diff), s.name
            continue
        outs = [o for o in as_tuple(g(*diff)) if o.requires_grad]
        gouts = [torch.randn_like(o) for o in outs]
        # first order under create_graph=True works (torch.func always asks for it) and is the plain gradient
        first = torch.autograd.grad(outs, diff, gouts, create_graph=True, allow_unused=True)
        plain = torch.autograd.grad([o for o in as_tuple(g(*diff)) if o.requires_grad], diff, gouts, allow_unused=True)
        for a, b in zip(first, plain):
            _close(a, b, f"{entry.name} {s.name}: create_graph gradient")
        # differentiating it again raises, naming the backward op
        bw = entry.double_backward_error or f"{entry.name}_backward"
        with pytest.raises(RuntimeError, match=rf"opforge::{bw}: double backward is not supported"):
            torch.autograd.grad(sum(x.sum() for x in first if x is not None), diff, allow_unused=True)
    # an entry whose every gradient is a straight-through estimator says so with gradcheck_args=(): its gradients
    # are then checked exactly against the reference's estimator in test_forward_and_gradients_match_float64
    assert checked or entry.gradcheck_args == (), f"{entry.name}: no sample had an argument to gradcheck"


# ---- torch.compile(fullgraph=True), static and dynamic ----------------------------------------------------------


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("entry", entry_params("test_compile_matches_eager"))
def test_compile_matches_eager(device, entry, dynamic):
    torch._dynamo.reset()

    def fn(*args, **kwargs):
        return entry.op(*args, **kwargs)

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    # dynamic: a second shape through the same graph; static: one (a second would only recompile)
    for s in entry.small_samples(device)[:2 if dynamic else 1]:
        args, kwargs = _float32(s.args), _float32_kwargs(s.kwargs)
        eager, eg, gouts = run_forward_backward(_bind(fn, kwargs), args)
        comp, cg, _ = run_forward_backward(_bind(compiled, kwargs), args, gouts)
        for a, b in zip(comp, eager):
            _close(a, b, f"{entry.name} {s.name}: output")
        for a, b in zip(cg, eg):
            _close(a, b, f"{entry.name} {s.name}: gradient")


# ---- compiled autograd: a backward compiled over a graph whose forward ran eagerly -----------------------------


@pytest.mark.parametrize("entry", entry_params("test_compiled_autograd"))
def test_compiled_autograd(device, entry):
    from torch._dynamo import compiled_autograd

    if not entry.differentiable:
        return _assert_no_history(entry, device)
    torch._dynamo.reset()
    for s in entry.small_samples(device)[:2]:
        op = _bind(entry.op, _float32_kwargs(s.kwargs))
        eager, eg, gouts = run_forward_backward(op, _float32(s.args))
        args, diff = prepare(_float32(s.args))
        outs = [o for o in as_tuple(op(*args)) if o.requires_grad]
        with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
            torch.autograd.backward(outs, gouts)
        for d, e in zip(diff, eg):
            _close(d.grad, e, f"{entry.name} {s.name}: compiled-autograd gradient")


# ---- torch.func: grad, vmap(grad), jacrev against torch's own composition ---------------------------------------


def _scalar_loss(fn, weights):
    """sum of the floating outputs weighted by `weights` (an op's mask or integer outputs carry no gradient)."""
    def loss(*args):
        return sum((o * w).sum() for o, w in zip([o for o in as_tuple(fn(*args)) if o.is_floating_point()], weights))
    return loss


@pytest.mark.parametrize("entry", entry_params("test_torch_func"))
def test_torch_func(device, entry):
    import torch.func as tf

    s = entry.small_samples(device)[0]
    # vmap_sample: where a per-sample slice of small_samples()[0] is no valid input (a 4-D-only op, an index)
    vs = entry.vmap_sample(device) if entry.vmap_sample else s
    if not entry.differentiable:  # no gradient to transform: vmap of the forward against torch's composition
        outs = [tf.vmap(_bind(impl, vs.kwargs), in_dims=entry.vmap_in_dims)(*vs.args)
                for impl in (entry.op, entry.baseline)]
        for i, (a, b) in enumerate(zip(as_tuple(outs[0]), as_tuple(outs[1]))):
            _close(a, b, f"{entry.name}: torch.func.vmap, output {i}")
        return
    outs = [o for o in as_tuple(_bind(entry.baseline, s.kwargs)(*s.args)) if o.is_floating_point()]
    weights = [torch.randn_like(o) for o in outs]
    for impl_name, which in (("grad", "grad"), ("jacrev", "jacrev"), ("vmap(grad)", "vmap")):
        smp = vs if which == "vmap" else s
        args = smp.args
        pos = tuple(i for i, a in enumerate(args) if differentiable(a))
        results = []
        for impl in (_bind(entry.op, smp.kwargs), _bind(entry.baseline, smp.kwargs)):
            loss = _scalar_loss(impl, weights)
            if which == "grad":
                results.append(tf.grad(loss, argnums=pos)(*args))
            elif which == "vmap":
                # per-sample gradients: the args of vmap_in_dims 0 are batched along their first dim
                def per_sample(*a, impl=impl):
                    a = list(a)
                    return tf.grad(lambda *b: sum(o.sum() for o in as_tuple(impl(*b)) if o.is_floating_point()),
                                   argnums=pos)(*a)
                results.append(tf.vmap(per_sample, in_dims=entry.vmap_in_dims)(*args))
            else:
                first = lambda *a, impl=impl: as_tuple(impl(*a))[0]  # noqa: E731
                results.append(tf.jacrev(first, argnums=pos)(*args))
        for i, (a, b) in enumerate(zip(*results)):
            _close(a, b, f"{entry.name}: torch.func.{impl_name}, argument {pos[i]}")


# ---- torch.autograd.grad(..., is_grads_batched=True): the backward under torch's legacy vmap --------------------


@pytest.mark.parametrize("entry", entry_params("test_is_grads_batched"))
def test_is_grads_batched(device, entry):
    """A leading batch of 3 upstream gradients through one backward (torch's legacy `Batched` key: its loop fallback,
    or csrc/core/legacy_batched for an op with a Tensor[] argument or return) equals the per-sample loop."""
    if not entry.differentiable:
        return _assert_no_history(entry, device)
    s = entry.small_samples(device)[0]
    args, diff = prepare(s.args)
    outs = [o for o in as_tuple(_bind(entry.op, s.kwargs)(*args)) if o.requires_grad]
    gouts = [torch.randn(3, *o.shape, dtype=o.dtype, device=o.device) for o in outs]
    batched = torch.autograd.grad(outs, diff, gouts, retain_graph=True, allow_unused=True, is_grads_batched=True)
    loop = [torch.autograd.grad(outs, diff, [g[i] for g in gouts], retain_graph=True, allow_unused=True)
            for i in range(3)]
    for j, got in enumerate(batched):
        want = None if loop[0][j] is None else torch.stack([lp[j] for lp in loop])
        _close(got, want, f"{entry.name} {s.name}: is_grads_batched gradient {j}")


# ---- autocast: eager, compiled and FakeTensor agree, and follow the native op's policy ---------------------------


@pytest.mark.parametrize("entry", entry_params("test_autocast"))
def test_autocast(device, entry):
    lowp = torch.bfloat16
    torch._dynamo.reset()
    for s in entry.small_samples(device)[:2]:
        kwargs = _float32_kwargs(s.kwargs)
        op = _bind(entry.op, kwargs)
        for args in (_float32(s.args), tuple(a.to(lowp) if differentiable(a) else a for a in s.args)):
            with torch.autocast(device, dtype=lowp):
                native = [o.dtype for o in as_tuple(_bind(entry.native, kwargs)(*args))]
                eager = as_tuple(op(*args))
                compiled = as_tuple(torch.compile(op, fullgraph=True, backend="aot_eager")(*args))
            with FakeTensorMode() as mode:
                fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
                fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                with torch.autocast(device, dtype=lowp):
                    fake = as_tuple(entry.op(*fake_args, **fake_kwargs))
            what = f"{entry.name} {s.name} {[a.dtype for a in args if isinstance(a, torch.Tensor)]}"
            assert [o.dtype for o in eager] == native, f"{what}: eager {[o.dtype for o in eager]}, torch's {native}"
            assert [o.dtype for o in compiled] == native, f"{what}: compiled {[o.dtype for o in compiled]}"
            assert [o.dtype for o in fake] == native, f"{what}: FakeTensor {[o.dtype for o in fake]}"
            for a, b in zip(compiled, eager):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: compiled vs eager: {m}")
            # gradients come back in each argument's own dtype, as torch's do under autocast
            pargs, diff = prepare(args)
            with torch.autocast(device, dtype=lowp):
                outs = [o for o in as_tuple(op(*pargs)) if o.requires_grad]
            if not outs:  # an op without gradients (OpEntry.differentiable=False)
                continue
            grads = torch.autograd.grad(outs, diff, [torch.ones_like(o) for o in outs], allow_unused=True)
            for d, g in zip(diff, grads):
                assert g is None or g.dtype == d.dtype, f"{what}: gradient {g.dtype} for an argument of {d.dtype}"
