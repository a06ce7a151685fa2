"""`python -m opforge demo` / `python -m opforge.demo`: the command line, the training run and the
`--report` throughput mode (see `opforge.demo` for what the demo shows)."""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..models.llama import BACKENDS
from . import __doc__ as _DEMO_DOC
from .data import DATA_FILE, make_batches
from .model import DTYPES, SIZES, _config, _initial_state, fp8_unavailable_message
from .report import _commit, _device_name, _fmt_mem, plot, print_table, unique_path, write_csv
from .convergence import CPU_DEFAULTS, CPU_STEPS, CUDA_DEFAULTS, CUDA_STEPS, GRANULARITIES as FP8_GRANULARITIES, run_convergence
from .train import Dist, Result, Trainer, _threads, check_agreement, init_distributed, train_lockstep, trainers_warmup, unwrap

def run(args) -> dict:
    """Trains the opforge and the torch.nn model side by side as `args` says, and reports the run.

    Prints the banner, the progress, the table, the agreement, the loss-curve PNG's path and a sample (unless
    `--quiet`); writes the CSV and JSON asked for. Under `--parallel ddp|fsdp` every rank trains its slice and
    rank 0 reports.

    Args:
        args: argparse.Namespace from `parse_args`.

    Returns:
        dict with `config`, `args`, `world`, `results` (per backend: losses, tokens/s, peak memory, seconds),
            `agreement` (`check_agreement` of the two runs, when both ran), `sample` and `wall_seconds`.

    Raises:
        ValueError: `--batch` not divisible by the world size.
        RuntimeError: `--parallel` without torchrun.
    """
    t_start = time.perf_counter()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    d = init_distributed(args.parallel, device.type)
    if d.on and device.type == "cuda":
        device = torch.device("cuda", d.local_rank)
    try:
        if args.batch % d.world:
            raise ValueError(f"opforge demo: expected --batch divisible by the world size {d.world}, but got {args.batch}")
        cfg = _config(args)
        state = _initial_state(cfg, args.seed)
        batches = make_batches(args.steps, args.batch, args.seq, args.seed + 1, eval_batches=args.eval_batches)
        eval_every = args.eval_every or max(1, args.steps // 5)
        if d.main and not args.quiet:
            print(f"opforge demo: Llama d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} d_ff={cfg.d_ff} "
                  f"({cfg.num_parameters() / 1e6:.2f} M params), seq {args.seq}, global batch {args.batch}, {args.steps} steps, "
                  f"{args.dtype}{f', FP8 {args.fp8} projections' if args.fp8 else ''}, {_device_name(device)}"
                  f"{', compiled' if args.compile else ''}"
                  f"{f', {d.parallel} x{d.world}' if d.on else ''}; text: {DATA_FILE.name} ({len(batches.tokens):,} bytes)")
        torch.manual_seed(args.seed)
        trainers = [Trainer(b, cfg, state, batches, args, device, dtype, d, args.steps, bool(args.compile))
                    for b in args.backends]
        results: Dict[str, Result] = {t.backend: r for t, r in zip(trainers, train_lockstep(
            trainers, args.steps, eval_every=eval_every, progress=not args.quiet,
            desc=" + ".join(args.backends) + (" (compiled)" if args.compile else "")))}
        opforge_model = next((unwrap(t.model) for t in trainers if t.backend == "opforge"), None)
        out = {"config": cfg.to_dict(), "args": {k: v for k, v in vars(args).items() if k != "func"}, "world": d.world,
               "results": {k: vars(v) for k, v in results.items()}}
        if "opforge" in results and "torch" in results:
            out["agreement"] = check_agreement(results["opforge"], results["torch"], args.dtype)
        sample = None
        if opforge_model is not None and args.sample_bytes > 0:
            g = torch.Generator().manual_seed(args.seed)
            prompt = torch.tensor(list(b"Alice "), dtype=torch.long, device=device)
            was = opforge_model.training
            opforge_model.eval()
            seq = opforge_model.generate(prompt, args.sample_bytes, generator=g)
            opforge_model.train(was)
            sample = bytes(seq.tolist()).decode("utf-8", errors="replace")
            out["sample"] = sample
        out["wall_seconds"] = time.perf_counter() - t_start
        if d.main:
            _report_training(out, results, args, device, d, sample)
        return out
    finally:
        if d.on:
            import torch.distributed as dist
            if sys.exc_info()[0] is None:
                dist.barrier()  # every rank past its last collective before the process group is torn down
            dist.destroy_process_group()



def _report_training(out: dict, results: Dict[str, Result], args, device, d: Dist, sample: Optional[str]) -> None:
    """Prints the table, agreement, plot path and sample of a training run; writes its CSV and JSON."""
    mem_label = ("cuda: max_memory_allocated growth in a step + params + AdamW state" if device.type == "cuda"
                 else "cpu estimate: params+grads+AdamW state+saved activations")
    rows = []
    base = results.get("torch")
    fp8 = f" fp8 {args.fp8}" if getattr(args, "fp8", None) else ""
    for name, r in results.items():
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and base.tokens_per_s else "-"
        rows.append([name + (fp8 if name == "opforge" else "") + (" (compiled)" if r.compiled else ""), f"{r.train_loss[-1]:.4f}",
                     f"{r.val_loss[-1]:.4f}" if r.val_loss else "-", f"{r.tokens_per_s:,.0f}", ratio, _fmt_mem(r.peak_mem)])
    if not args.quiet:
        print()
        print_table(rows, ["model", "train loss", "val loss", "tokens/s", "vs torch.nn", "peak memory"])
        print(f"(peak memory: {mem_label}; tokens/s: every step after the first {trainers_warmup(args)}, each model's steps timed on their own)")
        if "agreement" in out:
            a = out["agreement"]
            print(f"\nloss agreement ({args.dtype}: {a['rule']}): max relative difference {a['max_rel']:.2e} -> "
                  f"{'OK' if a['ok'] else 'MISMATCH'}")
    tag = device.type
    if args.plot:
        png = Path(args.plot) if args.plot_given else unique_path(Path(args.plot))
        title = (f"opforge vs torch.nn Llama, {out['config']['d_model']}d x {out['config']['n_layers']}L, seq {args.seq}, "
                 f"batch {args.batch}, {args.dtype}, {_device_name(device)}")
        existed = png.exists()
        if plot(png, list(results.values()), title) and not args.quiet:
            print(f"loss curves: {png.resolve()}{' (replaced the earlier file)' if existed else ''}")
    if args.csv:
        now = datetime.datetime.now().isoformat(timespec="seconds")
        rows = [dict(date=now, mode="train", device=_device_name(device), torch=torch.__version__, commit=_commit(),
                     backend=r.backend + (fp8 if r.backend == "opforge" else ""), compiled=r.compiled, dtype=args.dtype,
                     d_model=args.d_model, layers=args.layers, seq=args.seq, batch=args.batch, steps=args.steps,
                     world=d.world, parallel=d.parallel,
                     final_train_loss=round(r.train_loss[-1], 5), final_val_loss=round(r.val_loss[-1], 5) if r.val_loss else "",
                     tokens_per_s=round(r.tokens_per_s, 1), peak_mem_bytes=r.peak_mem, peak_mem_kind=mem_label)
                for r in results.values()]
        path = Path(args.csv.replace("<device>", tag))
        write_csv(path, rows)
        if not args.quiet:
            print(f"numbers: {path}")
    if sample is not None and not args.quiet:
        print("\nsample from the opforge model:\n" + "-" * 60 + "\n" + sample + "\n" + "-" * 60)
    if not args.quiet:
        models = "both models" if len(results) == 2 else f"{len(results)} model{'s' if len(results) > 1 else ''}"
        print(f"opforge demo: {out['wall_seconds']:.0f}s ({models}, {args.steps} steps each, evaluations and sample)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def report(args) -> dict:
    """Throughput mode: tokens/s of each (backend, eager|compiled) pair from short timed training runs.

    The same model on the same batches for every pair; prints a table, appends CSV rows and draws the loss curves.

    Args:
        args: argparse.Namespace from `parse_args` with `--report`.

    Returns:
        dict with `results` (one per run), `failures` (runs that raised, with the reason) and `agreement`
            (opforge against torch.nn, eager and compiled).

    Raises:
        SystemExit: a device other than CUDA (without the hidden `--allow-cpu-report`).
    """
    device = torch.device(args.device)
    if device.type != "cuda" and not args.allow_cpu_report:
        raise SystemExit("opforge demo --report: needs a CUDA device (pass --device cuda), or --allow-cpu-report to try it on the CPU")
    t_start = time.perf_counter()
    dtype = DTYPES[args.dtype]
    cfg = _config(args)
    state = _initial_state(cfg, args.seed)
    batches = make_batches(args.steps, args.batch, args.seq, args.seed + 1, eval_batches=1)
    d = Dist()
    warm = trainers_warmup(args)
    print(f"opforge demo --report: Llama d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads} d_ff={cfg.d_ff} "
          f"({cfg.num_parameters() / 1e6:,.1f} M params), seq {args.seq}, batch {args.batch} "
          f"({args.seq * args.batch:,} tokens a step), {args.dtype}, AdamW, {args.steps} steps (first {warm} untimed), "
          f"compile scope {args.compile_scope}, {_device_name(device)}, torch {torch.__version__}, commit {_commit()}",
          flush=True)
    results: List[Result] = []
    failures: List[str] = []
    for compiled in [m == "compiled" for m in args.modes]:
        for backend in args.backends:
            name = f"{backend} {'compiled' if compiled else 'eager'}"
            torch.manual_seed(args.seed)
            if compiled:
                torch._dynamo.reset()
            t0 = time.perf_counter()
            t = None
            try:
                t = Trainer(backend, cfg, state, batches, args, device, dtype, d, args.steps, compiled)
                res = train_lockstep([t], args.steps, progress=not args.quiet, record=False, desc=name)[0]
            except Exception as e:  # noqa: BLE001  (one failing run must not lose the others' numbers)
                import traceback
                traceback.print_exc()
                failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
                print(f"  {name}: FAILED ({failures[-1]})", flush=True)
            else:
                wall = time.perf_counter() - t0
                print(f"  {name}: {res.tokens_per_s:,.0f} tokens/s; {wall:.1f}s wall, of which {wall - res.seconds:.1f}s "
                      f"untimed (setup, warm-up steps{', compilation' if compiled else ''})", flush=True)
                results.append(res)
            del t
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    ref = {r.compiled: r for r in results if r.backend == "torch"}
    ours = {r.compiled: r for r in results if r.backend == "opforge"}
    agreement = {c: check_agreement(ours[c], ref[c], args.dtype) for c in ours if c in ref}
    rows = []
    for r in results:
        rows.append([r.backend + (" compiled" if r.compiled else " eager"), f"{r.tokens_per_s:,.0f}",
                     f"{r.tokens_per_s / ref[False].tokens_per_s:.2f}x" if ref.get(False) and ref[False].tokens_per_s else "-",
                     f"{r.tokens_per_s / ref[True].tokens_per_s:.2f}x" if ref.get(True) and ref[True].tokens_per_s else "-",
                     f"{1e3 * r.seconds / max(1, args.steps - warm):.1f}", _fmt_mem(r.peak_mem), f"{r.train_loss[-1]:.4f}"])
    print()
    print_table(rows, ["model", "tokens/s", "vs torch eager", "vs torch compiled", "ms/step", "peak memory", "last loss"])
    for f in failures:
        print(f"FAILED: {f}")
    for c, a in agreement.items():
        print(f"loss agreement, {'compiled' if c else 'eager'} opforge vs torch.nn ({args.dtype}: {a['rule']}): "
              f"max relative difference {a['max_rel']:.2e} -> {'OK' if a['ok'] else 'MISMATCH'}")
    mem_kind = ("cuda max_memory_allocated step growth + params + AdamW state" if device.type == "cuda"
                else "cpu estimate: params+grads+AdamW state+saved activations")
    if args.csv and results:
        now = datetime.datetime.now().isoformat(timespec="seconds")
        path = Path(args.csv.replace("<device>", device.type))
        write_csv(path, [
            dict(date=now, mode="report", device=_device_name(device), torch=torch.__version__, commit=_commit(),
                 backend=r.backend, compiled=r.compiled, dtype=args.dtype, d_model=args.d_model, layers=args.layers,
                 seq=args.seq, batch=args.batch, steps=args.steps, timed_steps=args.steps - warm, world=1,
                 parallel="none", compile_scope=args.compile_scope if r.compiled else "",
                 final_train_loss=round(r.train_loss[-1], 5), tokens_per_s=round(r.tokens_per_s, 1),
                 tokens_per_s_vs_torch_same_mode=round(r.tokens_per_s / ref[r.compiled].tokens_per_s, 4)
                 if ref.get(r.compiled) and ref[r.compiled].tokens_per_s else "",
                 max_rel_loss_diff_vs_torch=f"{agreement[r.compiled]['max_rel']:.3e}" if r.compiled in agreement else "",
                 peak_mem_bytes=r.peak_mem, peak_mem_kind=mem_kind)
            for r in results])
        print(f"numbers: {path}")
        if args.plot:
            png = Path(args.plot) if args.plot_given else unique_path(path.with_suffix(".png"))
            title = (f"opforge vs torch.nn Llama, {cfg.d_model}d x {cfg.n_layers}L, seq {args.seq}, batch {args.batch}, "
                     f"{args.dtype}, {_device_name(device)}")
            if plot(png, results, title):
                print(f"loss curves: {png}")
    print(f"report: {time.perf_counter() - t_start:.0f}s in all", flush=True)
    return {"results": [vars(r) for r in results], "failures": failures,
            "agreement": {("compiled" if c else "eager"): a for c, a in agreement.items()}}



def build_parser(prog: str = "python -m opforge demo") -> argparse.ArgumentParser:
    """The demo's argument parser (`--help` lists the sizes and examples).

    Args:
        prog: str. The program name in the usage line. Default: `"python -m opforge demo"`.

    Returns:
        argparse.ArgumentParser.
    """
    sizes = "\n".join(f"  {k:7s} " + ", ".join(f"{a}={v}" for a, v in kv.items()) for k, kv in SIZES.items())
    p = argparse.ArgumentParser(prog=prog, description=_DEMO_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"sizes (--d-model etc. override them):\n{sizes}\n\nexamples:\n"
                                       f"  {prog}                      # CPU: about 1.5 to 2 minutes\n"
                                       f"  {prog} --size tiny          # CPU: about 10 seconds\n"
                                       f"  {prog} --device cuda --compile\n"
                                       f"  {prog} --report --device cuda   # GPU tokens/s table, bf16, size h200\n"
                                       f"  {prog} --size tiny --fp8 tensorwise   # the opforge model's projections in FP8\n"
                                       f"  {prog} --convergence        # FP8 against bf16 (CPU: size tiny, {CPU_STEPS} steps, lr 1e-3)\n"
                                       f"  {prog} --convergence --device cuda   # size h200, {CUDA_STEPS} steps\n"
                                       "  torchrun --nproc_per_node=2 -m opforge.demo --parallel fsdp")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="named size (default: small on CPU, medium on CUDA, h200 with --report)")
    p.add_argument("--d-model", type=int, help="hidden size D")
    p.add_argument("--layers", type=int, help="decoder blocks")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--seq", type=int, help="sequence length in bytes")
    p.add_argument("--batch", type=int, help="global batch (sequences per step, split across ranks)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float, help="peak AdamW learning rate")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping, 0 for none (default 1.0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="parameter and activation dtype (default fp32; bf16 with --report)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--compile", action="store_true", help="torch.compile(model, fullgraph=True) both models")
    p.add_argument("--compile-scope", choices=["model", "blocks"], default="model",
                   help="what --compile and --report's compiled runs compile: the whole model with fullgraph=True "
                        "(default), or each decoder block on its own (regional compilation: compiles in about one "
                        "block's time)")
    p.add_argument("--parallel", choices=["none", "ddp", "fsdp"], default="none", help="under torchrun: DDP or FSDP2")
    p.add_argument("--report", action="store_true", help="GPU throughput table: eager and compiled, both backends")
    p.add_argument("--modes", default="eager,compiled", help="with --report: comma-separated subset of eager,compiled")
    p.add_argument("--allow-cpu-report", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backends", default=None,
                   help="comma-separated subset of opforge,torch (default: both; opforge alone with --fp8 or "
                        "--convergence)")
    p.add_argument("--fp8", choices=["tensorwise", "rowwise"], default=None,
                   help="the opforge model's decoder projections (attention q/k/v and o, MLP gate/up and down) in FP8 "
                        "through opforge.nn.Linear(fp8=...): FP8 GEMMs with current scaling of that granularity; the "
                        "embedding, norms, lm_head and loss keep --dtype. Trains the opforge model alone. With "
                        "--convergence: only that granularity (default: both)")
    p.add_argument("--convergence", action="store_true",
                   help="FP8 against bf16: bf16 runs from two init seeds (their spread gives the bound), FP8 "
                        "tensorwise and rowwise from the first seed, the same batches; checks every logged FP8 loss "
                        "against the bound, writes <out>/fp8_convergence_<device>.csv/.json/.png; exit status 1 if a "
                        "check fails (default size: tiny on the CPU, h200 on CUDA; see opforge.demo.convergence)")
    p.add_argument("--out", default=".", help="folder of the default output files (default: the current directory; "
                                              "the recorded runs use benchmarks/results)")
    p.add_argument("--plot", default=None,
                   help="PNG of the loss curves, '' for none (default <out>/opforge_demo_<device>.png, or -2, -3, ... "
                        "appended when that name is taken: a run never silently replaces an earlier plot)")
    p.add_argument("--csv", default=None,
                   help="CSV the numbers are appended to, '' for none (default: none when training; with --report "
                        "<out>/llama_report_<device>.csv, with the loss-curve PNG beside it)")
    p.add_argument("--json", default="", help="write all results (losses per step) as JSON here")
    p.add_argument("--eval-every", type=int, default=0, help="steps between validation evals (default: steps/5)")
    p.add_argument("--eval-batches", type=int, default=4, help="validation batches per eval")
    p.add_argument("--sample-bytes", type=int, default=300, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for the tiny and small sizes on the CPU, whose 128-wide matrices gain "
                        "little from more and slow down badly on a shared machine; else torch's)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, table or sample")
    return p


def parse_args(argv=None, prog: str = "python -m opforge demo"):
    """The command line, with every default filled in from the device, `--size` and `--report`.

    Args:
        argv: list of str or None. The arguments; None: `sys.argv[1:]`. Default: None.
        prog: str. The program name in messages. Default: `"python -m opforge demo"`.

    Returns:
        argparse.Namespace with the size's fields, dtype, threads, backends and modes as lists, and the plot and
            CSV paths resolved.

    Raises:
        SystemExit: an unknown `--modes` or `--backends` entry; `--fp8` or `--convergence` with `--report`, or with
            the torch backend in `--backends` (or argparse's own errors).
    """
    args = build_parser(prog).parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.report and (args.fp8 or args.convergence):
        raise SystemExit(f"opforge demo: --report compares the opforge and torch.nn models' throughput; expected no "
                         f"{'--fp8' if args.fp8 else '--convergence'} with it (run --convergence for FP8)")
    if args.backends is None:
        args.backends = "opforge" if args.fp8 or args.convergence else "opforge,torch"
    elif (args.fp8 or args.convergence) and "torch" in [b.strip() for b in args.backends.split(",")]:
        raise SystemExit(f"opforge demo: {'--convergence' if args.convergence else f'--fp8 {args.fp8}'} trains the "
                         f"opforge model only (FP8 projections are opforge.nn.Linear(fp8=...); the torch.nn model has "
                         f"none), but got --backends {args.backends}: leave out --backends or pass --backends opforge")
    if args.convergence and args.parallel != "none":
        raise SystemExit(f"opforge demo: --convergence trains on one device, but got --parallel {args.parallel}")
    if args.convergence and args.size is None:  # its own defaults: size, steps and learning rate
        conv = CUDA_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
        for k, v in conv.items():
            if getattr(args, k, None) is None:
                setattr(args, k, v)
    if args.size is None:
        args.size = "h200" if args.report else ("medium" if args.device.startswith("cuda") else "small")
    for k, v in SIZES[args.size].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.dtype is None:
        args.dtype = "bf16" if args.report or args.convergence else "fp32"
    if args.threads is None:
        args.threads = 1 if args.device == "cpu" and args.size in ("tiny", "small") and args.d_model <= 256 else 0
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("eager", "compiled") for m in args.modes):
        raise SystemExit(f"opforge demo: expected --modes from eager,compiled, but got {args.modes}")
    for b in args.backends:
        if b not in BACKENDS:
            raise SystemExit(f"opforge demo: expected --backends from {BACKENDS}, but got {b!r}")
    args.plot_given = args.plot is not None
    if args.convergence:  # None: the convergence run's own names in --out (opforge.demo.convergence)
        return args
    if args.plot is None:
        args.plot = "" if args.report else str(Path(args.out) / "opforge_demo_<device>.png")
        if args.report:
            args.plot = "<beside the csv>"
    if args.plot and not args.report:
        args.plot = args.plot.replace("<device>", args.device.split(":")[0])
    if args.csv is None:
        args.csv = str(Path(args.out) / "llama_report_<device>.csv") if args.report else ""
    return args


def cuda_unavailable_message(device: str) -> Optional[str]:
    """One line saying why `device` (e.g. "cuda", "cuda:1") cannot be used here, or None when it can.

    Args:
        device: str. A torch device string.

    Returns:
        None for a usable device; else the reason and what to do, in one line.
    """
    if not device.startswith("cuda"):
        return None
    if torch.version.cuda is None:
        return (f"opforge demo: --device {device} needs a CUDA build of torch, but torch {torch.__version__} is a "
                "CPU-only build: run with --device cpu (or install a CUDA torch; `python -m opforge doctor` checks)")
    if not torch.cuda.is_available():
        return (f"opforge demo: --device {device}: torch {torch.__version__} sees no CUDA device (no GPU or no driver): "
                "run with --device cpu (`python -m opforge doctor` explains)")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        return f"opforge demo: --device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def main(argv=None, prog: str = "python -m opforge demo") -> int:
    """Entry point of `python -m opforge demo`.

    Args:
        argv: list of str or None. The arguments; None: `sys.argv[1:]`. Default: None.
        prog: str. The program name in messages. Default: `"python -m opforge demo"`.

    Returns:
        The exit status: 0 when the run passed, 1 if the loss curves disagree (or a `--report` run failed, or a
            `--convergence` check failed), 2 for a device this machine does not have or an `--fp8` that cannot run
            on it (one line on stderr says why).
    """
    args = parse_args(argv, prog)
    reason = cuda_unavailable_message(args.device)
    with _threads(args.threads):
        if not reason and (args.fp8 or args.convergence):
            for g in [args.fp8] if args.fp8 else list(FP8_GRANULARITIES):
                reason = reason or fp8_unavailable_message(g, args.device, args.dtype)
        if reason:
            print(reason, file=sys.stderr)
            return 2
        if args.convergence:
            return 0 if run_convergence(args)["ok"] else 1
        if args.report:
            out = report(args)
            return 0 if not out["failures"] and all(a["ok"] for a in out["agreement"].values()) else 1
        out = run(args)
    agreement = out.get("agreement")
    return 0 if agreement is None or agreement["ok"] else 1
