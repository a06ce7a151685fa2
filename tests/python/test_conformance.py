"""The conformance suite: every entry of conformance.ENTRIES (one per public op) and the backward and private
ops its gradient calls, through the same checks (issue 9 item 3, issue 12; DESIGN.md §5).

Op-specific cases (bug reports, big tensors, CUDA graphs, mixed dtypes, activations) stay in test_<op>.py.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

import opforge  # noqa: F401
from conformance import (ENTRIES, as_tuple, differentiable, mask_variants, on_meta, prepare,
                         recorded_calls, run_forward_backward)
from opforge.testing import assert_matches_reference

BACKWARD_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
DTYPE_IDS = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
BAD_CASES = [(e, b.name) for e in ENTRIES for b in e.bad_inputs("cpu")]


def _float32(args):
    return tuple(a.float() if differentiable(a) else a for a in args)


def _close(a, b, what, **kw):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one is None"
        return
    torch.testing.assert_close(a, b, msg=lambda m: f"{what}: {m}", **kw)


# ---- forward and gradients against float64 ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_forward_and_gradients_match_float64(device, entry, dtype):
    if dtype not in entry.dtypes:
        pytest.skip(f"{entry.name} does not support {dtype}")
    check = entry.check or (lambda what, o, r, b, args, gouts: assert_matches_reference(o, r, b, what=what))
    for s in entry.samples(device, dtype):
        ours, ours_g, gouts = run_forward_backward(entry.op, s.args, strided=s.grad_strided)
        ref, ref_g, _ = run_forward_backward(entry.ref(dtype), s.args, gouts, cast=lambda t: t.double())
        base, base_g, _ = run_forward_backward(entry.baseline, s.args, gouts)
        assert len(ours) == len(ref) == len(base), s.name
        for i, (o, r, b) in enumerate(zip(ours, ref, base)):
            assert o.shape == b.shape and o.dtype == b.dtype and o.device == b.device, \
                f"{s.name}: output {i}: {o.shape} {o.dtype} vs torch's {b.shape} {b.dtype}"
            check(f"output {i}", o, r, b, s.args, gouts)
        diff = [a for a in s.args if differentiable(a)]
        for j, (a, g, r, b) in enumerate(zip(diff, ours_g, ref_g, base_g)):
            z = torch.zeros_like(a)
            g, r, b = (g if g is not None else z), (r if r is not None else z.double()), (b if b is not None else z)
            assert g.shape == a.shape and g.dtype == a.dtype, f"{s.name}: grad {j}: {g.shape} {g.dtype}, arg {a.shape} {a.dtype}"
            try:
                check(f"grad {j}", g, r, b, s.args, gouts)
            except AssertionError as e:
                raise AssertionError(f"sample {s.name}: {e}") from None


# ---- opcheck: the public op, its private forward and backward ops ----------------------------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_opcheck(device, entry):
    public = getattr(torch.ops.opforge, entry.name).default
    for s in entry.small_samples(device):
        args, _ = prepare(_float32(s.args))
        opcheck(public, args)
    for name, calls in recorded_calls(entry, device).items():
        if name == f"opforge::{entry.name}":
            continue
        for func, args, kwargs in calls[:2]:
            if name.endswith("_backward"):  # not differentiable (lazy error): schema, fake tensor, AOT dispatch
                for variant in mask_variants(args):
                    opcheck(func, variant, kwargs, test_utils=BACKWARD_UTILS)
            else:  # a private forward op: differentiable like the public one
                opcheck(func, prepare(args)[0], kwargs)


# ---- Meta against the real kernels -----------------------------------------------------------------------------


def _meta_matches(func, args, kwargs, what):
    real = as_tuple(func(*args, **kwargs))
    meta = as_tuple(func(*on_meta(args), **{k: v for k, v in kwargs.items()}))
    assert len(real) == len(meta), what
    for i, (r, m) in enumerate(zip(real, meta)):
        if r is None or m is None:
            assert r is None and m is None, f"{what}: output {i}: {r} vs meta {m}"
            continue
        assert (m.shape, m.dtype, m.stride()) == (r.shape, r.dtype, r.stride()), \
            f"{what}: output {i}: meta {m.shape} {m.dtype} {m.stride()} vs real {r.shape} {r.dtype} {r.stride()}"


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_meta_matches_real(device, entry):
    for dtype in (torch.float32, torch.bfloat16):
        for s in entry.samples(device, dtype):
            with torch.no_grad():
                _meta_matches(entry.op, s.args, {}, f"{entry.name} {s.name} {dtype}")
    for name, calls in recorded_calls(entry, device).items():
        for func, args, kwargs in calls[:2]:
            for variant in mask_variants(args):
                with torch.no_grad():
                    _meta_matches(func, variant, kwargs, f"{name} {variant}")


# ---- bad inputs: each raises its own message and leaves the inputs unchanged -----------------------------------


@pytest.mark.parametrize("entry,case", BAD_CASES, ids=[f"{e.name}-{c}" for e, c in BAD_CASES])
def test_bad_input(device, entry, case):
    (bad,) = [b for b in entry.bad_inputs(device) if b.name == case]
    fn, args = bad.make(device)
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type != "meta" else None for a in args]
    with pytest.raises(bad.exc, match=bad.match):
        fn(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if b is not None:
            assert torch.equal(a, b), f"{entry.name} {case}: argument {i} changed"


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_bad_input_table_is_complete(entry):
    cases = entry.bad_inputs("cpu")
    assert len(cases) >= 10, f"{entry.name}: {len(cases)} bad inputs in conformance.py, at least 10 wanted"
    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"{entry.name}: duplicate bad-input names"
    assert len({c.match for c in cases}) >= len(cases) - 2, f"{entry.name}: bad inputs should raise distinct messages"


# ---- gradcheck, and gradgradcheck or the lazy double-backward error ---------------------------------------------


def _diff_fn(fn, args):
    """(g, diff): g(*diff) calls fn with the floating args of `args` replaced by diff."""
    pos = [i for i, a in enumerate(args) if differentiable(a)]

    def g(*diff):
        a = list(args)
        for i, d in zip(pos, diff):
            a[i] = d
        return fn(*a)
    return g, [args[i].detach().requires_grad_() for i in pos]


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_gradcheck_and_double_backward(device, entry):
    for s in entry.small_samples(device):
        g, diff = _diff_fn(entry.op, s.args)
        assert torch.autograd.gradcheck(g, diff), s.name
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


# ---- torch.compile(fullgraph=True), static and dynamic ----------------------------------------------------------


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_compile_matches_eager(device, entry, dynamic):
    torch._dynamo.reset()

    def fn(*args):
        return entry.op(*args)

    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
    # dynamic: a second shape through the same graph; static: one (a second would only recompile)
    for s in entry.small_samples(device)[:2 if dynamic else 1]:
        args = _float32(s.args)
        eager, eg, gouts = run_forward_backward(fn, args)
        comp, cg, _ = run_forward_backward(compiled, args, gouts)
        for a, b in zip(comp, eager):
            _close(a, b, f"{entry.name} {s.name}: output")
        for a, b in zip(cg, eg):
            _close(a, b, f"{entry.name} {s.name}: gradient")


# ---- compiled autograd: a backward compiled over a graph whose forward ran eagerly -----------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_compiled_autograd(device, entry):
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    for s in entry.small_samples(device)[:2]:
        eager, eg, gouts = run_forward_backward(entry.op, _float32(s.args))
        args, diff = prepare(_float32(s.args))
        outs = [o for o in as_tuple(entry.op(*args)) if o.requires_grad]
        with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
            torch.autograd.backward(outs, gouts)
        for d, e in zip(diff, eg):
            _close(d.grad, e, f"{entry.name} {s.name}: compiled-autograd gradient")


# ---- torch.func: grad, vmap(grad), jacrev against torch's own composition ---------------------------------------


def _scalar_loss(fn, weights):
    def loss(*args):
        return sum((o * w).sum() for o, w in zip(as_tuple(fn(*args)), weights))
    return loss


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_torch_func(device, entry):
    import torch.func as tf

    s = entry.small_samples(device)[0]
    args = s.args
    outs = as_tuple(entry.baseline(*args))
    weights = [torch.randn_like(o) for o in outs]
    pos = tuple(i for i, a in enumerate(args) if differentiable(a))
    for impl_name, which in (("grad", "grad"), ("vmap(grad)", "vmap"), ("jacrev", "jacrev")):
        results = []
        for impl in (entry.op, entry.baseline):
            loss = _scalar_loss(impl, weights)
            if which == "grad":
                results.append(tf.grad(loss, argnums=pos)(*args))
            elif which == "vmap":
                # per-sample gradients: the args of vmap_in_dims 0 are batched along their first dim
                def per_sample(*a, impl=impl):
                    a = list(a)
                    return tf.grad(lambda *b: sum(o.sum() for o in as_tuple(impl(*b))), argnums=pos)(*a)
                results.append(tf.vmap(per_sample, in_dims=entry.vmap_in_dims)(*args))
            else:
                first = lambda *a, impl=impl: as_tuple(impl(*a))[0]  # noqa: E731
                results.append(tf.jacrev(first, argnums=pos)(*args))
        for i, (a, b) in enumerate(zip(*results)):
            _close(a, b, f"{entry.name}: torch.func.{impl_name}, argument {pos[i]}")


# ---- autocast: eager, compiled and FakeTensor agree, and follow the native op's policy ---------------------------


@pytest.mark.parametrize("entry", ENTRIES, ids=repr)
def test_autocast(device, entry):
    lowp = torch.bfloat16
    torch._dynamo.reset()
    for s in entry.small_samples(device)[:2]:
        for args in (_float32(s.args), tuple(a.to(lowp) if differentiable(a) else a for a in s.args)):
            with torch.autocast(device, dtype=lowp):
                native = [o.dtype for o in as_tuple(entry.native(*args))]
                eager = as_tuple(entry.op(*args))
                compiled = as_tuple(torch.compile(entry.op, fullgraph=True, backend="aot_eager")(*args))
            with FakeTensorMode() as mode:
                fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
                with torch.autocast(device, dtype=lowp):
                    fake = as_tuple(entry.op(*fake_args))
            what = f"{entry.name} {s.name} {[a.dtype for a in args if isinstance(a, torch.Tensor)]}"
            assert [o.dtype for o in eager] == native, f"{what}: eager {[o.dtype for o in eager]}, torch's {native}"
            assert [o.dtype for o in compiled] == native, f"{what}: compiled {[o.dtype for o in compiled]}"
            assert [o.dtype for o in fake] == native, f"{what}: FakeTensor {[o.dtype for o in fake]}"
            for a, b in zip(compiled, eager):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: compiled vs eager: {m}")
            # gradients come back in each argument's own dtype, as torch's do under autocast
            pargs, diff = prepare(args)
            with torch.autocast(device, dtype=lowp):
                outs = [o for o in as_tuple(entry.op(*pargs)) if o.requires_grad]
            grads = torch.autograd.grad(outs, diff, [torch.ones_like(o) for o in outs], allow_unused=True)
            for d, g in zip(diff, grads):
                assert g is None or g.dtype == d.dtype, f"{what}: gradient {g.dtype} for an argument of {d.dtype}"
