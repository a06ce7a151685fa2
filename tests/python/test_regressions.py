"""Regression tests from an adversarial pass over opforge's user-facing API (CPU and Meta): each test is a
minimal reproduction of a defect that was found and fixed."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD

import opforge
from conformance import RecordOpforgeCalls
from opforge import patch


# ---- opforge.patch: modules swapped without a check, silently changing the model ------------------------


class _LoRALinear(torch.nn.Linear):
    """A Linear subclass with extra (adapter) parameters, as LoRA/PEFT layers are. B starts at zero, so at
    initialisation it computes exactly what the plain Linear computes."""

    def __init__(self, i, o):
        super().__init__(i, o, bias=False)
        self.lora_A = torch.nn.Parameter(torch.randn(2, i))
        self.lora_B = torch.nn.Parameter(torch.zeros(o, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.lora_A.t() @ self.lora_B.t()


class _MLP(torch.nn.Module):
    def __init__(self, lin=torch.nn.Linear, extra=False):
        super().__init__()
        self.gate_proj, self.up_proj = lin(8, 16), lin(8, 16)
        self.down_proj = lin(16, 8)
        self.act_fn = torch.nn.SiLU()
        if extra:  # a learned output scale, initialised to one (the probe cannot see it)
            self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        y = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return y * self.scale if hasattr(self, "scale") else y


class _Wrap(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _lora_linear(i, o):
    return _LoRALinear(i, o)


def test_patch_keeps_gated_mlp_of_linear_subclasses():
    # Was: the MLP became a GatedMLP of plain opforge Linears, dropping the LoRA parameters (and their math)
    # without a word, since the probe agreed at initialisation.
    model = _Wrap(_MLP(lin=_lora_linear))
    names_before = {n for n, _ in model.named_parameters()}
    with pytest.warns(UserWarning, match="not a plain torch.nn.Linear"):
        report = patch.apply(model)
    assert not isinstance(model.inner, opforge.nn.GatedMLP), str(report)
    assert {n for n, _ in model.named_parameters()} == names_before
    with torch.no_grad():
        model.inner.down_proj.lora_B.fill_(1.0)  # the adapter still takes part
    x = torch.randn(3, 8)
    ref = _MLP(lin=_lora_linear)
    ref.load_state_dict(model.inner.state_dict())
    torch.testing.assert_close(model(x), ref(x))


def test_patch_keeps_gated_mlp_with_extra_parameters():
    model = _Wrap(_MLP(extra=True))
    with pytest.warns(UserWarning, match="parameters outside"):
        report = patch.apply(model)
    assert not isinstance(model.inner, opforge.nn.GatedMLP), str(report)
    assert "inner.scale" in dict(model.named_parameters())


class _LastDimRMSNorm(torch.nn.Module):
    """Llama-style (weight + variance_epsilon) but with a 2-D weight, normalizing over the last dim only."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(4, 8) + 0.5)
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight


def test_patch_probes_rms_norm_with_multi_dim_weight():
    # Was: the agreement probe ran only for a 1-D weight, so this norm was swapped for an RMSNorm over
    # (4, 8) and the model's output changed silently.
    model = _Wrap(_LastDimRMSNorm())
    x = torch.randn(2, 4, 8)
    ref = model(x).detach()
    with pytest.warns(UserWarning, match="differs"):
        patch.apply(model)
    assert not isinstance(model.inner, opforge.nn.RMSNorm)
    torch.testing.assert_close(model(x), ref)


def test_patch_still_swaps_torch_rms_norm_with_multi_dim_weight():
    model = _Wrap(torch.nn.RMSNorm((4, 8)))
    with torch.no_grad():
        model.inner.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 4, 8)
    ref = model(x).detach()
    report = patch.apply(model)
    assert report.ok and isinstance(model.inner, opforge.nn.RMSNorm), str(report)
    torch.testing.assert_close(model(x), ref)


# ---- clear errors naming the op -------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [opforge.rms_norm, lambda x, ns: opforge.fused_add_rms_norm(x, x, ns)])
@pytest.mark.parametrize("ns", [8.0, object()])
def test_rms_norm_bad_normalized_shape_type_names_op(fn, ns):
    # Was: TypeError "'float' object is not iterable", naming neither the op nor the argument.
    with pytest.raises(TypeError, match=r"opforge::(fused_add_)?rms_norm: expected normalized_shape"):
        fn(torch.randn(3, 8), ns)


FORWARD_AD_CASES = {
    "sigmoid": lambda x: opforge.sigmoid(x),
    "square": lambda x: opforge.square(x),
    "square_add": lambda x: opforge.square_add(x, torch.randn(4)),
    "swiglu": lambda x: opforge.swiglu(x, torch.randn(3, 4)),
    "rms_norm": lambda x: opforge.rms_norm(x, 4),
    "fused_add_rms_norm": lambda x: opforge.fused_add_rms_norm(x, torch.randn(3, 4), 4),
    "linear": lambda x: opforge.linear(x, torch.randn(2, 4)),
}


