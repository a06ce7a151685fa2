"""Hypothesis property tests: every op against its float64 reference under the tolerance rule, over
drawn shapes (0, 1 and odd sizes), layouts (contiguous, transposed, sliced, expanded), dtypes and value scales
1e-4..1e4 (and eps for the norms), forward and gradients. Bounded for CI: OPFORGE_HYPOTHESIS_EXAMPLES examples per op
(default 12), no deadline, derandomized (the same examples every run; set OPFORGE_HYPOTHESIS_RANDOM=1 to explore)."""
import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import conformance  # noqa: E402
from conformance import differentiable, run_forward_backward  # noqa: E402
from opforge.testing import assert_matches_reference, relative_error  # noqa: E402

EXAMPLES = int(os.environ.get("OPFORGE_HYPOTHESIS_EXAMPLES", "12"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    derandomize=os.environ.get("OPFORGE_HYPOTHESIS_RANDOM", "") in ("", "0"),
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])
SIZES = st.sampled_from([0, 1, 2, 3, 7, 17, 33, 83])
DTYPES = st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16])
LAYOUTS = st.sampled_from(["contiguous", "transposed", "sliced", "expanded"])
SCALES = st.sampled_from([1e-4, 1e-2, 1.0, 1e2, 1e4])


def _tensor(shape, dtype, layout, scale, device, gen):
    """A (*, M, N) tensor of the layout, values N(0, scale²) clamped to a finite range of dtype."""
    big = torch.finfo(dtype).max / 16

    def make(s):
        return (torch.randn(s, generator=gen, dtype=torch.float64) * scale).clamp(-big, big).to(dtype=dtype,
                                                                                              device=device)
    if len(shape) < 2 or layout == "contiguous":
        return make(shape)
    *lead, M, N = shape
    if layout == "transposed":
        return make((*lead, N, M)).transpose(-1, -2)
    if layout == "sliced":
        return make((*lead, M, 2 * N))[..., ::2]
    return make((*lead, 1, N)).expand(*lead, M, N)


class NoStrategy(KeyError):
    """_args has no branch for this conformance entry."""

    def __str__(self):
        name = self.args[0]
        return (f"tests/python/test_properties.py: _args has no strategy for opforge::{name}: add a branch that draws "
                f"its arguments (dtype, layout, scale, sizes as the others do), or list {name!r} in WITHOUT_STRATEGY "
                f"with why (docs/adding_an_op.md, checklist item 7)")


@st.composite
def _args(draw, name, device):
    dtype, layout, scale = draw(DTYPES), draw(LAYOUTS), draw(SCALES)
    M, N = draw(SIZES), draw(SIZES)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    t = lambda shape, lay=layout, sc=scale: _tensor(shape, dtype, lay, sc, device, gen)  # noqa: E731
    if name in ("sigmoid", "square"):
        return (t((M, N)),)
    if name == "square_add":
        other = draw(st.sampled_from(["row", "col", "same", "scalar"]))
        shape = {"row": (N,), "col": (M, 1), "same": (M, N), "scalar": ()}[other]
        return (t((M, N)), t(shape, "contiguous"))
    if name == "swiglu":
        return (t((M, N)), t((M, N), draw(LAYOUTS)))
    if name == "swiglu_packed":  # input (M, 2N): [gate | up]
        return (t((M, 2 * N)),)
    if name == "geglu":
        return (t((M, N)), t((M, N), draw(LAYOUTS)), draw(st.sampled_from(["none", "tanh"])))
    if name == "geglu_packed":  # input (M, 2N): [gate | up]
        return (t((M, 2 * N)), draw(st.sampled_from(["none", "tanh"])))
    if name in ("rms_norm", "fused_add_rms_norm"):
        N = max(N, 1)
        eps = draw(st.sampled_from([None, 1e-6, 1e-3, 1.0]))
        w = t((N,), "contiguous", 1.0) if draw(st.booleans()) else None
        res = (t((M, N), draw(LAYOUTS)),) if name == "fused_add_rms_norm" else ()
        return (t((M, N)), *res, (N,), w, eps)
    if name == "linear":
        K = draw(SIZES)
        bias = t((N,), "contiguous") if draw(st.booleans()) else None
        # the product's scale: input at `scale`, weight at 1/sqrt(K)
        return (t((M, K)), t((N, K), draw(LAYOUTS), 1.0 / max(K, 1) ** 0.5), bias)
    if name == "linear_log_probs":
        H, V = draw(SIZES), max(draw(SIZES), 1)  # V >= 1 classes
        # logits at `scale` (the input) times 1/sqrt(H) per weight; a temperature and softcap of their own
        x = t((M, H))
        w = t((V, H), draw(LAYOUTS), 1.0 / max(H, 1) ** 0.5)
        target = torch.randint(0, V, (M,), generator=gen)
        target[torch.rand(M, generator=gen) < 0.2] = -100
        bias = t((V,), "contiguous", 1.0) if draw(st.booleans()) else None
        temperature = draw(st.sampled_from([1.0, 0.5, 2.0]))
        softcap = draw(st.sampled_from([None, 3.0]))
        return (x, w, target.to(device), bias, temperature, -100, softcap, draw(st.booleans()),
                draw(st.sampled_from([None, 1, 5])))
    if name == "linear_jsd":  # (input, linear_weight, {teacher, target, options}): the dict is not differentiated
        H, Ht, V = draw(SIZES), draw(SIZES), max(draw(SIZES), 1)
        target = torch.randint(0, V, (M,), generator=gen)
        target[torch.rand(M, generator=gen) < 0.2] = -100
        opts = dict(teacher_input=t((M, Ht)), teacher_linear_weight=t((V, Ht), draw(LAYOUTS), 1.0 / max(Ht, 1) ** 0.5),
                    target=target.to(device) if draw(st.booleans()) else None,
                    beta=draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])), temperature=draw(st.sampled_from([1.0, 2.0])),
                    reduction=draw(st.sampled_from(["mean", "sum"])), chunk_size=draw(st.sampled_from([None, 1, 5])))
        counted = M if opts["target"] is None else int((target != -100).sum())
        assume(counted > 0 or opts["reduction"] == "sum")  # "mean" over no token is 0/0 for everyone
        return (t((M, H)), t((V, H), draw(LAYOUTS), 1.0 / max(H, 1) ** 0.5), opts)
    if name == "swiglu_linear":  # weight (2N, K): the gate's and the up projection's rows interleaved
        K = draw(SIZES)
        bias = t((2 * N,), "contiguous") if draw(st.booleans()) else None
        return (t((M, K)), t((2 * N, K), draw(LAYOUTS), 1.0 / max(K, 1) ** 0.5), bias)
    if name == "quantize_fp8":  # the recipe's bits for every drawn layout, scale, format and granularity
        fp8 = draw(st.sampled_from([None, torch.float8_e4m3fn, torch.float8_e5m2]))
        return (t((M, N)), fp8, draw(st.sampled_from(["tensorwise", "rowwise"])))
    if name == "fp8_linear":  # tensorwise (positional args only); rowwise: the conformance samples
        K = draw(SIZES)
        bias = t((N,), "contiguous") if draw(st.booleans()) else None
        return (t((M, K)), t((N, K), draw(LAYOUTS), 1.0 / max(K, 1) ** 0.5), bias)
    raise NoStrategy(name)


