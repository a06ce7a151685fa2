"""Worker of tests/python/test_tensor_parallel.py, run under torchrun: `python -m torch.distributed.run
--nproc_per_node=N tests/python/tensor_parallel_worker.py SUITE [--device cpu|cuda]`.

Suites: `ops` (every opforge op under each placement its rules support, against the single-process result, values and
gradients), `loss` (the vocabulary-parallel linear_cross_entropy against the op on one process, every option; its
per-rank memory), `edges` (odd shapes, ignored targets, every reduction, autocast), `model` (a tiny patched Llama
under TP + SP (+ FSDP2 on a 2-D mesh with 4 ranks) trained against the single-process run, and the collectives it
issues). Prints one line per check; exit status 1 on a failure. `--dtype bfloat16` runs ops, loss and edges on bf16
inputs.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import weakref

import torch
import torch.distributed as dist

import opforge
import opforge.losses  # noqa: F401
import opforge.parallel  # noqa: F401  (registers the sharding rules)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

R, P = Replicate(), Partial()
FAILURES = []
DEVICE = "cpu"
DTYPE = torch.float32  # the floating inputs' dtype of the ops and loss suites (--dtype)
#: the opforge ops dispatched with DTensor arguments (what the suites exercised), printed as "EXERCISED ..."
EXERCISED = set()


class _RecordOps(TorchDispatchMode):
    """Records each opforge op that reaches dispatch with a DTensor argument (above DTensor: the public op, its
    private forward and its backward, whichever autograd calls)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "opforge" and any(isinstance(a, DTensor)
                                               for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            EXERCISED.add(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


def tolerances(rtol, atol, ref):
    """The comparison's (rtol, atol): as given for float32 (and float64); for bfloat16 the rounding rule: each side is
    one bf16 rounding of float32 math (2 unit roundoffs u = 2^-8 relative), and a partial sum reduced across the ranks
    in bf16 adds one rounding of each rank's part (ranks · u of the largest magnitude). A float32 result (the losses,
their stats) of bf16 inputs is float32 math on the same values: the given tolerance."""
    if ref.dtype != torch.bfloat16:  # a float32 result (a loss) of bf16 inputs: float32 math, the given tolerance
        return rtol, atol
    u = 2.0 ** -8
    scale = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return max(rtol, 2 * u), max(atol, dist.get_world_size() * u * scale)


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def close(a, b, what, rtol=1e-5, atol=1e-6):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    ok = a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    if not ok:
        err = (a - b).abs().max().item() if a.shape == b.shape else f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        FAILURES.append(f"{what}: differs ({err})")
        log(f"FAIL {what}: {err}")
    return ok


def full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def check(name, fn, inputs, placements, mesh, grads=True, rtol=1e-5, atol=1e-6, frozen=(), keep_dtype=()):
    """fn(*inputs) on the full tensors and on DTensors in `placements` (None: a non-tensor or a plain tensor) give
    the same outputs and the same gradients of Σ out·c (c fixed random) for every floating input. Float32 inputs are
    cast to DTYPE, but those at the indices in keep_dtype (a float32 rstd)."""
    what = f"{name} {[str(p) if p is not None else '-' for p in placements]}"
    try:
        gen = torch.Generator().manual_seed(7)
        inputs = [(x.to(DEVICE, DTYPE) if x.dtype == torch.float32 and i not in keep_dtype else x.to(DEVICE))
                  if isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs)]
        ref_in = [x.detach().clone().requires_grad_(grads and x.is_floating_point() and i not in frozen)
                  if isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs)]
        ref = fn(*ref_in)
        ref = ref if isinstance(ref, (tuple, list)) else (ref,)
        cots = [torch.randn(r.shape, generator=gen, dtype=r.dtype).to(DEVICE) if isinstance(r, torch.Tensor)
                else None for r in ref]
        dt_in = []
        for i, (x, p) in enumerate(zip(inputs, placements)):
            if isinstance(x, torch.Tensor) and p is not None:
                d = distribute_tensor(x.detach().clone(), mesh, [p])
                dt_in.append(d.requires_grad_(grads and x.is_floating_point() and i not in frozen))
            elif isinstance(x, torch.Tensor):  # a plain tensor beside the DTensors
                dt_in.append(x.detach().clone().requires_grad_(grads and x.is_floating_point() and i not in frozen))
            else:
                dt_in.append(x)
        out = fn(*dt_in)
        out = out if isinstance(out, (tuple, list)) else (out,)
        for i, (o, r) in enumerate(zip(out, ref)):
            if isinstance(r, torch.Tensor):
                close(full(o), r, f"{what} output {i}", *tolerances(rtol, atol, r))
        if grads and any(isinstance(x, torch.Tensor) and x.requires_grad for x in ref_in):
            sum(((r.float() * c.float()).sum() for r, c in zip(ref, cots) if c is not None)).backward()
            sum(((full(o).float() * c.float()).sum() for o, c in zip(out, cots) if c is not None)).backward()
            for j, (a, b) in enumerate(zip(dt_in, ref_in)):
                if isinstance(b, torch.Tensor) and b.requires_grad:
                    if b.grad is None:
                        continue
                    close(full(a.grad), b.grad, f"{what} grad of input {j}", *tolerances(rtol, atol, b.grad))
                    _check_grad_placement(a, f"{what} grad of input {j}")
        log(f"ok   {what}")
    except Exception as e:  # noqa: BLE001
        FAILURES.append(f"{what}: {type(e).__name__}: {e}")
        log(f"FAIL {what}: {type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}")


def _check_grad_placement(param, what):
    """A DTensor leaf's gradient is in the leaf's own placements (a Partial one for a Replicate dim: a pending sum);
    a plain tensor's gradient is a plain tensor."""
    from opforge.parallel.sharding import grad_placements

    g = param.grad
    if not isinstance(param, DTensor):
        if isinstance(g, DTensor):
            FAILURES.append(f"{what}: a DTensor gradient {g.placements} of a plain tensor")
        return
    if not isinstance(g, DTensor) or tuple(g.placements) != grad_placements(param.placements, g.placements):
        got = g.placements if isinstance(g, DTensor) else type(g).__name__
        FAILURES.append(f"{what}: gradient in {got}, the parameter in {param.placements}")
        log(f"FAIL {what}: gradient in {got}, the parameter in {param.placements}")


