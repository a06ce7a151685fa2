"""linear_log_probs (with the entropy), DPO (sigmoid, a reference head in the same call: opforge.linear_preference_loss),
linear_jsd and GRPO's loss on linear_log_probs (opforge.linear_grpo_loss), forward and forward+backward, against the
GEMMs alone, eager PyTorch (F.linear, log_softmax in float32, the gather and the entropy: TRL's selective_log_softmax
and entropy_from_logits; for DPO those log-probabilities summed per sequence into the DPO formula; for the JSD TRL's
generalized_jsd_loss on both heads' logits; for GRPO those log-probabilities into opforge.grpo_loss), the same eager
math chunked ("eager chunked": 1024-row chunks, or whole pairs for DPO; for the scalar losses, DPO and the JSD, each
chunk's gradients taken in the forward as Liger-Kernel's chunked losses do; for the per-token log-probabilities each
chunk recomputed in backward, torch.utils.checkpoint; not for GRPO), torch.compile of the eager math and, on CUDA, Liger-Kernel's
chunked losses (LigerFusedLinearDPOLoss with its reference head, LigerFusedLinearJSDLoss with only its soft loss,
LigerFusedLinearGRPOLoss; their defaults, compiled). Rows: time and its ratio to the GEMMs alone (unit "xGEMM";
GEMMs: log-probs and GRPO forward 1, forward+backward 4; DPO 2 and 5 (the reference head's forward); JSD 2 and 4; the
"GEMMs" row is that many times one (tokens x hidden x vocab) torch.mm), and a second row (op <name>_mem) with the peak
memory above the inputs in MiB. DPO's batch: the tokens as 8 pairs of sequences (chosen, then rejected), GRPO's as 8
completions, each sequence's first eighth a prompt (not counted); GRPO "dapo" with beta = 0.04, the reference's and
the sampling policy's log-probabilities given.

Before timing, each shape's first 128 tokens are checked against opforge.testing's float64 references by the
tests' rule (linear_jsd with its a-priori float32 bound, opforge.testing.linear_jsd_error_bound): a wrong result is
not timed.

    python -m opforge bench --ops linear_log_probs [--quick]
    python benchmarks/bench_linear_log_probs.py                  # CUDA: the shapes below, bf16
    python benchmarks/bench_linear_log_probs.py --quick --no-compile   # CUDA: the goal shape 8192 x 4096 x 128256
    python benchmarks/bench_linear_log_probs.py --device cpu     # CPU: 2048 x 512 x 32000, float32
    python benchmarks/bench_linear_log_probs.py --device cpu --no-compile --paired 7   # the same, rounds of one
                                                                 # call each in turn (a loaded machine)
"""
from __future__ import annotations

import gc
import math

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness
from .linear_cross_entropy import peak_cpu, peak_cuda

NAME = "linear_log_probs"
JSD = "linear_jsd"
GRPO = "linear_grpo"
DPO = "linear_dpo"
DPO_PAIRS = 8
DPO_BETA = 0.1
CHUNK_ROWS = 1024
GRPO_SEQS = 8
GRPO_BETA = 0.04
CUDA_SHAPES = [(bt, h, v) for bt in (4096, 8192) for h in (2048, 4096) for v in (32000, 128256, 151936)]
CUDA_QUICK_SHAPES = [(8192, 4096, 128256)]
CPU_SHAPES = [(2048, 512, 32000)]
CPU_QUICK_SHAPES = [(256, 64, 1000)]
CHECK_ROWS = 128


def eager_log_probs(x, w, t):
    """TRL's unfused math: fp32 logits, log_softmax, the target's entry, the entropy."""
    logp = torch.log_softmax(F.linear(x, w).float(), -1)
    lp = logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.sum() + ent.sum()


def ours_log_probs(x, w, t):
    lp, ent = opforge.linear_log_probs(x, w, t, return_entropy=True)
    return lp.sum() + ent.sum()