def _check(entry, args):
    check = entry.check or (lambda what, o, r, b, a, g: assert_matches_reference(o, r, b, what=what))
    dtype = next(a.dtype for a in args if differentiable(a))
    ours, ours_g, gouts = run_forward_backward(entry.op, args)
    ref, ref_g, _ = run_forward_backward(entry.ref(dtype), args, gouts, cast=lambda t: t.double())
    # a true result past dtype's range cannot be represented (torch's overflows too): not a case of the rule
    big = torch.finfo(dtype).max
    for r in list(ref) + [g for g in ref_g if g is not None]:
        assume(r.numel() == 0 or r.double().abs().max().item() < big / 2)  # double: FP8 outputs too
    base, base_g, _ = run_forward_backward(entry.baseline, args, gouts)
    for i, (o, r, b) in enumerate(zip(ours, ref, base)):
        assert o.shape == b.shape and o.dtype == b.dtype
        check(f"output {i}", o, r, b, args, gouts)
    diff = [a for a in args if differentiable(a)]
    for j, (a, g, r, b) in enumerate(zip(diff, ours_g, ref_g, base_g)):
        z = torch.zeros_like(a)
        g, r, b = (g if g is not None else z), (r if r is not None else z.double()), (b if b is not None else z)
        assert g.shape == a.shape and g.dtype == a.dtype
        # a gradient that PyTorch's own math in this dtype gets wholly wrong (norm-relative error >= 1: e.g.
        # rms_norm over N = 1, where dx = w·rstd·dy·(1 − x̂²) cancels to eps/x²) is ill-conditioned in the
        # dtype: no digit is right for anyone, so which wrong digits come out is not a case of the rule
        finite = torch.isfinite(r)
        assume(relative_error(b.detach().double().cpu()[finite.cpu()], r.cpu()[finite.cpu()]) < 1.0)
        check(f"grad {j}", g, r, b, args, gouts)


# Entries that _args has no strategy for yet, each with why; test_every_entry_has_a_strategy keeps the list honest.
# Their conformance entries cover odd shapes, zero sizes, views and every dtype with fixed samples.
WITHOUT_STRATEGY = {name: "conformance entry added on 2026-12-01; strategy (shapes, options, index/target "
                          "draws) pending" for name in ("linear_cross_entropy", "rope", "rope_from_positions",
                                                       "fake_quant_linear", "fake_quantize_weight", "linear_cat",
                                                       "indexed_linear")}
WITH_STRATEGY = [e for e in conformance.ENTRIES if e.name not in WITHOUT_STRATEGY]


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_every_entry_has_a_strategy():
    for e in conformance.ENTRIES:
        if e.name in WITHOUT_STRATEGY:
            with pytest.raises(NoStrategy):  # listed: it has none (remove it from the list with its strategy)
                _args(e.name, "cpu").example()
        else:
            try:
                _args(e.name, "cpu").example()
            except NoStrategy as err:
                pytest.fail(str(err))


@pytest.mark.parametrize("entry", WITH_STRATEGY, ids=repr)
def test_matches_float64_reference(device, entry):
    @SETTINGS
    @given(data=st.data())
    def run(data):
        args = data.draw(_args(entry.name, device))
        _check(entry, args)
    run()
