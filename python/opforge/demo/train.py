"""The demo's training loop: distributed set-up (DDP, FSDP2), one `Trainer` per model run in
lock-step, the learning-rate schedule, evaluation, and the loss-agreement rule.

Tolerances (see the `opforge.demo` docstring for their justification):
`FP32_REL_TOL` (every logged loss, fp32), `BF16_REL_TOL` (every logged loss, bf16) and
`BF16_FINAL_REL_TOL` (final validation loss, bf16).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as TF

from ..models.llama import Llama, LlamaConfig
from .data import Batches
from .model import _nbytes, estimate_cpu_memory, unwrap

#: fp32: every logged loss of the two models within this relative difference.
FP32_REL_TOL = 1e-3
#: bf16: every logged loss within this relative difference (justified in the module docstring).
BF16_REL_TOL = 5e-2
#: bf16: final validation loss within this relative difference.
BF16_FINAL_REL_TOL = 2e-2


@dataclass
class Dist:
    """The run's distributed set-up: `"none"`, `"ddp"` or `"fsdp"`, this process's rank and the world size.

    Attributes:
        parallel: str. `"none"`, `"ddp"` or `"fsdp"`.
        rank: int. This process's rank.
        world: int. The number of processes.
        local_rank: int. This process's rank on its machine (its GPU).
    """
    parallel: str = "none"
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def on(self) -> bool:
        """True under DDP or FSDP."""
        return self.parallel != "none"

    @property
    def main(self) -> bool:
        """True on rank 0, the one that reports."""
        return self.rank == 0

    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's equal share of the global batch (rows).

        Args:
            x: `(B, ...)` tensor. The global batch's rows, B divisible by the world size.

        Returns:
            `(B / world, ...)`: a view.
        """
        if not self.on:
            return x
        n = x.shape[0] // self.world
        return x[self.rank * n:(self.rank + 1) * n]

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the ranks (all-reduce), or `value` itself without a process group.

        Args:
            value: tensor. This rank's value.

        Returns:
            tensor of value's shape, detached.
        """
        if not self.on:
            return value
        import torch.distributed as dist
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world


def init_distributed(parallel: str, device_type: str) -> Dist:
    """Starts the process group for `--parallel` (nccl on CUDA, gloo on the CPU) from torchrun's environment.

    Args:
        parallel: str. `"none"`, `"ddp"` or `"fsdp"`.
        device_type: str. `"cuda"` or `"cpu"`.

    Returns:
        Dist.

    Raises:
        RuntimeError: `--parallel` without torchrun (no `RANK` in the environment).
    """
    if parallel == "none":
        return Dist()
    import torch.distributed as dist
    if "RANK" not in os.environ:
        raise RuntimeError(f"opforge demo: --parallel {parallel} needs torchrun (e.g. `torchrun --nproc_per_node=2 -m opforge.demo --parallel {parallel}`)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
            os.environ.setdefault(k, v)
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    return Dist(parallel, rank, world, local)


def wrap_parallel(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """The model wrapped for `d`: DistributedDataParallel, or FSDP2's `fully_shard` on every block and the root.

    Args:
        model: Llama. The model.
        d: Dist. The set-up.

    Returns:
        torch.nn.Module: the wrapper (DDP), or model itself (FSDP2 shards in place; none: unchanged).
    """
    if d.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        dev = next(model.parameters()).device
        return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if d.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        # The mesh's device type comes from the model: FSDP's default mesh takes CUDA whenever CUDA is
        # present, which breaks a CPU (gloo) run on a GPU machine.
        mesh = init_device_mesh(next(model.parameters()).device.type, (d.world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model



@dataclass
class Result:
    """One model's record of a run.

    Attributes:
        backend: str. `"opforge"` or `"torch"`.
        compiled: bool. Whether the model ran under torch.compile.
        train_loss: list of float. The training loss of every step.
        val_steps: list of int. The steps after which validation ran.
        val_loss: list of float. The validation losses at those steps.
        tokens_per_s: float. Tokens per second over the timed steps.
        peak_mem: int. Peak memory, bytes (see `Trainer`).
        seconds: float. Time of the timed steps.
    """
    backend: str
    compiled: bool
    train_loss: List[float] = field(default_factory=list)
    val_steps: List[int] = field(default_factory=list)
    val_loss: List[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_mem: int = 0
    seconds: float = 0.0


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up for `warmup` steps, then cosine decay to lr/10 at the last step.

    Args:
        step: int. The step, from 0.
        steps: int. The run's steps.
        lr: float. The peak learning rate.
        warmup: int. Warm-up steps (at least 1).

    Returns:
        float: the learning rate of `step`.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup - 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss_fn(forward):
    def f(x, y):
        logits = forward(x)
        return TF.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    return f


@torch.no_grad()
def evaluate(loss_fn, batches: Batches, device, d: Dist) -> float:
    """The mean validation loss over the batches' validation offsets (averaged over the ranks).

    Args:
        loss_fn: callable (x, y) -> scalar loss tensor.
        batches: Batches. The data.
        device: torch.device. Where the batches go.
        d: Dist. The set-up.

    Returns:
        float.
    """
    total = torch.zeros((), device=device)
    for offs in batches.val_offsets:
        x, y = batches.get(d.slice(offs), device)
        total += loss_fn(x, y).float()
    return float(d.mean(total / len(batches.val_offsets)))


class Trainer:
    """One model, its optimizer and its record; `step` runs one timed training step.

    Several trainers run in lock-step (step i of every model, then step i+1), so a change in the machine's
    load (a shared CPU) affects every model alike; each step is timed on its own (CUDA: synchronized).
    Memory: CUDA, the largest `max_memory_allocated` growth within one of this model's steps plus what
    the model holds between steps (parameters and optimizer state), so models sharing the GPU do not
    count each other; CPU, `estimate_cpu_memory`.

    Args:
        backend: str. `"opforge"` or `"torch"`.
        cfg: LlamaConfig. The model's shape.
        state: dict. The initial state_dict (the same for every trainer).
        batches: Batches. The data order.
        args: argparse.Namespace. The command line (lr, clip, compile scope, `fp8`: None or the FP8 granularity
            of the model's decoder projections).
        device: torch.device. Where the model trains.
        dtype: torch.dtype. Parameter and activation dtype.
        d: Dist. The distributed set-up.
        steps: int. The run's steps (for the learning-rate schedule and the timed share).
        compiled: bool. Run the model under torch.compile.
    """

    def __init__(self, backend: str, cfg: LlamaConfig, state: dict, batches: Batches, args, device: torch.device,
                 dtype, d: Dist, steps: int, compiled: bool):
        self.backend, self.batches, self.args, self.device, self.d, self.steps = backend, batches, args, device, d, steps
        # args.fp8 (--fp8): the opforge model's decoder projections in FP8 (Llama refuses it for backend="torch")
        model = Llama(cfg, backend=backend, device=device, dtype=dtype, fp8=getattr(args, "fp8", None))
        model.load_state_dict(state)
        self.cpu_peak = 0
        if device.type != "cuda":
            x0, y0 = batches.get(d.slice(batches.train_offsets[0]), device)
            self.cpu_peak = estimate_cpu_memory(model, x0, y0)
        self.model = wrap_parallel(model, d)
        # fullgraph=True proves the model compiles without graph breaks; DDP's bucketing and FSDP2's
        # hooks split graphs on purpose, so distributed runs compile without it.
        # --compile-scope blocks compiles each decoder block on its own (regional compilation: identical
        # blocks share one compiled graph, so compilation takes about one block's time).
        if compiled and getattr(args, "compile_scope", "model") == "blocks":
            for layer in unwrap(self.model).layers:
                layer.compile(fullgraph=True)
            forward = self.model
        else:
            forward = torch.compile(self.model, fullgraph=not d.on) if compiled else self.model
        self.loss_fn = _loss_fn(forward)
        fused = device.type == "cuda" and d.parallel != "fsdp"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                     **({"fused": True} if fused else {}))
        self.res = Result(backend, compiled)
        self.warmup_steps = min(3, steps // 4)  # (trainers_warmup) untimed: compilation, allocator and GEMM-algorithm warm-up
        self.lr_warmup = max(1, min(20, steps // 10))
        self.timed = 0.0
        self.step_peak = 0
        self.pending: List[torch.Tensor] = []

    def _resident(self) -> int:
        n = sum(_nbytes(p.to_local() if hasattr(p, "to_local") else p) for p in self.model.parameters())
        for st in self.opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    n += _nbytes(v.to_local() if hasattr(v, "to_local") else v)
        return n

    def step(self, i: int, record: bool = True) -> Optional[float]:
        """Runs and times one training step (learning rate, forward, backward, clipping, AdamW).

        Args:
            i: int. The step.
            record: bool. Read the loss now (one host synchronisation) and log it; False keeps it on the device
                until `finish`. Default: True.

        Returns:
            float or None: the loss (averaged over the ranks) when recorded.
        """
        dev = self.device
        for group in self.opt.param_groups:
            group["lr"] = lr_at(i, self.steps, self.args.lr, self.lr_warmup)
        x, y = self.batches.get(self.d.slice(self.batches.train_offsets[i]), dev)
        _sync(dev)
        if dev.type == "cuda":
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = self.loss_fn(x, y)
        loss.backward()
        if self.args.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(dev)
        dt = time.perf_counter() - t0
        if i >= self.warmup_steps:
            self.timed += dt
        if dev.type == "cuda":
            self.step_peak = max(self.step_peak, torch.cuda.max_memory_allocated(dev) - before)
        if record:
            lv = float(self.d.mean(loss.detach()))
            self.res.train_loss.append(lv)
            return lv
        self.pending.append(loss.detach())
        return None

    def evaluate(self, i: int) -> float:
        """Evaluates after step i and logs it.

        Args:
            i: int. The step just run.

        Returns:
            float: the validation loss.
        """
        self.res.val_steps.append(i + 1)
        self.res.val_loss.append(evaluate(self.loss_fn, self.batches, self.device, self.d))
        return self.res.val_loss[-1]

    def finish(self) -> Result:
        """The run's Result: the losses kept on the device, tokens/s over the timed steps, peak memory.

        Returns:
            Result.
        """
        r = self.res
        if self.pending:  # losses kept on the device during timed runs: read once, at the end
            r.train_loss.extend(float(self.d.mean(v)) for v in self.pending)
            self.pending.clear()
        r.seconds = self.timed
        tokens = (self.steps - self.warmup_steps) * self.batches.train_offsets.shape[1] * self.batches.seq
        r.tokens_per_s = tokens / self.timed if self.timed > 0 else 0.0
        r.peak_mem = self.step_peak + self._resident() if self.device.type == "cuda" else self.cpu_peak
        return r


def train_lockstep(trainers: List[Trainer], steps: int, eval_every: int = 0, progress: bool = True,
                   record: bool = True, desc: str = "training") -> List[Result]:
    """Trains every trainer for `steps` steps in lock-step; evaluates every `eval_every` steps and at the end.

    Args:
        trainers: list of Trainer. The models.
        steps: int. Steps each.
        eval_every: int. Steps between evaluations; 0: none. Default: 0.
        progress: bool. A progress bar (tqdm, or a line every 10 %) on rank 0. Default: True.
        record: bool. Read every step's loss at once (else at the end). Default: True.
        desc: str. The progress bar's label. Default: `"training"`.

    Returns:
        list of Result, in trainers' order.
    """
    bar = None
    if progress and trainers and trainers[0].d.main:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # no tqdm: a plain progress line every 10%
            tqdm = _PlainBar
        if not sys.stderr.isatty():  # a log file (CI, the GPU scripts): lines, not carriage-return redraws
            tqdm = _PlainBar
        bar = tqdm(total=steps, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)
    for i in range(steps):
        post = {}
        for t in trainers:
            lv = t.step(i, record)
            if lv is not None:
                post[t.backend] = f"{lv:.4f}"
        if eval_every and ((i + 1) % eval_every == 0 or i == steps - 1):
            for t in trainers:
                post[f"val {t.backend}"] = f"{t.evaluate(i):.4f}"
        if bar is not None:
            bar.set_postfix(post, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    return [t.finish() for t in trainers]


class _PlainBar:
    """What the demo uses of tqdm, printing a line every 10% (when tqdm is not installed)."""

    def __init__(self, total: int, desc: str, file, **_):
        self.total, self.desc, self.file, self.n, self.post, self.t0 = total, desc, file, 0, {}, time.perf_counter()

    def set_postfix(self, post: dict, refresh: bool = False) -> None:
        self.post = post

    def update(self, n: int) -> None:
        self.n += n
        if self.n == self.total or self.n % max(1, self.total // 10) == 0:
            print(f"{self.desc}: {self.n}/{self.total} steps, {time.perf_counter() - self.t0:.0f}s, "
                  + ", ".join(f"{k} {v}" for k, v in self.post.items()), file=self.file, flush=True)

    def close(self) -> None:
        pass


def check_agreement(a: Result, b: Result, dtype_name: str) -> dict:
    """Compares two runs' logged losses by the demo's rule (`FP32_REL_TOL`, or the two bf16 bounds).

    Args:
        a: Result. The opforge run.
        b: Result. The torch.nn run (the denominator of the relative differences).
        dtype_name: str. `"fp32"` or `"bf16"`.

    Returns:
        dict with `ok` (bool: within the rule and the same number of logged losses), `max_rel` (the largest
            relative difference) and `rule` (the rule in words).
    """
    pairs = list(zip(a.train_loss, b.train_loss)) + list(zip(a.val_loss, b.val_loss))
    rel = [abs(p - q) / max(abs(q), 1e-12) for p, q in pairs]
    max_rel = max(rel) if rel else 0.0
    if dtype_name == "fp32":
        ok = max_rel <= FP32_REL_TOL
        rule = f"every logged loss within {FP32_REL_TOL:g} relative"
    else:
        final = abs(a.val_loss[-1] - b.val_loss[-1]) / abs(b.val_loss[-1]) if a.val_loss else 0.0
        ok = max_rel <= BF16_REL_TOL and final <= BF16_FINAL_REL_TOL
        rule = f"every logged loss within {BF16_REL_TOL:g} relative, final validation loss within {BF16_FINAL_REL_TOL:g}"
    return {"ok": bool(ok and len(a.train_loss) == len(b.train_loss)), "max_rel": max_rel, "rule": rule}



def trainers_warmup(args) -> int:
    """Untimed warm-up steps of a run of `args.steps` steps (see `Trainer`).

    Args:
        args: argparse.Namespace with `steps`.

    Returns:
        int: min(3, steps // 4).
    """
    return min(3, args.steps // 4)


class _threads:
    """Context manager: torch.set_num_threads(n) inside (n = 0: unchanged), restored on exit."""

    def __init__(self, n: int):
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self):
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)

