"""The conformance table: one OpInfo-style entry per public opforge op (tolerances: opforge.testing).

``test_conformance.py`` drives every entry (and the backward ops its gradient calls) through the same
checks: forward and gradients against the float64 reference of ``opforge.testing`` with the tolerance
rule, ``torch.library.opcheck``, ``torch.compile(fullgraph=True)`` static and dynamic, ``gradcheck`` and
``gradgradcheck`` (or the lazy double-backward error), Meta against the real kernels, every bad input,
compiled autograd, ``torch.func``, ``is_grads_batched`` and autocast. ``test_consistency.py`` fails when a public schema in
``csrc/library.cpp`` has no entry here.

Adding an op (docs/adding_an_op.md, "The conformance entry"): write a sample generator and a bad-input
list, then append one ``OpEntry(...)`` to ``ENTRIES`` at the end of this file, in a block of its own::

    # ---- rope -----------------------------------------------------------------------------------
    def _rope_samples(device, dtype): ...        # Sample("contiguous", (x, cos, sin)), views, zero-size
    def _rope_bad(device): ...                   # >= 10 Bad(...) cases, each its own message
    ENTRIES.append(OpEntry(name="rope", op=F.rope, reference=T.rope_reference,
                           baseline=<torch's own composition>, samples=_rope_samples,
                           small_samples=..., bad_inputs=_rope_bad, double_backward=False,
                           autocast="input_dtype", native=<the torch op it mirrors, for autocast>))

Everything else (opcheck of the backward and private ops, Meta, compile, torch.func, ...) follows from the
entry: the backward and private ops are found by recording what a forward+backward of the samples calls.
"""
from __future__ import annotations

import functools
import itertools
import math
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as TF
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

import opforge
import opforge.functional as F
import opforge.testing as T
from conftest import lce_lean, lce_lean_loss_bound, lean_accum_factor

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DTYPE_MSG = r"expected {} to have a floating dtype \(float64, float32, float16 or bfloat16\), but got {}"


# ---- the table's types ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One call of an op: ``entry.op(*args)``. Tensor args may be views (transposed, sliced, expanded,
    unaligned); every floating tensor arg is differentiated (the gradient taken with respect to the view
    itself, so it has the view's shape). ``grad_strided``: the upstream gradients are non-contiguous views.
    ``kwargs``: arguments passed by name to the op, its reference, baseline and native and to the schema (opcheck),
    never differentiated: options, and tensors the op has no gradient for (rope's cos/sin tables, cross-entropy's
    class weights, a position table)."""
    name: str
    args: tuple
    grad_strided: bool = False
    kwargs: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return self.name


@dataclass
class Bad:
    """One bad input: ``make(device)`` returns (callable, its args); calling it must raise ``exc`` with a message
    matching ``match`` and leave every tensor argument unchanged. ``devices``: where it is an error; an index
    value outside its range is one on the CPU only (CUDA never reads it and documents what happens instead, tested
    in the op's own test file: reading it would need a host synchronisation on every call)."""
    name: str
    make: Callable[[str], tuple]
    exc: type
    match: str
    devices: tuple = ("cpu", "cuda")


@dataclass
class OpEntry:
    """The conformance entry of one public op.

    name: the schema name (``torch.ops.opforge.<name>``); op: the functional wrapper (``opforge.<name>``);
    reference: float64 reference of ``opforge.testing`` with op's signature; baseline: torch's own composition of
    the same math (op's signature, computed in the input's dtype), the achievable error of the tolerance rule and
    the model for torch.func; native: the torch op this op mirrors, for the autocast policy (op's signature);
    samples(device, dtype): the accuracy grid; small_samples(device): float64 samples for gradcheck, compile,
    torch.func (first: contiguous, batched along dim 0 of the ``vmap_in_dims`` args); bad_inputs(device);
    double_backward: True = gradgradcheck, False = the lazy "double backward is not supported" error, raised by
    the backward op ``double_backward_error`` names (default ``<name>_backward``; a regex: ``(a|b)`` where the
    node depends on the options);
    reference_for: optional dtype -> reference, where the reference's defaults depend on the input dtype;
    check: optional tolerance hook (what, ours, ref, base, args, grad_outputs, **sample.kwargs) replacing
    assert_matches_reference (what: "output <i>" or "grad <j>", j counting the floating args);
    vmap_in_dims: per arg of small_samples()[0] (or of vmap_sample), 0 (per-sample) or None (shared);
    vmap_sample: optional device -> Sample for torch.func.vmap(grad), batched along dim 0 of the vmap_in_dims args,
    where a per-sample slice of small_samples()[0] is no valid input of the op;
    schema_args: optional args -> args of the schema, where op takes its sample args in another form than
    ``torch.ops.opforge.<name>`` (linear_cat: flat pieces vs one Tensor[]); used where the suite calls the schema;
    gradcheck_args: optional indices of the args whose gradient is the true derivative (default: every floating
    arg); a straight-through estimator's gradient is not, so gradcheck skips those (their gradients are checked
    against the reference's estimator) and () says none is;
    differentiable: False for an op documented as not differentiable: the gradient checks then assert that its
    outputs carry no autograd history, torch.func checks vmap of the forward;
    known_failures: {test function name: reason} of a defect the suite found in the op and that its owner has yet to
    fix: a strict xfail (it fails once the op is fixed, so the entry is removed with the fix);
    gradient_ops: names of private ops (not ``*_backward``) that the op's autograd calls to compute gradients, not
    differentiable themselves: opcheck'd with their recorded (detached) args and every bool[] mask, not as a
    differentiable private forward.
    """
    name: str
    op: Callable
    reference: Callable
    baseline: Callable
    native: Callable
    samples: Callable[[str, torch.dtype], Sequence[Sample]]
    small_samples: Callable[[str], Sequence[Sample]]
    bad_inputs: Callable[[str], Sequence[Bad]]
    double_backward: bool
    vmap_in_dims: tuple
    dtypes: tuple = FLOAT_DTYPES
    autocast: str = "input_dtype"  # "lower_precision" (linear-like) or "input_dtype" (core/autocast.h)
    check: Optional[Callable] = None
    double_backward_error: Optional[str] = None
    reference_for: Optional[Callable] = None
    vmap_sample: Optional[Callable[[str], Sample]] = None
    schema_args: Optional[Callable[[tuple], tuple]] = None
    gradcheck_args: Optional[tuple] = None
    differentiable: bool = True
    known_failures: dict = field(default_factory=dict)
    gradient_ops: tuple = ()

    def ref(self, dtype: torch.dtype) -> Callable:
        """The reference for inputs of ``dtype`` (called with float64 args): ``reference_for(dtype)`` where a default
        depends on the input's dtype (rms_norm's eps=None is float32's machine eps for float32/16-bit input)."""
        return self.reference_for(dtype) if self.reference_for is not None else self.reference

    def __repr__(self) -> str:
        return self.name


# ---- helpers shared by the generators -------------------------------------------------------------------------


def randn(shape, dtype, device, scale=1.0):
    """Normal values made in float64 then rounded (the same numbers in every dtype)."""
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def layouts(M, N, dtype, device, scale=1.0):
    """(name, (M, N) tensor) for contiguous, transposed, sliced, expanded and unaligned layouts."""
    return [
        ("contiguous", randn((M, N), dtype, device, scale)),
        ("transposed", randn((N, M), dtype, device, scale).t()),
        ("sliced", randn((M, 2 * N), dtype, device, scale)[:, ::2]),
        ("expanded", randn((1, N), dtype, device, scale).expand(M, N)),
        ("unaligned", randn((M * N + 1,), dtype, device, scale)[1:].view(M, N)),
    ]


def tensor_maker(device):
    """t(*shape, dtype=float32): a normal tensor of that shape on `device`, cast to dtype (the bad-input tables)."""
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, device=device).to(dtype)
    return t


def as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def tensors_of(args) -> list:
    return [a for a in args if isinstance(a, torch.Tensor)]


def differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.device.type != "meta"


def prepare(args, cast=None):
    """args with every floating tensor detached (strides kept), cast (e.g. to float64) and requiring grad.
    Returns (args, the list of those tensors)."""
    out, diff = [], []
    for a in args:
        if differentiable(a):
            a = (cast(a) if cast else a).detach().requires_grad_()
            diff.append(a)
        out.append(a)
    return tuple(out), diff


def grad_outputs(outs, strided: bool):
    """Random upstream gradients, contiguous or as every-second-element views of a larger tensor."""
    gs = []
    for o in outs:
        if strided and o.dim() >= 1:
            g = torch.randn(*o.shape[:-1], 2 * o.shape[-1], dtype=torch.float64)[..., ::2]
        else:
            g = torch.randn(o.shape, dtype=torch.float64)
        gs.append(g.to(dtype=o.dtype, device=o.device))
    return gs


def run_forward_backward(fn, args, gouts=None, strided=False, cast=None):
    """fn(*args) with gradients w.r.t. every floating arg. Returns (outputs, grads, upstream gradients)."""
    args, diff = prepare(args, cast)
    outs = as_tuple(fn(*args))
    douts = [o for o in outs if o.requires_grad]
    if gouts is None:
        gouts = grad_outputs(douts, strided)
    elif cast is not None:
        gouts = [cast(g) for g in gouts]
    grads = torch.autograd.grad(douts, diff, gouts, allow_unused=True) if douts and diff else [None] * len(diff)
    return [o.detach() for o in outs], list(grads), gouts


def on_meta(args):
    """args with every tensor (also inside a list: a Tensor[] argument) replaced by a meta tensor of the same shape,
    strides and dtype."""
    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
        if isinstance(a, list) and a and all(isinstance(t, torch.Tensor) for t in a):
            return [meta(t) for t in a]
        return a
    return tuple(meta(a) for a in args)


def on_meta_kwargs(kwargs):
    """kwargs with every tensor value replaced as on_meta does."""
    return dict(zip(kwargs, on_meta(tuple(kwargs.values()))))


class RecordOpforgeCalls(TorchDispatchMode):
    """Records every opforge op call that reaches below autograd (forward, private forward, backward ops)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "opforge":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def recorded_calls(entry: OpEntry, device: str):
    """{qualified op name: [(OpOverload, args, kwargs), ...]} of everything one forward+backward of each small
    float32 sample calls (args detached copies: safe to reuse)."""
    found = {}
    for s in entry.small_samples(device):
        args = tuple(a.float() if differentiable(a) else a for a in s.args)
        kwargs = {k: (v.float() if differentiable(v) else v) for k, v in s.kwargs.items()}
        with RecordOpforgeCalls() as rec:
            run_forward_backward(functools.partial(entry.op, **kwargs), args)
        for func, a, k in rec.calls:
            a = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else
                      [t.detach().clone() for t in x] if isinstance(x, list) and x and isinstance(x[0], torch.Tensor)
                      else x for x in a)
            found.setdefault(func._schema.name, []).append((func, a, k))
    return found


def mask_variants(args):
    """args, and for every ``bool[]`` argument each other combination of the mask."""
    idx = [i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and a and all(isinstance(b, bool) for b in a)]
    if not idx:
        return [args]
    out = []
    for i in idx:
        for combo in itertools.product([True, False], repeat=len(args[i])):
            a = list(args)
            a[i] = list(combo)
            out.append(tuple(a))
    return out


# ---- elementwise: sigmoid, square, square_add -------------------------------------------------------------------


def _unary_samples(scale):
    def samples(device, dtype):
        out = [Sample(f"83x7_{name}", (x,), grad_strided=(i % 2 == 1))
               for i, (name, x) in enumerate(layouts(83, 7, dtype, device, scale))]
        out += [
            Sample("1x1", (randn((1, 1), dtype, device, scale),)),
            Sample("odd_769x5", (randn((769, 5), dtype, device, scale),)),
            Sample("zero_size_0x7", (randn((0, 7), dtype, device),)),
            Sample("zero_size_7x0", (randn((7, 0), dtype, device),)),
            Sample("0d", (randn((), dtype, device, scale),)),
            Sample("4d_permuted", (randn((3, 5, 7, 9), dtype, device, scale).permute(2, 0, 3, 1),), grad_strided=True),
        ]
        return out
    return samples


def _unary_small(device):
    return [Sample("contiguous", (randn((4, 5), torch.float64, device),)),
            Sample("transposed", (randn((5, 4), torch.float64, device).t(),))]


def _unary_bad(name, backward, saved_name):
    op = getattr(opforge, name)
    bw = getattr(torch.ops.opforge, backward)

    def bad(device):
        def t(*shape, dtype=torch.float32):
            return torch.ones(shape, dtype=dtype, device=device) if not dtype.is_floating_point and not dtype.is_complex \
                else torch.randn(shape, device=device).to(dtype)
        pre = rf"opforge::{name}: "
        bpre = rf"opforge::{backward}: "
        return [
            Bad("int32", lambda d: (op, (t(3, 4, dtype=torch.int32),)), TypeError, pre + DTYPE_MSG.format("input", "Int")),
            Bad("int64", lambda d: (op, (t(3, dtype=torch.int64),)), TypeError, pre + DTYPE_MSG.format("input", "Long")),
            Bad("uint8", lambda d: (op, (t(3, dtype=torch.uint8),)), TypeError, pre + DTYPE_MSG.format("input", "Byte")),
            Bad("bool", lambda d: (op, (t(3, 4, dtype=torch.bool),)), TypeError, pre + DTYPE_MSG.format("input", "Bool")),
            Bad("complex64", lambda d: (op, (t(3, dtype=torch.complex64),)), TypeError,
                pre + DTYPE_MSG.format("input", "ComplexFloat")),
            Bad("complex128", lambda d: (op, (t(2, 2, dtype=torch.complex128),)), TypeError,
                pre + DTYPE_MSG.format("input", "ComplexDouble")),
            # no tensor at all reaches a kernel: the functional wrapper turns the dispatcher's error into the op's
            Bad("none", lambda d: (op, (None,)), ValueError, pre + "expected input to be a tensor, but got None"),
            Bad("backward_shape", lambda d: (bw, (t(3, 4), t(4, 3))), ValueError,
                bpre + rf"expected grad_output and {saved_name} of the same shape, but got \[3, 4\] and \[4, 3\]"),
            Bad("backward_numel_shape", lambda d: (bw, (t(3, 4), t(12))), ValueError,
                bpre + rf"expected grad_output and {saved_name} of the same shape, but got \[3, 4\] and \[12\]"),
            Bad("backward_int_grad", lambda d: (bw, (t(3, 4, dtype=torch.int32), t(3, 4))), TypeError,
                bpre + DTYPE_MSG.format("grad_output", "Int")),
            Bad("backward_complex_saved", lambda d: (bw, (t(3, 4), t(3, 4, dtype=torch.complex64))), TypeError,
                bpre + DTYPE_MSG.format(saved_name, "ComplexFloat")),
            Bad("backward_none_saved", lambda d: (bw, (t(3, 4), None)), ValueError,
                bpre + f"expected {saved_name} to be a tensor, but got None"),
            Bad("backward_other_device", lambda d: (bw, (t(3, 4), torch.empty(3, 4, device="meta"))), RuntimeError,
                bpre + rf"expected grad_output and {saved_name} to be on the same device"),
        ]
    return bad


def _square_add_samples(device, dtype):
    out = []
    for i, (name, x) in enumerate(layouts(83, 7, dtype, device)):
        out.append(Sample(f"{name}_other_row", (x, randn((7,), dtype, device)), grad_strided=(i % 2 == 1)))
    out += [
        Sample("other_col", (randn((83, 7), dtype, device), randn((83, 1), dtype, device))),
        Sample("other_0d", (randn((83, 7), dtype, device), randn((), dtype, device))),
        Sample("other_same_transposed", (randn((83, 7), dtype, device), randn((7, 83), dtype, device).t())),
        Sample("other_expanded", (randn((83, 7), dtype, device), randn((7,), dtype, device).expand(83, 7))),
        Sample("4d_other_broadcast", (randn((3, 5, 7, 9), dtype, device), randn((5, 1, 9), dtype, device))),
        Sample("zero_size", (randn((0, 7), dtype, device), randn((7,), dtype, device))),
        Sample("0d", (randn((), dtype, device), randn((), dtype, device))),
        Sample("1x1", (randn((1, 1), dtype, device), randn((1,), dtype, device))),
    ]
    return out


def _square_add_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((4, 5), d, device), randn((5,), d, device))),
            Sample("transposed_col", (randn((5, 4), d, device).t(), randn((4, 1), d, device)))]


def _square_add_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.square_add, torch.ops.opforge.square_add_backward
    pre, bpre = "opforge::square_add: ", "opforge::square_add_backward: "
    f = lambda: t(3, 4)  # noqa: E731
    return [
        Bad("int_input", lambda d: (op, (t(3, 4, dtype=torch.int32), f())), TypeError, pre + DTYPE_MSG.format("input", "Int")),
        Bad("int_other", lambda d: (op, (f(), t(3, 4, dtype=torch.int32))), TypeError, pre + DTYPE_MSG.format("other", "Int")),
        Bad("bool_other", lambda d: (op, (f(), t(4, dtype=torch.bool))), TypeError, pre + DTYPE_MSG.format("other", "Bool")),
        Bad("complex_other", lambda d: (op, (f(), t(3, 4, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("other", "ComplexFloat")),
        Bad("not_broadcastable", lambda d: (op, (f(), t(5))), ValueError,
            pre + r"expected other broadcastable to input's shape \[3, 4\], but got other of shape \[5\]"),
        Bad("other_larger", lambda d: (op, (t(3, 1), f())), ValueError,
            pre + r"expected other broadcastable to input's shape \[3, 1\], but got other of shape \[3, 4\]"),
        Bad("other_more_dims", lambda d: (op, (f(), t(2, 3, 4))), ValueError,
            pre + r"expected other broadcastable to input's shape \[3, 4\], but got other of shape \[2, 3, 4\]"),
        Bad("none_input", lambda d: (op, (None, f())), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("none_other", lambda d: (op, (f(), None)), ValueError, pre + "expected other to be a tensor, but got None"),
        Bad("other_device", lambda d: (op, (f(), torch.empty(4, device="meta"))), RuntimeError,
            pre + r"expected input and other to be on the same device"),
        Bad("backward_shape", lambda d: (bw, (t(5, 4), f(), t(4), [True, True])), ValueError,
            bpre + r"expected grad_output of input's shape \[3, 4\], but got \[5, 4\]"),
        Bad("backward_shape_other_only", lambda d: (bw, (t(5, 4), f(), t(4), [False, True])), ValueError,
            bpre + r"expected grad_output of input's shape \[3, 4\], but got \[5, 4\]"),
        Bad("backward_int_grad", lambda d: (bw, (t(3, 4, dtype=torch.int32), f(), t(4), [False, True])), TypeError,
            bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_not_broadcastable", lambda d: (bw, (f(), f(), t(5), [True, True])), ValueError,
            pre + r"expected other broadcastable to input's shape \[3, 4\], but got other of shape \[5\]"),
    ]


# ---- swiglu ---------------------------------------------------------------------------------------------------


def _swiglu_baseline(gate, up):
    return TF.silu(gate) * up


def _swiglu_samples(device, dtype):
    gates = layouts(83, 7, dtype, device, 3.0)
    ups = layouts(83, 7, dtype, device)
    out = [Sample(f"{g[0]}_{u[0]}", (g[1], u[1]), grad_strided=(i % 2 == 1))
           for i, (g, u) in enumerate(zip(gates, ups[1:] + ups[:1]))]
    out += [
        Sample("1", (randn((1,), dtype, device), randn((1,), dtype, device))),
        Sample("odd_3x769", (randn((3, 769), dtype, device, 3.0), randn((3, 769), dtype, device))),
        Sample("zero_size", (randn((0, 5), dtype, device), randn((0, 5), dtype, device))),
        Sample("0d", (randn((), dtype, device), randn((), dtype, device))),
    ]
    return out


def _swiglu_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((4, 5), d, device), randn((4, 5), d, device))),
            Sample("transposed", (randn((5, 4), d, device).t(), randn((4, 5), d, device)))]


def _swiglu_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.swiglu, torch.ops.opforge.swiglu_backward
    pre, bpre = "opforge::swiglu: ", "opforge::swiglu_backward: "
    return [
        Bad("shape", lambda d: (op, (t(3, 4), t(3, 5))), ValueError,
            pre + r"expected gate and up of the same shape, but got \[3, 4\] and \[3, 5\]"),
        Bad("broadcastable_shape", lambda d: (op, (t(3, 4), t(4))), ValueError,
            pre + r"expected gate and up of the same shape, but got \[3, 4\] and \[4\]"),
        Bad("int_gate", lambda d: (op, (t(3, dtype=torch.int64), t(3))), TypeError, pre + DTYPE_MSG.format("gate", "Long")),
        Bad("complex_up", lambda d: (op, (t(3), t(3, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("up", "ComplexFloat")),
        Bad("bool_up", lambda d: (op, (t(3), t(3, dtype=torch.bool))), TypeError, pre + DTYPE_MSG.format("up", "Bool")),
        Bad("none_gate", lambda d: (op, (None, t(3))), ValueError, pre + "expected gate to be a tensor, but got None"),
        Bad("none_up", lambda d: (op, (t(3), None)), ValueError, pre + "expected up to be a tensor, but got None"),
        Bad("device", lambda d: (op, (t(3), torch.empty(3, device="meta"))), RuntimeError,
            pre + "expected gate and up to be on the same device"),
        Bad("backward_grad_shape", lambda d: (bw, (t(3, 5), t(3, 4), t(3, 4))), ValueError,
            bpre + r"expected grad_output of gate's shape \[3, 4\], but got \[3, 5\]"),
        Bad("backward_shape", lambda d: (bw, (t(3, 4), t(3, 4), t(4, 3))), ValueError,
            bpre + r"expected gate and up of the same shape, but got \[3, 4\] and \[4, 3\]"),
        Bad("backward_int_grad", lambda d: (bw, (t(3, 4, dtype=torch.int32), t(3, 4), t(3, 4))), TypeError,
            bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_grad_device", lambda d: (bw, (torch.empty(3, 4, device="meta"), t(3, 4), t(3, 4))), RuntimeError,
            bpre + "expected grad_output and gate to be on the same device"),
    ]


# ---- rms_norm, fused_add_rms_norm -------------------------------------------------------------------------------


def _eps_of(dtype):
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _rms_norm_reference_for(dtype):
    def ref(input, normalized_shape, weight=None, eps=None):
        return T.rms_norm_reference(input, normalized_shape, weight, _eps_of(dtype) if eps is None else eps)
    return ref


def _fused_add_rms_norm_reference_for(dtype):
    def ref(input, residual, normalized_shape, weight=None, eps=None):
        return T.fused_add_rms_norm_reference(input, residual, normalized_shape, weight,
                                              _eps_of(dtype) if eps is None else eps)
    return ref


def _rms_norm_baseline(input, normalized_shape, weight=None, eps=None):
    return TF.rms_norm(input, normalized_shape, weight, eps)


def _fused_add_rms_norm_baseline(input, residual, normalized_shape, weight=None, eps=None):
    z = input + residual.to(input.dtype)
    return TF.rms_norm(z, normalized_shape, weight, eps), z


def _rms_norm_samples(device, dtype, fused=False):
    def res(shape):
        return (randn(shape, dtype, device),) if fused else ()

    def w(n):
        return (1 + 0.5 * randn(n, torch.float32, device)).to(dtype)

    out = []
    for i, (name, x) in enumerate(layouts(7, 83, dtype, device)):
        out.append(Sample(f"{name}_weight", (x, *res((7, 83)), (83,), w((83,))), grad_strided=(i % 2 == 1)))
    out += [
        Sample("no_weight", (randn((5, 3, 33), dtype, device), *res((5, 3, 33)), (33,))),
        Sample("two_dims", (randn((4, 6, 33), dtype, device), *res((4, 6, 33)), (6, 33), w((6, 33)))),
        Sample("eps_1e-3", (randn((3, 769), dtype, device), *res((3, 769)), (769,), w((769,)), 1e-3)),
        Sample("N_1", (randn((5, 1), dtype, device), *res((5, 1)), (1,), w((1,)))),
        Sample("1d", (randn((83,), dtype, device), *res((83,)), (83,), w((83,)))),
        Sample("zero_rows", (randn((0, 83), dtype, device), *res((0, 83)), (83,), w((83,)))),
        Sample("permuted_rows", (randn((4, 33, 3), dtype, device).permute(0, 2, 1), *res((4, 3, 33)), (33,),
                                 w((33,))), grad_strided=True),
    ]
    return out


def _rms_norm_small(device, fused=False):
    d = torch.float64
    r = (lambda s: (randn(s, d, device),)) if fused else (lambda s: ())
    return [Sample("contiguous", (randn((3, 2, 7), d, device), *r((3, 2, 7)), (7,), randn((7,), d, device), 1e-3)),
            Sample("transposed_no_weight", (randn((7, 4), d, device).t(), *r((4, 7)), (7,), None, 1e-3)),
            Sample("two_dims_default_eps", (randn((3, 2, 5), d, device), *r((3, 2, 5)), (2, 5), randn((2, 5), d, device)))]


def _rms_norm_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.rms_norm, torch.ops.opforge.rms_norm_backward
    pre, bpre = "opforge::rms_norm: ", "opforge::rms_norm_backward: "
    return [
        Bad("trailing_dims", lambda d: (op, (t(4, 8), (7,))), ValueError,
            pre + r"expected input with trailing dims equal to normalized_shape \[7\], but got input of shape \[4, 8\]"),
        Bad("too_many_dims", lambda d: (op, (t(8), (2, 8))), ValueError,
            pre + r"expected input with trailing dims equal to normalized_shape \[2, 8\], but got input of shape \[8\]"),
        Bad("empty_normalized_shape", lambda d: (op, (t(4, 8), ())), ValueError,
            pre + r"expected normalized_shape to have at least 1 dimension, but got \[\]"),
        Bad("weight_shape", lambda d: (op, (t(4, 8), (8,), t(7))), ValueError,
            pre + r"expected weight of shape \[8\], but got \[7\]"),
        Bad("int_input", lambda d: (op, (t(4, 8, dtype=torch.int32), (8,))), TypeError, pre + DTYPE_MSG.format("input", "Int")),
        Bad("int_weight", lambda d: (op, (t(4, 8), (8,), t(8, dtype=torch.int64))), TypeError,
            pre + DTYPE_MSG.format("weight", "Long")),
        Bad("negative_eps", lambda d: (op, (t(4, 8), (8,), None, -1.0)), ValueError, pre + "expected eps >= 0, but got -1"),
        Bad("nan_eps", lambda d: (op, (t(4, 8), (8,), None, float("nan"))), ValueError, pre + "expected eps >= 0, but got nan"),
        Bad("normalized_shape_type", lambda d: (op, (t(4, 8), 8.0)), TypeError,
            r"opforge::rms_norm: expected normalized_shape to be an int or a sequence of ints"),
        Bad("none_input", lambda d: (op, (None, (8,), t(8))), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("weight_device", lambda d: (op, (t(4, 8), (8,), torch.empty(8, device="meta"))), RuntimeError,
            pre + "expected input and weight to be on the same device"),
        Bad("backward_rstd_shape", lambda d: (bw, (t(4, 8), t(4, 8), t(3), None, [True, True])), ValueError,
            bpre + r"expected rstd of input's leading dims \(input \[4, 8\] without the normalized dims\), but got \[3\]"),
        Bad("backward_grad_shape", lambda d: (bw, (t(4, 7), t(4, 8), t(4), None, [True, True])), ValueError,
            bpre + r"expected grad_output of input's shape \[4, 8\], but got \[4, 7\]"),
        Bad("backward_rstd_dtype", lambda d: (bw, (t(4, 8), t(4, 8), t(4, dtype=torch.float64), None, [True, True])),
            TypeError, bpre + "expected rstd of dtype Float, but got Double"),
        Bad("backward_weight_shape", lambda d: (bw, (t(4, 8), t(4, 8), t(4), t(7), [True, True])), ValueError,
            bpre + r"expected weight of shape \[8\], but got \[7\]"),
    ]


def _fused_add_rms_norm_bad(device):
    t = tensor_maker(device)
    op = opforge.fused_add_rms_norm
    pre = "opforge::fused_add_rms_norm: "
    return [
        Bad("residual_shape", lambda d: (op, (t(4, 8), t(3, 8), (8,))), ValueError,
            pre + r"expected residual of input's shape \[4, 8\], but got \[3, 8\]"),
        Bad("residual_broadcastable", lambda d: (op, (t(4, 8), t(8), (8,))), ValueError,
            pre + r"expected residual of input's shape \[4, 8\], but got \[8\]"),
        Bad("trailing_dims", lambda d: (op, (t(4, 8), t(4, 8), (7,))), ValueError,
            pre + r"expected input with trailing dims equal to normalized_shape \[7\], but got input of shape \[4, 8\]"),
        Bad("empty_normalized_shape", lambda d: (op, (t(4, 8), t(4, 8), [])), ValueError,
            pre + r"expected normalized_shape to have at least 1 dimension"),
        Bad("weight_shape", lambda d: (op, (t(4, 8), t(4, 8), (8,), t(4, 2))), ValueError,
            pre + r"expected weight of shape \[8\], but got \[4, 2\]"),
        Bad("int_residual", lambda d: (op, (t(4, 8), t(4, 8, dtype=torch.int32), (8,))), TypeError,
            pre + DTYPE_MSG.format("residual", "Int")),
        Bad("complex_input", lambda d: (op, (t(4, 8, dtype=torch.complex64), t(4, 8), (8,))), TypeError,
            pre + DTYPE_MSG.format("input", "ComplexFloat")),
        Bad("negative_eps", lambda d: (op, (t(4, 8), t(4, 8), (8,), None, -1e-6)), ValueError, pre + "expected eps >= 0"),
        Bad("normalized_shape_type", lambda d: (op, (t(4, 8), t(4, 8), object())), TypeError,
            r"opforge::fused_add_rms_norm: expected normalized_shape to be an int or a sequence of ints"),
        Bad("none_residual", lambda d: (op, (t(4, 8), None, (8,))), ValueError,
            pre + "expected residual to be a tensor, but got None"),
        Bad("none_input", lambda d: (op, (None, t(4, 8), (8,))), ValueError,
            pre + "expected input to be a tensor, but got None"),
        Bad("residual_device", lambda d: (op, (t(4, 8), torch.empty(4, 8, device="meta"), (8,))), RuntimeError,
            pre + "expected input and residual to be on the same device"),
    ]


# ---- linear -------------------------------------------------------------------------------------------------------


def _linear_baseline(input, weight, bias=None, activation="none"):
    dt = input.dtype
    return T.activation_reference(TF.linear(input, weight.to(dt), bias.to(dt) if bias is not None else None),
                                  activation)


def _linear_native(input, weight, bias=None, activation="none"):
    return T.activation_reference(TF.linear(input, weight, bias), activation)


def _linear_check(what, ours, ref, base, args, gouts, **kwargs):
    """The tolerance rule with the a-priori GEMM rounding bound of output, grad_input and grad_weight
    (opforge.testing.gemm_error_bound): a correct GEMM may sum in another order than torch's."""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    act = args[3] if len(args) > 3 else "none"
    dt = x.dtype
    bound = None
    if act == "none":
        g = gouts[0]
        if what == "output 0":
            bound = T.gemm_error_bound(x, w, dt)
            if b is not None:
                bound = bound + torch.finfo(dt).eps * b.detach().double().abs()
        elif what == "grad 0":
            bound = T.gemm_error_bound(g, w.t(), dt).reshape(x.shape)
        elif what == "grad 1":
            rows = lambda t: t.flatten(0, -2) if t.dim() >= 2 else t.unsqueeze(0)  # noqa: E731
            x2, g2 = rows(x), rows(g)
            bound = T.gemm_error_bound(g2.t(), x2.t(), dt)
    T.assert_matches_reference(ours, ref, base, what=what, bound=bound)


def _linear_samples(device, dtype):
    def ops(M, K, N, bias=True, x_layout="contiguous", w_layout="contiguous"):
        if x_layout == "transposed":
            x = randn((K, M), dtype, device).t()
        elif x_layout == "sliced_3d":
            x = randn((3, M, 2 * K), dtype, device)[:, :, ::2].transpose(0, 1)
        else:
            x = randn((M, K), dtype, device)
        w = randn((K, N), dtype, device).t() if w_layout == "transposed" else randn((N, K), dtype, device)
        return (x, w, randn((N,), dtype, device)) if bias else (x, w)

    return [
        Sample("7x83x9", ops(7, 83, 9)),
        Sample("1x1x1", ops(1, 1, 1)),
        Sample("no_bias_83x7x5", ops(83, 7, 5, bias=False), grad_strided=True),
        Sample("weight_transposed", ops(7, 33, 9, w_layout="transposed")),
        Sample("input_transposed", ops(9, 33, 7, x_layout="transposed"), grad_strided=True),
        Sample("input_sliced_3d", ops(5, 17, 6, x_layout="sliced_3d")),
        Sample("zero_rows", ops(0, 5, 3)),
        Sample("zero_in_features", ops(4, 0, 3)),
        Sample("zero_out_features", ops(4, 5, 0)),
        Sample("1d_input", (randn((17,), dtype, device), randn((5, 17), dtype, device), randn((5,), dtype, device))),
    ]


def _linear_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((3, 4), d, device), randn((5, 4), d, device), randn((5,), d, device))),
            Sample("transposed_weight_3d", (randn((2, 3, 4), d, device), randn((4, 5), d, device).t())),
            Sample("gelu", (randn((3, 4), d, device), randn((5, 4), d, device), randn((5,), d, device), "gelu")),
            # silu: its double backward is at::silu_backward, which ATen cannot differentiate
            # (test_linear.py::test_silu_double_backward, xfail until linear.cpp's is fixed)
            Sample("relu", (randn((3, 4), d, device), randn((5, 4), d, device), None, "relu"))]


