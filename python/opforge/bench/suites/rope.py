"""rope (forward, forward+backward) against transformers' apply_rotary_pos_emb eager, torch.compile of it and
Liger-Kernel's liger_rotary_pos_emb.

q and k are laid out as a Hugging Face attention layer hands them over: (B, S, H, D) projections viewed as
(B, H, S, D) by ``transpose(1, 2)``; cos/sin (B, S, D) in the model dtype, as LlamaRotaryEmbedding returns them.

Metric: GB/s by the minimal-bytes rule: q and k read and written once each way
  forward:          read q, k; write q_out, k_out              = 2·(|q| + |k|)·e
  forward+backward: forward + read dq_out, dk_out; write dq, dk = 4·(|q| + |k|)·e
(cos/sin, read once per token, are not counted). Goal (H200, (4, 4096, 32 q heads, 8 kv heads, 128) bf16):
forward+backward ≥ 0.9 × the copy ceiling (4269 GB/s measured on 2026-12-01).

On CUDA, "opforge" is the default kernel (the per-token kernel where its table fits), "opforge rows kernel" the rows
kernel (the test hook rope_rows_kernel = 1), timed in the same run. "opforge rope_from_positions" is
the same rotation with the angles computed in the kernel from position_ids (arange(S), made once per shape), no
cos/sin tensors. Before timing, opforge.rope's output is checked against opforge.testing's float64 reference.

Timing: CUDA events with warm-up and an L2 flush before each repetition (harness.time_fn); on CPU blocks of wall
time (perf_counter); outliers dropped, median. A "copy" row (q and k cloned: 2·(|q| + |k|)·e bytes) gives the
device's ceiling in the same run.

    python -m opforge bench --ops rope [--quick]
    python benchmarks/bench_rope.py                       # CUDA when available
    python benchmarks/bench_rope.py --quick               # the goal shape only, bf16
    python benchmarks/bench_rope.py --device cpu --quick  # CPU
"""
from __future__ import annotations

import math

import torch

import opforge
from opforge.testing import rope_reference

from .. import harness

NAME = "rope"
# (batch, seq, q heads, kv heads, head dim)
CUDA_SHAPES = [(4, 4096, 32, 8, 128), (4, 2048, 16, 8, 128), (1, 32768, 32, 8, 128), (64, 1, 32, 8, 128)]
CUDA_QUICK_SHAPES = [(4, 4096, 32, 8, 128)]
CPU_SHAPES = [(1, 512, 8, 2, 64), (2, 1024, 16, 4, 128)]
CPU_QUICK_SHAPES = [(1, 512, 8, 2, 64)]


def _rotate_half(x):
    """(−x[..., h:], x[..., :h]) of the last dim."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_apply_rotary_pos_emb():
    """transformers' apply_rotary_pos_emb (Llama), or the same formula when transformers is not installed."""
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        return apply_rotary_pos_emb
    except Exception:
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

        return apply_rotary_pos_emb


def impls(device: str, use_compile: bool) -> dict:
    """{impl: fn(q, k, cos, sin) -> (q_out, k_out)}: opforge's, its variants and the peers available here (compile
    peer None when ``use_compile`` is False)."""
    hf = hf_apply_rotary_pos_emb()

    def eager(q, k, cos, sin):
        return hf(q, k, cos, sin)

    positions = {}  # (S, device) -> arange(S): made once per shape, outside the timed calls

    def from_positions(q, k, cos, sin):
        key = (q.shape[2], q.device)
        if key not in positions:
            positions[key] = torch.arange(q.shape[2], device=q.device)
        return opforge.rope_from_positions(q, k, positions[key])

    out = {
        "opforge": lambda q, k, cos, sin: opforge.rope(q, k, cos, sin),
        "opforge rope_from_positions": from_positions,
        "HF eager": eager,
        "compile HF": harness.compiled(lambda q, k, cos, sin: hf(q, k, cos, sin), fullgraph=True) if use_compile
        else None,
    }
    if device.startswith("cuda"):
        for impl in KNOBS:
            out[impl] = out["opforge"]  # the same call under KNOBS' setting
        out["liger"] = harness.liger("liger_rotary_pos_emb", "liger_kernel.transformers.rope")
    return out


# impl -> (knob, value) set while that impl is timed (forward and backward), restored after
KNOBS = {"opforge rows kernel": ("rope_rows_kernel", 1)}


def _timed(impl: str, time_it):
    """time_it() with the knob of ``impl`` in KNOBS set (restored after), else time_it()."""
    knob = KNOBS.get(impl)
    if knob is None:
        return time_it()
    prev = torch.ops.opforge._set_knob(*knob)
    try:
        return time_it()
    finally:
        torch.ops.opforge._set_knob(knob[0], prev)


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, warmup=(5, 2), reps=((20, 50), (10, 10)),
                       dtypes=lambda cuda, quick: [torch.bfloat16] if (quick or not cuda) else
                       [torch.bfloat16, torch.float32])
    device = run.device
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_QUICK_SHAPES)
    fns = impls(device, not run.args.no_compile)

    for dtype in run.dtypes:
        e = torch.empty((), dtype=dtype).element_size()
        for B, S, Hq, Hk, D in shapes:
            q = torch.randn(B, S, Hq, D, device=device, dtype=dtype).transpose(1, 2)
            k = torch.randn(B, S, Hk, D, device=device, dtype=dtype).transpose(1, 2)
            inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
            ang = torch.arange(S, device=device, dtype=torch.float32)[:, None] * inv
            emb = torch.cat((ang, ang), -1)
            cos = emb.cos().to(dtype)[None].expand(B, S, D).contiguous()
            sin = emb.sin().to(dtype)[None].expand(B, S, D).contiguous()
            dq, dk = torch.randn_like(q), torch.randn_like(k)
            qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
            case = f"rope {harness.dtype_str(dtype)} {harness.shape_str((B, S, Hq, Hk, D))}"
            ref = rope_reference(q.double(), k.double(), cos.double(), sin.double())
            ours, base = opforge.rope(q, k, cos, sin), fns["HF eager"](q, k, cos, sin)
            harness.check_reference(f"{case} q", ours[0], ref[0], base[0])
            harness.check_reference(f"{case} k", ours[1], ref[1], base[1])
            del ref, ours, base
            n = q.numel() + k.numel()
            shape = harness.shape_str((B, S, Hq, Hk, D))
            for pass_, nbytes in (("fwd", 2 * n * e), ("fwd+bwd", 4 * n * e)):
                group = []
                ceiling = run.time(lambda: (q.clone(), k.clone()))
                run.add(NAME, shape, dtype, "copy", pass_, ceiling, harness.gbps(2 * n * e, ceiling), "GB/s")
                for impl, fn in fns.items():
                    if fn is None:
                        t = math.nan
                    elif pass_ == "fwd":
                        t = _timed(impl, lambda fn=fn: run.time(lambda: fn(q, k, cos, sin), no_grad=True))
                    else:
                        def step(fn=fn):
                            oq, ok = fn(qg, kg, cos, sin)
                            return torch.autograd.grad((oq, ok), (qg, kg), (dq, dk))

                        t = _timed(impl, lambda: run.time(step))
                    gb = harness.gbps(nbytes, t)
                    run.add(NAME, shape, dtype, impl, pass_, t, gb, "GB/s")
                    group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(gb, 0)}GB/s")
                run.say(f"rope {pass_} {harness.dtype_str(dtype)} {shape} "
                        f"(copy {harness._fmt(harness.gbps(2 * n * e, ceiling), 0)}GB/s)", group)
            del q, k, cos, sin, dq, dk, qg, kg
            run.release()
    return run.finish()