def suite_ops(mesh):
    g = torch.Generator().manual_seed(0)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    S0, S1, S2 = Shard(0), Shard(1), Shard(2)
    x, w8 = rn(4, 6, 8), rn(8)
    # the op's own C++ autograd node runs above DTensor: the output is a DTensor whose grad_fn is opforge's node
    y = opforge.rms_norm(distribute_tensor(x.to(DEVICE), mesh, [S0]).requires_grad_(), (8,),
                         distribute_tensor(w8.to(DEVICE), mesh, [R]).requires_grad_())
    if not (type(y) is DTensor and y.grad_fn is not None and y.grad_fn.name().startswith("opforge::")):
        FAILURES.append(f"rms_norm of DTensors: {type(y).__name__} with grad_fn {y.grad_fn}, expected opforge's node")
    for p in (R, S0, S1):
        check("rms_norm", lambda a, w: opforge.rms_norm(a, (8,), w, 1e-6), [x, w8], [p, R], mesh)
    r = rn(4, 6, 8)
    for p in (R, S0, S1):
        check("fused_add_rms_norm", lambda a, b, w: opforge.fused_add_rms_norm(a, b, (8,), w, 1e-6), [x, r, w8],
              [p, p, R], mesh)
    check("rms_norm (Partial input)", lambda a, w: opforge.rms_norm(a, (8,), w), [x, w8], [P, R], mesh, grads=False)
    for p in (R, S0, S1, S2):
        check("sigmoid", opforge.sigmoid, [x], [p], mesh)
        check("square", opforge.square, [x], [p], mesh)
        check("swiglu", opforge.swiglu, [x, r], [p, p], mesh)
        check("square_add (broadcast other)", opforge.square_add, [x, w8], [p, R], mesh)
        check("square_add", opforge.square_add, [x, r], [p, p], mesh)
    for p in (R, S0, S1):
        check("swiglu_packed", opforge.swiglu_packed, [rn(4, 6, 16)], [p], mesh)
    check("swiglu_packed (last dim sharded: redistributed)", opforge.swiglu_packed, [rn(4, 6, 16)], [S2], mesh)
    # the FP8 producers' forms that also return max |output| (run replicated: a sharded input is gathered first)
    opforge_ops = torch.ops.opforge
    for p in (R, S0, S1):
        check("_rms_norm_forward_amax", lambda a, w: opforge_ops._rms_norm_forward_amax(a, (8,), w, 1e-6),
              [x, w8], [p, R], mesh)
        check("_fused_add_rms_norm_forward_amax",
              lambda a, b, w: opforge_ops._fused_add_rms_norm_forward_amax(a, b, (8,), w, 1e-6),
              [x, r, w8], [p, p, R], mesh)
        check("_swiglu_packed_amax", opforge_ops._swiglu_packed_amax, [rn(4, 6, 16)], [p], mesh)
    for approximate in ("none", "tanh"):
        for p in (R, S0, S1, S2):
            check(f"geglu {approximate}", lambda a, b, ap=approximate: opforge.geglu(a, b, ap), [x, r], [p, p], mesh)
        for p in (R, S0, S1, S2):
            check(f"geglu_packed {approximate}", lambda a, ap=approximate: opforge.geglu_packed(a, ap),
                  [rn(4, 6, 16)], [p], mesh)
    xs, Ws, bs = rn(4, 6, 8), rn(12, 8), rn(12)
    for px, pw, pb in ((R, R, R), (S0, R, R), (S1, R, R), (R, S0, S0), (S2, S1, R)):
        check("swiglu_linear", lambda a, w_, b_: opforge.swiglu_linear(a, w_, b_), [xs, Ws, bs], [px, pw, pb], mesh,
              rtol=1e-4, atol=1e-5)  # grad_weight: float32 partial sums over the token shards, added in another order
    q, k = rn(2, 4, 6, 8), rn(2, 2, 6, 8)
    ang = rn(2, 6, 8)
    cos, sin = ang.cos(), ang.sin()
    for p, pc in ((R, R), (S1, R), (S0, S0), (S2, S1)):
        check("rope", lambda a, b, c, s: opforge.rope(a, b, c, s), [q, k, cos, sin], [p, p, pc, pc], mesh,
              frozen=(2, 3))
    pos = torch.arange(6).repeat(2, 1)
    if hasattr(opforge, "rope_from_positions"):
        for p, pc in ((R, R), (S1, R), (S0, S0), (S2, S1)):
            check("rope_from_positions", lambda a, b, t: opforge.rope_from_positions(a, b, t), [q, k, pos],
                  [p, p, pc], mesh)
    xl, W, b = rn(4, 6, 8), rn(12, 8), rn(12)
    for act in ("none", "silu"):
        for px, pw, pb in ((R, R, R), (R, S0, S0), (S0, R, R), (S1, R, R), (S1, S0, S0)):
            check(f"linear {act}", lambda a, w_, b_: opforge.linear(a, w_, b_, act), [xl, W, b], [px, pw, pb], mesh)
    check("linear row-wise", lambda a, w_: opforge.linear(a, w_), [xl, W], [S2, S1], mesh)
    check("linear row-wise with bias (redistributed)", lambda a, w_, b_: opforge.linear(a, w_, b_), [xl, W, b],
          [S2, S1, R], mesh)
    for px, pw, pb in ((R, R, R), (R, S0, S0), (S0, R, R)):
        check("fake_quant_linear", lambda a, w_, b_: opforge.fake_quant_linear(a, w_, b_), [xl, W, b],
              [px, pw, pb], mesh, rtol=1e-4, atol=1e-5)
        check("fake_quant_linear act_quant", lambda a, w_, b_: opforge.fake_quant_linear(a, w_, b_, act_quant=True),
              [xl, W, b], [px, pw, pb], mesh, rtol=1e-4, atol=1e-5)
    check("fake_quantize_weight", lambda w_: opforge.fake_quantize_weight(w_)[0], [W], [S0], mesh, grads=False)
    if hasattr(opforge, "fp8_linear"):  # tensorwise: replicated; rowwise: column-wise and token-sharded too
        for px, pw, pb in ((R, R, R), (S0, R, R), (R, S0, S0)):
            for gran in ("tensorwise", "rowwise"):
                check(f"fp8_linear {gran}", lambda a, w_, b_, gr=gran: opforge.fp8_linear(a, w_, b_, granularity=gr),
                      [xl, W, b], [px, pw, pb], mesh, rtol=1e-4, atol=1e-5)
        for p in (R, S0, S1):  # data (as float) and scale
            check("quantize_fp8 rowwise", lambda a: [q.float() for q in opforge.quantize_fp8(a, None, "rowwise")],
                  [xl], [p], mesh, grads=False)
        check("quantize_fp8 tensorwise", lambda a: [q.float() for q in opforge.quantize_fp8(a)], [xl], [S0], mesh,
              grads=False)

        def quantized(a, w_, b_, gr):  # fp8_linear with the weight's operands precomputed (the layers' cache)
            ops = [t.detach() for t in torch.ops.opforge._quantize_fp8_weight(w_, gr)]
            return torch.ops.opforge._fp8_linear_quantized(a, w_, *ops, b_, granularity=gr)
        for gran in ("tensorwise", "rowwise"):
            check(f"_fp8_linear_quantized {gran}", lambda a, w_, b_, gr=gran: quantized(a, w_, b_, gr), [xl, W, b],
                  [R, R, R], mesh, rtol=1e-4, atol=1e-5)
    x1, x2, Wc = rn(4, 6, 3), rn(4, 6, 5), rn(12, 8)
    for px, pw, pb in ((R, R, R), (R, S0, S0), (S0, R, R)):
        check("linear_cat", lambda a, c, w_, b_: opforge.linear_cat([a, c], w_, b_), [x1, x2, Wc, b],
              [px, px, pw, pb], mesh)
    T, E = 10, 4
    xi, We, be = rn(T, 8), rn(E, 6, 8), rn(E, 6)
    idx = torch.tensor([0, 3, 1, 2, -1, 3, 0, 1, 2, 2])
    for px, pw, pidx, pb in ((R, R, R, R), (R, S0, R, S0), (R, S1, R, S1), (S0, R, S0, R)):
        check("indexed_linear", lambda a, w_, i, b_: opforge.indexed_linear(a, w_, i, b_), [xi, We, idx, be],
              [px, pw, pidx, pb], mesh)
    check("indexed_linear row-wise", lambda a, w_, i: opforge.indexed_linear(a, w_, i), [xi, We, idx],
          [S1, Shard(2), R], mesh)
    # index_sorted: every placement's local index keeps the order, except the expert-sharded one (other ranks' rows
    # become -1 in place), whose handler drops the flag (a kept flag raises on CPU)
    sidx = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3, -1, -1])
    for px, pw, pidx, pb in ((R, R, R, R), (R, S0, R, S0), (R, S1, R, S1), (S0, R, S0, R)):
        check("indexed_linear index_sorted",
              lambda a, w_, i, b_: opforge.indexed_linear(a, w_, i, b_, index_sorted=True), [xi, We, sidx, be],
              [px, pw, pidx, pb], mesh)
    check("indexed_linear index_sorted row-wise", lambda a, w_, i: opforge.indexed_linear(a, w_, i, index_sorted=True),
          [xi, We, sidx], [S1, Shard(2), R], mesh)
    if mesh.size() == 4:  # a handler on a 2-D mesh: a clear error, not a wrong result
        mesh2 = init_device_mesh(DEVICE, (2, 2))
        try:
            opforge.indexed_linear(distribute_tensor(xi.to(DEVICE), mesh2, [R, R]),
                                   distribute_tensor(We.to(DEVICE), mesh2, [Shard(0), R]),
                                   distribute_tensor(idx.to(DEVICE), mesh2, [R, R]))
            FAILURES.append("indexed_linear on a 2-D mesh: no error")
        except NotImplementedError as e:
            if "1-D" not in str(e):
                FAILURES.append(f"indexed_linear on a 2-D mesh: {e}")
    # under the placements the rules support, forward and backward issue no collective at all
    from torch.distributed.tensor.debug import CommDebugMode

    def no_comm(name, fn, inputs, placements):
        d = [distribute_tensor(x.to(DEVICE), mesh, [p]).requires_grad_(x.is_floating_point()) for x, p in
             zip(inputs, placements)]
        mode = CommDebugMode()
        with mode:
            out = fn(*d)
            out = out if isinstance(out, (tuple, list)) else (out,)
            sum(o.to_local().sum() for o in out if o is not None).backward()  # no reduction of the outputs
        if mode.get_total_counts():
            FAILURES.append(f"{name}: collectives {dict(mode.get_comm_counts())} under its own placements")

    no_comm("rms_norm S(1)", lambda a, w: opforge.rms_norm(a, (8,), w), [x, w8], [S1, R])
    no_comm("fused_add_rms_norm S(1)", lambda a, b, w: opforge.fused_add_rms_norm(a, b, (8,), w), [x, r, w8],
            [S1, S1, R])
    no_comm("linear column-wise", lambda a, w_: opforge.linear(a, w_), [xl, W], [R, S0])
    no_comm("linear row-wise", lambda a, w_: opforge.linear(a, w_), [xl, W], [S2, S1])
    no_comm("swiglu_packed S(0)", opforge.swiglu_packed, [rn(4, 6, 16)], [S0])
    # (heads divisible by the ranks: DTensor redistributes an uneven head split, correct but not free)
    no_comm("rope heads", lambda a, b, c, s: opforge.rope(a, b, c.detach(), s.detach()), [q, rn(2, 4, 6, 8), cos, sin],
            [S1, S1, R, R])
    no_comm("indexed_linear experts", lambda a, w_, i: opforge.indexed_linear(a, w_, i), [xi, We, idx], [R, S0, R])
    H, V = 8, 10
    xh, Wv, bv = rn(12, H), rn(V, H), rn(V)
    tgt = torch.tensor([1, 9, 0, -100, 5, 3, 3, 7, 8, 2, 4, 6])
    for red in ("mean", "sum", "none"):
        for px, pt in ((R, R), (S0, S0)):
            check(f"linear_cross_entropy {red} (weight replicated)",
                  lambda a, w_, t, b_: opforge.linear_cross_entropy(a, w_, t, linear_bias=b_, reduction=red),
                  [xh, Wv, tgt, bv], [px, R, pt, R], mesh)
    # linear_log_probs and linear_jsd: replicated and token-sharded (the lm_head replicated; a Shard(0) one gathered)
    for px, pt, pw in ((R, R, R), (S0, S0, R), (S0, S0, S0)):
        # weight S(0): vocabulary-parallel, the entropy gradient's cancellation in another order (suite_loss)
        check(f"linear_log_probs (weight {pw})",
              lambda a, w_, t, b_: opforge.linear_log_probs(a, w_, t, b_, temperature=0.7, return_entropy=True),
              [xh, Wv, tgt, bv], [px, pw, pt, R], mesh, rtol=1e-4 if pw != R else 1e-5, atol=1e-5 if pw != R else 1e-6)
    check("linear_log_probs no entropy", lambda a, w_, t: opforge.linear_log_probs(a, w_, t), [xh, Wv, tgt],
          [S0, R, S0], mesh)
    xt, Wt = rn(12, 6), rn(V, 6)
    for red in ("mean", "sum"):
        for px, pt in ((R, R), (S0, S0)):
            check(f"linear_jsd {red}",
                  lambda a, w_, ta, tw, t, b_: opforge.linear_jsd(a, w_, ta, tw, t, linear_bias=b_, beta=0.3,
                                                                  reduction=red),
                  [xh, Wv, xt, Wt, tgt, bv], [px, R, px, R, pt, R], mesh, frozen=(2, 3))
    # the public ops that autograd replaces by their private _forward when an input requires grad: without gradients
    # DTensor dispatches the public op itself
    rstd = torch.ops.opforge._rms_norm_forward(x.to(DTYPE), (8,), w8.to(DTYPE), 1e-6)[1]
    for p in (R, S0, S1):
        check("_rms_norm_apply", lambda a, s_, w: torch.ops.opforge._rms_norm_apply(a, s_, w), [x, rstd, w8],
              [p, p, R], mesh, grads=False, keep_dtype=(1,))
        check("fused_add_rms_norm (no grad)", lambda a, b, w: opforge.fused_add_rms_norm(a, b, (8,), w, 1e-6),
              [x, r, w8], [p, p, R], mesh, grads=False)
    for px, pw in ((R, R), (S0, R), (R, S0)):
        check("fake_quant_linear (no grad)", lambda a, w_: opforge.fake_quant_linear(a, w_), [xl, W], [px, pw], mesh,
              grads=False)
        check("swiglu_linear (no grad)", lambda a, w_: opforge.swiglu_linear(a, w_), [xs, Ws], [px, pw], mesh,
              grads=False)
        check("linear_log_probs (no grad)", lambda a, w_, t: opforge.linear_log_probs(a, w_, t, return_entropy=True),
              [xh, Wv, tgt], [px, pw, px], mesh, grads=False)
        check("linear_jsd sum (no grad)",
              lambda a, w_, ta, tw, t: opforge.linear_jsd(a, w_, ta, tw, t, reduction="sum"),
              [xh, Wv, xt, Wt, tgt], [px, pw, px, pw, px], mesh, grads=False)
    no_comm("linear_log_probs token-sharded",
            lambda a, w_, t: opforge.linear_log_probs(a, w_, t.detach(), return_entropy=True), [xh, Wv, tgt],
            [S0, R, S0])


