"""Post-training on opforge's fused losses against eager PyTorch: DPO fine-tuning and JSD distillation of tiny Llamas.

Two experiments on the bundled text (Lewis Carroll's *Alice's Adventures in Wonderland*, byte-level tokens,
`opforge/data/alice.txt`), each run twice from the same initialisation on the same batches:

* DPO: a tiny Llama, briefly pre-trained on the text (next-token loss), is fine-tuned with DPO's sigmoid loss on
  pairs built from the text: a prompt of the text, the chosen completion its real continuation, the rejected one
  the same bytes shuffled (a corrupted continuation); the reference is the pre-trained model, frozen. One run uses
  `opforge.linear_preference_loss` (fused log-probabilities, the reference head in the same call), the other the
  eager math: `F.linear`, `log_softmax`, the targets' log-probabilities summed per sequence, the DPO formula.
* Distillation: a smaller student learns from a larger teacher (pre-trained briefly on the text, then frozen) by the
  generalised JSD (beta = 0.5) per token: `opforge.linear_jsd` against the eager generalised JSD of both heads'
  logits (TRL's `generalized_jsd_loss`).

Both pairs of loss curves are plotted (`--plot`, a PNG) and must agree: every logged loss of the opforge run within
`REL_TOL` of the eager run's, relative to max(|eager loss|, the first step's loss). In float32 the two runs differ
only by the fused kernels' summation order (about 1e-7 relative per step), which training amplifies slowly over
this many steps; a wrong loss or gradient (a missing term, a wrong sign, a wrong normaliser) moves the curves by far
more than 1e-3 within a few steps. The exit status is 1 when a pair disagrees.

    python examples/post_training.py                         # about 80 s on 2 loaded CPU cores
    python examples/post_training.py --plot docs/performance/post_training.png
    python examples/post_training.py --tiny                  # a few seconds (the test's size)
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

try:
    import opforge
except ImportError:  # run from the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import opforge
from opforge.demo.data import load_text
from opforge.models.llama import Llama, LlamaConfig

#: Every logged loss of the opforge run within this relative difference of the eager run's (float32).
REL_TOL = 1e-3
IGNORE = -100


@dataclass
class Size:
    """One run's sizes: the models, the batches and the steps."""
    d_model: int = 64
    layers: int = 2
    teacher_d_model: int = 128
    teacher_layers: int = 3
    prompt: int = 32
    completion: int = 32
    seq: int = 64
    batch: int = 16
    pretrain_steps: int = 60
    steps: int = 40
    lr: float = 1e-3


FULL = Size()
TINY = Size(d_model=32, layers=1, teacher_d_model=48, teacher_layers=1, prompt=16, completion=16, seq=32, batch=8,
            pretrain_steps=5, steps=6)


def _model(d: int, layers: int, seed: int) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig(vocab_size=256, d_model=d, n_layers=layers, n_heads=4, max_seq_len=256), backend="torch")


def pretrain(model: Llama, tokens: torch.Tensor, size: Size, steps: int, seed: int) -> Llama:
    """A few steps of next-token training on the text (eager cross-entropy), in place; returns the model."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        off = torch.randint(0, len(tokens) - size.seq - 1, (size.batch,), generator=g)
        chunk = tokens[off[:, None] + torch.arange(size.seq + 1)]
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model


# ---- DPO ----------------------------------------------------------------------------------------------------------

def dpo_batches(tokens: torch.Tensor, size: Size, steps: int, seed: int) -> List[tuple]:
    """Per step (inputs, targets), each `(2B, P + C − 1)`: B chosen sequences (prompt + the real continuation), then
    the B rejected ones (prompt + the continuation's bytes shuffled); the targets ignore the prompt."""
    g = torch.Generator().manual_seed(seed)
    P, C, B = size.prompt, size.completion, size.batch
    out = []
    for _ in range(steps):
        off = torch.randint(0, len(tokens) - P - C, (B,), generator=g)
        seqs = tokens[off[:, None] + torch.arange(P + C)]
        perm = torch.stack([torch.randperm(C, generator=g) for _ in range(B)])
        rejected = seqs.clone()
        rejected[:, P:] = torch.gather(seqs[:, P:], 1, perm)
        both = torch.cat([seqs, rejected])
        inputs, targets = both[:, :-1], both[:, 1:].clone()
        targets[:, :P - 1] = IGNORE
        out.append((inputs, targets))
    return out


def eager_dpo_loss(h, w, targets, ref_h, ref_w, beta):
    """TRL's unfused DPO: float32 logits, log_softmax, each sequence's summed target log-probabilities (the
    reference's without gradients), −log σ(β ((π_c − ref_c) − (π_r − ref_r))) averaged over the pairs."""
    def seq_logps(x, m):
        logp = torch.log_softmax(F.linear(x, m).float(), -1)
        lp = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(targets != IGNORE, lp, torch.zeros_like(lp)).sum(-1)
    pol = seq_logps(h, w)
    with torch.no_grad():
        ref = seq_logps(ref_h, ref_w)
    b = targets.shape[0] // 2
    margin = (pol[:b] - ref[:b]) - (pol[b:] - ref[b:])
    return -F.logsigmoid(beta * margin).mean()


def opforge_dpo_loss(h, w, targets, ref_h, ref_w, beta):
    return opforge.linear_preference_loss(h, w, targets, ref_input=ref_h, ref_linear_weight=ref_w,
                                          loss_type="sigmoid", beta=beta)[0]


def run_dpo(base: Llama, batches: List[tuple], size: Size, loss_fn, beta: float = 0.1) -> List[float]:
    """DPO fine-tuning of a copy of `base` (the frozen reference) on `batches`; the loss per step."""
    policy, ref = copy.deepcopy(base), copy.deepcopy(base).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=size.lr)
    losses = []
    for inputs, targets in batches:
        with torch.no_grad():
            ref_h = ref.hidden(inputs)
        loss = loss_fn(policy.hidden(inputs), policy.lm_head.weight, targets, ref_h, ref.lm_head.weight, beta)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- distillation -------------------------------------------------------------------------------------------------