def _linear_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.linear, torch.ops.opforge.linear_backward
    pre, bpre = "opforge::linear: ", "opforge::linear_backward: "
    return [
        Bad("rank0", lambda d: (op, (torch.tensor(1.0, device=device), t(3, 1))), ValueError,
            pre + "expected input to have at least 1 dimension"),
        Bad("weight_1d", lambda d: (op, (t(4, 8), t(8))), ValueError,
            pre + r"expected weight to be 2-D \(out_features, in_features\), but got shape \[8\]"),
        Bad("weight_3d", lambda d: (op, (t(4, 8), t(2, 3, 8))), ValueError,
            pre + r"expected weight to be 2-D \(out_features, in_features\), but got shape \[2, 3, 8\]"),
        Bad("in_features", lambda d: (op, (t(4, 511), t(256, 512))), ValueError,
            pre + r"expected input's last dimension to equal weight's in_features 512, but got 511"),
        Bad("bias_shape", lambda d: (op, (t(4, 8), t(3, 8), t(4))), ValueError,
            pre + r"expected bias of shape \[3\] \(weight's out_features\), but got \[4\]"),
        Bad("bias_2d", lambda d: (op, (t(4, 8), t(3, 8), t(1, 3))), ValueError,
            pre + r"expected bias of shape \[3\] \(weight's out_features\), but got \[1, 3\]"),
        Bad("int_input", lambda d: (op, (t(4, 8, dtype=torch.int32), t(3, 8))), TypeError, pre + DTYPE_MSG.format("input", "Int")),
        Bad("complex_input", lambda d: (op, (t(4, 8, dtype=torch.complex64), t(3, 8))), TypeError,
            pre + DTYPE_MSG.format("input", "ComplexFloat")),
        Bad("int_weight", lambda d: (op, (t(4, 8), t(3, 8, dtype=torch.int64))), TypeError,
            pre + DTYPE_MSG.format("weight", "Long")),
        Bad("bool_weight", lambda d: (op, (t(4, 8), t(3, 8, dtype=torch.bool))), TypeError,
            pre + DTYPE_MSG.format("weight", "Bool")),
        Bad("complex_bias", lambda d: (op, (t(4, 8), t(3, 8), t(3, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("bias", "ComplexFloat")),
        Bad("activation", lambda d: (op, (t(4, 8), t(3, 8), None, "tanh")), ValueError,
            pre + r'expected activation to be one of "none", "relu", "gelu", "gelu_tanh", "silu", but got "tanh"'),
        Bad("none_weight", lambda d: (op, (t(4, 8), None)), ValueError, pre + "expected weight to be a tensor, but got None"),
        Bad("none_input", lambda d: (op, (None, t(3, 8))), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("weight_device", lambda d: (op, (t(4, 8), torch.empty(3, 8, device="meta"))), RuntimeError,
            pre + rf"expected input and weight to be on the same device, but got input on {device}\S* and weight on meta"),
        Bad("bias_device", lambda d: (op, (t(4, 8), t(3, 8), torch.empty(3, device="meta"))), RuntimeError,
            pre + rf"expected input and bias to be on the same device, but got input on {device}\S* and bias on meta"),
        Bad("backward_activation", lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), [True, True, True], None, "x", t(4, 3))),
            ValueError, bpre + r'expected activation to be one of .*but got "x"'),
        Bad("backward_missing_pre_activation", lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), [True, True, True], None, "gelu")),
            ValueError, bpre + r'expected pre_activation .* for activation "gelu", but got None'),
        Bad("backward_pre_activation_shape",
            lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), [True, True, True], None, "silu", t(4, 2))), ValueError,
            bpre + r"expected pre_activation of shape \[4, 3\] \(grad_output's shape\), but got \[4, 2\]"),
        Bad("backward_int_pre_activation",
            lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), [True, True, True], None, "relu", t(4, 3, dtype=torch.int32))),
            TypeError, bpre + "expected pre_activation to have a floating dtype"),
    ]


# ---- the table -----------------------------------------------------------------------------------------------------