def suite_edges(mesh):
    """Odd shapes and options: tokens, heads and the vocabulary not divisible by the ranks (a rank with an empty
    slice on 4 ranks), ignore_index everywhere (every target, one rank's whole token shard), every reduction, and
    autocast (bf16 on the CPU: the GEMM operands cast, the parameters' gradients back in their placements)."""
    g = torch.Generator().manual_seed(2)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    S0, S1, S2 = Shard(0), Shard(1), Shard(2)
    x, w = rn(5, 3, 8), rn(8)
    for p in (S0, S1):
        check("rms_norm uneven tokens", lambda a, w_: opforge.rms_norm(a, (8,), w_), [x, w], [p, R], mesh)
    xl, W, b = rn(5, 3, 8), rn(11, 8), rn(11)
    for px, pw, pb in ((R, S0, S0), (S0, R, R), (S1, S0, S0)):
        check("linear uneven", lambda a, w_, b_: opforge.linear(a, w_, b_), [xl, W, b], [px, pw, pb], mesh)
    check("linear uneven row-wise", lambda a, w_: opforge.linear(a, w_), [rn(5, 3, 7), rn(11, 7)], [S2, S1], mesh)
    q, k, ang = rn(2, 3, 5, 8), rn(2, 3, 5, 8), rn(5, 8)
    check("rope uneven heads", lambda a, b_, c, s_: opforge.rope(a, b_, c, s_), [q, k, ang.cos(), ang.sin()],
          [S1, S1, R, R], mesh, frozen=(2, 3))
    check("rope uneven sequence", lambda a, b_, c, s_: opforge.rope(a, b_, c, s_), [q, k, ang.cos(), ang.sin()],
          [S2, S2, S0, S0], mesh, frozen=(2, 3))
    H = 8
    for V in (7, 3):  # 3 classes on 4 ranks: the last rank's slice is empty
        xh, Wv, bv = rn(13, H), rn(V, H), rn(V)
        tgt = torch.randint(0, V, (13,), generator=g)
        shard0_ignored = tgt.clone()
        shard0_ignored[:7] = -100  # rank 0's token shard (2 and 4 ranks) has no target
        for name, t in (("targets", tgt), ("every target ignored", torch.full((13,), -100)),
                        ("rank 0's tokens ignored", shard0_ignored)):
            for red in ("mean", "sum", "none"):
                for px, pw, pt in ((R, S0, R), (S0, S0, S0), (S0, R, S0)):
                    check(f"linear_cross_entropy V={V} {name} {red}",
                          lambda a, w_, b_, t_, red=red: opforge.linear_cross_entropy(
                              a, w_, t_, linear_bias=b_, reduction=red, label_smoothing=0.1),
                          [xh, Wv, bv, t], [px, pw, pw, pt], mesh)
            for px, pw, pt in ((S0, R, S0), (R, S0, R), (S0, S0, S0)):  # token-sharded; vocabulary-parallel
                check(f"linear_log_probs V={V} {name}", lambda a, w_, t_: opforge.linear_log_probs(
                    a, w_, t_, return_entropy=True), [xh, Wv, t], [px, pw, pt], mesh, rtol=1e-4, atol=1e-5)
            for red in ("mean", "sum"):
                for px, pw in ((S0, R), (R, S0)):  # token-sharded (sum; mean gathers); vocabulary-parallel
                    check(f"linear_jsd V={V} {name} {red}", lambda a, w_, ta, tw, t_, red=red: opforge.linear_jsd(
                        a, w_, ta, tw, t_, reduction=red), [xh, Wv, rn(13, 6), rn(V, 6), t], [px, pw, px, pw, px],
                        mesh, frozen=(2, 3), rtol=1e-4, atol=1e-5)
        t2 = tgt.clone()
        t2[::3] = 1
        check(f"vocab-parallel loss V={V} ignore_index=1", lambda a, w_: opforge.linear_cross_entropy(
            a, w_, t2.to(DEVICE), ignore_index=1), [xh, Wv], [R, S0], mesh)

    # the default chunk rows (a memory budget, here scaled down) are the same on every rank, also where the slices
    # are uneven (11 classes: 6 and 5 on 2 ranks, 3, 3, 3, 2 on 4): every rank runs the same chunks, each a collective
    import opforge.parallel.loss as vp

    budget = vp._BUDGET_BYTES
    vp._BUDGET_BYTES = 12 * 64 * 5  # float32 rows: 128 (6 classes) and 192 (5); 320 (3 classes) and 480 (2)
    try:
        for fn_name, fn in (("linear_cross_entropy", lambda a, w_, t_: opforge.linear_cross_entropy(a, w_, t_)),
                            ("linear_log_probs", lambda a, w_, t_: opforge.linear_log_probs(a, w_, t_)[0])):
            check(f"vocab-parallel {fn_name} default chunks, uneven slices", fn,
                  [rn(400, H), rn(11, H), torch.randint(0, 11, (400,), generator=g)], [R, S0, R], mesh, rtol=1e-4,
                  atol=1e-5)
    finally:
        vp._BUDGET_BYTES = budget

    def autocast(fn):
        def run(*a):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                return fn(*a)
        return run

    xh, Wv, bv = rn(13, H), rn(7, H), rn(7)
    tgt = torch.randint(0, 7, (13,), generator=g).to(DEVICE)
    bf = dict(rtol=2 ** -6, atol=2 ** -6)  # a few bf16 roundings of the operands on both sides
    for red in ("mean", "none"):
        check(f"vocab-parallel loss autocast {red}", autocast(lambda a, w_, b_, red=red: opforge.linear_cross_entropy(
            a, w_, tgt, linear_bias=b_, reduction=red)), [xh, Wv, bv], [S0, S0, S0], mesh, **bf)
    check("linear autocast column-wise", autocast(lambda a, w_, b_: opforge.linear(a, w_, b_)), [xl, W, b],
          [R, S0, S0], mesh, **bf)
    check("rms_norm autocast", autocast(lambda a, w_: opforge.rms_norm(a, (8,), w_)), [x, w], [S0, R], mesh, **bf)


