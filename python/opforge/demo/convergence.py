"""`python -m opforge demo --convergence`: FP8 training of the demo's model measured against bf16.

Four runs of the demo's Llama (backend="opforge", parameters in `--dtype`, bf16 by default) on the bundled text,
with the same batches in the same order (the data seed is `--seed` + 1, as in the demo) and the same optimizer,
learning-rate schedule and clipping:

| run | initial weights | projections |
| --- | --- | --- |
| `bf16 A` | seed A = `--seed` | the parameters' dtype |
| `bf16 B` | seed B = `--seed` + 1 | the parameters' dtype |
| `fp8 tensorwise A` | seed A | `Llama(..., fp8="tensorwise")` |
| `fp8 rowwise A` | seed A | `Llama(..., fp8="rowwise")` |

The FP8 runs compute the four projections of every decoder block (qkv_proj, o_proj, gate_up_proj, down_proj) with
`opforge.fp8_linear`; the embedding, the norms, lm_head and the loss stay in the parameters' dtype (`--fp8 G`
runs only granularity G).

The bound. `bf16 A` and `bf16 B` are two equally good trainings of the same model on the same batches; they differ
only by the initial weights, so |loss_A − loss_B| at a step is how far apart two runs that nobody would call
different are. The bound B is the mean of |loss_A − loss_B| over the training steps after the learning-rate
warm-up (during the warm-up both runs sit near the initial loss ln 256 and the difference measures the initial
logits, not training): the typical distance between two equally good runs. The check: every logged loss of an FP8
run (the training loss of every step and every validation loss) is within B of `bf16 A`'s at the same step. An FP8
run starts from seed A's weights, so at no step may it be further from `bf16 A` than a run from other weights
typically is. The mean rather than the maximum: the largest seed differences are the few steps where the two runs
pass through the fast early descent at slightly different times, and a bound that wide would pass a run that lags
all along. A wrongly scaled gradient moves an FP8 run past B within tens of steps
(`tests/python/test_fp8_convergence.py` injects one).

Outputs (`--out DIR`, default the current directory; a run never replaces an earlier run's files):
`fp8_convergence_<device>.csv` (one row per run and logged loss: run, kind, step, loss, |loss − bf16 A|),
`fp8_convergence_<device>.json` (configuration, the bound, each check, every curve) and
`fp8_convergence_<device>.png` (the curves, and the |FP8 − bf16 A| differences against the band of B, with
|bf16 B − bf16 A| for reference). Exit status 0 when every check passes, 1 when one fails.

Sizes: the CPU default is `CPU_DEFAULTS` (the `tiny` size, 150 steps at a peak learning rate of 1e-3: about half a
minute on one core, CI runs it); on CUDA `CUDA_DEFAULTS` (the `h200` size, 500 steps). `--size`, `--steps`, `--lr`
and the other size options override them (docs/performance/fp8_convergence.md has the commands and the figures).
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .data import DATA_FILE, make_batches
from .model import DTYPES, _config, _initial_state
from .report import _commit, _device_name, print_table, write_csv
from .train import Dist, Result, Trainer, train_lockstep

#: The CPU default (`--convergence` without `--size`): the tiny model at a peak learning rate of 1e-3 (the tiny
#: size's 3e-3 makes this model's training chaotic: any perturbation, FP8's rounding or another rounding order,
#: decorrelates the per-step losses within about 20 steps; docs/performance/fp8_convergence.md has the figures).
CPU_DEFAULTS = dict(size="tiny", steps=150, lr=1e-3)
#: The CUDA default: the `h200` size (its learning rate), 500 steps.
CUDA_DEFAULTS = dict(size="h200", steps=500)
CPU_STEPS, CUDA_STEPS = CPU_DEFAULTS["steps"], CUDA_DEFAULTS["steps"]
#: The FP8 granularities the convergence run compares, in order.
GRANULARITIES = ("tensorwise", "rowwise")


def run_specs(seed: int, fp8: Optional[str], dtype_name: str) -> List[dict]:
    """The runs of a convergence run: labels, initial-weight seeds and FP8 granularities.

    Args:
        seed: int. Seed A; seed B is seed + 1.
        fp8: str or None. One granularity, or None for both (`GRANULARITIES`).
        dtype_name: str. The parameters' dtype name (`"bf16"`, `"fp32"`), used in the labels.

    Returns:
        list of dict with `label`, `init_seed` and `fp8` (None for the two reference runs), the reference run first.
    """
    grans = GRANULARITIES if fp8 is None else (fp8,)
    return ([dict(label=f"{dtype_name} A", init_seed=seed, fp8=None), dict(label=f"{dtype_name} B", init_seed=seed + 1, fp8=None)]
            + [dict(label=f"fp8 {g} A", init_seed=seed, fp8=g) for g in grans])


def warmup_steps(steps: int) -> int:
    """The learning-rate warm-up of a demo run of `steps` steps (the `Trainer`'s): max(1, min(20, steps // 10))."""
    return max(1, min(20, steps // 10))


def seed_spread(a: Result, b: Result, skip: int) -> dict:
    """B = mean over the steps i ≥ skip of |a.train_loss[i] − b.train_loss[i]|: the bound of the FP8 checks.

    Args:
        a: Result. The reference run (`bf16 A`).
        b: Result. The run from the other initial weights (`bf16 B`).
        skip: int. Leading steps left out (the learning-rate warm-up).

    Returns:
        dict with `bound` (float, nats: the mean), `mean`, `median`, `p90`, `max` (of the same differences),
            `skip` and `rule` (in words).

    Raises:
        ValueError: the runs' lengths differ, or no step is left after `skip`.
    """
    if len(a.train_loss) != len(b.train_loss):
        raise ValueError(f"opforge demo --convergence: expected two runs of the same length, but got "
                         f"{len(a.train_loss)} and {len(b.train_loss)} logged steps")
    d = (torch.tensor(a.train_loss, dtype=torch.float64) - torch.tensor(b.train_loss, dtype=torch.float64)).abs()[skip:]
    if d.numel() == 0:
        raise ValueError(f"opforge demo --convergence: expected more than {skip} logged steps, but got {len(a.train_loss)}")
    return dict(bound=float(d.mean()), mean=float(d.mean()), median=float(d.median()),
                p90=float(torch.quantile(d, 0.9)), max=float(d.max()), skip=skip,
                rule=f"mean of |loss_A - loss_B| (two init seeds) over the training steps after the first {skip}")


def check_run(run: Result, ref: Result, bound: float) -> dict:
    """Every logged loss of `run` (training, every step; validation) within `bound` of `ref`'s at the same step.

    Args:
        run: Result. An FP8 run.
        ref: Result. The reference run from the same initial weights (`bf16 A`).
        bound: float. B, nats.

    Returns:
        dict with `ok` (bool; False as well when the two runs logged different steps or a loss is not finite),
            `max_diff` (the largest |difference|), `worst` (`"train step N"` or `"val step N"`), `over` (how many
            logged losses are past the bound), `mean_diff` (of the training losses) and `final_val_diff`.
    """
    same = len(run.train_loss) == len(ref.train_loss) and run.val_steps == ref.val_steps
    pairs = [(f"train step {i + 1}", p, q) for i, (p, q) in enumerate(zip(run.train_loss, ref.train_loss))]
    pairs += [(f"val step {s}", p, q) for s, p, q in zip(run.val_steps, run.val_loss, ref.val_loss)]
    diffs = [(abs(p - q) if math.isfinite(p) else math.inf, where) for where, p, q in pairs]
    worst = max(diffs) if diffs else (0.0, "-")
    train = diffs[:min(len(run.train_loss), len(ref.train_loss))]
    return dict(ok=bool(same and diffs and worst[0] <= bound), max_diff=worst[0], worst=worst[1],
                over=sum(d > bound for d, _ in diffs), mean_diff=sum(d for d, _ in train) / max(1, len(train)),
                final_val_diff=abs(run.val_loss[-1] - ref.val_loss[-1]) if run.val_loss and ref.val_loss else None)


def train_run(args, cfg, state: dict, batches, device: torch.device, dtype: torch.dtype, fp8: Optional[str],
              label: str) -> Result:
    """Trains one model of the comparison (the demo's `Trainer`, backend="opforge") and returns its record.

    Args:
        args: argparse.Namespace. The command line (lr, clip, eval cadence, progress).
        cfg: LlamaConfig. The model's shape.
        state: dict. The initial weights.
        batches: Batches. The data order, the same for every run.
        device: torch.device. Where it trains.
        dtype: torch.dtype. The parameters' dtype.
        fp8: str or None. The decoder projections' FP8 granularity.
        label: str. The progress bar's label.

    Returns:
        Result.
    """
    run_args = type(args)(**{**vars(args), "fp8": fp8})
    torch.manual_seed(args.seed)
    t = Trainer("opforge", cfg, state, batches, run_args, device, dtype, Dist(), args.steps, bool(args.compile))
    eval_every = args.eval_every or max(1, args.steps // 5)
    res = train_lockstep([t], args.steps, eval_every=eval_every, progress=not args.quiet, desc=label)[0]
    del t
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def plot_convergence(path: Path, runs: Dict[str, Result], ref: str, other: str, bound: float, title: str,
                     skip: int = 0) -> bool:
    """Draws the loss curves (top) and each run's |loss − ref's loss| against the band [0, bound] (bottom).

    Args:
        path: Path. The PNG; its folder is made if needed.
        runs: dict of label to Result. The runs, the reference among them.
        ref: str. The reference run's label (`bf16 A`).
        other: str. The other-seed run's label (`bf16 B`), drawn in grey in the bottom panel.
        bound: float. B, nats.
        title: str. The figure's title.
        skip: int. The warm-up steps left out of the bound (a dotted line). Default: 0.

    Returns:
        bool: False (and a note on stderr) when matplotlib is not installed.
    """
    from .report import pyplot

    plt = pyplot("plot")
    if plt is None:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), dpi=120, sharex=True,
                                      gridspec_kw=dict(height_ratios=[3, 2]))
    colors = {ref: "black", other: "tab:gray"}
    palette = iter(["tab:red", "tab:blue", "tab:orange", "tab:purple"])
    r0 = runs[ref]
    for label, r in runs.items():
        c = colors.setdefault(label, next(palette))
        steps = range(1, len(r.train_loss) + 1)
        top.plot(steps, r.train_loss, color=c, lw=1.0, alpha=0.8, label=f"{label} train")
        if r.val_loss:
            top.plot(r.val_steps, r.val_loss, color=c, marker="o", ms=3, ls="--", lw=1.0, label=f"{label} validation")
        if label == ref:
            continue
        diff = [abs(p - q) for p, q in zip(r.train_loss, r0.train_loss)]
        bottom.plot(steps[:len(diff)], diff, color=c, lw=0.9 if label != other else 0.7,
                    alpha=0.9 if label != other else 0.6, label=f"|{label} - {ref}| train")
        vdiff = [abs(p - q) for p, q in zip(r.val_loss, r0.val_loss)]
        if vdiff:
            bottom.plot(r.val_steps[:len(vdiff)], vdiff, color=c, marker="o", ms=4, ls="none",
                        alpha=0.9 if label != other else 0.6, label=f"|{label} - {ref}| validation")
    bottom.axhspan(0, bound, color="tab:green", alpha=0.12, label=f"band: B = {bound:.4f} nats")
    bottom.axhline(bound, color="tab:green", lw=1.2)
    if skip:
        bottom.axvline(skip + 0.5, color="0.4", ls=":", lw=1.0, label=f"warm-up: steps 1..{skip} not in B")
    top.set_ylabel("cross-entropy (nats / byte)")
    top.set_title(title, fontsize=9)
    top.grid(alpha=0.3)
    top.legend(fontsize=7, ncol=2)
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"|loss - {ref}| (nats)")
    bottom.grid(alpha=0.3, which="both")
    bottom.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _free_stem(folder: Path, stem: str) -> Path:
    """folder/stem, or stem-2, -3, ...: the first stem none of whose .csv, .json and .png exists yet."""
    n, name = 1, stem
    while any((folder / f"{name}{ext}").exists() for ext in (".csv", ".json", ".png")):
        n += 1
        name = f"{stem}-{n}"
    return folder / name


def run_convergence(args) -> dict:
    """Runs the comparison (see the module docstring), prints the table and the checks, writes the CSV, JSON and PNG.

    Args:
        args: argparse.Namespace from `opforge.demo.parse_args` with `--convergence`.

    Returns:
        dict with `config`, `args`, `runs` (label to Result as a dict), `spread` (`seed_spread`), `checks` (label to
            `check_run`), `ok` (every check passed), `files` (the paths written) and `wall_seconds`.
    """
    t_start = time.perf_counter()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cfg = _config(args)
    batches = make_batches(args.steps, args.batch, args.seq, args.seed + 1, eval_batches=args.eval_batches)
    specs = run_specs(args.seed, args.fp8, args.dtype)
    ref, other = specs[0]["label"], specs[1]["label"]
    if not args.quiet:
        print(f"opforge demo --convergence: Llama d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} "
              f"d_ff={cfg.d_ff} ({cfg.num_parameters() / 1e6:.2f} M params), seq {args.seq}, batch {args.batch}, "
              f"{args.steps} steps, {args.dtype}, {_device_name(device)}; runs: {', '.join(s['label'] for s in specs)} "
              f"(A = init seed {args.seed}, B = {args.seed + 1}; data seed {args.seed + 1}); text: {DATA_FILE.name}; "
              f"torch {torch.__version__}, commit {_commit()}", flush=True)
    states: Dict[int, dict] = {}
    runs: Dict[str, Result] = {}
    for s in specs:
        if s["init_seed"] not in states:
            states[s["init_seed"]] = _initial_state(cfg, s["init_seed"])
        runs[s["label"]] = train_run(args, cfg, states[s["init_seed"]], batches, device, dtype, s["fp8"], s["label"])
    spread = seed_spread(runs[ref], runs[other], warmup_steps(args.steps))
    bound = spread["bound"]
    checks = {s["label"]: check_run(runs[s["label"]], runs[ref], bound) for s in specs[2:]}
    ok = all(c["ok"] for c in checks.values())

    files: Dict[str, str] = {}
    stem = _free_stem(Path(args.out), f"fp8_convergence_{device.type}")
    csv_rows = []
    for label, r in runs.items():
        r0 = runs[ref]
        for i, v in enumerate(r.train_loss):
            csv_rows.append(dict(run=label, kind="train", step=i + 1, loss=f"{v:.6f}",
                                 abs_diff_vs_ref=f"{abs(v - r0.train_loss[i]):.6f}"))
        for st, v, v0 in zip(r.val_steps, r.val_loss, r0.val_loss):
            csv_rows.append(dict(run=label, kind="val", step=st, loss=f"{v:.6f}", abs_diff_vs_ref=f"{abs(v - v0):.6f}"))
    if args.csv != "":
        csv_path = Path(args.csv.replace("<device>", device.type)) if args.csv else stem.with_suffix(".csv")
        write_csv(csv_path, csv_rows)
        files["csv"] = str(csv_path)
    title = (f"FP8 vs {args.dtype}: the demo's Llama {cfg.d_model}d x {cfg.n_layers}L, seq {args.seq}, batch {args.batch}, "
             f"{args.steps} steps, lr {args.lr:g}, {_device_name(device)}\n"
             f"B = mean |{ref} - {other}| after step {spread['skip']} = {bound:.4f} nats; torch {torch.__version__}, "
             f"commit {_commit()}")
    png = Path(args.plot.replace("<device>", device.type)) if args.plot else stem.with_suffix(".png")
    if args.plot != "" and plot_convergence(png, runs, ref, other, bound, title, spread["skip"]):
        files["png"] = str(png)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": _device_name(device),
           "torch": torch.__version__, "commit": _commit(), "config": cfg.to_dict(),
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "runs": {k: vars(v) for k, v in runs.items()}, "spread": spread, "checks": checks, "ok": ok}
    out["wall_seconds"] = time.perf_counter() - t_start
    json_path = Path(args.json) if args.json else stem.with_suffix(".json")
    files["json"] = str(json_path)
    out["files"] = files
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1))

    if not args.quiet:
        print()
        rows = [[label, f"{r.train_loss[-1]:.4f}", f"{r.val_loss[-1]:.4f}" if r.val_loss else "-",
                 f"{r.tokens_per_s:,.0f}"] for label, r in runs.items()]
        print_table(rows, ["run", "final train loss", "final val loss", "tokens/s"])
        print(f"\nseed spread |{ref} - {other}| over steps {spread['skip'] + 1}..{args.steps}: mean {spread['mean']:.4f}, "
              f"median {spread['median']:.4f}, p90 {spread['p90']:.4f}, max {spread['max']:.4f} nats")
        print(f"bound B = {spread['rule']} = {bound:.4f} nats")
        for label, c in checks.items():
            print(f"{label}: every logged loss within B of {ref}? largest |diff| {c['max_diff']:.4f} ({c['worst']}), "
                  f"mean {c['mean_diff']:.4f}, {c['over']} past B -> {'OK' if c['ok'] else 'FAILED'}")
        for k, v in files.items():
            print(f"{k}: {v}")
        print(f"opforge demo --convergence: {out['wall_seconds']:.0f}s, {'every check passed' if ok else 'a check FAILED'}")
    return out
