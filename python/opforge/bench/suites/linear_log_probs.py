"""linear_log_probs (with the entropy), linear_jsd and GRPO's loss on linear_log_probs (opforge.linear_grpo_loss),
forward and forward+backward, against eager PyTorch (F.linear, log_softmax in float32, the gather and the entropy:
TRL's selective_log_softmax and entropy_from_logits; for the JSD TRL's generalized_jsd_loss on both heads' logits; for
GRPO those log-probabilities into opforge.grpo_loss), torch.compile of it and, on CUDA, Liger-Kernel's chunked losses
(LigerFusedLinearJSDLoss with only its soft loss, LigerFusedLinearGRPOLoss; their defaults, compiled). Rows: time,
its ratio to the GEMMs alone (unit "xGEMM": log-probs and GRPO forward 1 GEMM, forward+backward 4; JSD forward 2,
forward+backward 4), and a second row (op <name>_mem) with the peak memory above the inputs in MiB. GRPO's batch:
the tokens as 8 completions, "dapo" with β = 0.04, the reference's and the sampling policy's log-probabilities given.

    python -m opforge bench --ops linear_log_probs [--quick]
    python benchmarks/bench_linear_log_probs.py                  # CUDA: the shapes below, bf16
    python benchmarks/bench_linear_log_probs.py --device cpu --quick
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
GRPO_SEQS = 8
GRPO_BETA = 0.04
CUDA_SHAPES = [(bt, h, v) for bt in (4096, 8192) for h in (2048, 4096) for v in (32000, 128256, 151936)]
CUDA_QUICK_SHAPES = [(8192, 4096, 128256)]
CPU_SHAPES = [(1024, 512, 32000)]
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


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(3, 1), reps=((10, 10), (3, 3)))
    dev, cuda = run.device, run.cuda
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_SHAPES)
    cases = {NAME: {"opforge": ours_log_probs, "eager": eager_log_probs},
             JSD: {"opforge": ours_jsd, "eager": eager_jsd},
             GRPO: {"opforge": ours_grpo, "eager": eager_grpo}}
    if not run.args.no_compile:
        for name, fn in ((NAME, eager_log_probs), (JSD, eager_jsd), (GRPO, eager_grpo)):
            comp = harness.compiled(fn, fullgraph=name != GRPO)
            if comp is not None:
                cases[name]["torch.compile"] = comp
    if cuda:
        for name, make in ((JSD, make_liger_jsd), (GRPO, make_liger_grpo)):
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
            harness.check_reference(f"{JSD} {harness.dtype_str(dtype)} {shape}", ours_jsd(xs, w, xt[:CHECK_ROWS], wt),
                                    testing.linear_jsd_reference(xs, w, xt[:CHECK_ROWS], wt),
                                    eager_jsd(xs, w, xt[:CHECK_ROWS], wt))
            gemm = run.time(lambda: torch.mm(x, w.t()))
            for name, impls in cases.items():
                for pass_ in ("fwd", "fwd+bwd"):
                    gemms = {(NAME, "fwd"): 1, (NAME, "fwd+bwd"): 4, (JSD, "fwd"): 2, (JSD, "fwd+bwd"): 4,
                             (GRPO, "fwd"): 1, (GRPO, "fwd+bwd"): 4}[name, pass_]
                    group = [f"GEMM {harness._fmt(gemm)}us"]
                    for impl, fn in impls.items():
                        xi = x.detach().requires_grad_(pass_ == "fwd+bwd")
                        wi = w.detach().requires_grad_(pass_ == "fwd+bwd")
                        extra = {NAME: [t], JSD: [xt, wt], GRPO: [tg, adv, old, ref]}[name]
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
