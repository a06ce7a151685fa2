"""PatchReport: what opforge.patch.apply did."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

@dataclass
class PatchReport:
    """What `apply` did.

    Attributes:
        patched: (qualified name, old class name, new class name / what) for each module patched.
        skipped: (qualified name, class name, reason) for each module that looked patchable, or that opforge
            has no op for (LayerNorm, GPT-2's Conv1D, non-SiLU MLPs, unrecognised norms), left unchanged.
        notes: free-text remarks (e.g. an op not built in this library, so a fallback is used).
    """

    patched: List[Tuple[str, str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str, str]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when something was patched and nothing was skipped."""
        return bool(self.patched) and not self.skipped

    def counts(self) -> dict:
        """{"OldClass -> NewClass": count} over the patched modules."""
        out: dict = {}
        for _, old, new in self.patched:
            key = f"{old} -> {new}"
            out[key] = out.get(key, 0) + 1
        return out

    def __str__(self) -> str:
        lines = [f"opforge.patch: patched {len(self.patched)} module(s), could not patch {len(self.skipped)}"]
        for key, n in sorted(self.counts().items()):
            lines.append(f"  patched {n:4d} x {key}")
        for name, cls, reason in self.skipped:
            lines.append(f"  not patched: {name or '<root>'} ({cls}): {reason}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)