@pytest.mark.parametrize("op", sorted(FORWARD_AD_CASES))
def test_forward_ad_error_names_op(op):
    # Was (all but linear): RuntimeError "jvp is not implemented for the c++ API of custom Function yet",
    # naming no op.
    with fwAD.dual_level():
        x = fwAD.make_dual(torch.randn(3, 4), torch.randn(3, 4))
        with pytest.raises(NotImplementedError, match=f"opforge::{op}: forward-mode AD is not supported"):
            FORWARD_AD_CASES[op](x)


# ---- hostile inputs: views, dtypes, bad arguments ---------------------------------------------------------

NONE_CASES = {
    "sigmoid": (lambda: opforge.sigmoid(None), "input"),
    "square": (lambda: opforge.square(None), "input"),
    "square_add": (lambda: opforge.square_add(None, None), "input"),
    "swiglu": (lambda: opforge.swiglu(None, None), "gate"),
    "linear": (lambda: opforge.linear(None, None), "input"),
    "fused_add_rms_norm": (lambda: opforge.fused_add_rms_norm(None, None, [4]), "input"),
    "linear_cross_entropy": (lambda: opforge.linear_cross_entropy(None, None, None), "input"),
    "fake_quant_linear": (lambda: opforge.fake_quant_linear(None, None), "input"),
    "fake_quantize_weight": (lambda: opforge.fake_quantize_weight(None), "weight"),
    "indexed_linear": (lambda: opforge.indexed_linear(None, None, None), "input"),
    "rope": (lambda: opforge.rope(None, None, None, None), "q"),
    "rope_from_positions": (lambda: opforge.rope_from_positions(None, None, None), "q"),
}


@pytest.mark.parametrize("op", sorted(NONE_CASES))
def test_none_for_every_tensor_names_op(op):
    # Was: the dispatcher's "There were no tensor arguments to this function ... no fallback function is registered
    # for schema opforge::<op>", which names neither the argument nor what to pass.
    fn, name = NONE_CASES[op]
    with pytest.raises(ValueError, match=rf"^opforge::{op}: expected {name} to be a tensor, but got None$"):
        fn()


@pytest.mark.parametrize("inputs", [torch.randn(1, 4), torch.randn(3, 4), None])
def test_linear_cat_inputs_not_a_list(inputs):
    # Was: list(tensor) split a (1, 4) tensor into its rows and returned shape (5,) silently (a (3, 4) one gave a
    # misleading in_features error).
    with pytest.raises(TypeError, match=r"^opforge::linear_cat: expected inputs to be a sequence of tensors"):
        opforge.linear_cat(inputs, torch.randn(5, 4))


@pytest.mark.parametrize("ns", ["4", torch.ones(4), b"4"])
def test_rms_norm_normalized_shape_of_wrong_type(ns):
    # Was: "opforge::rms_norm() Expected a value of type 'List[int]' ... but instead found type 'list'".
    with pytest.raises(TypeError, match=r"^opforge::rms_norm: expected normalized_shape to be an int or a sequence"):
        opforge.rms_norm(torch.randn(2, 4), ns)


@pytest.mark.parametrize("scale", [1.0, 7.0])
def test_fake_quant_convert_float64_weight(scale):
    # Was: convert() computed the integers with weight.float(), so for a float64 weight (whose fake-quantization runs
    # in float64) some integers were a whole step off and (weight − zeros) · scales differed from the forward's.
    torch.manual_seed(0)
    m = opforge.nn.FakeQuantLinear(64, 8, group_size=-1, dtype=torch.float64)
    with torch.no_grad():
        m.weight.mul_(scale)
    d = m.convert()
    fq = opforge.fake_quantize_weight(m.weight, m.weight_bits, m.group_size, m.symmetric)[0]
    deq = (d["weight"].double() - d["zeros"].double()) * d["scales"].double()
    torch.testing.assert_close(deq, fq, rtol=0, atol=0)


def test_rotary_embedding_checks_head_dim():
    # Was: a q/k head size other than head_dim rotated only the first head_dim dims, silently.
    m = opforge.nn.RotaryEmbedding(head_dim=64)
    q = torch.randn(1, 2, 3, 128)
    with pytest.raises(ValueError, match=r"RotaryEmbedding: expected q's last dim to be head_dim 64, but got 128"):
        m(q, q, torch.arange(3))