def loss_options():
    yield {}
    yield {"reduction": "sum"}
    yield {"reduction": "none"}
    yield {"label_smoothing": 0.1}
    yield {"z_loss": 1e-3, "reduction": "sum"}
    yield {"softcap": 5.0}
    yield {"weight": "class", "label_smoothing": 0.2, "reduction": "mean"}
    yield {"weight": "class", "reduction": "none", "softcap": 3.0, "z_loss": 1e-2}
    yield {"ignore_index": 2, "chunk_size": 3}


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors the ops under it allocate while those tensors are alive (a tensor whose
    storage is already counted or is an input's, a view or an in-place result, adds nothing; a storage is freed when
    the tensor that brought it dies). CPU tensors have no allocator statistics, so this is the memory measure on the
    CPU."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self.counted = set()

    def _free(self, key, n):
        self.counted.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                key = t.untyped_storage().data_ptr()
                if key in self.counted or key in inputs or key == 0:
                    continue
                n = t.untyped_storage().nbytes()
                self.counted.add(key)
                self.live += n
                self.largest = max(self.largest, n)
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, n)
        return out


def peak_bytes(fn, largest=False):
    """The peak of live bytes allocated by fn() (its results included while they are alive), and optionally the
    largest single allocation."""
    with _LiveBytes() as m:
        res = fn()
        del res
    return (m.peak, m.largest) if largest else m.peak