def eager_jsd(x, w, xt, wt, beta=0.5):
    """TRL's generalized_jsd_loss on both heads' fp32 logits (the mean over the tokens)."""
    ls = torch.log_softmax(F.linear(x, w).float(), -1)
    lt = torch.log_softmax(F.linear(xt, wt).float(), -1)
    lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    kl_t = F.kl_div(lm, lt, reduction="none", log_target=True)
    kl_s = F.kl_div(lm, ls, reduction="none", log_target=True)
    return (beta * kl_t + (1 - beta) * kl_s).sum() / x.shape[0]


def ours_jsd(x, w, xt, wt):
    return opforge.linear_jsd(x, w, xt, wt, beta=0.5)


def _grpo_inputs(x, t):
    """(B, T, H) hidden states and (B, T) targets of GRPO_SEQS completions from (N, H) and (N,)."""
    return x.view(GRPO_SEQS, -1, x.shape[-1]), t.view(GRPO_SEQS, -1)


def eager_grpo(x, w, t, adv, old, ref):
    """TRL's unfused math: fp32 logits, log_softmax, the targets' entries, then grpo_loss ("dapo")."""
    xs, ts = _grpo_inputs(x, t)
    logp = torch.log_softmax(F.linear(xs, w).float(), -1)
    lp = logp.gather(-1, ts.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return opforge.grpo_loss(lp, adv, ts != -100, old, ref, beta=GRPO_BETA)[0]


def ours_grpo(x, w, t, adv, old, ref):
    xs, ts = _grpo_inputs(x, t)
    return opforge.linear_grpo_loss(xs, w, ts, adv, old_log_probs=old, ref_log_probs=ref, beta=GRPO_BETA)[0]


def _dpo_inputs(x, t):
    """(2 DPO_PAIRS, T, H) hidden states and (2 DPO_PAIRS, T) targets (chosen, then rejected) from (N, H), (N,)."""
    return x.view(2 * DPO_PAIRS, -1, x.shape[-1]), t.view(2 * DPO_PAIRS, -1)


def _seq_logps(x, w, t):
    """TRL's concatenated forward: fp32 logits, log_softmax, the targets' entries summed over each sequence."""
    logp = torch.log_softmax(F.linear(x, w).float(), -1)
    lp = logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(t != -100, lp, torch.zeros_like(lp)).sum(-1)


def _dpo(x, w, t, xr, wr, pairs):
    """DPO's sigmoid loss of 2b sequences (b chosen, then b rejected), summed and divided by ``pairs``."""
    pol = _seq_logps(x, w, t)
    with torch.no_grad():
        ref = _seq_logps(xr, wr, t)
    b = t.shape[0] // 2
    h = (pol[:b] - ref[:b]) - (pol[b:] - ref[b:])
    return -F.logsigmoid(DPO_BETA * h).sum() / pairs


def eager_dpo(x, w, t, xr, wr):
    """TRL's unfused DPO: both heads' log-probabilities (the reference's without gradients), the sigmoid loss."""
    (xs, ts), (xrs, _) = _dpo_inputs(x, t), _dpo_inputs(xr, t)
    return _dpo(xs, w, ts, xrs, wr, DPO_PAIRS)


def ours_dpo(x, w, t, xr, wr):
    (xs, ts), (xrs, _) = _dpo_inputs(x, t), _dpo_inputs(xr, t)
    return opforge.linear_preference_loss(xs, w, ts, ref_input=xrs, ref_linear_weight=wr, loss_type="sigmoid",
                                          beta=DPO_BETA)[0]


class _Chunked(torch.autograd.Function):
    """Eager chunking as Liger-Kernel's chunked losses: ``loss(x_c, w, *extra_c)`` per chunk c of dimension ``dim``
    (its part of the total), the chunk's gradients taken at once in the forward (nothing of a chunk kept), the
    backward a scaling of them."""

    @staticmethod
    def forward(ctx, x, w, loss, chunk, dim, *extra):
        gx = torch.empty_like(x)
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for i in range(0, x.shape[dim], chunk):
            sl = [slice(None)] * dim + [slice(i, i + chunk)]
            xc = x[tuple(sl)].detach().requires_grad_()
            wc = w.detach().requires_grad_()
            with torch.enable_grad():
                lc = loss(xc, wc, *[e[tuple(sl)] for e in extra])
                dxc, dwc = torch.autograd.grad(lc, (xc, wc))
            gx[tuple(sl)] = dxc
            gw += dwc
            total += lc.detach().float()
        ctx.save_for_backward(gx, gw.to(w.dtype))
        ctx.extra = len(extra)
        return total

    @staticmethod
    def backward(ctx, g):
        gx, gw = ctx.saved_tensors
        return gx * g.to(gx.dtype), gw * g.to(gw.dtype), None, None, None, *([None] * ctx.extra)


def _chunked(x, w, loss, chunk, dim, *extra):
    """`_Chunked` when a gradient is wanted, else the chunks' losses summed (no gradient work in a forward only)."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Chunked.apply(x, w, loss, chunk, dim, *extra)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[dim], chunk):
        sl = tuple([slice(None)] * dim + [slice(i, i + chunk)])
        total += loss(x[sl], w, *[e[sl] for e in extra]).float()
    return total


def _lp_ent(x, w, t):
    logp = torch.log_softmax(F.linear(x, w).float(), -1)
    return logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def chunked_log_probs(x, w, t):
    """The per-token log-probabilities and entropies chunk by chunk, each chunk's logits recomputed in backward
    (torch.utils.checkpoint): per-token outputs, whose gradients are not known in the forward, as opforge's."""
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_lp_ent, x[i:i + CHUNK_ROWS], w, t[i:i + CHUNK_ROWS], use_reentrant=False)
             for i in range(0, x.shape[0], CHUNK_ROWS)]
    return sum(lp.sum() + ent.sum() for lp, ent in parts)


