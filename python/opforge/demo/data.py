"""The demo's data: the bundled public-domain text as byte-level tokens, and a fixed, seeded batch order.

Lewis Carroll's *Alice's Adventures in Wonderland* (`opforge/data/alice.txt`, see `NOTICE`), one token per
byte (vocabulary 256).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

#: The bundled text (UTF-8 bytes).
DATA_FILE = Path(__file__).resolve().parents[1] / "data" / "alice.txt"

def load_text(path: Path = DATA_FILE) -> torch.Tensor:
    """The bundled text as byte-level tokens.

    Args:
        path: Path. The file. Default: the bundled `alice.txt`.

    Returns:
        `(bytes,)` int64 of values 0..255.
    """
    data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


@dataclass
class Batches:
    """Fixed, seeded data order: `train_offsets[i]` are the global batch's start offsets at step i.

    Attributes:
        tokens: `(N,)` int64. The whole text.
        train_offsets: `(steps, B)` int64. Start of each training sequence, per step.
        val_offsets: `(eval_batches, B)` int64. Start of each validation sequence, from the held-out tail.
        seq: int. Tokens per sequence.
    """

    tokens: torch.Tensor
    train_offsets: torch.Tensor  # [steps, B]
    val_offsets: torch.Tensor  # [eval_batches, B]
    seq: int

    def get(self, offsets: torch.Tensor, device) -> tuple:
        """The inputs and next-token targets of the sequences starting at `offsets`.

        Args:
            offsets: `(B,)` int64. Start offsets (a row of train_offsets or val_offsets).
            device: torch.device or str. Where the batch goes.

        Returns:
            (x, y), each `(B, seq)` int64: y is x shifted by one token.
        """
        idx = offsets[:, None] + torch.arange(self.seq + 1)[None, :]
        chunk = self.tokens[idx]
        return chunk[:, :-1].to(device), chunk[:, 1:].to(device)


def make_batches(steps: int, batch: int, seq: int, seed: int, eval_batches: int = 4, val_fraction: float = 0.1) -> Batches:
    """The run's data order: seeded random offsets into the first 90 % of the text (training) and the rest (validation).

    Args:
        steps: int. Training steps.
        batch: int. Sequences per step (the global batch).
        seq: int. Tokens per sequence.
        seed: int. Seed of the offsets' generator.
        eval_batches: int. Validation batches. Default: 4.
        val_fraction: float. The held-out tail of the text. Default: 0.1.

    Returns:
        Batches.
    """
    tokens = load_text()
    n_val = int(len(tokens) * val_fraction)
    split = len(tokens) - n_val
    g = torch.Generator().manual_seed(seed)
    train = torch.randint(0, split - seq - 1, (steps, batch), generator=g)
    val = split + torch.randint(0, n_val - seq - 1, (eval_batches, batch), generator=g)
    return Batches(tokens, train, val, seq)