def test_linear_cat_takes_any_sequence_of_tensors():
    # The list check above must not refuse what list(inputs) took before (a deque, a generator), and a None piece
    # is named (the dispatcher's message was "Expected a value of type 'List[Tensor]' ... found type 'list'").
    import collections
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    ref = opforge.linear_cat([x[:, :3], x[:, 3:]], w)
    for inputs in (collections.deque([x[:, :3], x[:, 3:]]), (t for t in (x[:, :3], x[:, 3:]))):
        torch.testing.assert_close(opforge.linear_cat(inputs, w), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"^opforge::linear_cat: expected inputs\[0\] to be a tensor, but got None$"):
        opforge.linear_cat([None, x], w)


def test_rms_norm_normalized_shape_of_numpy_or_tensor_ints():
    # Integers that are not Python ints (numpy, a 1-D integer tensor) are shapes as before; floats, bools, sets are not.
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 8)
    ref = opforge.rms_norm(x, [8])
    for ns in (np.array([8]), torch.tensor([8]), (d for d in [8])):
        torch.testing.assert_close(opforge.rms_norm(x, ns), ref, rtol=0, atol=0)
    for ns in ({8}, np.array([8.0]), iter([True])):
        with pytest.raises(TypeError, match=r"^opforge::rms_norm: expected normalized_shape"):
            opforge.rms_norm(x, ns)


# zero-size column views (a (0, 5) slice of a (0, 10) tensor keeps strides (10, 1) through .contiguous()): the
# outputs are contiguous, as the Meta kernels and torch's ops give them (the CPU kernels returned the view's strides)
@pytest.mark.parametrize("op", ["sigmoid", "square", "swiglu", "swiglu_backward", "sigmoid_backward"])
def test_zero_size_views_give_contiguous_outputs(device, op):
    base = torch.randn(0, 10, device=device)
    a, b = base[:, :5], base[:, 5:]
    fn = {"sigmoid": lambda t: opforge.sigmoid(t), "square": lambda t: opforge.square(t),
          "swiglu": lambda t: opforge.swiglu(t, b.to(t.device)),
          "swiglu_backward": lambda t: torch.ops.opforge.swiglu_backward(t, t, b.to(t.device))[0],
          "sigmoid_backward": lambda t: torch.ops.opforge.sigmoid_backward(t, t)}[op]
    out, meta = fn(a), fn(a.to("meta"))
    assert out.shape == meta.shape == (0, 5)
    assert out.stride() == meta.stride() == (5, 1), (out.stride(), meta.stride())


# ---- backward computes only the gradients this backward pass asks for ------------------------------------


def _output_masks(calls):
    """[(op name, output_mask)] of the opforge calls (conformance.RecordOpforgeCalls) that take an output_mask."""
    out = []
    for func, args, kwargs in calls:
        for i, a in enumerate(func._schema.arguments):
            if a.name == "output_mask":
                out.append((func.name(), list(kwargs.get("output_mask", args[i] if i < len(args) else []))))
    return out


def _weighted_ops():
    """(name, inputs, fn(inputs) -> output): ops with an input and a weight (position 0 and 1 of their masks)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    idx = torch.tensor([0, 2, 1, -1, 2, 0])
    return [
        ("linear", [r(6, 8), r(5, 8)], lambda x, w: opforge.linear(x, w)),
        ("indexed_linear", [r(6, 8), r(3, 5, 8)], lambda x, w: opforge.indexed_linear(x, w, idx)),
        ("rms_norm", [r(6, 8), r(8)], lambda x, w: opforge.rms_norm(x, (8,), w)),
        ("swiglu_linear", [r(6, 8), r(10, 8)], lambda x, w: opforge.swiglu_linear(x, w)),
        ("fp8_linear", [r(6, 16).float(), r(16, 16).float()], lambda x, w: opforge.fp8_linear(x, w)),
    ]


@pytest.mark.parametrize("case", _weighted_ops(), ids=lambda c: c[0])
@pytest.mark.parametrize("wanted", [0, 1], ids=["input", "weight"])
def test_backward_computes_only_the_requested_gradient(case, wanted):
    """torch.autograd.grad(y, [input]) must not compute the weight's gradient (nor the reverse): the backward op
    gets an output_mask with only the requested entry set, and its gradient is the one a full backward gives."""
    name, inputs, fn = case
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    full = torch.autograd.grad(fn(*leaves), leaves, dy)
    with RecordOpforgeCalls() as rec:
        (got,) = torch.autograd.grad(y, [leaves[wanted]], dy)
    masks = [m for op, m in _output_masks(rec.calls) if op.endswith("backward")]
    assert masks, f"{name}: no backward op with an output_mask ran"
    for m in masks:
        assert m[wanted] and not m[1 - wanted], f"{name}: output_mask {m} when only input {wanted} was requested"
    torch.testing.assert_close(got, full[wanted], rtol=0, atol=0)