ENTRIES: list = [
    OpEntry(name="sigmoid", op=F.sigmoid, reference=T.sigmoid_reference, baseline=torch.sigmoid, native=torch.sigmoid,
            samples=_unary_samples(4.0), small_samples=_unary_small,
            bad_inputs=_unary_bad("sigmoid", "sigmoid_backward", "output"), double_backward=True, vmap_in_dims=(0,)),
    OpEntry(name="square", op=F.square, reference=T.square_reference, baseline=torch.square, native=torch.square,
            samples=_unary_samples(1.0), small_samples=_unary_small,
            bad_inputs=_unary_bad("square", "square_backward", "input"), double_backward=True, vmap_in_dims=(0,)),
    OpEntry(name="square_add", op=F.square_add, reference=T.square_add_reference, baseline=lambda x, o: x * x + o,
            native=lambda x, o: x * x + o, samples=_square_add_samples, small_samples=_square_add_small,
            bad_inputs=_square_add_bad, double_backward=True, vmap_in_dims=(0, None)),
    OpEntry(name="swiglu", op=F.swiglu, reference=T.swiglu_reference, baseline=_swiglu_baseline,
            native=_swiglu_baseline, samples=_swiglu_samples, small_samples=_swiglu_small, bad_inputs=_swiglu_bad,
            double_backward=True, vmap_in_dims=(0, 0)),
    OpEntry(name="rms_norm", op=F.rms_norm, reference=T.rms_norm_reference, baseline=_rms_norm_baseline,
            native=_rms_norm_baseline, samples=_rms_norm_samples, small_samples=_rms_norm_small,
            bad_inputs=_rms_norm_bad, double_backward=False, vmap_in_dims=(0, None, None, None),
            reference_for=_rms_norm_reference_for),
    OpEntry(name="fused_add_rms_norm", op=F.fused_add_rms_norm, reference=T.fused_add_rms_norm_reference,
            baseline=_fused_add_rms_norm_baseline, native=_fused_add_rms_norm_baseline,
            samples=lambda dev, dt: _rms_norm_samples(dev, dt, fused=True),
            small_samples=lambda dev: _rms_norm_small(dev, fused=True), bad_inputs=_fused_add_rms_norm_bad,
            double_backward=False, double_backward_error="rms_norm_backward", vmap_in_dims=(0, 0, None, None, None),
            reference_for=_fused_add_rms_norm_reference_for),
    OpEntry(name="linear", op=F.linear, reference=T.linear_reference, baseline=_linear_baseline, native=_linear_native,
            samples=_linear_samples, small_samples=_linear_small, bad_inputs=_linear_bad, double_backward=True,
            vmap_in_dims=(0, None, None), autocast="lower_precision", check=_linear_check),
]

# ---- entries of the ops added in parallel (linear_cross_entropy, rope, fake_quant_linear, linear_cat,
# indexed_linear): append `ENTRIES.append(OpEntry(...))` below, one block per op (see the module docstring).


def _ste(x, values, mask):
    """values with the straight-through gradient of x masked by `mask` (d/dx = mask): the estimator of the
    fake-quantizing ops, written with torch ops so autograd and torch.func differentiate it."""
    return values.detach() + (x - x.detach()) * mask


def _bias_bound(b, dt):
    return 0 if b is None else torch.finfo(dt).eps * b.detach().double().abs()


def _rows(t):
    """t as a 2-D (rows, last dim) tensor ((*, K) as (N, K), also for K = 0)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)


# ---- linear_cross_entropy --------------------------------------------------------------------------------------


def _lce(input, linear_weight, target, linear_bias=None, **kwargs):
    """opforge.linear_cross_entropy with linear_bias positional (it is differentiated; the functional takes it by
    name only), in the schema's order; the class weights and options come by name (Sample.kwargs)."""
    return F.linear_cross_entropy(input, linear_weight, target, linear_bias=linear_bias, **kwargs)


def _lce_reference(input, linear_weight, target, linear_bias=None, chunk_size=None, **kwargs):
    return T.linear_cross_entropy_reference(input, linear_weight, target, linear_bias=linear_bias, **kwargs)


def _lce_baseline(input, linear_weight, target, linear_bias=None, chunk_size=None, **kwargs):
    """The reference's math done in input's dtype (its compute_dtype): the achievable error; the loss in float32 for
    16-bit inputs (float64 for float64), the dtype opforge computes and returns it in."""
    loss = T.linear_cross_entropy_reference(input, linear_weight, target, linear_bias=linear_bias,
                                            compute_dtype=input.dtype, **kwargs)
    return loss.to(torch.float64 if input.dtype == torch.float64 else torch.float32)


def _lce_native(input, linear_weight, target, linear_bias=None, weight=None, reduction="mean", ignore_index=-100,
                label_smoothing=0.0, **kwargs):
    """torch's linear then cross_entropy: under autocast the GEMM in the lower precision, the loss in float32."""
    z = TF.linear(input, linear_weight, linear_bias)
    return TF.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1), weight=weight, reduction=reduction,
                            ignore_index=ignore_index, label_smoothing=label_smoothing)


def _lce_check(what, ours, ref, base, args, gouts, chunk_size=None, **kwargs):
    """The tolerance rule; in lean mode (conftest.lce_lean: CUDA, OPFORGE_LCE_LEAN=1, 16-bit input and head) the
    loss may also pass by the a-priori bound of its logits' rounding to the 16-bit dtype (conftest.lce_lean_loss_bound)
    and the weight gradient, accumulated in that dtype over k > 1 chunks, takes the factor conftest.lean_accum_factor(k)
    (docs/ops/linear_cross_entropy.md, "Lean mode"). Outside lean mode: the plain rule."""
    x, w, t = args[0], args[1], args[2]
    b = args[3] if len(args) > 3 else None
    bound, factor = None, 2.0
    if lce_lean(x, w, b):
        if what == "output 0":
            bound = lce_lean_loss_bound(x, w, t, b, **kwargs)
        elif what == "grad 1":
            N = t.numel()
            factor = lean_accum_factor(math.ceil(N / (chunk_size or max(N, 1))))
    T.assert_matches_reference(ours, ref, base, what=what, factor=factor, bound=bound)


def _lce_data(lead, H, V, dtype, device, ignore=0.2, scale=2.0):
    x = randn((*lead, H), dtype, device, scale)
    w = randn((V, H), dtype, device, 1 / math.sqrt(H))
    b = randn((V,), dtype, device)
    t = torch.randint(0, V, lead)
    t[torch.rand(lead) < ignore] = -100
    return x, w, t.to(device), b


def _lce_samples(device, dtype):
    x, w, t, b = _lce_data((37,), 24, 83, dtype, device)
    cw = (torch.rand(83) + 0.5).to(dtype=dtype, device=device)
    x3, _, t3, _ = _lce_data((3, 5), 24, 83, dtype, device)
    x3t = x3.transpose(0, 1).contiguous().transpose(0, 1)  # (3, 5, 24) with transposed batch dims
    return [
        Sample("mean_bias", (x, w, t, b)),
        Sample("sum_smoothing_z_loss_softcap", (x, w, t, b),
               kwargs=dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=5.0)),
        Sample("none_class_weights_chunked", (x, w, t, b), kwargs=dict(reduction="none", weight=cw, chunk_size=16),
               grad_strided=True),
        Sample("all_options_mean", (x, w, t),
               kwargs=dict(weight=cw, label_smoothing=0.2, z_loss=1e-4, softcap=3.0, chunk_size=7)),
        Sample("batch_dims_strided_none", (x3t, w, t3, b), kwargs=dict(reduction="none"), grad_strided=True),
        Sample("weight_transposed", (x, randn((24, 83), dtype, device, 1 / math.sqrt(24)).t(), t)),
        Sample("ignore_index_0", (x, w, t.clamp(min=0), b), kwargs=dict(ignore_index=0)),
        Sample("zero_tokens", (randn((0, 24), dtype, device), w, torch.zeros(0, dtype=torch.long, device=device), b),
               kwargs=dict(reduction="sum")),
    ]


def _lce_small(device):
    d = torch.float64
    x, w, t, b = _lce_data((6,), 5, 7, d, device, ignore=0.0, scale=1.0)
    t[2] = -100
    cw = (torch.rand(7) + 0.5).to(dtype=d, device=device)
    return [
        Sample("contiguous_mean_chunked", (x, w, t, b), kwargs=dict(chunk_size=4)),
        Sample("none_all_options", (x, w, t, b), kwargs=dict(reduction="none", weight=cw, label_smoothing=0.2,
                                                              z_loss=0.01, softcap=2.0, chunk_size=4)),
        Sample("sum_no_bias", (x, w, t), kwargs=dict(reduction="sum", label_smoothing=0.1)),
    ]


def _lce_vmap(device):
    d = torch.float64
    x, w, t, b = _lce_data((2, 6), 5, 7, d, device, ignore=0.2, scale=1.0)
    t[:, 0] = 1  # every per-sample mean has a valid token
    return Sample("batched_mean", (x, w, t, b))


def _lce_bad(device):
    t = tensor_maker(device)

    def data():
        return t(5, 4), t(6, 4), torch.randint(0, 6, (5,), device=device)

    def call(**kw):
        return lambda x, w, tg: F.linear_cross_entropy(x, w, tg, **kw)

    op = F.linear_cross_entropy
    pre = "opforge::linear_cross_entropy: "
    x, w, tg = data()
    return [
        Bad("int_input", lambda d: (op, (x.long(), w, tg)), TypeError, pre + DTYPE_MSG.format("input", "Long")),
        Bad("int_linear_weight", lambda d: (op, (x, w.int(), tg)), TypeError,
            pre + DTYPE_MSG.format("linear_weight", "Int")),
        Bad("float_target", lambda d: (op, (x, w, tg.float())), TypeError, pre + "expected target of dtype int64"),
        Bad("h_mismatch", lambda d: (op, (t(5, 5), w, tg)), ValueError,
            pre + "expected input's last dimension to equal linear_weight's H 4, but got 5"),
        Bad("weight_1d", lambda d: (op, (x, w.reshape(-1), tg)), ValueError, pre + "expected linear_weight to be 2-D"),
        Bad("target_shape", lambda d: (op, (x, w, tg[:4])), ValueError, pre + "expected target of input's leading shape"),
        Bad("bias_shape", lambda d: (call(linear_bias=t(5)), (x, w, tg)), ValueError,
            pre + r"expected linear_bias of shape \[6\]"),
        Bad("class_weight_shape", lambda d: (call(weight=t(7)), (x, w, tg)), ValueError,
            pre + r"expected weight of shape \[6\]"),
        Bad("smoothing_high", lambda d: (call(label_smoothing=1.5), (x, w, tg)), ValueError,
            pre + r"expected label_smoothing in \[0, 1\], but got 1.5"),
        Bad("smoothing_low", lambda d: (call(label_smoothing=-0.1), (x, w, tg)), ValueError,
            pre + r"expected label_smoothing in \[0, 1\], but got -0.1"),
        Bad("z_loss", lambda d: (call(z_loss=-1.0), (x, w, tg)), ValueError, pre + "expected z_loss >= 0"),
        Bad("softcap", lambda d: (call(softcap=0.0), (x, w, tg)), ValueError, pre + "expected softcap > 0"),
        Bad("chunk", lambda d: (call(chunk_size=0), (x, w, tg)), ValueError, pre + "expected chunk_size >= 1"),
        Bad("reduction", lambda d: (call(reduction="avg"), (x, w, tg)), ValueError,
            pre + "expected reduction to be one of"),
        Bad("target_out_of_range", lambda d: (op, (x, w, torch.tensor([0, 1, 6, 2, 3], device=device))), IndexError,
            pre + r"expected every target in \[0, 6\).*got target 6 at flat position 2", devices=("cpu",)),
        Bad("target_negative", lambda d: (op, (x, w, torch.tensor([0, 1, 2, -1, 3], device=device))), IndexError,
            pre + r"expected every target in \[0, 6\).*got target -1", devices=("cpu",)),
    ]


ENTRIES.append(OpEntry(
    name="linear_cross_entropy", op=_lce, reference=_lce_reference, baseline=_lce_baseline, native=_lce_native,
    samples=_lce_samples, small_samples=_lce_small, bad_inputs=_lce_bad, double_backward=False,
    vmap_in_dims=(0, None, 0, None), vmap_sample=_lce_vmap, autocast="lower_precision", check=_lce_check,
    # mean and sum compute the gradients in the forward (scaled by _linear_cross_entropy_scale_grads), none in
    # linear_cross_entropy_backward: either node refuses double backward
    double_backward_error="(_linear_cross_entropy_scale_grads|linear_cross_entropy_backward)",
    gradient_ops=("_linear_cross_entropy_forward", "_linear_cross_entropy_scale_grads")))


# ---- linear_log_probs ------------------------------------------------------------------------------------------


def _llp(input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100, softcap=None,
         return_entropy=False, chunk_size=None):
    """opforge.linear_log_probs with its options positional too, in the schema's order (the hypothesis strategy and
    the samples give them as args)."""
    return F.linear_log_probs(input, linear_weight, target, linear_bias, temperature=temperature,
                              ignore_index=ignore_index, softcap=softcap, return_entropy=return_entropy,
                              chunk_size=chunk_size)


def _llp_reference(input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100, softcap=None,
                   return_entropy=False, chunk_size=None):
    return T.linear_log_probs_reference(input, linear_weight, target, linear_bias, temperature=temperature,
                                        ignore_index=ignore_index, softcap=softcap, return_entropy=return_entropy)


def _llp_baseline(input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100, softcap=None,
                  return_entropy=False, chunk_size=None):
    """The reference's math in input's dtype (the achievable error), returned in float32 (float64 for float64)."""
    out = T.linear_log_probs_reference(input, linear_weight, target, linear_bias, temperature=temperature,
                                       ignore_index=ignore_index, softcap=softcap, return_entropy=return_entropy,
                                       compute_dtype=input.dtype)
    dt = torch.float64 if input.dtype == torch.float64 else torch.float32
    return tuple(o.to(dt) for o in out) if return_entropy else out.to(dt)


