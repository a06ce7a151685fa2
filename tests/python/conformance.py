"""The conformance table: one OpInfo-style entry per public opforge op (issue 9, DESIGN.md §5).

``test_conformance.py`` drives every entry (and the backward ops its gradient calls) through the same
checks: forward and gradients against the float64 reference of ``opforge.testing`` with the tolerance
rule, ``torch.library.opcheck``, ``torch.compile(fullgraph=True)`` static and dynamic, ``gradcheck`` and
``gradgradcheck`` (or the lazy double-backward error), Meta against the real kernels, every bad input,
compiled autograd, ``torch.func`` and autocast. ``test_consistency.py`` fails when a public schema in
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

import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as TF
from torch.utils._python_dispatch import TorchDispatchMode

import opforge
import opforge.functional as F
import opforge.testing as T

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
DTYPE_MSG = r"expected {} to have a floating dtype \(float64, float32, float16 or bfloat16\), but got {}"


# ---- the table's types ---------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One call of an op: ``entry.op(*args)``. Tensor args may be views (transposed, sliced, expanded,
    unaligned); every floating tensor arg is differentiated (the gradient taken with respect to the view
    itself, so it has the view's shape). ``grad_strided``: the upstream gradients are non-contiguous views."""
    name: str
    args: tuple
    grad_strided: bool = False

    def __repr__(self) -> str:
        return self.name


@dataclass
class Bad:
    """One bad input: ``make(device)`` returns (callable, its args); calling it must raise ``exc`` with a message
    matching ``match`` and leave every tensor argument unchanged."""
    name: str
    make: Callable[[str], tuple]
    exc: type
    match: str


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
    the backward op ``double_backward_error`` names (default ``<name>_backward``);
    reference_for: optional dtype -> reference, where the reference's defaults depend on the input dtype;
    check: optional tolerance hook (what, ours, ref, base, args, grad_outputs) replacing assert_matches_reference
    (what: "output <i>" or "grad <j>", j counting the floating args);
    vmap_in_dims: per arg of small_samples()[0], 0 (per-sample) or None (shared).
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
    """args with every tensor replaced by a meta tensor of the same shape, strides and dtype."""
    return tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
                 if isinstance(a, torch.Tensor) else a for a in args)


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
        with RecordOpforgeCalls() as rec:
            run_forward_backward(entry.op, args)
        for func, a, k in rec.calls:
            a = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in a)
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
            # torch's own dispatcher message (no tensor at all reaches a kernel), but it names the op
            Bad("none", lambda d: (op, (None,)), NotImplementedError, rf"opforge::{name}\b"),
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
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, device=device).to(dtype)
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
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, device=device).to(dtype)
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
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, device=device).to(dtype)
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
            r"opforge\.rms_norm: expected normalized_shape to be an int or a sequence of ints"),
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
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, device=device).to(dtype)
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
            r"opforge\.fused_add_rms_norm: expected normalized_shape to be an int or a sequence of ints"),
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


def _linear_check(what, ours, ref, base, args, gouts):
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
    def t(*shape, dtype=torch.float32):
        return torch.randn(shape, device=device).to(dtype)
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


def entry(name: str) -> OpEntry:
    for e in ENTRIES:
        if e.name == name:
            return e
    raise KeyError(f"no conformance entry for {name!r} in tests/python/conformance.py")