def suite_loss(mesh):
    g = torch.Generator().manual_seed(1)
    N, H, V = 14, 8, 11  # V not divisible by the ranks: uneven slices
    x, W, b = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    cw = (torch.rand(V, generator=g) + 0.5).to(DEVICE)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    t[3] = -100
    for opts in loss_options():
        o = dict(opts)
        if o.get("weight") == "class":
            o["weight"] = cw
        tt = t.clone()
        if "ignore_index" in o:
            tt[tt == -100] = o["ignore_index"]
        for bias in (None, b):
            for px in (R, Shard(0)):
                fn = lambda a, w_, b_, o=o, tt=tt: opforge.linear_cross_entropy(a, w_, tt, linear_bias=b_, **o)  # noqa
                check(f"vocab-parallel loss {opts} bias={bias is not None}",
                      fn, [x, W, bias], [px, Shard(0), Shard(0) if bias is not None else None], mesh)
    # a plain (replicated) input or bias beside the sharded weight: its gradient comes back as a plain tensor, whole;
    # a Replicate DTensor bias: its gradient Replicate (the Shard(0) one gathered)
    for red in ("mean", "sum", "none"):
        check(f"vocab-parallel loss {red}, plain input", lambda a, w_: opforge.linear_cross_entropy(a, w_, t, reduction=red),
              [x, W], [None, Shard(0)], mesh)
        for pb in (None, R):
            check(f"vocab-parallel loss {red}, bias {pb or 'plain'}",
                  lambda a, w_, b_: opforge.linear_cross_entropy(a, w_, t, linear_bias=b_, reduction=red),
                  [x, W, b], [Shard(0), Shard(0), pb], mesh)
    # a bias of the wrong shape beside a Shard(0) weight: a clear error naming the op
    try:
        opforge.linear_cross_entropy(distribute_tensor(x.to(DEVICE), mesh, [R]),
                                     distribute_tensor(W.to(DEVICE), mesh, [Shard(0)]), t,
                                     linear_bias=b[:-1].to(DEVICE))
        FAILURES.append("vocab-parallel loss with a bias of V - 1 classes: no error")
    except ValueError as e:
        if "opforge::linear_cross_entropy: expected linear_bias of shape" not in str(e):
            FAILURES.append(f"vocab-parallel loss with a bias of V - 1 classes: {e}")
    # linear_log_probs (the post-training losses' op) with a Shard(0) lm_head: vocabulary-parallel. The entropy's
    # gradient (z − m) − (r − H) cancels: float32 results a few ulps of its magnitude apart (float64 exact: the
    # single-process test of the local math)
    for opts in ({}, {"temperature": 0.7, "return_entropy": True}, {"softcap": 3.0, "return_entropy": True},
                 {"ignore_index": 2, "return_entropy": True}):
        tt = t.clone()
        if "ignore_index" in opts:
            tt[tt == -100] = opts["ignore_index"]
        for bias, pb in ((None, None), (b, Shard(0)), (b, None)):
            for px in (R, Shard(0)):
                fn = lambda a, w_, b_, o=opts, tt=tt: opforge.linear_log_probs(a, w_, tt, b_, **o)  # noqa: E731
                check(f"vocab-parallel linear_log_probs {opts} bias={pb if bias is not None else None}", fn,
                      [x, W, bias], [px, Shard(0), pb], mesh, rtol=1e-4, atol=1e-5)
    # linear_jsd with Shard(0) heads: vocabulary-parallel (the teacher's inputs frozen, as the op requires)
    xt, Wt, bt = torch.randn(N, 6, generator=g), torch.randn(V, 6, generator=g), torch.randn(V, generator=g)
    for opts in ({}, {"beta": 0.0, "reduction": "sum"}, {"beta": 1.0}, {"beta": 0.3, "temperature": 0.7}):
        for with_target in (False, True):
            for pt_w in (Shard(0), R):  # the teacher's head sharded too, or replicated beside the student's
                fn = lambda a, w_, b_, ta, tw, tb, o=opts, tg=with_target: opforge.linear_jsd(  # noqa: E731
                    a, w_, ta, tw, t if tg else None, linear_bias=b_, teacher_linear_bias=tb, **o)
                check(f"vocab-parallel linear_jsd {opts} target={with_target} teacher {pt_w}", fn,
                      [x, W, b, xt, Wt, bt], [Shard(0), Shard(0), Shard(0), R, pt_w, pt_w], mesh, frozen=(3, 4, 5),
                      rtol=1e-4, atol=1e-5)
    # the post-training losses composed on linear_log_probs (opforge.losses) with the Shard(0) head: every input a
    # DTensor (Replicate where not sharded), the policy's gradients against one process
    B, T = 2, 5
    hs = torch.randn(2 * B, T, H, generator=g)
    ids = torch.randint(0, V, (2 * B, T), generator=g)
    ids[:, :2] = -100  # the prompt
    ref_lp = torch.randn(B, generator=g) - 5.0
    for loss_type in ("sigmoid", "ipo", "simpo"):
        check(f"vocab-parallel linear_preference_loss {loss_type}",
              lambda a, w_, t_, rc, rr, lt=loss_type: opforge.losses.linear_preference_loss(
                  a, w_, t_, ref_chosen_logps=rc, ref_rejected_logps=rr, loss_type=lt)[0],
              [hs, W, ids, ref_lp, ref_lp + 0.3], [R, Shard(0), R, R, R], mesh, frozen=(3, 4), rtol=1e-4, atol=1e-5)
    # the fused op itself (linear_preference_loss composes linear_log_probs on DTensors): replicated, a Shard(0) head
    # gathered; without gradients (the op itself on DTensors) and with them (its private forward)
    for loss_type, grads in (("sigmoid", True), ("orpo", True), ("ipo", False)):
        check(f"linear_preference_loss's fused op {loss_type} grads={grads}",
              lambda a, w_, t_, rc, rr, lt=loss_type: torch.ops.opforge._linear_preference_loss(
                  a, w_, t_, ref_chosen_logps=rc, ref_rejected_logps=rr, loss_type=lt),
              [hs, W, ids, ref_lp, ref_lp + 0.3], [R, Shard(0), R, R, R], mesh, grads=grads, frozen=(3, 4),
              rtol=1e-4, atol=1e-5)
    adv = torch.randn(2 * B, generator=g)
    old = torch.randn(2 * B, T, generator=g) - 3.0
    check("vocab-parallel linear_grpo_loss dapo",
          lambda a, w_, t_, ad, ol: opforge.losses.linear_grpo_loss(a, w_, t_, ad, old_log_probs=ol)[0],
          [hs, W, ids, adv, old], [R, Shard(0), R, R, R], mesh, frozen=(3, 4), rtol=1e-4, atol=1e-5)
    if DEVICE == "cuda" and DTYPE == torch.float32:
        _cuda_loss_memory(mesh)
    if DEVICE == "cpu" and DTYPE == torch.float32:
        _cpu_loss_memory(mesh, g)


