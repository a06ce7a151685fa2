"""The demo's output: tables, CSV rows, loss-curve PNGs, and names that never silently replace a file."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import torch

from .train import Result

def _fmt_mem(n: int) -> str:
    """n bytes in MiB, e.g. `53.5 MiB`."""
    return f"{n / 2**20:,.1f} MiB"


def _commit() -> str:
    """Short commit of this source tree: $OPFORGE_GIT_COMMIT if set (a copy without .git), else git's."""
    if os.environ.get("OPFORGE_GIT_COMMIT"):
        return os.environ["OPFORGE_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def _device_name(device: torch.device) -> str:
    """The device as the banner and the CSV name it: the GPU's name, or `cpu (N threads)` (`1 thread`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'' if n == 1 else 's'})"


def write_csv(path: Path, rows: List[dict]) -> None:
    """Appends `rows` to the CSV at `path` (its header first when the file is new).

    Args:
        path: Path. The CSV; its folder is made if needed.
        rows: list of dict. One row each, all with the same keys (the columns).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        if new:
            w.writeheader()
        w.writerows(rows)


def pyplot(what: str):
    """matplotlib.pyplot on the Agg backend (files only), or None with "(no <what>: matplotlib is not installed;
    pip install matplotlib)" on stderr."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no {what}: matplotlib is not installed; pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def plot(path: Path, results: List[Result], title: str) -> bool:
    """Draws the results' loss curves (train every step, validation at its steps) into the PNG `path`.

    Args:
        path: Path. The PNG; its folder is made if needed.
        results: list of Result. The runs.
        title: str. The plot's title.

    Returns:
        bool: False (and a note on stderr) when matplotlib is not installed.
    """
    plt = pyplot("loss-curve PNG")
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colors = {"opforge": "tab:red", "torch": "tab:blue"}
    for r in results:
        st = dict(color=colors.get(r.backend), lw=1.6 if r.backend == "opforge" else 1.0,
                  ls=(":" if r.compiled else "-") if r.backend == "opforge" else ("-." if r.compiled else "--"))
        name = r.backend + (" compiled" if r.compiled else "")
        ax.plot(range(1, len(r.train_loss) + 1), r.train_loss, label=f"{name} train", alpha=0.85, **st)
        if r.val_loss:
            ax.plot(r.val_steps, r.val_loss, marker="o", ms=3, label=f"{name} validation", **{**st, "alpha": 1.0})
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def print_table(rows: List[List[str]], header: List[str]) -> None:
    """Prints `rows` under `header` in left-aligned columns.

    Args:
        rows: list of lists of str. The cells.
        header: list of str. The column names.
    """
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))




def unique_path(path: Path) -> Path:
    """`path` if no file has that name yet, else the first free `<stem>-2<suffix>`, `-3`, ...

    Args:
        path: Path. The wanted file name.

    Returns:
        A path in the same folder that does not exist yet (so a new run never replaces an older file).
    """
    path = Path(path)
    if not path.exists():
        return path
    n = 2
    while (path.parent / f"{path.stem}-{n}{path.suffix}").exists():
        n += 1
    return path.parent / f"{path.stem}-{n}{path.suffix}"