def eager_jsd_loss(h, w, th, tw, beta=0.5):
    """TRL's generalized_jsd_loss on both heads' float32 logits: β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m),
    m = β p_t + (1 − β) p_s, averaged over the tokens."""
    ls = torch.log_softmax(F.linear(h, w).float(), -1)
    lt = torch.log_softmax(F.linear(th, tw).float(), -1)
    lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    per = beta * F.kl_div(lm, lt, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
        lm, ls, reduction="none", log_target=True)
    return per.sum(-1).mean()


def opforge_jsd_loss(h, w, th, tw, beta=0.5):
    return opforge.linear_jsd(h, w, th, tw, beta=beta)


def run_distill(student0: Llama, teacher: Llama, tokens: torch.Tensor, size: Size, loss_fn, seed: int) -> List[float]:
    """Distillation of a copy of `student0` from the frozen `teacher` on seeded text batches; the loss per step."""
    student = copy.deepcopy(student0)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(size.steps):
        off = torch.randint(0, len(tokens) - size.seq, (size.batch,), generator=g)
        x = tokens[off[:, None] + torch.arange(size.seq)]
        with torch.no_grad():
            th = teacher.hidden(x).flatten(0, 1)
        loss = loss_fn(student.hidden(x).flatten(0, 1), student.lm_head.weight, th, teacher.lm_head.weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- the comparison -----------------------------------------------------------------------------------------------

def disagreement(ours: List[float], eager: List[float]) -> float:
    """max over steps of |ours − eager| / max(|eager|, |eager[0]|): the quantity `REL_TOL` bounds."""
    floor = abs(eager[0])
    return max(abs(a - b) / max(abs(b), floor) for a, b in zip(ours, eager))


def run(size: Size, seed: int = 0) -> Dict[str, Dict[str, List[float]]]:
    """Both experiments, each with opforge's loss and the eager one; {"dpo": {...}, "distill": {...}} of curves."""
    torch.manual_seed(seed)
    tokens = load_text()
    base = pretrain(_model(size.d_model, size.layers, seed), tokens, size, size.pretrain_steps, seed + 1)
    batches = dpo_batches(tokens, size, size.steps, seed + 2)
    dpo = {"opforge": run_dpo(base, batches, size, opforge_dpo_loss),
           "eager": run_dpo(base, batches, size, eager_dpo_loss)}
    teacher = pretrain(_model(size.teacher_d_model, size.teacher_layers, seed + 3), tokens, size,
                       2 * size.pretrain_steps, seed + 4).requires_grad_(False)
    student = _model(size.d_model, size.layers, seed + 5)
    distill = {"opforge": run_distill(student, teacher, tokens, size, opforge_jsd_loss, seed + 6),
               "eager": run_distill(student, teacher, tokens, size, eager_jsd_loss, seed + 6)}
    return {"dpo": dpo, "distill": distill}


def plot(curves: Dict[str, Dict[str, List[float]]], path: Path) -> None:
    """The two pairs of curves side by side, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    titles = {"dpo": "DPO fine-tuning (sigmoid, beta 0.1)", "distill": "JSD distillation (beta 0.5), student <- teacher"}
    for ax, (name, pair) in zip(axes, curves.items()):
        ax.plot(pair["eager"], label="eager PyTorch", lw=3, alpha=0.5)
        ax.plot(pair["opforge"], label="opforge (fused)", lw=1.2, ls="--")
        ax.set_title(f"{titles[name]}\nmax rel. difference {disagreement(pair['opforge'], pair['eager']):.1e}",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    """Run both experiments, print the curves' agreement, plot them if asked; 0 when both pairs agree."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the test's sizes (a few seconds)")
    p.add_argument("--steps", type=int, default=None, help="fine-tuning / distillation steps")
    p.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = TINY if args.tiny else FULL
    if args.steps:
        size = dataclasses.replace(size, steps=args.steps)
    t0 = time.perf_counter()
    curves = run(size)
    ok = True
    for name, pair in curves.items():
        d = disagreement(pair["opforge"], pair["eager"])
        ok &= d <= REL_TOL
        print(f"{name:8s} loss {pair['eager'][0]:.4f} -> {pair['eager'][-1]:.4f} (eager), "
              f"{pair['opforge'][0]:.4f} -> {pair['opforge'][-1]:.4f} (opforge); max rel. difference {d:.2e} "
              f"({'agree' if d <= REL_TOL else 'DISAGREE'}: rule {REL_TOL:g})")
    if args.plot:
        plot(curves, args.plot)
        print(f"plot: {args.plot}")
    print(f"{time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
