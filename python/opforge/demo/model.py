"""The demo's model: named sizes, the Llama configuration built from the command line, identical initial
weights for every backend, and a CPU memory estimate (`opforge.models.llama.Llama` is the model).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..models.llama import Llama, LlamaConfig


#: Named sizes: model shape and run length. "small" is the CPU default (about two minutes on 2 cores),
#: "medium" the CUDA default, "h200" the GPU throughput shape of `--report` (keeps an H200 busy: GEMMs of
#: 16,384 x 2048 x 5504).
SIZES: Dict[str, dict] = {
    "tiny": dict(d_model=64, layers=2, heads=4, seq=64, batch=8, steps=20, lr=3e-3),
    "small": dict(d_model=128, layers=4, heads=4, seq=128, batch=8, steps=450, lr=1.5e-3),
    "medium": dict(d_model=512, layers=8, heads=8, seq=256, batch=32, steps=500, lr=6e-4),
    "h200": dict(d_model=2048, layers=8, heads=16, seq=2048, batch=8, steps=20, lr=1e-4),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (`model.module`), or `model` itself.

    Args:
        model: torch.nn.Module. A model, possibly wrapped.

    Returns:
        torch.nn.Module.
    """
    return getattr(model, "module", model)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def estimate_cpu_memory(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer_states: int = 2) -> int:
    """Bytes of the training step's peak, estimated without an allocator hook.

    Parameters + gradients + `optimizer_states` optimizer tensors per parameter (AdamW: 2) + the distinct
    storages saved for backward by one forward (counted with `torch.autograd.graph.saved_tensors_hooks`).

    Args:
        model: torch.nn.Module. The model (its `loss(x, y)` if it has one, else `model(x)`, runs once).
        x: `(B, T)` int64. Input tokens.
        y: `(B, T)` int64. Targets.
        optimizer_states: int. Optimizer tensors per parameter. Default: 2.

    Returns:
        int, bytes.
    """
    params = sum(_nbytes(p) for p in model.parameters())
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # noqa: BLE001  (e.g. a tensor subclass without storage)
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = unwrap(model).loss(x, y) if hasattr(unwrap(model), "loss") else model(x)
    del out
    return params * (2 + optimizer_states) + sum(seen.values())


def _config(args) -> LlamaConfig:
    """The LlamaConfig of the command line's sizes (byte vocabulary, 256)."""
    return LlamaConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                       max_seq_len=args.seq)


def _initial_state(cfg: LlamaConfig, seed: int) -> dict:
    """The initial weights every backend loads: a torch-backend Llama made after seeding, on the CPU."""
    torch.manual_seed(seed)
    ref = Llama(cfg, backend="torch", device="cpu")
    return {k: v.clone() for k, v in ref.state_dict().items()}




def fp8_unavailable_message(fp8: str, device: str, dtype_name: str) -> Optional[str]:
    """One line saying why `--fp8 fp8` cannot train on `device` in `dtype_name`, or None when it can.

    Runs `opforge.fp8_linear` (forward and backward) once on a `(16, 32)` input of the dtype on the device, so a
    combination that `fp8_linear` or the device's scaled GEMM refuses (e.g. a GPU without FP8 tensor cores, compute
    capability below 8.9) is told before any training.

    Args:
        fp8: str. `"tensorwise"` or `"rowwise"`.
        device: str. A torch device string.
        dtype_name: str. A key of `DTYPES`.

    Returns:
        None when it runs; else the reason, naming the option, the device and the dtype, in one line.
    """
    where = f"opforge demo: --fp8 {fp8} on {device} with --dtype {dtype_name}"
    if not hasattr(torch.ops.opforge, "fp8_linear"):
        return f"{where}: this build of the opforge library has no fp8_linear (rebuild it from this source tree)"
    from .. import functional as OF
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 32, generator=g).to(device=device, dtype=DTYPES[dtype_name]).requires_grad_()
        w = torch.randn(16, 32, generator=g).to(device=device, dtype=DTYPES[dtype_name]).requires_grad_()
        OF.fp8_linear(x, w, granularity=fp8).float().sum().backward()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001  (any refusal becomes the one-line reason)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = (" (FP8 GEMMs need a GPU of compute capability 8.9 or newer, e.g. Ada or Hopper, or the CPU)"
                if torch.device(device).type == "cuda" else "")
        return f"{where}: opforge.fp8_linear refused it: {type(e).__name__}: {first[:300]}{hint}"
    return None
