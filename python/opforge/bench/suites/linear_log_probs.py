"""linear_log_probs (with the entropy) and linear_jsd, forward and forward+backward, against eager PyTorch (F.linear,
log_softmax in float32, the gather and the entropy: TRL's selective_log_softmax and entropy_from_logits; for the JSD
TRL's generalized_jsd_loss on both heads' logits) and torch.compile of it. Rows: time, its ratio to the GEMMs alone
(unit "xGEMM": log-probs forward 1 GEMM, forward+backward 4; JSD forward 2, forward+backward 4), and a second row
(op <name>_mem) with the peak memory above the inputs in MiB.

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
CUDA_SHAPES = [(bt, h, v) for bt in (4096, 8192) for h in (2048, 4096) for v in (32000, 128256, 151936)]
CUDA_QUICK_SHAPES = [(8192, 4096, 128256), (4096, 2048, 151936)]
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


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(3, 1), reps=((10, 10), (3, 3)))
    dev, cuda = run.device, run.cuda
    shapes = run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES, CPU_SHAPES)
    cases = {NAME: {"opforge": ours_log_probs, "eager": eager_log_probs},
             JSD: {"opforge": ours_jsd, "eager": eager_jsd}}
    if not run.args.no_compile:
        for name, fn in ((NAME, eager_log_probs), (JSD, eager_jsd)):
            comp = harness.compiled(fn, fullgraph=True)
            if comp is not None:
                cases[name]["torch.compile"] = comp
    peak = peak_cuda if cuda else peak_cpu
    for dtype in run.dtypes:
        for (BT, H, V) in shapes:
            torch.manual_seed(0)
            x = torch.randn(BT, H, device=dev, dtype=dtype)
            w = torch.randn(V, H, device=dev, dtype=dtype) / math.sqrt(H)
            xt = torch.randn(BT, H, device=dev, dtype=dtype)
            wt = torch.randn(V, H, device=dev, dtype=dtype) / math.sqrt(H)
            t = torch.randint(0, V, (BT,), device=dev)
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
                    gemms = {(NAME, "fwd"): 1, (NAME, "fwd+bwd"): 4, (JSD, "fwd"): 2, (JSD, "fwd+bwd"): 4}[name, pass_]
                    group = [f"GEMM {harness._fmt(gemm)}us"]
                    for impl, fn in impls.items():
                        xi = x.detach().requires_grad_(pass_ == "fwd+bwd")
                        wi = w.detach().requires_grad_(pass_ == "fwd+bwd")
                        extra = [t] if name == NAME else [xt, wt]
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
