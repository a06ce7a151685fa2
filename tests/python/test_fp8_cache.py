"""The FP8 weight-operand cache and the saved q(inputᵀ): `_fp8_linear_quantized` (the weight's operands precomputed)
is bit-identical to fp8_linear in the output and every gradient; fp8_linear saves q(inputᵀ) (FP8) in place of the
input where the scales allow; opforge.nn.Linear(fp8=...) and the patch's FP8 projections reuse the cached operands
while the weight is unchanged and never serve stale ones (after optimizer steps of every torch.optim implementation,
in-place writes, load_state_dict, .to(), .data replacement, writes through a fused projection's row Parameters);
under DDP (gloo, 2 processes) the patched model trains as without the cache and reuses the operands, under FSDP2 and
FSDP1 the cache stays off."""
import copy

import pytest
import torch

import opforge
from conftest import spawn_gloo
from opforge import _fp8_cache, testing

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GRANS = ["tensorwise", "rowwise"]
E4 = torch.float8_e4m3fn
OPS = torch.ops.opforge


_same = testing.same_bits


def _operands(w, granularity):
    """(q(W), 1 / s_W, q(Wᵀ), 1 / s_Wᵀ) from the public quantize_fp8: the operands _fp8_linear_quantized takes."""
    with torch.no_grad():
        d, s = opforge.quantize_fp8(w.detach(), None, granularity)
        dt, st = opforge.quantize_fp8(w.detach().t(), None, granularity)
        return d, s.reciprocal(), dt, st.reciprocal()


def _grads(fn, tensors, g):
    for t in tensors:
        t.grad = None
    y = fn()
    y.backward(g)
    return y.detach(), [t.grad for t in tensors]


# ---- _quantize_fp8_weight: the bits of quantize_fp8 of W and of Wᵀ --------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(17, 33), (64, 48), (1, 130), (24, 1), (0, 16), (8, 0)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_quantize_fp8_weight_is_quantize_fp8_of_w_and_its_transpose(device, granularity, dtype, shape, layout):
    torch.manual_seed(0)
    base = torch.randn(shape[0], shape[1] * 2, dtype=torch.float64) * 5
    if base.numel():  # an exact zero and a large value among the elements
        base.view(-1)[0] = 0.0
        base.view(-1)[-1] = 300.0
    if layout == "contiguous":
        w = base[:, : shape[1]].contiguous()
    elif layout == "transposed":
        w = base[:, : shape[1]].contiguous().t().contiguous().t()  # (N, K) with K-major storage
    else:
        w = base[:, ::2]  # every other column: no dim contiguous in rows
    w = w.to(dtype=dtype, device=device)
    d, s, dt, st = OPS._quantize_fp8_weight(w, granularity)
    rd, rs = opforge.quantize_fp8(w, None, granularity)
    rdt, rst = opforge.quantize_fp8(w.t(), None, granularity)
    assert d.dtype == dt.dtype == E4 and s.dtype == st.dtype == torch.float32
    assert d.shape == w.shape and dt.shape == w.t().shape and d.is_contiguous() and dt.is_contiguous()
    assert s.shape == (rs.numel(),) and st.shape == (rst.numel(),)
    assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8))
    assert torch.equal(dt.view(torch.uint8), rdt.view(torch.uint8))
    # the dequantization scales: the reciprocals of quantize_fp8's scales, bit for bit
    assert torch.equal(s, rs.reshape(-1).reciprocal()) and torch.equal(st, rst.reshape(-1).reciprocal())
    assert s.data_ptr() != st.data_ptr() or s.numel() == 0  # outputs never alias
    # Meta: the same shapes and dtypes
    md, ms, mdt, mst = OPS._quantize_fp8_weight(w.to("meta"), granularity)
    for real, meta in zip((d, s, dt, st), (md, ms, mdt, mst)):
        assert real.shape == meta.shape and real.dtype == meta.dtype and real.stride() == meta.stride()


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_fp8_weight_errors(device):
    pre = "opforge::_quantize_fp8_weight: "
    with pytest.raises(ValueError, match=pre + "expected a 2-D weight"):
        OPS._quantize_fp8_weight(torch.randn(2, 3, 4, device=device))
    with pytest.raises(ValueError, match=pre + "expected a 2-D weight"):
        OPS._quantize_fp8_weight(torch.randn(4, device=device))
    with pytest.raises(TypeError, match=pre):
        OPS._quantize_fp8_weight(torch.ones(2, 3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=pre):
        OPS._quantize_fp8_weight(torch.randn(2, 3, device=device), "blockwise")
    w = torch.randn(4, 8, device=device, requires_grad=True)
    d, s, dt, st = OPS._quantize_fp8_weight(w)  # not differentiable: no history
    assert all(t.grad_fn is None and not t.requires_grad for t in (d, s, dt, st))


# ---- _fp8_linear_quantized and the saved q(inputᵀ): the bits of fp8_linear ------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("x_shape, N", [((7, 33), 17), ((2, 5, 48), 24), ((130, 64), 1), ((0, 16), 8)])
@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False), (False, True, True)])
def test_quantized_op_is_fp8_linear_bitwise(device, granularity, dtype, x_shape, N, needs):
    torch.manual_seed(0)
    x = (torch.randn(x_shape, dtype=torch.float64) * 3).to(dtype=dtype, device=device).requires_grad_(needs[0])
    w = torch.randn(N, x_shape[-1], dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_(needs[1])
    b = torch.randn(N, dtype=torch.float64).to(dtype=dtype, device=device).requires_grad_(needs[2])
    g = torch.randn(*x_shape[:-1], N, dtype=torch.float64).to(dtype=dtype, device=device)
    ops = _operands(w, granularity)
    leaves = [t for t in (x, w, b) if t.requires_grad]
    y1, g1 = _grads(lambda: OPS._fp8_linear_quantized(x, w, *ops, b, granularity=granularity), leaves, g)
    y2, g2 = _grads(lambda: opforge.fp8_linear(x, w, b, granularity=granularity), leaves, g)
    assert _same(y1, y2)
    for a, c in zip(g1, g2):
        assert _same(a, c)
    with torch.no_grad():  # no node: the op's own kernel
        assert _same(OPS._fp8_linear_quantized(x, w, *ops, b, granularity=granularity), y2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_shape, N", [((7, 33), 17), ((130, 70), 65), ((3, 200), 129), ((64, 64), 64), ((5, 80), 144),
                                        ((9, 256), 48)])