def chunked_jsd(x, w, xt, wt):
    n = x.shape[0]
    return _chunked(x, w, lambda a, b, c: eager_jsd(a, b, c, wt) * a.shape[0] / n, CHUNK_ROWS, 0, xt)


def chunked_dpo(x, w, t, xr, wr):
    """Chunks of whole pairs (a pair's chosen and rejected sequence together, as Liger-Kernel's preference losses)."""
    T = x.shape[0] // (2 * DPO_PAIRS)
    xs, xrs, ts = (a.view(2, DPO_PAIRS, T, *a.shape[1:]) for a in (x, xr, t))

    def loss(xc, wc, tc, xrc):
        return _dpo(xc.flatten(0, 1), wc, tc.flatten(0, 1), xrc.flatten(0, 1), wr, DPO_PAIRS)
    return _chunked(xs, w, loss, max(1, CHUNK_ROWS // (2 * T)), 1, ts, xrs)


def make_liger_dpo():
    """Liger-Kernel's LigerFusedLinearDPOLoss ("sigmoid", the reference head given) as fn(x, w, t, xr, wr), or
    None when it does not import."""
    cls = harness.liger("LigerFusedLinearDPOLoss", "liger_kernel.chunked_loss")
    if cls is None:
        return None
    loss = cls(beta=DPO_BETA, use_ref_model=True)

    def fn(x, w, t, xr, wr):
        (xs, ts), (xrs, _) = _dpo_inputs(x, t), _dpo_inputs(xr, t)
        out = loss(w, xs, ts, ref_input=xrs, ref_weight=wr)
        return out[0] if isinstance(out, (tuple, list)) else out
    return fn


def make_liger_grpo():
    """Liger-Kernel's LigerFusedLinearGRPOLoss ("dapo", the given reference log-probabilities) as
    fn(x, w, t, adv, old, ref), or None when it does not import."""
    cls = harness.liger("LigerFusedLinearGRPOLoss", "liger_kernel.chunked_loss")
    if cls is None:
        return None
    loss = cls(beta=GRPO_BETA, loss_type="dapo", use_ref_model=True)

    def fn(x, w, t, adv, old, ref):
        xs, ts = _grpo_inputs(x, t)
        out = loss(xs, w, ts, (ts != -100).long(), adv, ref_per_token_logps=ref, old_per_token_logps=old)
        return out[0] if isinstance(out, (tuple, list)) else out
    return fn


def make_liger_jsd():
    """Liger-Kernel's LigerFusedLinearJSDLoss with only its soft (JSD) loss as fn(x, w, xt, wt), or None."""
    cls = harness.liger("LigerFusedLinearJSDLoss", "liger_kernel.chunked_loss")
    if cls is None:
        return None
    loss = cls(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.5)
    labels = {}

    def fn(x, w, xt, wt):
        key = (x.shape[0], x.device)
        if key not in labels:
            labels[key] = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return loss(x, w, xt, wt, labels[key])
    return fn


def _paired(run, name, pass_, shape, dtype, steps, gemms, rounds):
    """`rounds` rounds of one call of each step (the order rotated each round), so that a load that changes
    during the run weighs on every implementation alike; the median call per implementation and, per
    implementation, the median over the rounds of its time over opforge's in the same round."""
    import time

    for fn in steps.values():  # warm-up
        fn()
    times = {k: [] for k in steps}
    keys = list(steps)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            gc.collect()
            t0 = time.perf_counter()
            steps[k]()
            times[k].append((time.perf_counter() - t0) * 1e6)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    line = []
    for k, v in times.items():
        rel = sorted(a / b for a, b in zip(v, times["opforge"]))[len(v) // 2]
        run.add(name, shape, dtype, k, pass_, med[k], med[k] / med["GEMMs"], "xGEMM")
        line.append(f"{k} {med[k] / 1e3:.1f} ms ({med[k] / med['GEMMs']:.2f}x GEMMs, {rel:.2f}x opforge)")
    print(f"  {name} {pass_} {harness.dtype_str(dtype)} {shape} (median of {rounds} paired rounds): " + "; ".join(line))


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    p = harness.parser(__doc__)
    p.add_argument("--paired", type=int, default=0, metavar="ROUNDS",
                   help="forward+backward only, ROUNDS rounds of one call of each implementation in turn (for a "
                        "loaded machine: the ratios are taken within a round); no memory rows")
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(3, 1), reps=((10, 10), (3, 3)), arg_parser=p)
    dev, cuda = run.device, run.cuda
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_QUICK_SHAPES)
    cases = {NAME: {"opforge": ours_log_probs, "eager": eager_log_probs, "eager chunked": chunked_log_probs},
             DPO: {"opforge": ours_dpo, "eager": eager_dpo, "eager chunked": chunked_dpo},
             JSD: {"opforge": ours_jsd, "eager": eager_jsd, "eager chunked": chunked_jsd},
             GRPO: {"opforge": ours_grpo, "eager": eager_grpo}}
    if not run.args.no_compile:
        for name, fn in ((NAME, eager_log_probs), (DPO, eager_dpo), (JSD, eager_jsd), (GRPO, eager_grpo)):
            comp = harness.compiled(fn, fullgraph=name != GRPO)
            if comp is not None:
                cases[name]["torch.compile"] = comp
    if cuda:
        for name, make in ((DPO, make_liger_dpo), (JSD, make_liger_jsd), (GRPO, make_liger_grpo)):
            fn = make()
            if fn is not None:
                cases[name]["liger"] = fn
    peak = peak_cuda if cuda else peak_cpu
    for dtype in run.dtypes:
        for (BT, H, V) in shapes:
            torch.manual_seed(0)
            x = torch.randn(BT, H, device=dev, dtype=dtype)
            w = torch.randn(V, H, device=dev, dtype=dtype) / math.sqrt(H)
            xt = torch.randn(BT, H, device=dev, dtype=dtype)
            wt = torch.randn(V, H, device=dev, dtype=dtype) / math.sqrt(H)
            t = torch.randint(0, V, (BT,), device=dev)
            tg = t.clone()  # GRPO's targets: each completion's first eighth (its prompt) not counted
            tg.view(GRPO_SEQS, -1)[:, :BT // GRPO_SEQS // 8] = -100
            td = t.clone()  # DPO's: the same for each sequence of the pairs
            td.view(2 * DPO_PAIRS, -1)[:, :BT // (2 * DPO_PAIRS) // 8] = -100
            adv = torch.randn(GRPO_SEQS, device=dev)
            with torch.no_grad():
                xs3, ts3 = _grpo_inputs(x, tg)
                lp0 = opforge.linear_log_probs(xs3, w, ts3)
            old, ref = lp0 + 0.01 * torch.randn_like(lp0), lp0 + 0.02 * torch.randn_like(lp0)
            shape = harness.shape_str((BT, H, V))
            xs, ts = x[:CHECK_ROWS], t[:CHECK_ROWS]
            harness.check_reference(f"{NAME} {harness.dtype_str(dtype)} {shape}",
                                    opforge.linear_log_probs(xs, w, ts),
                                    testing.linear_log_probs_reference(xs, w, ts),
                                    torch.log_softmax(F.linear(xs, w).float(), -1).gather(-1, ts[:, None])[:, 0])
            xts = xt[:CHECK_ROWS]
            ref_jsd = testing.linear_jsd_reference(xs, w, xts, wt)
            harness.check_reference(f"{JSD} {harness.dtype_str(dtype)} {shape}", ours_jsd(xs, w, xts, wt), ref_jsd,
                                    eager_jsd(xs, w, xts, wt),
                                    bound=testing.linear_jsd_error_bound(xs, w, xts, wt, reference=ref_jsd))
            if run.args.paired:
                for name, impls in cases.items():
                    gemms = {NAME: 4, DPO: 5, JSD: 4, GRPO: 4}[name]
                    extra = {NAME: [t], DPO: [td, xt, wt], JSD: [xt, wt], GRPO: [tg, adv, old, ref]}[name]
                    xi, wi = x.detach().requires_grad_(), w.detach().requires_grad_()
                    steps = {"GEMMs": lambda n=gemms: [torch.mm(x, w.t()) for _ in range(n)]}
                    steps.update({impl: harness.fwd_bwd(fn, [xi, wi, *extra]) for impl, fn in impls.items()
                                  if impl != "torch.compile"})
                    _paired(run, name, "fwd+bwd", shape, dtype, steps, gemms, run.args.paired)
                    gc.collect()
                continue
            gemm = run.time(lambda: torch.mm(x, w.t()))
            try:
                gemm_mem = peak(lambda: torch.mm(x, w.t()))
            except Exception:
                gemm_mem = math.nan
            for name, impls in cases.items():
                for pass_ in ("fwd", "fwd+bwd"):
                    gemms = {(NAME, "fwd"): 1, (NAME, "fwd+bwd"): 4, (DPO, "fwd"): 2, (DPO, "fwd+bwd"): 5,
                             (JSD, "fwd"): 2, (JSD, "fwd+bwd"): 4, (GRPO, "fwd"): 1, (GRPO, "fwd+bwd"): 4}[name, pass_]
                    run.add(name, shape, dtype, "GEMMs", pass_, gemms * gemm, 1.0, "xGEMM")
                    run.add(name + "_mem", shape, dtype, "GEMMs", pass_, gemms * gemm, gemm_mem, "MiB")
                    group = [f"GEMMs {harness._fmt(gemms * gemm)}us ({harness._fmt(gemm_mem, 0)} MiB)"]
                    for impl, fn in impls.items():
                        xi = x.detach().requires_grad_(pass_ == "fwd+bwd")
                        wi = w.detach().requires_grad_(pass_ == "fwd+bwd")
                        extra = {NAME: [t], DPO: [td, xt, wt], JSD: [xt, wt], GRPO: [tg, adv, old, ref]}[name]
                        step = harness.fwd_bwd(fn, [xi, wi, *extra]) if pass_ == "fwd+bwd" \
                            else (lambda fn=fn, xi=xi, wi=wi, extra=extra: fn(xi, wi, *extra))
                        tm = run.time(step)
                        spread = harness.last_spread()
                        try:
                            mem = peak(step) if not math.isnan(tm) else math.nan
                        except Exception:
                            mem = math.nan
                        ratio = tm / (gemms * gemm) if gemm > 0 else math.nan
                        run.add(name, shape, dtype, impl, pass_, tm, ratio, "xGEMM", spread=spread)
                        run.add(name + "_mem", shape, dtype, impl, pass_, tm, mem, "MiB", spread=spread)
                        group.append(f"{impl} {harness._fmt(tm)}us ({harness._fmt(ratio, 2)}x, "
                                     f"{harness._fmt(mem, 0)} MiB)")
                        del step
                        gc.collect()
                        run.release()
                    run.say_case(name, pass_, dtype, shape, group)
    return run.finish()