def _cpu_loss_memory(mesh, g):
    """Each rank's peak for the loss (forward with its gradients, the training path) against the same loop on one
    rank, counted by _LiveBytes; and no tensor as large as the rank's slice of the logits."""
    N, H, V = 64, 32, 4096
    x, W = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    from opforge.parallel.loss import vocab_parallel_forward, vocab_slice
    start, size = vocab_slice(V, mesh.size(), mesh.get_local_rank())
    local = W[start:start + size].contiguous()
    one = peak_bytes(lambda: vocab_parallel_forward(x, W, t, chunk_size=32, grad_mask=(True, True, False)))
    many, largest = peak_bytes(lambda: vocab_parallel_forward(x, local, t, chunk_size=32, grad_mask=(True, True, False),
                                                              vocab_start=start, vocab_size=V,
                                                              group=mesh.get_group()), largest=True)
    ratio = many / one
    log(f"loss memory: peak per rank {many} bytes, one rank {one} bytes, ratio {ratio:.3f}; largest tensor "
        f"{largest} bytes (full logits {N * V * 4})")
    if not ratio <= 0.55 + 0.45 * (mesh.size() != 2):
        FAILURES.append(f"loss memory ratio {ratio:.3f} > 0.55")
    if not largest < N * V * 4 / mesh.size() + 1:
        FAILURES.append(f"a tensor of {largest} bytes: not less than the rank's slice of the logits")
    # the post-training ops likewise: no tensor as large as the rank's slice of the logits (chunks of 32 rows)
    from opforge.parallel.loss import vocab_parallel_jsd_forward, vocab_parallel_log_probs_forward
    kw = dict(vocab_start=start, vocab_size=V, group=mesh.get_group())
    xt, Wt = torch.randn(N, 16, generator=g), torch.randn(V, 16, generator=g)
    for name, fn in (("linear_log_probs", lambda: vocab_parallel_log_probs_forward(
                          x, local, t, return_entropy=True, chunk_size=32, **kw)),
                     ("linear_jsd", lambda: vocab_parallel_jsd_forward(
                          x, local, xt, Wt[start:start + size].contiguous(), chunk_size=32,
                          grad_mask=(True, True, False), **kw))):
        peak, largest = peak_bytes(fn, largest=True)
        log(f"{name} memory: peak per rank {peak} bytes; largest tensor {largest} bytes (full logits {N * V * 4})")
        if not largest < N * V * 4 / mesh.size() + 1:
            FAILURES.append(f"{name}: a tensor of {largest} bytes, not less than the rank's slice of the logits")