@pytest.mark.parametrize("transpose", [0, 1], ids=["byte-kernel", "4x4-kernel"])
def test_quantized_op_takes_the_transposed_view_tensorwise(device, dtype, x_shape, N, transpose, knob):
    """Tensorwise, q(Wᵀ) given as the view q(W).t() (as the layers' cache gives it: one FP8 copy of the weight): the
    backward's transpose kernel makes it row-major; output and gradients bit-identical to fp8_linear (shapes across
    the kernel's 64 x 64 tiles, ragged at both ends; on CUDA the test hook fp8_transpose picks the byte kernel or the
    4 x 4 block kernel, which takes the shapes whose sides are multiples of 16)."""
    knob("fp8_transpose", transpose)
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(N, x_shape[-1], dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(*x_shape[:-1], N, dtype=dtype, device=device)
    ops = _fp8_cache.quantize(w, "tensorwise")  # q(Wᵀ) as the view q(W).t()
    y1, g1 = _grads(lambda: OPS._fp8_linear_quantized(x, w, *ops, None, granularity="tensorwise"), [x, w], g)
    y2, g2 = _grads(lambda: opforge.fp8_linear(x, w, granularity="tensorwise"), [x, w], g)
    assert _same(y1, y2) and all(_same(a, c) for a, c in zip(g1, g2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_cache_holds_one_fp8_copy_tensorwise(device, granularity):
    """Tensorwise, the cached q(Wᵀ) is the transposed view of the cached q(W) (the same storage); rowwise, two
    tensors (per-row and per-column scales)."""
    m = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    m(torch.randn(4, 48, device=device)).sum().backward()
    d, s, dt, st = _fp8_cache.operands(m.weight, granularity)
    assert d.shape == (24, 48) and dt.shape == (48, 24) and d.is_contiguous()
    shared = dt.untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    assert shared == (granularity == "tensorwise")
    ref = opforge.quantize_fp8(m.weight.detach().t().contiguous(), None, granularity)[0]
    assert torch.equal(dt.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_fp8_linear_saves_fp8_input_t_where_the_scale_allows(device, granularity):
    """Tensorwise with a weight gradient: autograd keeps q(inputᵀ) [K, M] in e4m3 (one scale) and not the input;
    rowwise (per-column scales of inputᵀ), or without a weight gradient: the input, as before."""
    x = torch.randn(2, 6, 32, device=device, requires_grad=True)
    for w_grad in (True, False):
        w = torch.randn(16, 32, device=device, requires_grad=w_grad)
        saved = []

        def pack(t):
            saved.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            opforge.fp8_linear(x, w, granularity=granularity)
        kept_t = granularity == "tensorwise" and w_grad
        assert ((E4, (32, 12)) in saved) == kept_t
        assert ((torch.float32, (2, 6, 32)) in saved) == (not kept_t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_save_input_saves_the_input_and_keeps_the_bits(device, granularity):
    """_fp8_linear_quantized(save_input=True): autograd saves the input (never q(inputᵀ)), and the output and every
    gradient are the bits of the default (the backward quantizes inputᵀ from the input)."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 32, device=device, requires_grad=True)
    w = torch.randn(16, 32, device=device, requires_grad=True)
    g = torch.randn(2, 6, 16, device=device)
    ops = _operands(w, granularity)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = OPS._fp8_linear_quantized(x, w, *ops, None, granularity=granularity, save_input=True)
    assert (E4, (32, 12)) not in saved and (torch.float32, (2, 6, 32)) in saved
    y.backward(g)
    y1, g1 = y.detach(), [x.grad, w.grad]
    y2, g2 = _grads(lambda: OPS._fp8_linear_quantized(x, w, *ops, None, granularity=granularity), [x, w], g)
    assert _same(y1, y2) and all(_same(a, c) for a, c in zip(g1, g2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_quantize_fp8_of_a_transposed_view_is_that_of_a_copy(device, granularity, dtype):
    """quantize_fp8(w.t()) reads w in place (the transposed kernel): the bits of quantizing a contiguous copy,
    special values included."""
    w = (torch.randn(24, 40, dtype=torch.float64) * 3).to(dtype)
    w[3, 2], w[5, 4], w[:, 6], w[7, :] = float("nan"), -float("inf"), 0, 0
    w = w.to(device)
    for fp8 in (E4, torch.float8_e5m2):
        d, s = opforge.quantize_fp8(w.t(), fp8, granularity)
        rd, rs = opforge.quantize_fp8(w.t().contiguous(), fp8, granularity)
        assert d.shape == (40, 24) and d.is_contiguous() and s.shape == rs.shape
        assert torch.equal(d.view(torch.uint8), rd.view(torch.uint8))
        torch.testing.assert_close(s, rs, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_private_ops_bad_inputs(device):
    x, w = torch.randn(4, 16, device=device), torch.randn(8, 16, device=device)
    d, s, dt, st = _operands(w, "tensorwise")
    pre = "opforge::_fp8_linear_quantized: "
    with pytest.raises(TypeError, match=pre + "expected weight_data to be torch.float8_e4m3fn, but got Float8_e5m2"):
        OPS._fp8_linear_quantized(x, w, d.view(torch.float8_e5m2), s, dt, st)
    with pytest.raises(TypeError, match=pre + "expected weight_t_inv_scale to be torch.float32, but got Double"):
        OPS._fp8_linear_quantized(x, w, d, s, dt, st.double())
    with pytest.raises(ValueError, match=pre + r"expected weight_t_data of shape \[16, 8\], but got \[8, 16\]"):
        OPS._fp8_linear_quantized(x, w, d, s, d, st)
    with pytest.raises(ValueError, match=pre + r"expected weight_inv_scale with 8 element\(s\), but got shape \[\]"):
        OPS._fp8_linear_quantized(x, w, d, s, dt, st, granularity="rowwise")
    with pytest.raises(ValueError, match=pre + "expected granularity"):
        OPS._fp8_linear_quantized(x, w, d, s, dt, st, granularity="blockwise")
    with pytest.raises(ValueError, match=pre + "expected input's last dimension"):
        OPS._fp8_linear_quantized(torch.randn(4, 15, device=device), w, d, s, dt, st)
    with pytest.raises(ValueError, match="opforge::_fp8_linear_forward: expected granularity \"tensorwise\""):
        OPS._fp8_linear_forward(x, w, granularity="rowwise")
    with pytest.raises(ValueError, match="opforge::_fp8_linear_forward: expected weight_data and weight_inv_scale both"):
        OPS._fp8_linear_forward(x, w, None, d)
    with pytest.raises(ValueError, match="opforge::_fp8_linear_quantized_backward: expected input or input_t_data"):
        OPS._fp8_linear_quantized_backward(torch.randn(4, 8, device=device), None, None, None, w, None, None,
                                           [False, True, False])
    if device == "cpu":
        with pytest.raises(RuntimeError, match=pre + "expected weight_data and weight to be on the same device"):
            OPS._fp8_linear_quantized(x.to("meta"), w.to("meta"), d, s, dt.to("meta"), st.to("meta"))


@pytest.mark.parametrize("granularity", GRANS)
def test_private_ops_meta_shapes(granularity):
    x, w, b = torch.randn(2, 5, 16), torch.randn(8, 16), torch.randn(8)
    ops = _operands(w, granularity)
    meta = [t.to("meta") for t in (x, w, b, *ops)]
    assert OPS._fp8_linear_quantized(meta[0], meta[1], *meta[3:], meta[2], granularity=granularity).shape == (2, 5, 8)
    if granularity == "tensorwise":
        y, d, s = OPS._fp8_linear_forward(*meta[:3])
        ry, rd, rs = OPS._fp8_linear_forward(x, w, b)
        assert (y.shape, d.shape, d.dtype, s.shape) == (ry.shape, rd.shape, rd.dtype, rs.shape) == \
            ((2, 5, 8), (16, 10), E4, (1,))
    g = torch.randn(2, 5, 8, device="meta")
    gi, gw, gb = OPS._fp8_linear_quantized_backward(g, None, None, None, meta[1], *meta[5:7], [True, False, True],
                                                    granularity, None, torch.float64)
    assert gi.shape == (2, 5, 16) and gw is None and gb.shape == (8,) and gb.dtype == torch.float64


# ---- the cache of opforge.nn.Linear(fp8=...) --------------------------------------------------------------------

class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the opforge ops dispatched below autograd, by name."""

    def __init__(self):
        super().__init__()
        self.n = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        self.n[name] = self.n.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _fresh(m, x, g=None):
    """The layer's output (and gradients) through fp8_linear itself, the weight quantized in the op."""
    w = m.weight.detach().clone().requires_grad_()
    b = m.bias.detach().clone().requires_grad_()
    x = x.detach().clone().requires_grad_()
    y = opforge.fp8_linear(x, w, b, granularity=m.fp8)
    if g is None:
        return y.detach()
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_layer_reuses_the_operands_until_the_weight_changes(device, granularity):
    torch.manual_seed(0)
    m = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    x = torch.randn(3, 5, 48, device=device, requires_grad=True)
    g = torch.randn(3, 5, 24, device=device)
    n0 = _fp8_cache.QUANTIZED[0]
    with _CountOps() as rec:
        for _ in range(3):  # forward and backward three times, no update: one quantization of the weight
            x.grad = m.weight.grad = m.bias.grad = None
            y = m(x)
            y.backward(g)
    assert _fp8_cache.QUANTIZED[0] - n0 == 1
    # once: tensorwise q(W) (q(Wᵀ) is its transposed view), rowwise q(W) and q(Wᵀ)
    quantizer = "opforge::quantize_fp8" if granularity == "tensorwise" else "opforge::_quantize_fp8_weight"
    assert rec.n.get(quantizer, 0) == 1
    assert "opforge::fp8_linear" not in rec.n and "opforge::fp8_linear_backward" not in rec.n
    # the cached layer's output and gradients are the uncached op's, bit for bit
    ref = _fresh(m, x, g)
    for a, b in zip((y.detach(), x.grad, m.weight.grad, m.bias.grad), ref):
        assert _same(a, b)
    with torch.no_grad():  # evaluation reuses them too
        assert _same(m(x), ref[0])
    assert _fp8_cache.QUANTIZED[0] - n0 == 1


def _changes(device):
    """{name: fn(module)} of the ways a weight changes (each followed by a check against a fresh computation)."""
    def step(opt_cls, **kw):
        def fn(m):
            opt = opt_cls(m.parameters(), lr=0.5, **kw)
            m(torch.randn(4, 48, device=device)).sum().backward()
            opt.step()
            opt.zero_grad()
        return fn

    def no_grad_add(m):
        with torch.no_grad():
            m.weight.add_(1)

    def load(m):
        sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
        m.load_state_dict(sd)

    def to_and_back(m):  # new storages (the first one's freed: its address may come back) and rounded values
        m.to(torch.bfloat16)
        m.to(torch.float32)

    def replace_data(m):
        m.weight.data = torch.randn_like(m.weight)

    def data_write_then_clear(m):
        m.weight.data.mul_(2)  # not recorded by any counter: the documented case for fp8_cache_clear
        opforge.functional.fp8_cache_clear()

    return {"sgd": step(torch.optim.SGD), "adamw_foreach": step(torch.optim.AdamW, foreach=True),
            "adamw_single": step(torch.optim.AdamW, foreach=False), "adamw_fused": step(torch.optim.AdamW, fused=True),
            "no_grad_add": no_grad_add, "load_state_dict": load, "to_and_back": to_and_back,
            "replace_data": replace_data, "data_write_then_clear": data_write_then_clear}


CHANGES = list(_changes("cpu"))  # the names (the functions are made per device in the test)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("name", CHANGES)
def test_layer_never_serves_stale_operands(device, granularity, name):
    fn = _changes(device)[name]
    torch.manual_seed(0)
    m = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    x = torch.randn(6, 48, device=device)
    y0 = m(x).detach()  # cached
    fn(m)
    fresh = _fresh(m, x)
    assert not torch.equal(fresh, y0), name  # the change shows in the output: a stale operand would be seen
    assert _same(m(x).detach(), fresh), name
    m2 = m.to(torch.float64)  # a dtype change re-quantizes from the new weight
    assert _same(m2(x.double()).detach(), _fresh(m2, x.double())), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("name", ["sgd", "adamw_foreach", "adamw_single", "adamw_fused"])
def test_optimizer_step_refreshes_the_operands_it_changed(device, granularity, name):
    """An optimizer step quantizes again the cached operands of the weights it updated (the next forward quantizes
    nothing and serves the bits of fp8_linear on the new weight); a layer whose weight no optimizer holds is not
    touched by the step and is quantized again at its next use; a write after the step is never hidden by the
    refreshed entry."""
    torch.manual_seed(0)
    m = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    other = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    x = torch.randn(6, 48, device=device)
    m(x), other(x)  # both cached
    n0 = _fp8_cache.QUANTIZED[0]
    _changes(device)[name](m)  # a forward (cached operands), backward and step of an optimizer over m alone
    assert _fp8_cache.QUANTIZED[0] - n0 == 1  # the step's refresh of m's weight, not other's
    n0 = _fp8_cache.QUANTIZED[0]
    y = m(x).detach()
    assert _fp8_cache.QUANTIZED[0] == n0 and _same(y, _fresh(m, x))
    assert _same(other(x).detach(), _fresh(other, x)) and _fp8_cache.QUANTIZED[0] - n0 == 1
    with torch.no_grad():  # a write after the step: the refreshed entry is stale, the next forward quantizes
        m.weight.mul_(-1)
    n0 = _fp8_cache.QUANTIZED[0]
    assert _same(m(x).detach(), _fresh(m, x)) and _fp8_cache.QUANTIZED[0] - n0 == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_weights_no_optimizer_holds_see_writes_through_data_after_a_step(device, granularity):
    """A weight no optimizer holds (a frozen base weight, the model copy of fp32 master weights) written through
    `.data` right after a step (no version bump: PEFT's merge adds to `weight.data`, apex / DeepSpeed copy the masters
    back through `.data`) serves fp8_linear's bits on the written weight at its next use, step after step."""
    torch.manual_seed(0)
    m = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    masters = [p.detach().clone().requires_grad_() for p in m.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-1)
    x = torch.randn(6, 48, device=device)
    for _ in range(3):
        m(x).square().mean().backward()
        for p, q in zip(m.parameters(), masters):
            q.grad, p.grad = p.grad, None
        opt.step()
        for p, q in zip(m.parameters(), masters):
            p.data.copy_(q.data)
        assert _same(m(x).detach(), _fresh(m, x))


@pytest.mark.parametrize("granularity", GRANS)
def test_peft_merge_after_training_serves_the_merged_weight(granularity):
    """A patched FP8 model under PEFT LoRA, trained (an optimizer over the adapters alone), then merged: the merged
    model's logits are those with the operands quantized afresh (merge_adapter adds to the frozen base weights'
    `.data`)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from opforge import patch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).float()
    assert patch.apply(model, fp8=granularity).ok
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.merge_adapter()
        merged = model(input_ids=ids).logits
        opforge.functional.fp8_cache_clear()
        assert _same(merged, model(input_ids=ids).logits)


# ---- PEFT LoRA merges into the patched FP8 projections ---------------------------------------------------------
#
# merge_adapter / unmerge_adapter / merge_and_unload write the base weights through `.data` (no version bump). The
# patched model's FP8 projections (the fused q/k/v and gate/up GEMMs, o_proj and down_proj as opforge.nn.Linear) must
# serve, after each, the bits of the operands quantized afresh (the same model after fp8_cache_clear), and be within
# test_fp8_patch.py's FP8 rule of the unpatched PEFT model in the same merge state: its norm-relative error of the
# logits is at most 2 x that of torch's composition of the same FP8 math (each LoRA base layer's GEMM replaced by
# conformance.py's composition, reading the base weight as it is now) plus 2^-4 * 10^-2.

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FP8_SLACK = 2 ** -4 * 1e-2


def _lora_config(peft):
    # init_lora_weights=False: B is random too, so every merge changes the base weights
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=LORA_TARGETS)


def _tiny_llama(transformers):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).float()


def _copy_adapters(dst, src):
    with torch.no_grad():
        mine = dict(src.named_parameters())
        for n, p in dst.named_parameters():
            if "lora_" in n:
                p.copy_(mine[n])


def _torch_fp8_bases(model, granularity):
    """An unpatched PEFT model whose LoRA base layers compute torch's composition of fp8_linear (the weight read at
    each call, so merges are seen)."""
    from conformance import _fp8_linear_baseline

    for m in model.modules():
        base = m.__dict__.get("_modules", {}).get("base_layer")
        if isinstance(base, torch.nn.Linear):
            base.forward = (lambda x, lin=base: _fp8_linear_baseline(x, lin.weight, lin.bias,
                                                                     granularity=granularity))
    return model


def _peft_fp8_models(order, granularity):
    """(patched FP8 PEFT model, unpatched PEFT model, the unpatched one with torch's FP8 composition), with the same
    base weights and adapters; `order`: get_peft_model then apply, or apply then get_peft_model."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from opforge import patch

    base = _tiny_llama(transformers)
    ref = peft.get_peft_model(copy.deepcopy(base), _lora_config(peft))
    ref8 = _torch_fp8_bases(copy.deepcopy(ref), granularity)
    if order == "peft_then_apply":
        model = peft.get_peft_model(copy.deepcopy(base), _lora_config(peft))
        assert patch.apply(model, fp8=granularity).ok
    else:
        inner = copy.deepcopy(base)
        assert patch.apply(inner, fp8=granularity).ok
        model = peft.get_peft_model(inner, _lora_config(peft))
    _copy_adapters(model, ref)
    layer = model.base_model.model.model.layers[0]
    for called in (layer.self_attn.o_proj, layer.mlp.down_proj):  # FP8 in both orders, under the LoRA layer
        assert type(called.base_layer) is opforge.nn.Linear and called.base_layer.fp8 == granularity
    return model, ref, ref8


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _check_current(model, ref, ref8, ids):
    """The patched model's logits now: fp8_linear's bits on the weights as they are (the same model with the cache
    cleared) and within the FP8 rule of the unpatched model."""
    from opforge import testing as T

    out = _logits(model, ids)
    want, want8 = _logits(ref, ids), _logits(ref8, ids)
    opforge.functional.fp8_cache_clear()
    assert _same(out, _logits(model, ids)), "the cached FP8 operands are stale"
    err, err8 = T.relative_error(out, want), T.relative_error(want8, want)
    assert err <= 2 * err8 + FP8_SLACK, (err, err8)


PEFT_SCENARIOS = {
    # merged forward, unmerge, forward
    "merge_forward_unmerge": lambda m, kw: [m.merge_adapter(), "check", m.unmerge_adapter(), "check"],
    # unmerged forward, merge, forward
    "forward_merge": lambda m, kw: [m.merge_adapter(), "check"],
    # merge and unmerge with no forward between: (W + d) - d is not W bit for bit
    "merge_unmerge": lambda m, kw: [m.merge_adapter(), m.unmerge_adapter(), "check"],
    # PEFT's safe merge replaces the base weights' .data
    "safe_merge_forward_unmerge": lambda m, kw: [m.merge_adapter(safe_merge=True), "check", m.unmerge_adapter(),
                                                 "check"],
}


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
@pytest.mark.parametrize("granularity", GRANS)
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("scenario", list(PEFT_SCENARIOS))
def test_peft_merge_and_unmerge_serve_the_current_weights(order, granularity, train, scenario):
    """Every FP8 projection a LoRA layer merges into (the fused q/k/v and gate/up, o_proj, down_proj), both orders,
    after an optimizer step over the adapters or none: after merge_adapter / unmerge_adapter (also safe_merge, and
    the two with no forward between) the logits are fp8_linear's bits on the current weights (see _check_current)."""
    model, ref, ref8 = _peft_fp8_models(order, granularity)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    if train:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        _copy_adapters(ref, model)
        _copy_adapters(ref8, model)
    model.eval(), ref.eval(), ref8.eval()
    _logits(model, ids)  # the operands cached before the first merge or unmerge
    steps = iter(PEFT_SCENARIOS[scenario](_Recorder(), None))
    for step in steps:
        if step == "check":
            _check_current(model, ref, ref8, ids)
            continue
        name, args, kwargs = step
        for m in (model, ref, ref8):
            getattr(m, name)(*args, **kwargs)


class _Recorder:
    """Records the PEFT calls of a scenario, to replay them on the three models in step."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: (name, args, kwargs)


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
@pytest.mark.parametrize("granularity", GRANS)
def test_peft_merge_and_unload_serves_the_merged_weights(order, granularity):
    """merge_and_unload after apply, after a forward that cached the base weights' operands: the unloaded model's
    FP8 projections serve the merged weights' bits."""
    model, ref, ref8 = _peft_fp8_models(order, granularity)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    _logits(model, ids)
    model, ref, ref8 = (m.merge_and_unload() for m in (model, ref, ref8))
    _check_current(model, ref, ref8, ids)


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
def test_revert_after_merge_and_unload_gives_plain_linears_back(order):
    """merge_and_unload drops the LoRA layers (which held the record of o_proj's / down_proj's FP8 swap when PEFT came
    first); revert still puts every torch.nn.Linear back: the state_dict and logits of the unpatched merged model,
    bit for bit, and no opforge module left."""
    from opforge import patch

    model, ref, _ = _peft_fp8_models(order, "tensorwise")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    _logits(model.eval(), ids)
    model, ref = model.merge_and_unload(), ref.merge_and_unload()
    patch.revert(model)
    assert not patch.is_patched(model)
    assert not [n for n, m in model.named_modules() if type(m).__module__.startswith("opforge")]
    layer = model.model.layers[0]
    assert type(layer.self_attn.o_proj) is torch.nn.Linear and type(layer.mlp.down_proj) is torch.nn.Linear
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys() and all(torch.equal(sd[k], rsd[k]) for k in rsd)
    assert torch.equal(_logits(model.eval(), ids), _logits(ref.eval(), ids))


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
@pytest.mark.parametrize("merged", [False, True])
def test_revert_keeps_the_lora_layers(order, merged):
    """revert with the LoRA layers still in the model (apply then get_peft_model puts them in the slots of the FP8
    o_proj / down_proj): every opforge module goes, each LoRA layer holds a torch.nn.Linear base layer again, and the
    state_dict and logits are the unpatched PEFT model's, bit for bit (merged or not)."""
    from opforge import patch

    model, ref, _ = _peft_fp8_models(order, "tensorwise")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    _logits(model.eval(), ids)
    if merged:
        model.merge_adapter(), ref.merge_adapter()
    patch.revert(model)
    assert not patch.is_patched(model)
    assert not [n for n, m in model.named_modules() if type(m).__module__.startswith("opforge")]
    layer = model.base_model.model.model.layers[0]
    for called in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert type(called.base_layer) is torch.nn.Linear
    sd, rsd = model.state_dict(), ref.state_dict()
    assert sd.keys() == rsd.keys() and all(torch.equal(sd[k], rsd[k]) for k in rsd)
    assert torch.equal(_logits(model.eval(), ids), _logits(ref.eval(), ids))


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
@pytest.mark.parametrize("fp8", [None, "tensorwise"])
def test_disable_adapter_with_merged_adapters(order, fp8):
    """disable_adapter() over merged adapters: PEFT's LoRA forward unmerges before its base GEMM, so the fused q/k/v
    and gate/up GEMMs must too. The first forward under the block serves the base weights (the bits of the same
    model with the cache cleared; unquantized, the unpatched PEFT model's logits within float32 rounding)."""
    from opforge import patch

    model, ref, _ = _peft_fp8_models(order, "tensorwise")
    if fp8 is None:
        patch.revert(model)
        assert patch.apply(model).ok
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    model.eval(), ref.eval()
    _logits(model, ids)
    model.merge_adapter(), ref.merge_adapter()
    with model.disable_adapter(), ref.disable_adapter():
        first = _logits(model, ids)
        opforge.functional.fp8_cache_clear()
        assert _same(first, _logits(model, ids))
        if fp8 is None:
            torch.testing.assert_close(first, _logits(ref, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("granularity", GRANS)
def test_peft_wrapped_after_a_forward_then_merged_and_unloaded(granularity):
    """apply, a forward (the base weights' operands cached), get_peft_model (an adapter loaded the same way), then
    merge_and_unload with no forward between: no forward ever ran under the LoRA layers, yet the unloaded model serves
    the merged weights' bits."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    peft = pytest.importorskip("peft", reason="peft is not installed")
    from opforge import patch

    base = _tiny_llama(transformers)
    ref = peft.get_peft_model(copy.deepcopy(base), _lora_config(peft))
    ref8 = _torch_fp8_bases(copy.deepcopy(ref), granularity)
    model = copy.deepcopy(base)
    assert patch.apply(model, fp8=granularity).ok
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    _logits(model.eval(), ids)
    model = peft.get_peft_model(model, _lora_config(peft))
    _copy_adapters(model, ref)
    model, ref, ref8 = (m.merge_and_unload() for m in (model, ref, ref8))
    _check_current(model.eval(), ref.eval(), ref8.eval(), ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_two_optimizers_quantize_each_weight_once_a_step(device, granularity):
    """Two optimizers stepped one after the other (each over one layer): each step refreshes its own weights and
    leaves the other's current, so each weight is quantized once per training step, and the next forward quantizes
    nothing and serves fp8_linear's bits."""
    torch.manual_seed(0)
    a = opforge.nn.Linear(48, 24, device=device, fp8=granularity)
    b = opforge.nn.Linear(24, 24, device=device, fp8=granularity)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=1e-2), torch.optim.AdamW(b.parameters(), lr=1e-2)
    x = torch.randn(6, 48, device=device)
    b(a(x)).square().mean().backward()
    for _ in range(3):
        n0 = _fp8_cache.QUANTIZED[0]
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad(set_to_none=True)
        opt_b.zero_grad(set_to_none=True)
        assert _fp8_cache.QUANTIZED[0] - n0 == 2
        h = a(x)
        assert _same(h.detach(), _fresh(a, x)) and _same(b(h).detach(), _fresh(b, h.detach()))
        b(a(x)).square().mean().backward()
        assert _fp8_cache.QUANTIZED[0] - n0 == 2


def test_operands_cached_under_inference_mode_serve_training():
    """Operands first made under torch.inference_mode are normal tensors: a training forward saves them."""
    torch.manual_seed(0)
    m = opforge.nn.Linear(32, 16, fp8="rowwise")
    x = torch.randn(5, 32)
    with torch.inference_mode():
        y0 = m(x)
    n0 = _fp8_cache.QUANTIZED[0]
    y = m(x)
    y.sum().backward()
    assert _fp8_cache.QUANTIZED[0] == n0 and _same(y.detach(), y0) and m.weight.grad is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANS)
def test_cached_layer_under_autocast_is_fp8_linear(device, granularity):
    """float32 master weights under bfloat16 autocast: the cache quantizes the weight in its own precision, as
    fp8_linear does; output and gradients bit for bit."""
    torch.manual_seed(0)
    m = opforge.nn.Linear(64, 32, device=device, fp8=granularity)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    w = m.weight.detach().clone().requires_grad_()
    b = m.bias.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        m(x)  # cached now
        y, ref = m(x), opforge.fp8_linear(x2, w, b, granularity=granularity)
    assert y.dtype == torch.bfloat16 and _same(y.detach(), ref.detach())
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    for a, c in ((x.grad, x2.grad), (m.weight.grad, w.grad), (m.bias.grad, b.grad)):
        assert _same(a, c)


def test_deepcopy_and_functional_call_give_the_uncached_values():
    torch.manual_seed(0)
    m = opforge.nn.Linear(32, 16, fp8="tensorwise")
    x = torch.randn(5, 32)
    m(x)
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.weight.mul_(3)
    assert _same(c(x).detach(), _fresh(c, x)) and _same(m(x).detach(), _fresh(m, x))
    n0 = _fp8_cache.QUANTIZED[0]
    w2 = torch.randn(16, 32)  # a plain tensor in the parameter's place: quantized in the op, not cached
    y = torch.func.functional_call(m, {"weight": w2}, (x,))
    assert _fp8_cache.QUANTIZED[0] == n0
    assert _same(y, opforge.fp8_linear(x, w2, m.bias.detach(), granularity="tensorwise"))
    m.fp8_cache = False
    with _CountOps() as rec, torch.no_grad():
        m(x)
    assert rec.n == {"opforge::fp8_linear": 1}


def test_compiled_layer_quantizes_in_the_op():
    """Under torch.compile the layer calls fp8_linear (no cache lookup in the graph): eager's values."""
    import torch._dynamo

    torch.manual_seed(0)
    m = opforge.nn.Linear(32, 16, fp8="tensorwise")
    x = torch.randn(5, 32)
    ref = _fresh(m, x)
    torch._dynamo.reset()
    n0 = _fp8_cache.QUANTIZED[0]
    y = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    assert _fp8_cache.QUANTIZED[0] == n0 and _same(y.detach(), ref)
    torch._dynamo.reset()


class _OpsWithout:
    """torch.ops.opforge with some ops missing (a library built before they were added): every other attribute is
    the namespace's own."""

    def __init__(self, ns, missing):
        self._ns, self._missing = ns, set(missing)

    def __getattr__(self, name):
        if name in self._missing:
            raise AttributeError(f"'_OpNamespace' 'opforge' object has no attribute '{name}'")
        return getattr(self._ns, name)


@pytest.mark.parametrize("missing", [("_quantize_fp8_weight",), ("_fp8_linear_quantized",)])
def test_layer_without_the_private_ops_quantizes_in_the_op(missing, monkeypatch):
    """A library that lacks either private op of the cache (the operands' quantizer or the quantized GEMM): the
    layer calls fp8_linear, with its values, instead of failing on the missing op."""
    torch.manual_seed(0)
    m = opforge.nn.Linear(32, 16, fp8="tensorwise")
    x, g = torch.randn(5, 32), torch.randn(5, 16)
    ref = _fresh(m, x, g)
    monkeypatch.setattr(torch.ops, "opforge", _OpsWithout(torch.ops.opforge, missing))
    n0 = _fp8_cache.QUANTIZED[0]
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(g)
    assert _fp8_cache.QUANTIZED[0] == n0
    for got, want in zip((y.detach(), x.grad, m.weight.grad, m.bias.grad), ref):
        assert _same(got, want)


def test_fsdp_marked_weights_and_modules_quantize_in_the_op():
    """The markers FSDP sets (a flattened Parameter, a managed module) turn the cache off for that layer only; an
    unmarked layer keeps it."""
    torch.manual_seed(0)
    x = torch.randn(5, 32)
    for mark in ("module", "parameter", None):
        m = opforge.nn.Linear(32, 16, fp8="tensorwise")
        if mark == "module":
            m._is_fsdp_managed_module = True
        elif mark == "parameter":
            m.weight._fsdp_flattened = True
        n0 = _fp8_cache.QUANTIZED[0]
        with _CountOps() as rec, torch.no_grad():
            y = m(x)
        assert _fp8_cache.QUANTIZED[0] - n0 == (mark is None), mark
        assert ("opforge::fp8_linear" in rec.n) == (mark is not None), mark
        assert _same(y, _fresh(m, x)), mark


# ---- the patch's FP8 projections ---------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=64, max_position_embeddings=32)


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("granularity", GRANS)
def test_patched_model_steps_as_without_the_cache(granularity, monkeypatch):
    """Three fused-AdamW steps (which bump no version counter) and a write through q_proj's row Parameter: the same
    loss and gradients, bit for bit, as the model quantizing in the op; the weights are quantized once per step."""
    from opforge import patch

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().train()
    patch.apply(base, fp8=granularity)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    runs = []
    for cached in (True, False):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        with monkeypatch.context() as mp:
            if not cached:
                mp.setattr(_fp8_cache, "usable", lambda w, modules=(): False)
            out = []
            for step in range(3):
                n0 = _fp8_cache.QUANTIZED[0]
                out.append(_run(model, ids))
                with torch.no_grad():
                    model(input_ids=ids)  # a second forward: the same operands
                if cached:
                    # each projection once, by the first forward; after that by each optimizer step's refresh
                    fills = 4 if step == 0 else 0
                    assert _fp8_cache.QUANTIZED[0] - n0 == fills * TINY["num_hidden_layers"], step
                n0 = _fp8_cache.QUANTIZED[0]
                opt.step()
                if cached:
                    assert _fp8_cache.QUANTIZED[0] - n0 == 4 * TINY["num_hidden_layers"], step
            with torch.no_grad():
                model(input_ids=ids)  # operands cached after the last step
                # q_proj's rows written through the Parameter standing for them (the fused weight's version counter
                # does not move)
                model.model.layers[0].self_attn.q_proj.weight.mul_(-1)
            out.append(_run(model, ids))
        runs.append(out)
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            assert _same(x, y)


# ---- DDP, FSDP2 and FSDP1 (gloo, 2 processes on the CPU) ---------------------------------------------------------

DIST_STEPS = 4
N_FP8 = 4 * TINY["num_hidden_layers"]  # FP8 projections: fused q/k/v, o, fused gate/up, down


def _uncached(w, modules=()):
    return False


def _dist_train(make, ids, cached, write=None, zero=False):
    """(losses, parameters after DIST_STEPS AdamW steps, cache fills in each step's forwards, cache fills in each
    optimizer step) of the model `make()` returns, each step a forward and backward then a no_grad forward (whose
    operands are the ones just made). `write(model)` runs
    between the last two steps; `zero`: AdamW in ZeroRedundancyOptimizer (each rank steps its share of the
    parameters and broadcasts them). Uncached: every projection quantizes in fp8_linear."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    saved = _fp8_cache.usable
    if not cached:
        _fp8_cache.usable = _uncached
    try:
        model = make()
        if zero:
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, fills, refreshes = [], [], []
        for step in range(DIST_STEPS):
            if write is not None and step == DIST_STEPS - 1:
                write(model)
            n0 = _fp8_cache.QUANTIZED[0]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            with torch.no_grad():
                losses.append(loss.detach())
                losses.append(model(input_ids=ids, labels=ids).loss)
            fills.append(_fp8_cache.QUANTIZED[0] - n0)
            n0 = _fp8_cache.QUANTIZED[0]
            opt.step()
            refreshes.append(_fp8_cache.QUANTIZED[0] - n0)
            opt.zero_grad(set_to_none=True)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in model.named_parameters()}
        return torch.stack(losses), params, fills, refreshes
    finally:
        _fp8_cache.usable = saved


def _dist_worker(rank, world, granularity, out):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from opforge import patch

    ids = torch.randint(0, TINY["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(1))[rank::world]

    def llama(seed):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().train()
        patch.apply(model, fp8=granularity)
        return model

    def ddp():
        model = llama(rank)  # each rank its own weights, cached by a forward before DDP broadcasts rank 0's
        with torch.no_grad():
            model(input_ids=ids)
        return DDP(model)

    def fsdp2():
        model = llama(0)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    def fsdp1():
        return FSDP1(llama(0), use_orig_params=True, device_id=torch.device("cpu"))

    def write(model):  # an in-place write to the (sharded) weights that no optimizer step announces
        names = [n for n, _ in model.named_parameters() if n.endswith("proj.weight")]
        assert len(names) == N_FP8, names
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in names:
                    p.mul_(-1)

    res = {}
    for name, make in (("ddp", ddp), ("ddp_zero", ddp), ("fsdp2", fsdp2), ("fsdp1", fsdp1)):
        res[name] = {cached: _dist_train(make, ids, cached, write, zero=name == "ddp_zero")
                     for cached in (True, False)}
    torch.save(res, f"{out}.{rank}")


@pytest.mark.parametrize("granularity", GRANS)
def test_cache_under_ddp_and_fsdp_gloo(tmp_path, granularity):
    """DDP (AdamW, and AdamW in ZeroRedundancyOptimizer): the cached patched model trains as the one quantizing in
    the op, bit for bit (losses, parameters after AdamW steps and an in-place write), each FP8 weight quantized once
    by the first forward and then by each optimizer step's refresh (in ZeroRedundancyOptimizer also by its inner
    optimizer's step), never in the forwards after a step, but again in the forward after the unannounced write;
    rank 1's operands cached before DDP broadcast rank 0's weights are not used. FSDP2 (fully_shard) and FSDP1 (use_orig_params): the cache never fills and the results are those of
    quantizing in the op."""
    out = tmp_path / "res.pt"
    spawn_gloo(tmp_path, _dist_worker, granularity, str(out))
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    for rank, res in enumerate(ranks):
        for name in ("ddp", "ddp_zero", "fsdp2", "fsdp1"):
            (l1, p1, f1, r1), (l0, p0, f0, r0) = res[name][True], res[name][False]
            assert f0 == [0] * DIST_STEPS and r0 == [0] * DIST_STEPS, (rank, name)
            if name.startswith("ddp"):
                assert f1 == [N_FP8] + [0] * (DIST_STEPS - 2) + [N_FP8], (rank, name, f1)
                assert all(N_FP8 <= r <= (2 * N_FP8 if name == "ddp_zero" else N_FP8) for r in r1), (rank, name, r1)
            else:
                assert f1 == [0] * DIST_STEPS and r1 == [0] * DIST_STEPS, (rank, name, f1, r1)
            assert _same(l1, l0), (rank, name, l1, l0)
            assert p1.keys() == p0.keys()
            for n in p1:
                assert _same(p1[n], p0[n]), (rank, name, n)
    for name in ("ddp", "ddp_zero"):
        for n, p in ranks[0][name][True][1].items():  # DDP's replicas agree
            assert _same(p, ranks[1][name][True][1][n]), (name, n)


def test_a_failed_refresh_does_not_fail_the_optimizer_step(monkeypatch):
    """A refresh that raises (here: the quantizer) drops the entry; the step completes, and the next use quantizes."""
    torch.manual_seed(0)
    m = opforge.nn.Linear(32, 16, fp8="tensorwise")
    x = torch.randn(4, 32)
    m(x).sum().backward()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as mp:
        mp.setattr(_fp8_cache, "_quantize", broken)
        opt.step()  # does not raise
    assert "tensorwise" not in _fp8_cache._CACHE.get(m.weight, {})
    n0 = _fp8_cache.QUANTIZED[0]
    assert _same(m(x).detach(), _fresh(m, x)) and _fp8_cache.QUANTIZED[0] - n0 == 1


def test_refresh_while_another_thread_fills_the_cache():
    """One thread steps an optimizer (whose refresh walks the cached weights) while another thread's FP8 forwards
    add entries and drop them (their layers die): no step raises, and the stepped layer serves the bits of
    fp8_linear on its new weight."""
    import sys
    import threading

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    held = [opforge.nn.Linear(8, 8, fp8="tensorwise") for _ in range(1000)]  # many entries to walk
    with torch.no_grad():
        for lin in held:
            lin(x)
    m = held[0]
    m.weight.grad = torch.ones_like(m.weight)
    opt = torch.optim.SGD([m.weight], lr=1e-3)
    done, errors = threading.Event(), []

    def fill():
        live = []
        while not done.is_set():
            lin = opforge.nn.Linear(8, 8, fp8="tensorwise")
            with torch.no_grad():
                lin(x)
            live = (live + [lin])[-20:]

    def step():
        try:
            for _ in range(200):
                opt.step()
        except Exception as e:  # (collected: the assertion below names it)
            errors.append(repr(e))
        finally:
            done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        threads = [threading.Thread(target=fill), threading.Thread(target=step)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert _same(m(x).detach(), _fresh(m, x))


def test_revert_drops_the_cached_operands():
    """After `patch.revert`, no projection is FP8: the cache holds nothing of the model, and an optimizer step over
    the reverted model quantizes nothing (the refresh does not keep quantizing weights no FP8 layer uses)."""
    from opforge import patch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).float().train()
    patch.apply(model, fp8="tensorwise")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    _run(model, ids)  # every FP8 projection cached
    patch.revert(model)
    assert not any(p in _fp8_cache._CACHE for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _run(model, ids)
    n0 = _fp8_cache.QUANTIZED[0]
    opt.step()
    assert _fp8_cache.QUANTIZED[0] == n0