def _llp_native(input, linear_weight, target, linear_bias=None, temperature=1.0, ignore_index=-100, softcap=None,
                return_entropy=False, chunk_size=None):
    """torch's linear then log_softmax (TRL's selective_log_softmax): under autocast the GEMM in the lower precision,
    the log-softmax in float32."""
    z = TF.linear(input, linear_weight, linear_bias).float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    valid = target != ignore_index
    lp = logp.gather(-1, torch.where(valid, target, 0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    if not return_entropy:
        return lp
    ent = -(logp.exp() * logp).sum(-1)
    return lp, torch.where(valid, ent, torch.zeros_like(ent))


def _llp_check(what, ours, ref, base, args, gouts, **kwargs):
    """The tolerance rule with, for the gradients, an a-priori bound of their float32 rounding: the logit gradient
    dz (its float64 value from the reference, through the bias, softcap and temperature) is off by at most
    eps |dz| + 4 eps (|g_lp| + |g_ent| mag) p / T per logit (mag = max |z| + log V: the log-probabilities' rounding,
    which the entropy's (z − m) − (r − H) does not cancel), and the gradient GEMMs and the bias's column sum over the
    N tokens add their own (N u Σ |dz|: any summation order)."""
    names = ("input", "linear_weight", "target", "linear_bias", "temperature", "ignore_index", "softcap",
             "return_entropy", "chunk_size")
    o = {**dict(zip(names, args)), **kwargs}
    x, w, t, b = o["input"], o["linear_weight"], o["target"], o.get("linear_bias")
    if what not in ("grad 0", "grad 1", "grad 2") or x.numel() == 0:
        return T.assert_matches_reference(ours, ref, base, what=what)
    temp, ent = o.get("temperature", 1.0), o.get("return_entropy", False)
    f32 = torch.float32
    eps, u = torch.finfo(f32).eps, torch.finfo(f32).eps / 2
    V, H = w.shape
    x2 = _rows(x.detach().double())
    l = (x2 @ w.detach().double().t()).requires_grad_()
    eye = torch.eye(V, dtype=torch.float64, device=l.device)
    tg = t.reshape(-1)
    out = T.linear_log_probs_reference(l, eye, tg, None if b is None else b.detach().double(), temperature=temp,
                                       ignore_index=o.get("ignore_index", -100), softcap=o.get("softcap"),
                                       return_entropy=ent)
    out = out if ent else (out,)
    gs = [g.detach().double().reshape(-1) for g in gouts]
    (dz,) = torch.autograd.grad(sum((y * g).sum() for y, g in zip(out, gs)), l)
    dz = dz.abs()
    with torch.no_grad():
        z = l if b is None else l + b.detach().double()
        if o.get("softcap") is not None:
            z = o["softcap"] * torch.tanh(z / o["softcap"])
        z = z / temp
        p = torch.softmax(z, -1)
        mag = z.abs().amax(-1, keepdim=True) + math.log(V)
        coef = gs[0].abs().unsqueeze(-1) + (gs[1].abs().unsqueeze(-1) * mag if ent else 0)
        err = eps * dz + 4 * eps * coef * p / temp
        err = torch.where((tg != o.get("ignore_index", -100)).unsqueeze(-1).to(err.device), err, torch.zeros_like(err))
        if what == "grad 0":
            bound = (err @ w.detach().double().abs() + T.gemm_error_bound(dz, w.detach().t(), f32)).reshape(x.shape)
        elif what == "grad 1":
            bound = err.t() @ x2.abs() + T.gemm_error_bound(dz.t(), x2.t(), f32)
        else:
            bound = err.sum(0) + x2.shape[0] * u * dz.sum(0)
    T.assert_matches_reference(ours, ref, base, what=what, bound=bound)


def _llp_samples(device, dtype):
    x, w, t, b = _lce_data((37,), 24, 83, dtype, device)
    x3, _, t3, _ = _lce_data((3, 5), 24, 83, dtype, device)
    x3t = x3.transpose(0, 1).contiguous().transpose(0, 1)  # (3, 5, 24) with transposed batch dims
    return [
        Sample("bias", (x, w, t, b)),
        Sample("entropy_temperature_chunked", (x, w, t, b, 0.7, -100, None, True, 16), grad_strided=True),
        Sample("entropy_softcap_no_bias", (x, w, t, None, 1.3, -100, 4.0, True)),
        Sample("batch_dims_strided", (x3t, w, t3, b, 2.0), grad_strided=True),
        Sample("weight_transposed", (x, randn((24, 83), dtype, device, 1 / math.sqrt(24)).t(), t)),
        Sample("ignore_index_0", (x, w, t.clamp(min=0), b), kwargs=dict(ignore_index=0)),
        Sample("zero_tokens", (randn((0, 24), dtype, device), w, torch.zeros(0, dtype=torch.long, device=device), b,
                               1.0, -100, None, True)),
    ]


def _llp_small(device):
    d = torch.float64
    x, w, t, b = _lce_data((6,), 5, 7, d, device, ignore=0.0, scale=1.0)
    t[2] = -100
    return [
        Sample("entropy_chunked", (x, w, t, b, 0.8, -100, None, True, 4)),
        Sample("softcap_entropy", (x, w, t, b, 1.5, -100, 2.0, True, 4)),
        Sample("log_probs_no_bias", (x, w, t)),
    ]


def _llp_bad(device):
    t = tensor_maker(device)
    x, w, tg = t(5, 4), t(6, 4), torch.randint(0, 6, (5,), device=device)

    def call(**kw):
        return lambda x, w, tg: F.linear_log_probs(x, w, tg, **kw)

    op = F.linear_log_probs
    pre = "opforge::linear_log_probs: "
    return [
        Bad("int_input", lambda d: (op, (x.long(), w, tg)), TypeError, pre + DTYPE_MSG.format("input", "Long")),
        Bad("int_linear_weight", lambda d: (op, (x, w.int(), tg)), TypeError,
            pre + DTYPE_MSG.format("linear_weight", "Int")),
        Bad("float_target", lambda d: (op, (x, w, tg.float())), TypeError, pre + "expected target of dtype int64"),
        Bad("h_mismatch", lambda d: (op, (t(5, 5), w, tg)), ValueError,
            pre + "expected input's last dimension to equal linear_weight's H 4, but got 5"),
        Bad("weight_1d", lambda d: (op, (x, w.reshape(-1), tg)), ValueError, pre + "expected linear_weight to be 2-D"),
        Bad("target_shape", lambda d: (op, (x, w, tg[:4])), ValueError, pre + "expected target of input's leading shape"),
        Bad("bias_shape", lambda d: (call(linear_bias=t(5)), (x, w, tg)), ValueError,
            pre + r"expected linear_bias of shape \[6\]"),
        Bad("temperature_zero", lambda d: (call(temperature=0.0), (x, w, tg)), ValueError,
            pre + "expected temperature > 0 and finite, but got 0"),
        Bad("temperature_inf", lambda d: (call(temperature=math.inf), (x, w, tg)), ValueError,
            pre + "expected temperature > 0 and finite, but got inf"),
        Bad("softcap", lambda d: (call(softcap=-1.0), (x, w, tg)), ValueError, pre + "expected softcap > 0"),
        Bad("chunk", lambda d: (call(chunk_size=0), (x, w, tg)), ValueError, pre + "expected chunk_size >= 1"),
        Bad("target_out_of_range", lambda d: (op, (x, w, torch.tensor([0, 1, 6, 2, 3], device=device))), IndexError,
            pre + r"expected every target in \[0, 6\).*got target 6 at flat position 2", devices=("cpu",)),
    ]


ENTRIES.append(OpEntry(
    name="linear_log_probs", op=_llp, reference=_llp_reference, baseline=_llp_baseline, native=_llp_native,
    samples=_llp_samples, small_samples=_llp_small, bad_inputs=_llp_bad, double_backward=False,
    vmap_in_dims=(0, None, 0, None, None, None, None, None, None), autocast="lower_precision", check=_llp_check))


# ---- linear_jsd ------------------------------------------------------------------------------------------------
# The student's input and weight are the differentiated args; the teacher (no gradient), the target, the biases and
# the options come by name (Sample.kwargs), as the schema takes them, or (the hypothesis strategy) as one dict arg,
# which is not differentiated.


def _jsd(input, linear_weight, options=None, **kwargs):
    return F.linear_jsd(input, linear_weight, **{**(options or {}), **kwargs})


def _jsd_reference(input, linear_weight, options=None, **kwargs):
    kwargs = {**(options or {}), **kwargs}
    kwargs.pop("chunk_size", None)
    return T.linear_jsd_reference(input, linear_weight, **kwargs)


def _jsd_baseline(input, linear_weight, options=None, **kwargs):
    """The reference's math in input's dtype, returned in float32 (float64 for float64)."""
    kwargs = {**(options or {}), **kwargs}
    kwargs.pop("chunk_size", None)
    kwargs = {k: v.to(input.dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kwargs.items()}
    loss = T.linear_jsd_reference(input, linear_weight, compute_dtype=input.dtype, **kwargs)
    return loss.to(torch.float64 if input.dtype == torch.float64 else torch.float32)


def _jsd_native(input, linear_weight, teacher_input, teacher_linear_weight, target=None, linear_bias=None,
                teacher_linear_bias=None, beta=0.5, temperature=1.0, ignore_index=-100, reduction="mean",
                chunk_size=None):
    """torch's linear for both heads, then TRL's generalized_jsd_loss in float32 (under autocast the GEMMs in the
    lower precision)."""
    ls = torch.log_softmax(TF.linear(input, linear_weight, linear_bias).float() / temperature, -1)
    lt = torch.log_softmax(TF.linear(teacher_input, teacher_linear_weight, teacher_linear_bias).float() / temperature,
                           -1)
    if beta == 0:
        per = TF.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        per = TF.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
        per = beta * TF.kl_div(lm, lt, reduction="none", log_target=True) + (1 - beta) * TF.kl_div(
            lm, ls, reduction="none", log_target=True)
    per = per.sum(-1)
    valid = torch.ones_like(per, dtype=torch.bool) if target is None else target != ignore_index
    total = torch.where(valid, per, torch.zeros_like(per)).sum()
    return total if reduction == "sum" else total / valid.sum()


def _jsd_check(what, ours, ref, base, args, gouts, **kwargs):
    """The tolerance rule with a-priori bounds of the float32 rounding (`opforge.testing.linear_jsd_error_bound` for
    the loss, a scalar: PyTorch's own float32 result can be luckily close, and one unit in the last place is then
    already past the rule; `linear_jsd_grad_error_bounds` for the gradients)."""
    opts = {**(args[2] if len(args) > 2 and isinstance(args[2], dict) else {}), **kwargs}
    x, w = args[0], args[1]
    if what not in ("output 0", "grad 0", "grad 1") or x.numel() == 0:
        return T.assert_matches_reference(ours, ref, base, what=what)
    heads = (x, w, opts["teacher_input"], opts["teacher_linear_weight"])
    kw = {k: opts[k] for k in ("linear_bias", "teacher_linear_bias", "temperature", "ignore_index", "reduction")
          if k in opts}
    if what == "output 0":
        bound = T.linear_jsd_error_bound(*heads, opts.get("target"), reference=ref, **kw)
    else:
        bounds = T.linear_jsd_grad_error_bounds(*heads, gouts[0], opts.get("target"), beta=opts.get("beta", 0.5), **kw)
        bound = bounds[0] if what == "grad 0" else bounds[1]
    T.assert_matches_reference(ours, ref, base, what=what, bound=bound)


def _jsd_samples(device, dtype):
    x, w, t, b = _lce_data((37,), 24, 83, dtype, device)
    xt, wt, _, bt = _lce_data((37,), 16, 83, dtype, device)
    x3, _, t3, _ = _lce_data((3, 5), 24, 83, dtype, device)
    xt3, _, _, _ = _lce_data((3, 5), 16, 83, dtype, device)
    x3t = x3.transpose(0, 1).contiguous().transpose(0, 1)  # (3, 5, 24) with transposed batch dims
    teacher = dict(teacher_input=xt, teacher_linear_weight=wt)
    return [
        Sample("jsd_target_biases", (x, w), kwargs=dict(teacher, target=t, linear_bias=b, teacher_linear_bias=bt)),
        Sample("forward_kl_sum_temperature_chunked", (x, w),
               kwargs=dict(teacher, target=t, beta=0.0, temperature=2.0, reduction="sum", chunk_size=16)),
        Sample("reverse_kl_no_target", (x, w), kwargs=dict(teacher, beta=1.0, chunk_size=7)),
        Sample("batch_dims_strided", (x3t, w), kwargs=dict(teacher_input=xt3, teacher_linear_weight=wt, target=t3,
                                                           beta=0.3), grad_strided=True),
        Sample("weight_transposed", (x, randn((24, 83), dtype, device, 1 / math.sqrt(24)).t()), kwargs=teacher),
        Sample("zero_tokens", (randn((0, 24), dtype, device), w),
               kwargs=dict(teacher_input=randn((0, 16), dtype, device), teacher_linear_weight=wt, reduction="sum")),
    ]


def _jsd_small(device):
    d = torch.float64
    x, w, t, b = _lce_data((6,), 5, 7, d, device, ignore=0.0, scale=1.0)
    xt, wt, _, bt = _lce_data((6,), 4, 7, d, device, ignore=0.0, scale=1.0)
    t[2] = -100
    teacher = dict(teacher_input=xt, teacher_linear_weight=wt)
    return [
        Sample("jsd_chunked", (x, w), kwargs=dict(teacher, target=t, linear_bias=b, teacher_linear_bias=bt,
                                                  chunk_size=4)),
        Sample("forward_kl", (x, w), kwargs=dict(teacher, target=t, beta=0.0, temperature=0.7)),
        Sample("reverse_kl_sum", (x, w), kwargs=dict(teacher, beta=1.0, reduction="sum")),
    ]


def _jsd_vmap(device):
    d = torch.float64
    x, w, _, _ = _lce_data((2, 6), 5, 7, d, device, ignore=0.0, scale=1.0)
    return Sample("batched", (x, w), kwargs=dict(teacher_input=x.detach()[0].flip(0).clone(),
                                                 teacher_linear_weight=w.detach().flip(0).clone()))


def _jsd_bad(device):
    t = tensor_maker(device)
    x, w, xt, wt, tg = t(5, 4), t(6, 4), t(5, 3), t(6, 3), torch.randint(0, 6, (5,), device=device)

    def call(**kw):
        return lambda x, w: F.linear_jsd(x, w, xt, wt, tg, **kw)

    pre = "opforge::linear_jsd: "
    return [
        Bad("int_input", lambda d: (call(), (x.long(), w)), TypeError, pre + DTYPE_MSG.format("input", "Long")),
        Bad("int_linear_weight", lambda d: (call(), (x, w.int())), TypeError,
            pre + DTYPE_MSG.format("linear_weight", "Int")),
        Bad("h_mismatch", lambda d: (call(), (t(5, 5), w)), ValueError,
            pre + "expected input's last dimension to equal linear_weight's H 4, but got 5"),
        Bad("teacher_rows", lambda d: (lambda x, w: F.linear_jsd(x, w, xt[:4], wt, tg), (x, w)), ValueError,
            pre + r"expected teacher_input of input's leading shape \[5\]"),
        Bad("teacher_weight", lambda d: (lambda x, w: F.linear_jsd(x, w, xt, wt[:5], tg), (x, w)), ValueError,
            pre + r"expected teacher_linear_weight of shape \[6, 3\]"),
        Bad("target_dtype", lambda d: (lambda x, w: F.linear_jsd(x, w, xt, wt, tg.float()), (x, w)), TypeError,
            pre + "expected target of dtype int64"),
        Bad("bias_shape", lambda d: (call(linear_bias=t(5)), (x, w)), ValueError,
            pre + r"expected linear_bias of shape \[6\]"),
        Bad("teacher_bias_shape", lambda d: (call(teacher_linear_bias=t(5)), (x, w)), ValueError,
            pre + r"expected teacher_linear_bias of shape \[6\]"),
        Bad("beta", lambda d: (call(beta=-0.5), (x, w)), ValueError, pre + r"expected beta in \[0, 1\], but got -0.5"),
        Bad("temperature", lambda d: (call(temperature=-1.0), (x, w)), ValueError,
            pre + "expected temperature > 0 and finite"),
        Bad("reduction_none", lambda d: (call(reduction="none"), (x, w)), ValueError,
            pre + "expected reduction to be one of \"mean\", \"sum\""),
        Bad("chunk", lambda d: (call(chunk_size=0), (x, w)), ValueError, pre + "expected chunk_size >= 1"),
    ]


ENTRIES.append(OpEntry(
    name="linear_jsd", op=_jsd, reference=_jsd_reference, baseline=_jsd_baseline, native=_jsd_native,
    samples=_jsd_samples, small_samples=_jsd_small, bad_inputs=_jsd_bad, double_backward=False,
    vmap_in_dims=(0, None), vmap_sample=_jsd_vmap, autocast="lower_precision", check=_jsd_check,
    # the gradients are computed in the forward and scaled in backward: that node refuses double backward
    double_backward_error="_linear_cross_entropy_scale_grads",
    gradient_ops=("_linear_jsd_forward", "_linear_cross_entropy_scale_grads")))


# ---- rope, rope_from_positions ---------------------------------------------------------------------------------


def rope_baseline(q, k, cos, sin, interleaved=False, rotary_dim=None):
    """rope composed of PyTorch ops in q's dtype (transformers' formula, the tables cast to q's dtype): the
    achievable error. rotary_dim None or -1: cos.size(-1)."""
    dt = q.dtype
    c, s = cos.to(dt), sin.to(dt)
    if c.dim() == 2:
        c, s = c[None], s[None]
    if c.dim() == 3:
        c, s = c[:, None], s[:, None]
    R = c.shape[-1] if rotary_dim in (None, -1) else rotary_dim

    def rot(x):
        if interleaved:
            return torch.stack((-x[..., 1::2], x[..., 0::2]), -1).flatten(-2)
        return torch.cat((-x[..., R // 2:], x[..., :R // 2]), -1)

    def one(x):
        xr = x[..., :R]
        return torch.cat((xr * c + rot(xr) * s, x[..., R:]), -1)

    return one(q), one(k)


def _rope_from_positions_baseline(q, k, position_ids, base=10000.0, interleaved=False, rotary_dim=None):
    R = q.shape[-1] if rotary_dim in (None, -1) else rotary_dim
    cos, sin = T.rope_cos_sin_reference(position_ids, R, base, interleaved=interleaved)
    return rope_baseline(q, k, cos, sin, interleaved, R)


def _rope_tables(positions, R, dtype, device, interleaved=False, base=10000.0):
    """cos, sin of the positions in float32 (float64 for float64 q): as transformers passes them."""
    cos, sin = T.rope_cos_sin_reference(torch.as_tensor(positions), R, base, interleaved=interleaved)
    tdt = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(cos=cos.to(dtype=tdt, device=device), sin=sin.to(dtype=tdt, device=device))


def _rope_qk(dtype, device, B, Hq, Hk, S, D):
    return randn((B, Hq, S, D), dtype, device), randn((B, Hk, S, D), dtype, device)


def _rope_samples(device, dtype):
    pos7 = torch.arange(7)
    big = torch.tensor([[0, 3, 9, 700, 2], [1, 1, 1, 1, 4000]])
    qt = randn((2, 5, 3, 8), dtype, device).transpose(1, 2)  # (B, H, S, D) view of a (B, S, H, D) projection
    kt = randn((2, 5, 1, 8), dtype, device).transpose(1, 2)
    return [
        Sample("gqa_rotate_half", _rope_qk(dtype, device, 2, 4, 1, 7, 8), kwargs=_rope_tables(pos7, 8, dtype, device)),
        Sample("interleaved", _rope_qk(dtype, device, 2, 2, 2, 7, 8), grad_strided=True,
               kwargs=dict(_rope_tables(pos7, 8, dtype, device, interleaved=True), interleaved=True)),
        Sample("partial_rotary_4_of_8", _rope_qk(dtype, device, 1, 2, 1, 5, 8),
               kwargs=dict(_rope_tables(torch.arange(5)[None], 4, dtype, device), rotary_dim=4)),
        Sample("transposed_qk_batched_tables_4d", (qt, kt), grad_strided=True,
               kwargs={k: v[:, None] for k, v in _rope_tables(big, 8, dtype, device).items()}),
        Sample("head_dim_6_large_positions", _rope_qk(dtype, device, 2, 3, 3, 5, 6),
               kwargs=_rope_tables(big, 6, dtype, device, base=500000.0)),
        Sample("zero_seq", _rope_qk(dtype, device, 2, 2, 1, 0, 8), kwargs=_rope_tables(torch.arange(0), 8, dtype, device)),
        Sample("zero_heads", _rope_qk(dtype, device, 2, 0, 1, 3, 8), kwargs=_rope_tables(torch.arange(3), 8, dtype, device)),
    ]


def _rope_small(device):
    d = torch.float64
    # random (non-duplicated) tables: the backward must be the exact transpose of the forward's map
    tables = dict(cos=randn((2, 5, 6), d, device), sin=randn((2, 5, 6), d, device))
    q, k = _rope_qk(d, device, 2, 3, 1, 5, 6)
    return [Sample("contiguous", (q, k), kwargs=tables),
            Sample("interleaved_transposed_q", (randn((2, 5, 3, 6), d, device).transpose(1, 2), k),
                   kwargs=dict(tables, interleaved=True)),
            Sample("partial_rotary", _rope_qk(d, device, 1, 2, 2, 5, 8),
                   kwargs=dict(cos=randn((5, 4), d, device), sin=randn((5, 4), d, device), rotary_dim=4))]


def _rope_vmap(device):
    d = torch.float64
    return Sample("batched", (randn((2, 1, 3, 5, 6), d, device), randn((2, 1, 1, 5, 6), d, device)),
                  kwargs=dict(cos=randn((5, 6), d, device), sin=randn((5, 6), d, device)))


def _rope_bad(device):
    t = tensor_maker(device)

    def qkcs(D=8, R=8, S=3, hq=2, hk=1):
        return t(1, hq, S, D), t(1, hk, S, D), t(S, R), t(S, R)

    op = F.rope
    pre = "opforge::rope: "
    grad_table = t(3, 8).requires_grad_()
    return [
        Bad("odd_head_dim", lambda d: (op, qkcs(D=7, R=6)), ValueError, pre + "expected an even head_dim, but got 7"),
        Bad("odd_rotary_dim", lambda d: (op, qkcs(R=5)[:2] + (t(3, 5), t(3, 5))), ValueError,
            pre + "expected rotary_dim to be even, positive and at most head_dim 8, but got 5"),
        Bad("rotary_dim_past_head_dim", lambda d: (op, qkcs(D=8, R=10)), ValueError,
            pre + "expected rotary_dim to be even, positive and at most head_dim 8, but got 10"),
        Bad("rotary_dim_not_table", lambda d: (lambda *a: op(*a, rotary_dim=4), qkcs()), ValueError,
            pre + r"expected rotary_dim of -1 or cos.size\(-1\) 8, but got 4"),
        Bad("cos_sin_shapes", lambda d: (op, qkcs()[:3] + (t(3, 6),)), ValueError,
            pre + r"expected cos and sin of the same shape, but got \[3, 8\] and \[3, 6\]"),
        Bad("table_seq", lambda d: (op, qkcs()[:2] + (t(4, 8), t(4, 8))), ValueError,
            pre + r"expected cos and sin of shape \(1, 3, rotary_dim\)"),
        Bad("table_batch", lambda d: (op, qkcs()[:2] + (t(2, 3, 8), t(2, 3, 8))), ValueError,
            pre + r".*to match q's \(batch, seq\), but got \[2, 3, 8\]"),
        Bad("qk_batch", lambda d: (op, (t(1, 2, 3, 8), t(2, 1, 3, 8)) + qkcs()[2:]), ValueError,
            pre + r"expected q and k of the same batch, seq and head_dim \(dims 0, 2, 3\), but got \[1, 2, 3, 8\] and "
                  r"\[2, 1, 3, 8\]"),
        Bad("qk_seq", lambda d: (op, (t(1, 2, 3, 8), t(1, 1, 4, 8)) + qkcs()[2:]), ValueError,
            pre + r"expected q and k of the same batch, seq and head_dim .*\[1, 1, 4, 8\]"),
        Bad("q_3d", lambda d: (op, (t(2, 3, 8), t(1, 1, 3, 8)) + qkcs()[2:]), ValueError,
            pre + r"expected q of shape \(batch, heads, seq, head_dim\), but got shape \[2, 3, 8\]"),
        Bad("qk_dtype", lambda d: (op, (t(1, 2, 3, 8), t(1, 1, 3, 8, dtype=torch.float64)) + qkcs()[2:]), TypeError,
            pre + "expected q and k of the same dtype, but got Float and Double"),
        Bad("int_q", lambda d: (op, (t(1, 2, 3, 8, dtype=torch.int32), t(1, 1, 3, 8)) + qkcs()[2:]), TypeError,
            pre + DTYPE_MSG.format("q", "Int")),
        Bad("int_cos", lambda d: (op, qkcs()[:2] + (t(3, 8, dtype=torch.int64), t(3, 8))), TypeError,
            pre + DTYPE_MSG.format("cos", "Long")),
        Bad("table_requires_grad", lambda d: (op, qkcs()[:2] + (grad_table, t(3, 8))), NotImplementedError,
            pre + "gradients with respect to cos and sin"),
        Bad("table_device", lambda d: (op, qkcs()[:2] + (torch.empty(3, 8, device="meta"), t(3, 8))), RuntimeError,
            pre + "expected q and cos to be on the same device"),
    ]


def _rope_from_positions_samples(device, dtype):
    big = torch.tensor([[0, 3, 9, 700, 2], [1, 1, 1, 1, 4000]], device=device)
    qt = randn((2, 5, 3, 8), dtype, device).transpose(1, 2)
    kt = randn((2, 5, 1, 8), dtype, device).transpose(1, 2)
    return [
        Sample("gqa_arange", _rope_qk(dtype, device, 2, 4, 1, 7, 8), kwargs=dict(position_ids=torch.arange(7, device=device))),
        Sample("interleaved_base_500000", _rope_qk(dtype, device, 2, 2, 2, 5, 8), grad_strided=True,
               kwargs=dict(position_ids=big, base=500000.0, interleaved=True)),
        Sample("partial_rotary_int32_positions", _rope_qk(dtype, device, 1, 2, 1, 5, 8),
               kwargs=dict(position_ids=torch.arange(5, dtype=torch.int32, device=device)[None], rotary_dim=4)),
        Sample("transposed_qk", (qt, kt), grad_strided=True, kwargs=dict(position_ids=big, base=100.0)),
        Sample("zero_seq", _rope_qk(dtype, device, 2, 2, 1, 0, 8),
               kwargs=dict(position_ids=torch.zeros(0, dtype=torch.long, device=device))),
    ]


def _rope_from_positions_small(device):
    d = torch.float64
    pos = torch.tensor([[0, 3, 9, 700, 2], [1, 1, 1, 1, 1]], device=device)
    return [Sample("contiguous", _rope_qk(d, device, 2, 3, 1, 5, 8), kwargs=dict(position_ids=pos, base=500.0)),
            Sample("interleaved_partial", (randn((2, 5, 2, 8), d, device).transpose(1, 2), randn((2, 2, 5, 8), d, device)),
                   kwargs=dict(position_ids=pos, base=500.0, interleaved=True, rotary_dim=6))]


def _rope_from_positions_vmap(device):
    d = torch.float64
    return Sample("batched", (randn((2, 1, 3, 5, 6), d, device), randn((2, 1, 1, 5, 6), d, device)),
                  kwargs=dict(position_ids=torch.arange(5, device=device)))


def _rope_from_positions_bad(device):
    t = tensor_maker(device)

    op = F.rope_from_positions
    pre = "opforge::rope_from_positions: "
    pos = torch.arange(3, device=device)

    def qk(D=8, S=3):
        return t(1, 2, S, D), t(1, 1, S, D)
    return [
        Bad("float_positions", lambda d: (op, qk() + (torch.arange(3.0, device=device),)), TypeError,
            pre + "expected position_ids of an integer dtype"),
        Bad("positions_length", lambda d: (op, qk() + (torch.arange(4, device=device),)), ValueError,
            pre + r"expected position_ids of shape \(3,\) or \(1, 3\)"),
        Bad("positions_batch", lambda d: (op, qk() + (torch.zeros(2, 3, dtype=torch.long, device=device),)),
            ValueError, pre + r"expected position_ids of shape \(3,\) or \(1, 3\) to match q's \(batch, seq\), but got \[2, 3\]"),
        Bad("negative_base", lambda d: (op, qk() + (pos, -1.0)), ValueError, pre + "expected a finite base > 0, but got -1"),
        Bad("nan_base", lambda d: (op, qk() + (pos, float("nan"))), ValueError,
            pre + "expected a finite base > 0, but got nan"),
        Bad("odd_rotary_dim", lambda d: (lambda *a: op(*a, rotary_dim=3), qk() + (pos,)), ValueError,
            pre + "expected rotary_dim to be even, positive and at most head_dim 8, but got 3"),
        Bad("rotary_dim_past_head_dim", lambda d: (lambda *a: op(*a, rotary_dim=10), qk() + (pos,)), ValueError,
            pre + "expected rotary_dim to be even, positive and at most head_dim 8, but got 10"),
        Bad("odd_head_dim", lambda d: (op, qk(D=7) + (pos,)), ValueError, pre + "expected an even head_dim, but got 7"),
        Bad("q_3d", lambda d: (op, (t(2, 3, 8), t(1, 1, 3, 8), pos)), ValueError,
            pre + r"expected q of shape \(batch, heads, seq, head_dim\), but got shape \[2, 3, 8\]"),
        Bad("qk_dtype", lambda d: (op, (t(1, 2, 3, 8), t(1, 1, 3, 8, dtype=torch.float64), pos)), TypeError,
            pre + "expected q and k of the same dtype, but got Float and Double"),
        Bad("int_k", lambda d: (op, (t(1, 2, 3, 8), t(1, 1, 3, 8, dtype=torch.int32), pos)), TypeError,
            pre + DTYPE_MSG.format("k", "Int")),
        Bad("positions_device", lambda d: (op, qk() + (torch.arange(3, device="meta"),)), RuntimeError,
            pre + "expected q and position_ids to be on the same device"),
    ]


ENTRIES.append(OpEntry(
    name="rope", op=F.rope, reference=T.rope_reference, baseline=rope_baseline, native=rope_baseline,
    samples=_rope_samples, small_samples=_rope_small, bad_inputs=_rope_bad, double_backward=True,
    vmap_in_dims=(0, 0), vmap_sample=_rope_vmap))
ENTRIES.append(OpEntry(
    name="rope_from_positions", op=F.rope_from_positions, reference=T.rope_from_positions_reference,
    baseline=_rope_from_positions_baseline, native=_rope_from_positions_baseline,
    samples=_rope_from_positions_samples, small_samples=_rope_from_positions_small,
    bad_inputs=_rope_from_positions_bad, double_backward=True, vmap_in_dims=(0, 0),
    vmap_sample=_rope_from_positions_vmap))


# ---- fake_quant_linear, fake_quantize_weight -------------------------------------------------------------------


def _fq_rows_torch(x2, scale, zero_point, qmin, qmax):
    """(values, in-range mask) of fake-quantizing each row of x2 with its scale and zero point, composed of torch
    ops as torch's fake_quantize kernels compute (x · (1/scale) in fp32, round half to even, + zero point, clamp)."""
    inv = (1.0 / scale)[:, None]
    q = torch.round(x2 * inv) + zero_point[:, None]
    mask = (q >= qmin) & (q <= qmax)
    return (q.clamp(qmin, qmax) - zero_point[:, None]) * scale[:, None], mask


def _fq_weight_torch(weight, bits=4, group_size=-1, symmetric=True):
    """fake_quantize_weight composed of torch ops in float32 (float64 for float64): (fq_w with the straight-through
    gradient, mask, scale, zero_point); torch.func-friendly (no .item(), no inner autograd)."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    N, K = weight.shape
    w = weight if weight.dtype == torch.float64 else weight.float()
    wg = w.reshape(1, -1) if group_size == 0 else w.reshape(-1, K if group_size < 0 else group_size)
    scale, zp = T.fake_quant_qparams_reference(wg.detach().amin(1), wg.detach().amax(1), qmin, qmax, symmetric)
    values, mask = _fq_rows_torch(wg.detach(), scale, zp, qmin, qmax)
    shape = (1, 1) if group_size == 0 else (N, 1 if group_size < 0 else K // group_size)
    return (_ste(wg, values, mask).reshape(N, K).to(weight.dtype), mask.reshape(N, K), scale.reshape(shape),
            zp.reshape(shape))


def _fq_per_token_torch(x):
    """fq_a(x) (each row to int8, asymmetric) composed of torch ops, with the straight-through gradient."""
    x2 = _rows(x)
    xf = x2 if x.dtype == torch.float64 else x2.float()
    scale, zp = T.fake_quant_qparams_reference(xf.detach().amin(1), xf.detach().amax(1), -128, 127, False)
    values, mask = _fq_rows_torch(xf.detach(), scale, zp, -128, 127)
    return _ste(x2, values.to(x.dtype), mask).reshape(x.shape)


def _fql_baseline(input, weight, bias=None, weight_bits=4, group_size=-1, symmetric=True, act_quant=False):
    """fake_quant_linear as torchao composes it: fake-quantize (torch ops), then F.linear in input's dtype."""
    wq = _fq_weight_torch(weight, weight_bits, group_size, symmetric)[0].to(input.dtype)
    xq = _fq_per_token_torch(input) if act_quant else input
    return TF.linear(xq, wq, None if bias is None else bias.to(input.dtype))


def _fql_native(input, weight, bias=None, **kwargs):
    """The op fake_quant_linear mirrors for autocast: torch's linear."""
    return TF.linear(input, weight, bias)


def _fql_quantized(input, weight, dtype, weight_bits=4, group_size=-1, symmetric=True, act_quant=False):
    """(fq_a(input), its mask, fq_w(weight) in input's dtype, its mask) by torch's fake_quantize functions
    (opforge.testing), on the args rounded back to the sample's dtype: bit-identical to the op's."""
    # torch's fake_quantize functions on the CPU: the spec. Their CUDA kernels differ for float64
    # (H200, torch 2.11: the float64 product is not the CPU's), which opforge's CUDA kernel does not follow.
    dev = input.device
    wq, wm = T.fake_quantize_weight_reference(weight.detach().cpu().to(dtype), weight_bits, group_size, symmetric)[:2]
    x = input.detach().cpu().to(dtype)
    xq, xm = T.fake_quantize_per_token_reference(x) if act_quant else (x, torch.ones(x.shape, dtype=torch.bool))
    return xq.to(dev), xm.to(dev), wq.to(dtype).to(dev), wm.to(dev)


def _fql_reference_for(dtype):
    def ref(input, weight, bias=None, **kw):
        """fake_quant_linear in float64 from torch's fake quantization of the sample's dtype, with the
        straight-through gradients (x.grad = dY · fq_w(W) ⊙ mask_a, W.grad = (dYᵀ · fq_a(x)) ⊙ mask_w)."""
        xq, xm, wq, wm = _fql_quantized(input, weight, dtype, **kw)
        return T.linear_reference(_ste(input, xq.double(), xm), _ste(weight, wq.double(), wm), bias)
    return ref


def _fql_check(what, ours, ref, base, args, gouts, **kw):
    """The tolerance rule with the GEMM rounding bound of the quantized operands (as _linear_check)."""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    dt = x.dtype
    xq, xm, wq, _ = _fql_quantized(x, w, dt, **kw)
    g = gouts[0]
    bound = None
    if what == "output 0":
        bound = T.gemm_error_bound(xq, wq, dt) + _bias_bound(b, dt)
    elif what == "grad 0":
        bound = T.gemm_error_bound(g, wq.t(), dt).reshape(x.shape)
    elif what == "grad 1":
        bound = T.gemm_error_bound(_rows(g).t(), _rows(xq).t(), dt)
    T.assert_matches_reference(ours, ref, base, what=what, bound=bound)


def _fql_samples(device, dtype):
    def ops(lead, K, N, bias=True, x_layout="contiguous", scale=0.2):
        x = randn((*lead, K), dtype, device)
        if x_layout == "transposed":
            x = randn((K, *lead), dtype, device).t()
        w = randn((N, K), dtype, device, scale)
        return (x, w, randn((N,), dtype, device)) if bias else (x, w)

    kw8da4w = dict(weight_bits=4, group_size=32, symmetric=True, act_quant=True)
    return [
        Sample("8da4w_group_32", ops((3, 7), 64, 40), kwargs=kw8da4w),
        Sample("asymmetric_per_channel", ops((13,), 64, 9, bias=False), grad_strided=True,
               kwargs=dict(weight_bits=4, group_size=-1, symmetric=False)),
        Sample("int8_per_tensor_act", ops((5,), 48, 17), kwargs=dict(weight_bits=8, group_size=0, act_quant=True)),
        Sample("3_bit_group_16_asymmetric", ops((6,), 32, 5), kwargs=dict(weight_bits=3, group_size=16, symmetric=False)),
        Sample("2_bit_transposed_input", ops((9,), 16, 7, x_layout="transposed"), grad_strided=True,
               kwargs=dict(weight_bits=2, group_size=8)),
        Sample("weight_transposed", (randn((4, 32), dtype, device), randn((32, 6), dtype, device, 0.2).t()),
               kwargs=dict(group_size=16, act_quant=True)),
        Sample("zero_rows", ops((0,), 16, 4), kwargs=dict(group_size=8, act_quant=True)),
        Sample("1d_input", ops((), 32, 5), kwargs=dict(group_size=32, act_quant=True)),
    ]


def _fql_small(device):
    d = torch.float64
    x, w, b = randn((3, 8), d, device), randn((4, 8), d, device), randn((4,), d, device)
    return [Sample("transposed_per_tensor", (randn((8, 3), d, device).t(), w, b),
                   kwargs=dict(weight_bits=8, group_size=0, symmetric=False)),
            Sample("contiguous_act_quant", (x, w, b), kwargs=dict(group_size=4, act_quant=True))]


def _fql_bad(device):
    t = tensor_maker(device)

    op = F.fake_quant_linear
    pre = "opforge::fake_quant_linear: "

    def kw(**k):
        return lambda *a: op(*a, **k)
    return [
        Bad("weight_bits_1", lambda d: (kw(weight_bits=1), (t(2, 8), t(3, 8))), ValueError,
            pre + r"expected weight_bits in \[2, 8\], but got 1"),
        Bad("weight_bits_9", lambda d: (kw(weight_bits=9), (t(2, 8), t(3, 8))), ValueError,
            pre + r"expected weight_bits in \[2, 8\], but got 9"),
        Bad("group_not_dividing", lambda d: (kw(group_size=3), (t(2, 8), t(3, 8))), ValueError,
            pre + r"expected group_size to divide in_features 8 .*but got 3"),
        Bad("group_negative", lambda d: (kw(group_size=-2), (t(2, 8), t(3, 8))), ValueError,
            pre + r"expected group_size to be -1 .*but got -2"),
        Bad("in_features", lambda d: (op, (t(2, 8), t(3, 7))), ValueError,
            pre + r"expected input's last dimension to equal weight's in_features 7"),
        Bad("weight_3d", lambda d: (op, (t(2, 8), t(3, 8, 1))), ValueError, pre + r"expected weight to be 2-D"),
        Bad("int_input", lambda d: (op, (t(2, 8, dtype=torch.int32), t(3, 8))), TypeError,
            pre + DTYPE_MSG.format("input", "Int")),
        Bad("int_weight", lambda d: (op, (t(2, 8), t(3, 8, dtype=torch.int64))), TypeError,
            pre + DTYPE_MSG.format("weight", "Long")),
        Bad("complex_bias", lambda d: (op, (t(2, 8), t(3, 8), t(3, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("bias", "ComplexFloat")),
        Bad("bias_shape", lambda d: (op, (t(2, 8), t(3, 8), t(4))), ValueError, pre + r"expected bias of shape \[3\]"),
        Bad("none_weight", lambda d: (op, (t(2, 8), None)), ValueError, pre + "expected weight to be a tensor, but got None"),
        Bad("weight_device", lambda d: (op, (t(2, 8), torch.empty(3, 8, device="meta"))), RuntimeError,
            pre + "expected input and weight to be on the same device"),
    ]


def _fqw_reference_for(dtype):
    def ref(weight, bits=4, group_size=-1, symmetric=True):
        """torch's fake_quantize functions (on the CPU, the spec) on the weight in the sample's dtype (opforge.testing)."""
        out = T.fake_quantize_weight_reference(weight.detach().cpu().to(dtype), bits, group_size, symmetric)
        return tuple(t.to(weight.device) for t in out)
    return ref


def _exact_check(what, ours, ref, base, args, gouts, **kwargs):
    """Bit-exact: the fake quantization is torch's fake_quantize's, bit for bit; the mask, scales and
    zero points too."""
    assert ours.dtype == base.dtype, f"{what}: dtype {ours.dtype}, torch's {base.dtype}"
    torch.testing.assert_close(ours.cpu(), ref.to(ours.dtype).cpu(), rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _fqw_baseline(weight, bits=4, group_size=-1, symmetric=True):
    """_fq_weight_torch without history: fake_quantize_weight is not differentiable."""
    return tuple(t.detach() for t in _fq_weight_torch(weight, bits, group_size, symmetric))


def _fqw_samples(device, dtype):
    w = randn((16, 64), dtype, device, 0.3)
    w[3] = 0  # an all-zero row: a finite scale (eps), zero output
    return [
        Sample("per_channel", (w,)),
        Sample("per_tensor_8_bit", (w,), kwargs=dict(bits=8, group_size=0)),
        Sample("group_32_asymmetric", (w,), kwargs=dict(bits=4, group_size=32, symmetric=False)),
        Sample("group_8_2_bit_transposed", (randn((64, 16), dtype, device).t(),), kwargs=dict(bits=2, group_size=8)),
        Sample("sliced_3_bit", (randn((16, 128), dtype, device)[:, ::2],), kwargs=dict(bits=3, group_size=16)),
        Sample("zero_rows", (randn((0, 32), dtype, device),), kwargs=dict(group_size=16)),
    ]


def _fqw_small(device):
    d = torch.float64
    return [Sample("per_channel", (randn((4, 8), d, device),)),
            Sample("group_4_asymmetric", (randn((8, 4), d, device).t(),), kwargs=dict(group_size=4, symmetric=False))]


def _fqw_vmap(device):
    return Sample("batched", (randn((2, 4, 8), torch.float32, device),), kwargs=dict(group_size=4))


def _fqw_bad(device):
    t = tensor_maker(device)

    op = F.fake_quantize_weight
    pre = "opforge::fake_quantize_weight: "
    return [
        Bad("weight_1d", lambda d: (op, (t(8),)), ValueError, pre + "expected weight to be 2-D"),
        Bad("weight_3d", lambda d: (op, (t(2, 8, 1),)), ValueError, pre + "expected weight to be 2-D"),
        Bad("group_not_dividing", lambda d: (op, (t(2, 8), 4, 5)), ValueError,
            pre + "expected group_size to divide in_features 8 .*but got 5"),
        Bad("group_negative", lambda d: (op, (t(2, 8), 4, -3)), ValueError, pre + r"expected group_size to be -1 .*but got -3"),
        # the message names fake_quant_linear's weight_bits (the shared checker of csrc/ops/fake_quant_linear)
        Bad("bits_1", lambda d: (op, (t(2, 8), 1)), ValueError, pre + r"expected bits in \[2, 8\], but got 1"),
        Bad("bits_16", lambda d: (op, (t(2, 8), 16)), ValueError, pre + r"expected bits in \[2, 8\], but got 16"),
        Bad("int_weight", lambda d: (op, (t(2, 8, dtype=torch.int64),)), TypeError, pre + DTYPE_MSG.format("weight", "Long")),
        Bad("bool_weight", lambda d: (op, (t(2, 8, dtype=torch.bool),)), TypeError, pre + DTYPE_MSG.format("weight", "Bool")),
        Bad("complex_weight", lambda d: (op, (t(2, 8, dtype=torch.complex64),)), TypeError,
            pre + DTYPE_MSG.format("weight", "ComplexFloat")),
        # torch's own dispatcher message (no tensor at all reaches a kernel), but it names the op
        Bad("none_weight", lambda d: (op, (None,)), ValueError,
            r"opforge::fake_quantize_weight: expected weight to be a tensor, but got None"),
    ]


ENTRIES.append(OpEntry(
    name="fake_quant_linear", op=F.fake_quant_linear, reference=_fql_reference_for(torch.float64),
    reference_for=_fql_reference_for, baseline=_fql_baseline, native=_fql_native, samples=_fql_samples,
    small_samples=_fql_small, bad_inputs=_fql_bad, double_backward=False, vmap_in_dims=(0, None, None),
    autocast="lower_precision", check=_fql_check,
    # the input and weight gradients are the straight-through estimator (not the derivative of the step function);
    # checked against the reference's estimator above; gradcheck sees the bias only
    gradcheck_args=(2,)))
ENTRIES.append(OpEntry(
    name="fake_quantize_weight", op=F.fake_quantize_weight, reference=_fqw_reference_for(torch.float64),
    reference_for=_fqw_reference_for, baseline=_fqw_baseline, native=_fqw_baseline, samples=_fqw_samples,
    small_samples=_fqw_small, bad_inputs=_fqw_bad, double_backward=False, vmap_in_dims=(0,), vmap_sample=_fqw_vmap,
    check=_exact_check, gradcheck_args=(),
    # documented as not differentiable (docs/ops/fake_quant_linear.md): its outputs carry no history
    differentiable=False))


# ---- linear_cat -------------------------------------------------------------------------------------------------
# linear_cat's first argument is a Tensor[]: the generic checks differentiate tensor args only, so the entry takes
# the pieces flat, (*inputs, weight, bias), and schema_args packs them into the schema's list (opcheck).


def _linear_cat(*args):
    """opforge.linear_cat(list(args[:-2]), args[-2], args[-1]): the pieces flat, then weight and bias (or None)."""
    return F.linear_cat(list(args[:-2]), args[-2], args[-1])


def _linear_cat_schema_args(args):
    return (list(args[:-2]), args[-2], args[-1])


def _linear_cat_reference(*args):
    return T.linear_cat_reference(list(args[:-2]), args[-2], args[-1])


def _linear_cat_baseline(*args):
    return _linear_baseline(torch.cat(args[:-2], -1), args[-2], args[-1])


def _linear_cat_native(*args):
    return TF.linear(torch.cat(args[:-2], -1), args[-2], args[-1])


def _linear_cat_check(what, ours, ref, base, args, gouts, **kwargs):
    """The tolerance rule with the GEMM rounding bound (as _linear_check) of the concatenated input: each piece's
    gradient is its column slice of grad_input's bound."""
    pieces, w, b = args[:-2], args[-2], args[-1]
    dt = w.dtype
    x = torch.cat([p.detach() for p in pieces], -1)
    g = gouts[0]
    j = int(what.split()[1])
    bound = None
    if what == "output 0":
        bound = T.gemm_error_bound(x, w, dt) + _bias_bound(b, dt)
    elif j < len(pieces):
        k0 = sum(p.shape[-1] for p in pieces[:j])
        bound = T.gemm_error_bound(g, w[:, k0:k0 + pieces[j].shape[-1]].t(), dt).reshape(pieces[j].shape)
    elif j == len(pieces):
        bound = T.gemm_error_bound(_rows(g).t(), _rows(x).t(), dt)
    T.assert_matches_reference(ours, ref, base, what=what, bound=bound)


def _linear_cat_samples(device, dtype):
    def ops(lead, widths, N, bias=True, strided=False):
        xs = [randn((*lead, 2 * k), dtype, device)[..., ::2] if strided and i % 2 == 0 else randn((*lead, k), dtype, device)
              for i, k in enumerate(widths)]
        w = randn((N, sum(widths)), dtype, device, 1 / math.sqrt(max(1, sum(widths))))
        return (*xs, w, randn((N,), dtype, device) if bias else None)

    return [
        Sample("two_pieces", ops((7,), (5, 11), 13)),
        Sample("zero_width_piece_batch_dims", ops((3, 4), (16, 0, 9), 8), grad_strided=True),
        Sample("single_piece_M_1", ops((1,), (33,), 17)),
        Sample("three_pieces_no_bias", ops((83,), (64, 64, 1), 31, bias=False)),
        Sample("strided_pieces", ops((10,), (6, 5, 3), 4, strided=True), grad_strided=True),
        Sample("transposed_piece_and_weight", (randn((12, 9), dtype, device).t(), randn((9, 4), dtype, device),
                                               randn((16, 6), dtype, device, 0.25).t(), randn((6,), dtype, device))),
        Sample("zero_rows", ops((0,), (4, 6), 5)),
        Sample("1d_pieces", ops((), (3, 8), 5)),
    ]


def _linear_cat_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((3, 2), d, device), randn((3, 3), d, device), randn((4, 5), d, device),
                                  randn((4,), d, device))),
            Sample("batch_dims_zero_width_no_bias", (randn((3, 2, 2), d, device), randn((3, 2, 0), d, device),
                                                      randn((2, 3, 3), d, device).transpose(0, 1),
                                                      randn((4, 5), d, device), None))]


def _linear_cat_bad(device):
    t = tensor_maker(device)

    op, bw = F.linear_cat, torch.ops.opforge.linear_cat_backward
    pre, bpre = "opforge::linear_cat: ", "opforge::linear_cat_backward: "
    return [
        Bad("no_inputs", lambda d: (op, ([], t(2, 3))), ValueError, pre + "expected a non-empty list of inputs"),
        Bad("leading_dims", lambda d: (op, ([t(2, 3), t(3, 2)], t(4, 5))), ValueError,
            pre + r"expected every input to have inputs\[0\]'s leading dims \[2\], but got inputs\[1\] of shape \[3, 2\]"),
        Bad("in_features", lambda d: (op, ([t(2, 3), t(2, 2)], t(4, 6))), ValueError,
            pre + "expected the inputs' last dims to sum to weight's in_features 6, but got 5"),
        Bad("bias_shape", lambda d: (op, ([t(2, 3)], t(4, 3), t(5))), ValueError, pre + r"expected bias of shape \[4\]"),
        Bad("mixed_input_dtypes", lambda d: (op, ([t(2, 3), t(2, 2, dtype=torch.float64)], t(4, 5))), TypeError,
            pre + r"expected every input to have inputs\[0\]'s dtype Float, but got Double for inputs\[1\]"),
        Bad("int_input", lambda d: (op, ([t(2, 3, dtype=torch.int64)], t(4, 3))), TypeError,
            pre + DTYPE_MSG.format(r"inputs\[0\]", "Long")),
        Bad("int_weight", lambda d: (op, ([t(2, 3)], t(4, 3, dtype=torch.int32))), TypeError,
            pre + DTYPE_MSG.format("weight", "Int")),
        Bad("weight_3d", lambda d: (op, ([t(2, 3)], t(4, 3, 1))), ValueError, pre + "expected weight to be 2-D"),
        Bad("rank0_input", lambda d: (op, ([torch.tensor(1.0, device=device)], t(4, 1))), ValueError,
            pre + r"expected inputs\[0\] to have at least 1 dimension"),
        Bad("weight_device", lambda d: (op, ([t(2, 3)], torch.empty(4, 3, device="meta"))), RuntimeError,
            pre + r"expected inputs\[0\] and weight to be on the same device"),
        Bad("backward_grad_shape", lambda d: (bw, (t(2, 5), [t(2, 3)], t(4, 3), [True, True, True])), ValueError,
            bpre + r"expected grad_output of shape \[2, 4\]"),
    ]


ENTRIES.append(OpEntry(
    name="linear_cat", op=_linear_cat, reference=_linear_cat_reference, baseline=_linear_cat_baseline,
    native=_linear_cat_native, samples=_linear_cat_samples, small_samples=_linear_cat_small,
    bad_inputs=_linear_cat_bad, double_backward=True, vmap_in_dims=(0, 0, None, None), autocast="lower_precision",
    check=_linear_cat_check, schema_args=_linear_cat_schema_args))


# ---- indexed_linear ---------------------------------------------------------------------------------------------
# index is an int64 tensor: never differentiated (the generic checks take floating args only); vmap batches it with
# the input (vmap_sample), since a per-token slice of a (T, K) input is no valid input.


def _indexed_linear_baseline(input, weight, index, bias=None):
    """The same math in input's dtype with torch ops, torch.func-friendly: gather each token's weight, batched
    product, rows of index −1 zero."""
    dt = input.dtype
    i = index.clamp(min=0)
    y = torch.einsum("tk,tnk->tn", input, weight.to(dt)[i])
    if bias is not None:
        y = y + bias.to(dt)[i]
    return torch.where((index >= 0)[:, None], y, torch.zeros_like(y))


def _indexed_linear_native(input, weight, index, bias=None):
    """The op indexed_linear mirrors for autocast: torch's linear (with expert 0's weight)."""
    return TF.linear(input, weight[0], None if bias is None else bias[0])


def _indexed_linear_check(what, ours, ref, base, args, gouts, **kwargs):
    """The tolerance rule with the per-token GEMM rounding bound (gemm_error_bound's K · u · |x| |w|ᵀ, per row)."""
    x, w, index = args[0].detach().double(), args[1].detach().double(), args[2]
    b = args[3] if len(args) > 3 else None
    dt = args[0].dtype
    u = torch.finfo(dt).eps / 2
    ws = w[index.clamp(min=0)].abs() * (index >= 0)[:, None, None]
    g = gouts[0].double().abs()
    bound = None
    if what == "output 0":
        bias_rows = None if b is None else b.detach()[index.clamp(min=0)]
        bound = x.shape[1] * u * torch.einsum("tk,tnk->tn", x.abs(), ws) + _bias_bound(bias_rows, dt)
    elif what == "grad 0":
        bound = w.shape[1] * u * torch.einsum("tn,tnk->tk", g, ws)
    elif what == "grad 1":
        onehot = (index[:, None] == torch.arange(w.shape[0], device=index.device)).double()
        bound = max(1, x.shape[0]) * u * torch.einsum("te,tn,tk->enk", onehot, g, x.abs())
    T.assert_matches_reference(ours, ref, base, what=what, bound=bound)


def _indexed_linear_samples(device, dtype):
    def ops(Tn, E, N, K, bias=True, index=None):
        x = randn((Tn, K), dtype, device)
        w = randn((E, N, K), dtype, device, 1 / math.sqrt(max(K, 1)))
        i = torch.randint(-1, E, (Tn,)) if index is None else torch.tensor(index, dtype=torch.int64)
        return (x, w, i.to(device), randn((E, N), dtype, device)) if bias else (x, w, i.to(device))

    return [
        Sample("minus_one_rows", ops(8, 4, 5, 7, index=[0, -1, 3, -1, 1, 2, -1, 0])),
        Sample("83_tokens_no_bias", ops(83, 5, 24, 40, bias=False), grad_strided=True),
        Sample("empty_experts", ops(12, 6, 9, 16, index=[0, 2, 2, 3, 0, 5, 5, 5, 2, 3, 0, 0])),
        Sample("one_token", ops(1, 3, 5, 7)),
        Sample("transposed_bank", (randn((40, 24), dtype, device), randn((3, 24, 16), dtype, device, 0.2).transpose(1, 2),
                                   torch.randint(-1, 3, (40,)).to(device))),
        Sample("sliced_bank_and_input", (randn((40, 48), dtype, device)[:, 24:], randn((3, 32, 24), dtype, device, 0.2)[:, :16],
                                         torch.randint(-1, 3, (40,)).to(device), randn((3, 16), dtype, device)),
               grad_strided=True),
        Sample("zero_tokens", ops(0, 3, 4, 5, index=[])),
        Sample("zero_out_features", ops(6, 3, 0, 5)),
    ]


def _indexed_linear_small(device):
    d = torch.float64
    index = torch.tensor([0, -1, 2, 2, 1, -1, 0, 2, 2], device=device)
    return [Sample("contiguous", (randn((9, 5), d, device), randn((3, 4, 5), d, device), index, randn((3, 4), d, device))),
            Sample("transposed_bank_no_bias", (randn((5, 9), d, device).t(), randn((3, 5, 4), d, device).transpose(1, 2),
                                               index.flip(0)))]


def _indexed_linear_vmap(device):
    d = torch.float64
    return Sample("batched", (randn((2, 6, 5), d, device), randn((3, 4, 5), d, device),
                              torch.tensor([[0, -1, 2, 2, 1, 0], [1, 1, -1, 0, 2, 2]], device=device),
                              randn((3, 4), d, device)))


def _indexed_linear_bad(device):
    t = tensor_maker(device)

    def idx(*v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    op, bw = F.indexed_linear, torch.ops.opforge.indexed_linear_backward
    pre, bpre = "opforge::indexed_linear: ", "opforge::indexed_linear_backward: "
    z4 = idx(0, 0, 0, 0)
    return [
        Bad("int32_index", lambda d: (op, (t(4, 3), t(2, 5, 3), z4.int())), TypeError,
            pre + "expected index to have dtype int64, but got Int"),
        Bad("weight_2d", lambda d: (op, (t(4, 3), t(5, 3), z4)), ValueError, pre + "expected weight to be 3-D"),
        Bad("in_features", lambda d: (op, (t(4, 3), t(2, 5, 4), z4)), ValueError,
            pre + "expected input's last dimension to equal weight's in_features 4, but got 3"),
        Bad("bias_shape", lambda d: (op, (t(4, 3), t(2, 5, 3), z4, t(5))), ValueError, pre + r"expected bias of shape \[2, 5\]"),
        Bad("input_3d", lambda d: (op, (t(2, 4, 3), t(2, 5, 3), z4)), ValueError, pre + "expected input to be 2-D"),
        Bad("int_input", lambda d: (op, (t(4, 3, dtype=torch.int64), t(2, 5, 3), z4)), TypeError,
            pre + DTYPE_MSG.format("input", "Long")),
        Bad("complex_weight", lambda d: (op, (t(4, 3), t(2, 5, 3, dtype=torch.complex64), z4)), TypeError,
            pre + DTYPE_MSG.format("weight", "ComplexFloat")),
        Bad("index_length", lambda d: (op, (t(8, 3), t(4, 5, 3), idx(0, 1, 2, 3, 0, 1, 2))), ValueError,
            pre + r"expected index of length 8 \(input's rows\), but got 7"),
        Bad("index_too_large", lambda d: (op, (t(8, 3), t(4, 5, 3), idx(0, 1, 2, 3, 0, 1, 2, 4))), IndexError,
            pre + r"expected every index in \[-1, 4\).*but got 4 at position 7", devices=("cpu",)),
        Bad("index_below_minus_one", lambda d: (op, (t(8, 3), t(4, 5, 3), idx(0, 1, 2, 3, 0, 1, 2, -2))), IndexError,
            pre + r"expected every index in \[-1, 4\).*but got -2 at position 7", devices=("cpu",)),
        Bad("backward_index_too_large",
            lambda d: (bw, (t(8, 5), t(8, 3), t(4, 5, 3), idx(0, 1, 2, 3, 0, 1, 2, 1000000), [True, True, True])),
            IndexError, bpre + r"expected every index in \[-1, 4\)", devices=("cpu",)),
        Bad("weight_device", lambda d: (op, (t(4, 3), torch.empty(2, 5, 3, device="meta"), z4)), RuntimeError,
            pre + "expected input and weight to be on the same device"),
    ]


ENTRIES.append(OpEntry(
    name="indexed_linear", op=F.indexed_linear, reference=T.indexed_linear_reference, baseline=_indexed_linear_baseline,
    native=_indexed_linear_native, samples=_indexed_linear_samples, small_samples=_indexed_linear_small,
    bad_inputs=_indexed_linear_bad, double_backward=True, vmap_in_dims=(0, None, 0, None),
    vmap_sample=_indexed_linear_vmap, autocast="lower_precision", check=_indexed_linear_check))


# ---- swiglu_packed ---------------------------------------------------------------------------------------------


def _swiglu_packed_baseline(input):
    gate, up = input.chunk(2, dim=-1)
    return TF.silu(gate) * up


def _swiglu_packed_samples(device, dtype):
    # I = 7 (odd) in the layouts; "column_slice": the (*, 2I) columns of a wider row, read in place on CUDA
    out = [Sample(name, (x,), grad_strided=(i % 2 == 1)) for i, (name, x) in enumerate(layouts(83, 14, dtype, device, 3.0))]
    out += [
        Sample("column_slice", (randn((83, 2 * 64 + 8), dtype, device, 3.0)[:, 8:],)),
        Sample("column_slice_unaligned", (randn((5, 3, 2 * 83 + 3), dtype, device, 3.0)[..., 3:],), grad_strided=True),
        Sample("1d_I1", (randn((2,), dtype, device, 3.0),)),
        Sample("odd_3x1538", (randn((3, 1538), dtype, device, 3.0),)),
        Sample("zero_rows", (randn((0, 10), dtype, device),)),
        Sample("zero_I", (randn((3, 0), dtype, device),)),
    ]
    return out


def _swiglu_packed_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((4, 10), d, device, 2.0),)),
            Sample("transposed", (randn((10, 4), d, device, 2.0).t(),)),
            Sample("column_slice", (randn((4, 13), d, device, 2.0)[:, 3:],))]


def _swiglu_packed_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.swiglu_packed, torch.ops.opforge.swiglu_packed_backward
    pre, bpre = "opforge::swiglu_packed: ", "opforge::swiglu_packed_backward: "
    odd = r"expected input's last dimension to be even \(2I: the \[gate \| up\] halves\), but got {}"
    return [
        Bad("odd_last_dim", lambda d: (op, (t(3, 5),)), ValueError, pre + odd.format(5)),
        Bad("odd_1d", lambda d: (op, (t(7),)), ValueError, pre + odd.format(7)),
        Bad("0d", lambda d: (op, (t(),)), ValueError,
            pre + r"expected input of shape \(\*, 2I\) \(the \[gate \| up\] halves\), but got a 0-d tensor"),
        Bad("int_input", lambda d: (op, (t(3, 4, dtype=torch.int64),)), TypeError, pre + DTYPE_MSG.format("input", "Long")),
        Bad("complex_input", lambda d: (op, (t(3, 4, dtype=torch.complex64),)), TypeError,
            pre + DTYPE_MSG.format("input", "ComplexFloat")),
        Bad("bool_input", lambda d: (op, (t(3, 4, dtype=torch.bool),)), TypeError, pre + DTYPE_MSG.format("input", "Bool")),
        Bad("none_input", lambda d: (op, (None,)), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("backward_grad_shape", lambda d: (bw, (t(3, 3), t(3, 4))), ValueError,
            bpre + r"expected grad_output of shape \[3, 2\] \(input's with the last dimension halved\), but got \[3, 3\]"),
        Bad("backward_grad_of_input_shape", lambda d: (bw, (t(3, 4), t(3, 4))), ValueError,
            bpre + r"expected grad_output of shape \[3, 2\] \(input's with the last dimension halved\), but got \[3, 4\]"),
        Bad("backward_odd_input", lambda d: (bw, (t(3, 2), t(3, 5))), ValueError, bpre + odd.format(5)),
        Bad("backward_int_grad", lambda d: (bw, (t(3, 2, dtype=torch.int32), t(3, 4))), TypeError,
            bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_int_input", lambda d: (bw, (t(3, 2), t(3, 4, dtype=torch.int32))), TypeError,
            bpre + DTYPE_MSG.format("input", "Int")),
        Bad("backward_grad_device", lambda d: (bw, (torch.empty(3, 2, device="meta"), t(3, 4))), RuntimeError,
            bpre + "expected grad_output and input to be on the same device"),
    ]


ENTRIES.append(OpEntry(
    name="swiglu_packed", op=F.swiglu_packed, reference=T.swiglu_packed_reference, baseline=_swiglu_packed_baseline,
    native=_swiglu_packed_baseline, samples=_swiglu_packed_samples, small_samples=_swiglu_packed_small,
    bad_inputs=_swiglu_packed_bad, double_backward=True, vmap_in_dims=(0,)))


# ---- geglu, geglu_packed: swiglu's gated engine with gelu (approximate "none": erf, "tanh") --------------------------


def _geglu_baseline(gate, up, approximate="none"):
    return TF.gelu(gate, approximate=approximate) * up


def _geglu_samples(device, dtype):
    # swiglu's grid, the two forms of gelu alternating over it (the layouts twice: each form sees every layout)
    gates = layouts(83, 7, dtype, device, 3.0)
    ups = layouts(83, 7, dtype, device)
    out = [Sample(f"{g[0]}_{u[0]}_{a}", (g[1], u[1]), grad_strided=(i % 2 == 1), kwargs={"approximate": a})
           for a in ("none", "tanh") for i, (g, u) in enumerate(zip(gates, ups[1:] + ups[:1]))]
    for a in ("none", "tanh"):
        out += [
            Sample(f"1_{a}", (randn((1,), dtype, device), randn((1,), dtype, device)), kwargs={"approximate": a}),
            Sample(f"odd_3x769_{a}", (randn((3, 769), dtype, device, 3.0), randn((3, 769), dtype, device)),
                   kwargs={"approximate": a}),
            Sample(f"zero_size_{a}", (randn((0, 5), dtype, device), randn((0, 5), dtype, device)),
                   kwargs={"approximate": a}),
            Sample(f"0d_{a}", (randn((), dtype, device), randn((), dtype, device)), kwargs={"approximate": a}),
        ]
    return out


def _geglu_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((4, 5), d, device, 2.0), randn((4, 5), d, device))),
            Sample("contiguous_tanh", (randn((4, 5), d, device, 2.0), randn((4, 5), d, device)),
                   kwargs={"approximate": "tanh"}),
            Sample("transposed_tanh", (randn((5, 4), d, device, 2.0).t(), randn((4, 5), d, device)),
                   kwargs={"approximate": "tanh"})]


_APPROX_MSG = r'expected approximate to be "none" or "tanh", but got "{}"'


def _geglu_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.geglu, torch.ops.opforge.geglu_backward
    pre, bpre = "opforge::geglu: ", "opforge::geglu_backward: "
    return [
        Bad("shape", lambda d: (op, (t(3, 4), t(3, 5))), ValueError,
            pre + r"expected gate and up of the same shape, but got \[3, 4\] and \[3, 5\]"),
        Bad("broadcastable_shape", lambda d: (op, (t(3, 4), t(4), "tanh")), ValueError,
            pre + r"expected gate and up of the same shape, but got \[3, 4\] and \[4\]"),
        Bad("int_gate", lambda d: (op, (t(3, dtype=torch.int64), t(3))), TypeError, pre + DTYPE_MSG.format("gate", "Long")),
        Bad("complex_up", lambda d: (op, (t(3), t(3, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("up", "ComplexFloat")),
        Bad("bool_up", lambda d: (op, (t(3), t(3, dtype=torch.bool))), TypeError, pre + DTYPE_MSG.format("up", "Bool")),
        Bad("none_gate", lambda d: (op, (None, t(3))), ValueError, pre + "expected gate to be a tensor, but got None"),
        Bad("none_up", lambda d: (op, (t(3), None)), ValueError, pre + "expected up to be a tensor, but got None"),
        Bad("device", lambda d: (op, (t(3), torch.empty(3, device="meta"))), RuntimeError,
            pre + "expected gate and up to be on the same device"),
        Bad("approximate_erf", lambda d: (op, (t(3), t(3), "erf")), ValueError, pre + _APPROX_MSG.format("erf")),
        Bad("approximate_case", lambda d: (op, (t(3), t(3), "Tanh")), ValueError, pre + _APPROX_MSG.format("Tanh")),
        Bad("approximate_linear_name", lambda d: (op, (t(3), t(3), "gelu_tanh")), ValueError,
            pre + _APPROX_MSG.format("gelu_tanh")),
        Bad("backward_grad_shape", lambda d: (bw, (t(3, 5), t(3, 4), t(3, 4))), ValueError,
            bpre + r"expected grad_output of gate's shape \[3, 4\], but got \[3, 5\]"),
        Bad("backward_shape", lambda d: (bw, (t(3, 4), t(3, 4), t(4, 3), "tanh")), ValueError,
            bpre + r"expected gate and up of the same shape, but got \[3, 4\] and \[4, 3\]"),
        Bad("backward_int_grad", lambda d: (bw, (t(3, 4, dtype=torch.int32), t(3, 4), t(3, 4))), TypeError,
            bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_grad_device", lambda d: (bw, (torch.empty(3, 4, device="meta"), t(3, 4), t(3, 4))), RuntimeError,
            bpre + "expected grad_output and gate to be on the same device"),
        Bad("backward_approximate", lambda d: (bw, (t(3, 4), t(3, 4), t(3, 4), "")), ValueError,
            bpre + _APPROX_MSG.format("")),
    ]


ENTRIES.append(OpEntry(
    name="geglu", op=F.geglu, reference=T.geglu_reference, baseline=_geglu_baseline, native=_geglu_baseline,
    samples=_geglu_samples, small_samples=_geglu_small, bad_inputs=_geglu_bad, double_backward=True,
    vmap_in_dims=(0, 0)))


def _geglu_packed_baseline(input, approximate="none"):
    gate, up = input.chunk(2, dim=-1)
    return TF.gelu(gate, approximate=approximate) * up


def _geglu_packed_samples(device, dtype):
    out = []
    for a in ("none", "tanh"):
        kw = {"approximate": a}
        out += [Sample(f"{name}_{a}", (x,), grad_strided=(i % 2 == 1), kwargs=kw)
                for i, (name, x) in enumerate(layouts(83, 14, dtype, device, 3.0))]
        out += [
            Sample(f"column_slice_{a}", (randn((83, 2 * 64 + 8), dtype, device, 3.0)[:, 8:],), kwargs=kw),
            Sample(f"column_slice_unaligned_{a}", (randn((5, 3, 2 * 83 + 3), dtype, device, 3.0)[..., 3:],),
                   grad_strided=True, kwargs=kw),
            Sample(f"1d_I1_{a}", (randn((2,), dtype, device, 3.0),), kwargs=kw),
            Sample(f"odd_3x1538_{a}", (randn((3, 1538), dtype, device, 3.0),), kwargs=kw),
            Sample(f"zero_rows_{a}", (randn((0, 10), dtype, device),), kwargs=kw),
            Sample(f"zero_I_{a}", (randn((3, 0), dtype, device),), kwargs=kw),
        ]
    return out


def _geglu_packed_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((4, 10), d, device, 2.0),)),
            Sample("contiguous_tanh", (randn((4, 10), d, device, 2.0),), kwargs={"approximate": "tanh"}),
            Sample("column_slice_tanh", (randn((4, 13), d, device, 2.0)[:, 3:],), kwargs={"approximate": "tanh"})]


def _geglu_packed_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.geglu_packed, torch.ops.opforge.geglu_packed_backward
    pre, bpre = "opforge::geglu_packed: ", "opforge::geglu_packed_backward: "
    odd = r"expected input's last dimension to be even \(2I: the \[gate \| up\] halves\), but got {}"
    return [
        Bad("odd_last_dim", lambda d: (op, (t(3, 5),)), ValueError, pre + odd.format(5)),
        Bad("odd_1d", lambda d: (op, (t(7), "tanh")), ValueError, pre + odd.format(7)),
        Bad("0d", lambda d: (op, (t(),)), ValueError,
            pre + r"expected input of shape \(\*, 2I\) \(the \[gate \| up\] halves\), but got a 0-d tensor"),
        Bad("int_input", lambda d: (op, (t(3, 4, dtype=torch.int64),)), TypeError, pre + DTYPE_MSG.format("input", "Long")),
        Bad("complex_input", lambda d: (op, (t(3, 4, dtype=torch.complex64),)), TypeError,
            pre + DTYPE_MSG.format("input", "ComplexFloat")),
        Bad("bool_input", lambda d: (op, (t(3, 4, dtype=torch.bool),)), TypeError, pre + DTYPE_MSG.format("input", "Bool")),
        Bad("none_input", lambda d: (op, (None,)), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("approximate_erf", lambda d: (op, (t(3, 4), "erf")), ValueError, pre + _APPROX_MSG.format("erf")),
        Bad("approximate_sigmoid", lambda d: (op, (t(3, 4), "sigmoid")), ValueError,
            pre + _APPROX_MSG.format("sigmoid")),
        Bad("backward_grad_shape", lambda d: (bw, (t(3, 3), t(3, 4))), ValueError,
            bpre + r"expected grad_output of shape \[3, 2\] \(input's with the last dimension halved\), but got \[3, 3\]"),
        Bad("backward_odd_input", lambda d: (bw, (t(3, 2), t(3, 5), "tanh")), ValueError, bpre + odd.format(5)),
        Bad("backward_int_grad", lambda d: (bw, (t(3, 2, dtype=torch.int32), t(3, 4))), TypeError,
            bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_int_input", lambda d: (bw, (t(3, 2), t(3, 4, dtype=torch.int32))), TypeError,
            bpre + DTYPE_MSG.format("input", "Int")),
        Bad("backward_grad_device", lambda d: (bw, (torch.empty(3, 2, device="meta"), t(3, 4))), RuntimeError,
            bpre + "expected grad_output and input to be on the same device"),
        Bad("backward_approximate", lambda d: (bw, (t(3, 2), t(3, 4), "none ")), ValueError,
            bpre + _APPROX_MSG.format("none ")),
    ]


ENTRIES.append(OpEntry(
    name="geglu_packed", op=F.geglu_packed, reference=T.geglu_packed_reference, baseline=_geglu_packed_baseline,
    native=_geglu_packed_baseline, samples=_geglu_packed_samples, small_samples=_geglu_packed_small,
    bad_inputs=_geglu_packed_bad, double_backward=True, vmap_in_dims=(0,)))

# ---- swiglu_linear ---------------------------------------------------------------------------------------------


def _swiglu_linear_baseline(input, weight, bias=None):
    dt = input.dtype
    z = TF.linear(input, weight.to(dt), bias.to(dt) if bias is not None else None)
    return TF.silu(z[..., 0::2]) * z[..., 1::2]


def _swiglu_linear_native(input, weight, bias=None):
    z = TF.linear(input, weight, bias)
    return TF.silu(z[..., 0::2]) * z[..., 1::2]


def _swiglu_linear_samples(device, dtype):
    def ops(M, K, I, bias=True, x_layout="contiguous", w_layout="contiguous"):
        if x_layout == "transposed":
            x = randn((K, M), dtype, device).t()
        elif x_layout == "sliced_3d":
            x = randn((3, M, 2 * K), dtype, device)[:, :, ::2].transpose(0, 1)
        else:
            x = randn((M, K), dtype, device)
        w = randn((K, 2 * I), dtype, device).t() if w_layout == "transposed" else randn((2 * I, K), dtype, device)
        return (x, w, randn((2 * I,), dtype, device)) if bias else (x, w)

    return [
        Sample("7x83x9", ops(7, 83, 9)),
        Sample("1x1x1", ops(1, 1, 1)),
        Sample("no_bias_83x8x5", ops(83, 8, 5, bias=False), grad_strided=True),
        Sample("weight_transposed", ops(7, 33, 9, w_layout="transposed")),
        Sample("input_transposed", ops(9, 32, 8, x_layout="transposed"), grad_strided=True),
        Sample("input_sliced_3d", ops(5, 17, 6, x_layout="sliced_3d")),
        Sample("aligned_65x64x48", ops(65, 64, 48)),
        Sample("zero_rows", ops(0, 5, 3)),
        Sample("zero_in_features", ops(4, 0, 3)),
        Sample("zero_out_features", ops(4, 5, 0)),
        Sample("1d_input", (randn((17,), dtype, device), randn((10, 17), dtype, device), randn((10,), dtype, device))),
    ]


def _swiglu_linear_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((3, 4), d, device), randn((6, 4), d, device), randn((6,), d, device))),
            Sample("transposed_weight_3d", (randn((2, 3, 4), d, device), randn((4, 6), d, device).t()))]


def _swiglu_linear_bad(device):
    t = tensor_maker(device)
    op, bw = opforge.swiglu_linear, torch.ops.opforge.swiglu_linear_backward
    pre, bpre = "opforge::swiglu_linear: ", "opforge::swiglu_linear_backward: "
    mask = [True, True, True]
    return [
        Bad("rank0", lambda d: (op, (torch.tensor(1.0, device=device), t(2, 1))), ValueError,
            pre + "expected input to have at least 1 dimension"),
        Bad("weight_1d", lambda d: (op, (t(4, 8), t(8))), ValueError,
            pre + r"expected weight to be 2-D \(2 \* intermediate, in_features\), but got shape \[8\]"),
        Bad("weight_odd_rows", lambda d: (op, (t(4, 8), t(7, 8))), ValueError,
            pre + r"expected weight's rows to be even \(the gate's and the up projection's rows interleaved\), "
                  r"but got 7"),
        Bad("in_features", lambda d: (op, (t(4, 511), t(8, 512))), ValueError,
            pre + r"expected input's last dimension to equal weight's in_features 512, but got 511"),
        Bad("bias_shape", lambda d: (op, (t(4, 8), t(6, 8), t(3))), ValueError,
            pre + r"expected bias of shape \[6\] \(weight's rows\), but got \[3\]"),
        Bad("int_input", lambda d: (op, (t(4, 8, dtype=torch.int32), t(6, 8))), TypeError,
            pre + DTYPE_MSG.format("input", "Int")),
        Bad("bool_weight", lambda d: (op, (t(4, 8), t(6, 8, dtype=torch.bool))), TypeError,
            pre + DTYPE_MSG.format("weight", "Bool")),
        Bad("complex_bias", lambda d: (op, (t(4, 8), t(6, 8), t(6, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("bias", "ComplexFloat")),
        Bad("none_input", lambda d: (op, (None, t(6, 8))), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("none_weight", lambda d: (op, (t(4, 8), None)), ValueError,
            pre + "expected weight to be a tensor, but got None"),
        Bad("weight_device", lambda d: (op, (t(4, 8), torch.empty(6, 8, device="meta"))), RuntimeError,
            pre + "expected input and weight to be on the same device"),
        Bad("backward_grad_shape", lambda d: (bw, (t(4, 6), t(4, 8), t(6, 8), t(4, 6), mask)), ValueError,
            bpre + r"expected grad_output of shape \[4, 3\] \(input's leading dims, half of weight's rows\), "
                   r"but got \[4, 6\]"),
        Bad("backward_pre_activation_shape", lambda d: (bw, (t(4, 3), t(4, 8), t(6, 8), t(4, 3), mask)), ValueError,
            bpre + r"expected pre_activation of shape \[4, 6\] \(the forward's input · weightᵀ \+ bias\), "
                   r"but got \[4, 3\]"),
        Bad("backward_int_grad", lambda d: (bw, (t(4, 3, dtype=torch.int32), t(4, 8), t(6, 8), t(4, 6), mask)),
            TypeError, bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_bias_dtype", lambda d: (bw, (t(4, 3), t(4, 8), t(6, 8), t(4, 6), mask, torch.int32)),
            TypeError, bpre + r"expected bias_dtype to be a floating dtype"),
    ]


ENTRIES.append(OpEntry(
    name="swiglu_linear", op=F.swiglu_linear, reference=T.swiglu_linear_reference, baseline=_swiglu_linear_baseline,
    native=_swiglu_linear_native, samples=_swiglu_linear_samples, small_samples=_swiglu_linear_small,
    bad_inputs=_swiglu_linear_bad, double_backward=True, vmap_in_dims=(0, None, None), autocast="lower_precision"))



# ---- fp8: quantize_fp8, fp8_linear ----------------------------------------------------------------------------


def _fp8_exact_check(what, ours, ref, base, args, gouts, **kwargs):
    """Bit-exact: quantize_fp8's data and scale are torch's cast of the recipe (opforge.testing's reference), bit
    for bit, NaNs included."""
    assert ours.dtype == base.dtype, f"{what}: dtype {ours.dtype}, torch's {base.dtype}"
    r = ref.to(ours.dtype)
    if ours.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        ours, r = ours.view(torch.uint8), r.view(torch.uint8)
    torch.testing.assert_close(ours.cpu(), r.cpu(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _quantize_fp8_baseline(input, dtype=None, granularity="tensorwise"):
    """torch's own composition of the recipe (the cast is torch's .to(float8)), in the input's dtype."""
    return T.quantize_fp8_reference(input, dtype, granularity)


def _quantize_fp8_samples(device, dtype):
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    special = randn((3, 5), dtype, device, 2.0)
    special[0, 1], special[1, 2], special[2] = float("nan"), float("inf"), 0.0
    out = [Sample(f"{name}_{g}_{'e5m2' if fp8 is e5 else 'e4m3'}", (x, fp8, g))
           for name, x in layouts(7, 33, dtype, device, 3.0) for g in ("tensorwise", "rowwise") for fp8 in (e4, e5)]
    return out + [
        Sample("3d_rowwise", (randn((2, 3, 17), dtype, device, 1e-2), None, "rowwise")),
        Sample("special_values_rowwise", (special, None, "rowwise")),
        Sample("special_values_tensorwise", (special[2:], e5, "tensorwise")),
        Sample("0d_tensorwise", (randn((), dtype, device), None, "tensorwise")),
        Sample("zero_rows_rowwise", (randn((0, 8), dtype, device), None, "rowwise")),
        Sample("zero_width_rowwise", (randn((4, 0), dtype, device), None, "rowwise")),
        Sample("empty_tensorwise", (randn((0, 8), dtype, device), e5, "tensorwise")),
    ]


def _quantize_fp8_small(device):
    d = torch.float64
    return [Sample("rowwise", (randn((3, 8), d, device), None, "rowwise")),
            Sample("tensorwise_e5m2_transposed", (randn((8, 3), d, device).t(), torch.float8_e5m2, "tensorwise"))]


def _quantize_fp8_vmap(device):
    return Sample("batched_tensorwise", (randn((2, 3, 8), torch.float32, device), None, "tensorwise"))


def _quantize_fp8_bad(device):
    t = tensor_maker(device)
    op, pre = F.quantize_fp8, "opforge::quantize_fp8: "
    fp8_msg = pre + r"expected dtype to be torch.float8_e4m3fn or torch.float8_e5m2, but got {}"
    gran_msg = pre + r'expected granularity to be "tensorwise" or "rowwise", but got "{}"'
    return [
        Bad("int_input", lambda d: (op, (t(4, 8, dtype=torch.int32),)), TypeError, pre + DTYPE_MSG.format("input", "Int")),
        Bad("bool_input", lambda d: (op, (t(4, 8, dtype=torch.bool),)), TypeError, pre + DTYPE_MSG.format("input", "Bool")),
        Bad("complex_input", lambda d: (op, (t(4, 8, dtype=torch.complex64),)), TypeError,
            pre + DTYPE_MSG.format("input", "ComplexFloat")),
        Bad("fp8_input", lambda d: (op, (t(4, 8).to(torch.float8_e4m3fn),)), TypeError,
            pre + DTYPE_MSG.format("input", "Float8_e4m3fn")),
        Bad("dtype_float16", lambda d: (op, (t(4, 8), torch.float16)), ValueError, fp8_msg.format("Half")),
        Bad("dtype_fnuz", lambda d: (op, (t(4, 8), torch.float8_e4m3fnuz)), ValueError, fp8_msg.format("Float8_e4m3fnuz")),
        Bad("dtype_int8", lambda d: (op, (t(4, 8), torch.int8)), ValueError, fp8_msg.format("Char")),
        Bad("granularity_blockwise", lambda d: (op, (t(4, 8), None, "blockwise")), ValueError, gran_msg.format("blockwise")),
        Bad("granularity_empty", lambda d: (op, (t(4, 8), None, "")), ValueError, gran_msg.format("")),
        Bad("rowwise_0d", lambda d: (op, (torch.tensor(1.0, device=device), None, "rowwise")), ValueError,
            pre + r"expected input with at least 1 dimension for rowwise scales, but got a 0-d tensor"),
        Bad("none_input", lambda d: (op, (None,)), ValueError, pre + "expected input to be a tensor, but got None"),
    ]


ENTRIES.append(OpEntry(
    name="quantize_fp8", op=F.quantize_fp8, reference=T.quantize_fp8_reference, baseline=_quantize_fp8_baseline,
    native=_quantize_fp8_baseline, samples=_quantize_fp8_samples, small_samples=_quantize_fp8_small,
    bad_inputs=_quantize_fp8_bad, double_backward=False, vmap_in_dims=(0, None, None), vmap_sample=_quantize_fp8_vmap,
    check=_fp8_exact_check, gradcheck_args=(),
    # documented as not differentiable (docs/ops/fp8.md): its outputs carry no history
    differentiable=False))


def _fp8_operands(a, b, dtype_a, dtype_b, rowwise):
    """deq(q(a)), deq(q(b)) in float64: the operands of one scaled FP8 GEMM a · bᵀ, each quantized along its rows
    by the recipe (opforge.testing) and dequantized as the scaled GEMM does (data · float32(1 / scale))."""
    g = "rowwise" if rowwise else "tensorwise"
    out = []
    for x, dt in ((a, dtype_a), (b, dtype_b)):
        q, s = T.quantize_fp8_reference(x.detach().cpu(), dt, g)
        out.append(q.double() * s.reciprocal().double())
    return out


def _fp8_linear_check(what, ours, ref, base, args, gouts, granularity="tensorwise", grad_dtype=None):
    """Every element within the a-priori bound of the quantized math (no fallback to the baseline: torch's
    composition calls the same scaled GEMM, so only the bound judges the GEMM): the reference is the float64 product
    of the same quantized operands, so the bound is the GEMM's rounding alone (opforge.testing.fp8_gemm_bound, with
    the FP8 tensor cores' truncating accumulation on CUDA)."""
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 and isinstance(args[2], torch.Tensor) else None
    rowwise = granularity == "rowwise"
    e4 = torch.float8_e4m3fn
    gdt = grad_dtype or (e4 if rowwise else torch.float8_e5m2)
    dt = x.dtype
    x2 = T._fp8_rows(x.detach())
    if what == "grad 2":  # Σ_rows grad: fp32 accumulation, not quantized
        g2 = T._fp8_rows(gouts[0].detach()).double().cpu()
        u = torch.finfo(torch.float32 if dt != torch.float64 else dt).eps / 2
        bound = (g2.shape[0] * u + torch.finfo(b.dtype).eps / 2) * g2.abs().sum(0)
    else:
        g2 = T._fp8_rows(gouts[0].detach())
        if what == "output 0":
            A, B = _fp8_operands(x2, w, e4, e4, rowwise)
        elif what == "grad 0":
            A, B = _fp8_operands(g2, w.t(), gdt, e4, rowwise)
        else:  # grad 1
            A, B = _fp8_operands(g2.t(), x2.t(), gdt, e4, rowwise)
        bound = T.fp8_gemm_bound(A, B, w.dtype if what == "grad 1" else dt, rowwise, ours.is_cuda)
        if what == "output 0" and b is not None:
            bound = bound + torch.finfo(dt).eps * (bound + (A @ B.t()).abs() + b.detach().double().cpu().abs())
        bound = bound.reshape(ref.shape)
    assert ours.shape == ref.shape and ours.dtype == base.dtype, f"{what}: {ours.shape} {ours.dtype}"
    err = (ours.detach().double().cpu() - ref.detach().double().cpu()).abs()
    within = err <= bound + 1e-300
    assert bool(within.all()), (f"{what}: {int((~within).sum())} of {within.numel()} elements past the FP8 GEMM's "
                                f"rounding bound, max excess {(err - bound).max().item():.3g}")


def _aligned16(s):
    """s (float32) stored from a 16-byte boundary: cuBLASLt refuses a scale at a 4-byte offset
    (CUBLAS_STATUS_NOT_SUPPORTED), which vmap's per-sample loop over _scaled_mm (no batching rule) gives the
    samples of a batched scale; padded to 4 floats per sample, each sample's scale starts 16-byte aligned."""
    n = s.numel()
    return TF.pad(s.reshape(n), (0, (-n) % 4))[:n].reshape(s.shape)


class _FP8LinearTorch(torch.autograd.Function):
    """fp8_linear composed of torch ops as torchao's float8 training does: the recipe's cast (torch's .to(float8)),
    torch._scaled_mm for the three GEMMs (the contraction and mat2's columns zero-padded to multiples of 16 on CUDA,
    mat1 row-major and mat2 column-major, the scales 16-byte aligned, as cuBLASLt needs there), the rowwise product
    in bfloat16."""

    @staticmethod
    def _gemm(a, b, dtype_a, dtype_b, rowwise, out_dtype):
        g = "rowwise" if rowwise else "tensorwise"
        R, C, Rb = a.shape[0], a.shape[1], b.shape[0]
        if R == 0 or Rb == 0 or C == 0:
            return torch.zeros(R, Rb, dtype=out_dtype, device=a.device)
        if a.is_cuda:  # zeros before the cast: no amax changes, the padded rows of b are sliced off the output
            pc, pr = (-C) % 16, (-Rb) % 16
            a, b = TF.pad(a, (0, pc)), TF.pad(b, (0, pc, 0, pr))
        # row-major operands (a transposed input or weight keeps its strides through the cast): mat1 = qa
        # row-major, mat2 = qbᵀ column-major
        qa, sa = T.quantize_fp8_reference(a.contiguous(), dtype_a, g)
        qb, sb = T.quantize_fp8_reference(b.contiguous(), dtype_b, g)
        ia, ib = _aligned16(sa.reciprocal()), _aligned16(sb.reciprocal())
        if rowwise:
            ia, ib = ia.reshape(R, 1), ib.reshape(1, -1)
        gemm_dt = torch.bfloat16 if rowwise else (torch.float32 if out_dtype == torch.float64 else out_dtype)
        y = torch._scaled_mm(qa, qb.t(), ia, ib, out_dtype=gemm_dt)
        return y[:, :Rb].to(out_dtype)

    @staticmethod
    def forward(input, weight, bias, granularity, grad_dtype):
        return T.fp8_linear_forward_with(_FP8LinearTorch._gemm, input, weight, bias, granularity)

    setup_context = staticmethod(T.fp8_linear_setup_context)

    @staticmethod
    def backward(ctx, grad):
        return T.fp8_linear_backward_with(_FP8LinearTorch._gemm, ctx, grad, weight_grad_in_input_dtype=False)

    generate_vmap_rule = True


def _fp8_linear_baseline(input, weight, bias=None, *, granularity="tensorwise", grad_dtype=None):
    return _FP8LinearTorch.apply(input, weight, bias, granularity, grad_dtype)


def _fp8_linear_native(input, weight, bias=None, **kwargs):
    """The op fp8_linear mirrors for autocast: torch's linear."""
    return TF.linear(input, weight, bias)


def _fp8_linear_samples(device, dtype):
    def ops(lead, K, N, bias=True, x_layout="contiguous", w_layout="contiguous"):
        x = randn((*lead, K), dtype, device)
        if x_layout == "transposed":
            x = randn((K, *lead), dtype, device).t()
        elif x_layout == "sliced_3d":
            x = randn((3, *lead, 2 * K), dtype, device)[..., ::2].transpose(0, 1)
        w = randn((K, N), dtype, device, 0.1).t() if w_layout == "transposed" else randn((N, K), dtype, device, 0.1)
        return (x, w, randn((N,), dtype, device)) if bias else (x, w)

    rw, e4 = dict(granularity="rowwise"), dict(grad_dtype=torch.float8_e4m3fn)
    return [
        Sample("7x83x9", ops((7,), 83, 9)),
        Sample("7x83x9_rowwise", ops((7,), 83, 9), kwargs=rw),
        Sample("1x1x1", ops((1,), 1, 1)),
        Sample("no_bias_83x7x5_rowwise", ops((83,), 7, 5, bias=False), grad_strided=True, kwargs=rw),
        Sample("weight_transposed_e4m3_grad", ops((7,), 33, 9, w_layout="transposed"), kwargs=e4),
        Sample("input_transposed_rowwise", ops((9,), 33, 7, x_layout="transposed"), grad_strided=True, kwargs=rw),
        Sample("input_sliced_3d", ops((5,), 17, 6, x_layout="sliced_3d")),
        Sample("aligned_3d_rowwise", ops((2, 16), 64, 48), kwargs=rw),
        Sample("zero_rows", ops((0,), 5, 3)),
        Sample("zero_in_features_rowwise", ops((4,), 0, 3), kwargs=rw),
        Sample("zero_out_features", ops((4,), 5, 0)),
        Sample("1d_input", ops((), 17, 5)),
    ]


def _fp8_linear_small(device):
    d = torch.float64
    return [Sample("contiguous", (randn((3, 4), d, device), randn((5, 4), d, device), randn((5,), d, device))),
            Sample("rowwise_3d_transposed_weight", (randn((2, 3, 4), d, device), randn((4, 5), d, device).t(),
                                                    randn((5,), d, device)), kwargs=dict(granularity="rowwise"))]


def _fp8_linear_bad(device):
    t = tensor_maker(device)
    op, bw = F.fp8_linear, torch.ops.opforge.fp8_linear_backward
    pre, bpre = "opforge::fp8_linear: ", "opforge::fp8_linear_backward: "
    mask = [True, True, True]

    def kw(**k):
        return lambda *a: op(*a, **k)
    return [
        Bad("rank0", lambda d: (op, (torch.tensor(1.0, device=device), t(3, 1))), ValueError,
            pre + "expected input to have at least 1 dimension"),
        Bad("weight_1d", lambda d: (op, (t(4, 8), t(8))), ValueError,
            pre + r"expected weight to be 2-D \(out_features, in_features\), but got shape \[8\]"),
        Bad("in_features", lambda d: (op, (t(4, 7), t(3, 8))), ValueError,
            pre + r"expected input's last dimension to equal weight's in_features 8, but got 7"),
        Bad("bias_shape", lambda d: (op, (t(4, 8), t(3, 8), t(4))), ValueError,
            pre + r"expected bias of shape \[3\] \(weight's out_features\), but got \[4\]"),
        Bad("int_input", lambda d: (op, (t(4, 8, dtype=torch.int32), t(3, 8))), TypeError,
            pre + DTYPE_MSG.format("input", "Int")),
        Bad("fp8_weight", lambda d: (op, (t(4, 8), t(3, 8).to(torch.float8_e4m3fn))), TypeError,
            pre + DTYPE_MSG.format("weight", "Float8_e4m3fn")),
        Bad("complex_bias", lambda d: (op, (t(4, 8), t(3, 8), t(3, dtype=torch.complex64))), TypeError,
            pre + DTYPE_MSG.format("bias", "ComplexFloat")),
        Bad("granularity", lambda d: (kw(granularity="blockwise"), (t(4, 8), t(3, 8))), ValueError,
            pre + r'expected granularity to be "tensorwise" or "rowwise", but got "blockwise"'),
        Bad("grad_dtype_bfloat16", lambda d: (kw(grad_dtype=torch.bfloat16), (t(4, 8), t(3, 8))), ValueError,
            pre + r"expected grad_dtype to be torch.float8_e4m3fn or torch.float8_e5m2, but got BFloat16"),
        Bad("none_input", lambda d: (op, (None, t(3, 8))), ValueError, pre + "expected input to be a tensor, but got None"),
        Bad("none_weight", lambda d: (op, (t(4, 8), None)), ValueError,
            pre + "expected weight to be a tensor, but got None"),
        Bad("weight_device", lambda d: (op, (t(4, 8), torch.empty(3, 8, device="meta"))), RuntimeError,
            pre + "expected input and weight to be on the same device"),
        Bad("backward_grad_shape", lambda d: (bw, (t(4, 2), t(4, 8), t(3, 8), mask)), ValueError,
            bpre + r"expected grad_output of shape \[4, 3\] \(input's leading dims, out_features\), but got \[4, 2\]"),
        Bad("backward_granularity", lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), mask, "x")), ValueError,
            bpre + r'expected granularity to be "tensorwise" or "rowwise", but got "x"'),
        Bad("backward_grad_dtype", lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), mask, "rowwise", torch.float16)),
            ValueError, bpre + r"expected grad_dtype to be torch.float8_e4m3fn or torch.float8_e5m2, but got Half"),
        Bad("backward_int_grad", lambda d: (bw, (t(4, 3, dtype=torch.int32), t(4, 8), t(3, 8), mask)), TypeError,
            bpre + DTYPE_MSG.format("grad_output", "Int")),
        Bad("backward_bias_dtype", lambda d: (bw, (t(4, 3), t(4, 8), t(3, 8), mask, "tensorwise", None, torch.int32)),
            TypeError, bpre + r"expected bias_dtype to be a floating dtype"),
    ]


ENTRIES.append(OpEntry(
    name="fp8_linear", op=F.fp8_linear, reference=T.fp8_linear_reference, baseline=_fp8_linear_baseline,
    native=_fp8_linear_native, samples=_fp8_linear_samples, small_samples=_fp8_linear_small,
    bad_inputs=_fp8_linear_bad, double_backward=False, vmap_in_dims=(0, None, None), autocast="lower_precision",
    check=_fp8_linear_check,
    # a node that saved q(inputᵀ) (tensorwise, weight trained) runs the backward op reading it
    double_backward_error="(fp8_linear_backward|_fp8_linear_quantized_backward)",
    # the input and weight gradients are the FP8 GEMMs of the quantized operands, not the derivative of the
    # quantized forward (a step function); checked against the reference's above; gradcheck sees the bias only
    gradcheck_args=(2,)))

def entry(name: str) -> OpEntry:
    for e in ENTRIES:
        if e.name == name:
            return e
    raise KeyError(f"no conformance entry for {name!r} in tests/python/conformance.py")


class LiveStorages(TorchDispatchMode):
    """Records every storage an op outputs (weakly); ``live_bytes()``: the bytes of those still alive, less the
    storages that existed before (parameters, inputs: ``known``). What a forward leaves alive for backward."""

    def __init__(self, known):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
                s = t.untyped_storage()
                if s.data_ptr() not in self.known:
                    self.seen[s.data_ptr()] = (weakref.ref(s), s.nbytes())
        return out

    def live_bytes(self):
        return sum(n for ref, n in self.seen.values() if ref() is not None)


def decoder_layer_inputs(model, dtype, batch=2, seq=16):
    """(x, (cos, sin)): a random input `(batch, seq, hidden)` that requires grad for the first decoder layer of a
    transformers causal LM, and the model's rotary embedding of it."""
    torch.manual_seed(3)
    x = torch.randn(batch, seq, model.config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(seq)[None].expand(batch, -1))
    return x, (cos, sin)


def decoder_layer_live_bytes(model, dtype):
    """(bytes the first decoder layer's forward leaves alive: its output and what its graph keeps for backward;
    the output; the input's gradient; the layer's parameters' gradients) — a backward of ones follows the count."""
    layer = model.model.layers[0]
    x, pe = decoder_layer_inputs(model, dtype)
    with LiveStorages([*model.parameters(), x, *pe]) as mode:
        y = layer(x, position_embeddings=pe, attention_mask=None)
    live = mode.live_bytes()
    y.backward(torch.ones_like(y))
    return live, y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}