def _tiny_llama(device, family="llama", kv_heads=2):
    import transformers

    config, causal_lm = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[family]  # qwen3: per-head q_norm/k_norm
    cfg = getattr(transformers, config)(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
                                        max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
                                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = getattr(transformers, causal_lm)(cfg).to(device)
    opforge.patch.apply(model)
    return model


def _batches(device, steps, batch, seq, vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(steps)]


def _train(model, batches, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses


def _cuda_loss_memory(mesh, N=4096, H=1024, V=65536, chunk=1024):
    """On CUDA: the peak memory the loss adds (forward + backward), the vocabulary-parallel loss on each rank against
    the op on one GPU, the same chunk size; the ratio should be at most 0.55 on 2 ranks."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, H, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    W = (torch.randn(V, H, generator=g) * 0.02).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def single():
        w1 = W.clone().requires_grad_()
        opforge.linear_cross_entropy(x, w1, t, chunk_size=chunk).backward()

    one = peak(single)
    wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_()
    x.grad = None
    many = peak(lambda: opforge.linear_cross_entropy(x, wd, t, chunk_size=chunk).backward())
    log(f"CUDA loss memory (N={N}, H={H}, V={V}, bf16, chunk {chunk}): one GPU {one / 2**20:.1f} MiB, each of "
        f"{mesh.size()} ranks {many / 2**20:.1f} MiB, ratio {many / one:.3f}")
    if mesh.size() == 2 and not many / one <= 0.55:
        FAILURES.append(f"CUDA loss memory ratio {many / one:.3f} > 0.55")


def suite_model(dp, device, steps=4, batch=4, seq=8, family="llama"):
    """TP + SP (+ FSDP2 on a (dp, tp) mesh) against the single-process run of the same global batches."""
    from torch.distributed.fsdp import fully_shard

    from opforge.parallel import parallelize

    import copy

    world = dist.get_world_size()
    tp = world // dp
    model = _tiny_llama(device, family, kv_heads=max(2, tp))
    reference = copy.deepcopy(model)
    batches = _batches(device, steps, batch, seq, model.config.vocab_size)
    ref = [float(x.detach()) for x in _train(reference, batches)]
    mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"])
    if dp > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    r = mesh["dp"].get_local_rank()
    local = [ids.chunk(dp, 0)[r] for ids in batches]  # each dp rank its rows: the same token count per rank
    got = []
    for loss in _train(model, local):
        v = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().reshape(1)
        if dp > 1:
            dist.all_reduce(v, group=mesh["dp"].get_group())
            v = v / dp
        got.append(float(v))
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    log(f"model {family} dp={dp} tp={tp}: losses {got} single-process {ref}; largest relative difference {rel:.2e}")
    if not rel <= 1e-5:
        FAILURES.append(f"model {family} dp={dp} tp={tp}: losses differ from the single-process run by {rel:.2e} relative")
    _compare_grads(model, reference, batches[0], dp, tp, family)
    if dp > 1:  # between steps the fused parameters are FSDP2's sharded ones: the slices still read transformers' rows
        for owner, part in (("self_attn", "q_proj"), ("self_attn", "v_proj"), ("mlp", "up_proj")):
            got = getattr(getattr(model.model.layers[0], owner), part).weight
            want = getattr(getattr(reference.model.layers[0], owner), part).weight
            close(full(got), want, f"model {family} dp={dp} tp={tp}: {owner}.{part}.weight between steps", rtol=1e-4,
                  atol=1e-6)
    # without labels (inference, generate): the lm_head's logits gathered, equal to the single process's
    ids = batches[0].chunk(dp, 0)[r]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    close(full(logits), want, f"model dp={dp} tp={tp}: logits without labels", rtol=1e-4, atol=1e-5)
    if dp == 1:
        _check_state_dict(model, reference, batches[0], tp, family)
    if dp == 1 and family == "llama":
        _count_collectives(model, batches[0], tp)
    if dp == 1:
        _check_fresh_model(device, family, tp, batches[0])


def _compare_grads(model, reference, ids, dp, tp, family):
    """Every parameter's gradient of one more step equals the single process's (the fused weights back in
    transformers' row order)."""
    from opforge.parallel import unpermute_fused

    r = dist.get_rank() // tp if dp > 1 else 0
    model(input_ids=ids.chunk(dp, 0)[r], labels=ids.chunk(dp, 0)[r]).loss.backward()
    reference(input_ids=ids, labels=ids).loss.backward()
    ref = dict(reference.named_parameters())
    sizes = {}
    for name, m in reference.named_modules():
        if hasattr(m, "_opforge_sizes"):
            sizes[f"{name}.qkv_proj.weight"] = list(m._opforge_sizes)
        if hasattr(m, "gate_up_proj"):
            sizes[f"{name}.gate_up_proj.weight"] = [m.gate_up_proj.out_features // 2] * 2
    for name, p in model.named_parameters():
        if dp == 1:  # (under FSDP2 the gradients are FSDP's sharded ones)
            _check_grad_placement(p, f"model {family} tp={tp}: gradient of {name}")
        g = full(p.grad)
        if name in sizes:
            g = unpermute_fused(g, sizes[name], tp)
        close(g, ref[name].grad, f"model {family} dp={dp} tp={tp}: gradient of {name}", rtol=1e-4, atol=1e-6)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)


def _check_state_dict(model, reference, ids, tp, family):
    """state_dict() of the parallelized model has the keys and values of the single process's (transformers' q/k/v
    and gate/up, not the plan's row order); loading a changed one gives the single process's loss."""
    what = f"model {family} tp={tp}: state_dict"
    sd, want = model.state_dict(), reference.state_dict()
    if sorted(sd) != sorted(want):
        FAILURES.append(f"{what}: keys differ")
        return
    for k, v in want.items():
        close(full(sd[k]), v, f"{what} {k}")  # a wrong row order is off by O(1); training leaves ulps
    with torch.no_grad():
        sd = {k: v * 1.5 for k, v in sd.items()}
    model.load_state_dict(sd)
    reference.load_state_dict({k: full(v) for k, v in sd.items()})
    got = model(input_ids=ids, labels=ids).loss
    close(full(got), reference(input_ids=ids, labels=ids).loss, f"{what} loaded: loss")
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)


def _check_fresh_model(device, family, tp, ids):
    """A freshly parallelized model: its first forward gathers no weight (as many all-gathers as the plan's, the
    fused projections' slices read locally), the slices (`self_attn.q_proj`, `mlp.up_proj`...) have transformers'
    rows (their weights and their outputs equal the single process's), and freezing one of them alone raises."""
    from torch.distributed.tensor.debug import CommDebugMode

    from opforge.parallel import parallelize

    import copy

    what = f"model {family} tp={tp} fresh"
    model = _tiny_llama(device, family, kv_heads=max(2, tp))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh(device, (tp,))
    parallelize(model, mesh)
    mode = CommDebugMode()
    with mode:
        model(input_ids=ids, labels=ids)
    gathers = sum(v for k, v in mode.get_comm_counts().items() if "all_gather" in str(k))
    want = 2 * model.config.num_hidden_layers + 1
    if gathers != want:
        FAILURES.append(f"{what}: first forward {gathers} all-gathers, expected {want} (a weight gathered)")
        log(f"FAIL {what}: first forward {gathers} all-gathers, expected {want}")
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(device)
    for owner, parts in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        for part in parts:
            got = getattr(getattr(model.model.layers[0], owner), part)
            want_m = getattr(getattr(reference.model.layers[0], owner), part)
            close(full(got.weight), want_m.weight, f"{what}: {owner}.{part}.weight", rtol=0, atol=0)
            y = got(distribute_tensor(x, mesh, [R]))
            close(full(y), want_m(x), f"{what}: {owner}.{part}(x)")
    try:  # a second parallelize would reorder the fused rows again
        parallelize(model, mesh)
        FAILURES.append(f"{what}: parallelized twice: no error")
    except ValueError as e:
        if "already a DTensor" not in str(e):
            FAILURES.append(f"{what}: parallelized twice: {e}")
    # one part frozen alone: the plan trains the fused projection as one parameter, so it refuses (no wrong rows)
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    try:
        model(input_ids=ids, labels=ids)
        FAILURES.append(f"{what}: k_proj frozen alone: no error")
    except NotImplementedError as e:
        if "fused projection" not in str(e):
            FAILURES.append(f"{what}: k_proj frozen alone: {e}")


def _count_collectives(model, ids, tp):
    """One forward + backward under CommDebugMode: the collectives are exactly the plan's (no parameter or
    activation the plan keeps sharded is gathered)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        loss = model(input_ids=ids, labels=ids).loss
        fwd = dict(mode.get_comm_counts())
        loss.backward()
        total = dict(mode.get_comm_counts())
    bwd = {k: v - fwd.get(k, 0) for k, v in total.items() if v - fwd.get(k, 0)}
    model.zero_grad(set_to_none=True)
    layers = model.config.num_hidden_layers
    chunks = 1  # the loss's tokens fit one chunk here
    # forward: per layer the attention's and the MLP's input gathered (2 all-gathers) and o_proj's and down_proj's
    # outputs reduce-scattered (2); the embedding's output reduce-scattered (1); the loss: the final hidden
    # states gathered (1 all-gather), per chunk the row max and the row sums all-reduced (2)
    ag, rs, ar = "c10d_functional.all_gather_into_tensor", "c10d_functional.reduce_scatter_tensor", "c10d.allreduce_"
    want_fwd = {ag: 2 * layers + 1, rs: 2 * layers + 1, ar: 2 * chunks}
    # backward, the transposes: per layer the attention's and the MLP's partial input gradients reduce-scattered and
    # o_proj's and down_proj's output gradients gathered, the loss's partial grad_input reduce-scattered and the
    # embedding's output gradient gathered. The replicated norm weights' gradients stay Partial (reduced where they
    # are used: the optimizer step, or FSDP2's reduction)
    want_bwd = {ag: 2 * layers + 1, rs: 2 * layers + 1}
    fwd = {str(k): v for k, v in fwd.items()}
    bwd = {str(k): v for k, v in bwd.items()}
    log(f"collectives forward {fwd}; backward {bwd}")
    for what, got, want in (("forward", fwd, want_fwd), ("backward", bwd, want_bwd)):
        if got != want:
            FAILURES.append(f"{what}: collectives {got}, expected {want}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("suites", nargs="+", choices=["ops", "loss", "edges", "model"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the floating inputs of the ops and loss suites (the model trains in float32)")
    a = ap.parse_args()
    global DEVICE, DTYPE
    DEVICE = a.device
    DTYPE = getattr(torch, a.dtype)
    backend = "nccl" if a.device == "cuda" else "gloo"
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    torch.set_num_threads(1)
    world = dist.get_world_size()
    for suite in a.suites:
        before = len(FAILURES)
        if suite == "model":
            suite_model(a.dp, a.device)
            if a.dp > 1:  # and tensor parallelism over every rank
                suite_model(1, a.device)
            if a.dp == 1:
                import transformers

                if hasattr(transformers, "Qwen3ForCausalLM"):
                    suite_model(1, a.device, family="qwen3")
                else:
                    log(f"model qwen3: not in transformers {transformers.__version__}, not run")
        else:
            mesh = init_device_mesh(a.device, (world,))
            with _RecordOps():
                {"ops": suite_ops, "loss": suite_loss, "edges": suite_edges}[suite](mesh)
        dist.barrier()
        log(f"SUITE {suite} on {world} ranks ({a.device}, {a.dtype}): {len(FAILURES) - before} failure(s)")
    log("EXERCISED " + " ".join(sorted(EXERCISED)))
    n = len(FAILURES)
    for f in FAILURES:
        log(f"FAILURE {f}")
    sys.stdout.flush()
    os._exit(1 if n else 0)  # skip the process-group teardown (gloo may abort in it); the result is known


if __name__ == "__main__":
    main()
