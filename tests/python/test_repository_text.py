"""Every git-tracked text file describes the code as it is, not how the project was worked on.

The scan flags text that names work periods (the word "stop" with a number), the GPU machine's runs and its loan
of time, sessions in that sense, numbered device runs, the project's own issue numbers (the word "issue" or a hash
sign with a number, unless an owner/repo precedes the hash) and AI tools or agents. References to another
project's tracker (an owner/repo and a number) are allowed. History lives in git, and measurements live in
docs/performance with their date, commit, GPU, torch version and command.

Each pattern is tested below on text it must flag and on ordinary text it must leave alone (a process or pytest
session, the word "call" alone, torch.distributed), so the scan stays precise. The examples are split into
pieces so that this file passes its own scan.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: tracked files the scan skips: a public-domain book (its prose is not ours to edit)
SKIPPED = {"python/opforge/data/alice.txt"}

#: (name, compiled pattern); each match is a hit unless an allowance below excuses it
PATTERNS: list[tuple[str, re.Pattern]] = [
    # the word stop (or stops) and a number, with a space or a hyphen between them
    ("work period", re.compile(r"\bstops?[ \t-]+\d+", re.IGNORECASE)),
    ("device-machine call", re.compile(r"(?<![Mm]eta-)\b(device|GPU)[ \t-]+calls?\b", re.IGNORECASE)),
    ("machine loan", re.compile(r"\b(leas(e|es|ed|ing)|le[n]t)\b", re.IGNORECASE)),
    # sessions in the sense of a work period (this, the next, a working one, one's device time, one of a date); not
    # a pytest, profiler or process session
    ("session", re.compile(
        r"\b(this|next|last|earlier|later|previous|every|each|one|working|helper|device|GPU)[ \t]+sessions?\b"
        r"|\ba[ \t]+session[ \t]+(without|with)\b"
        r"|\bsession'?s[ \t]+(device[ \t]+time|last|first|\d)"
        r"|\bsessions?[ \t]+of[ \t]+\d{4}-\d\d-\d\d", re.IGNORECASE)),
    # call(s) and a number, as a device run is named; not a command-line option such as --calls
    ("numbered run", re.compile(r"(?<![\w-])calls?[ \t]+(\d+|F\d)\b(?![ \t]*(times|µs|us|ms)\b)",
                                        re.IGNORECASE)),
    # run and one digit followed by punctuation or a verb of measuring; not "runs" with a count of steps
    ("numbered run", re.compile(r"(?<![\w-])[Rr]un[ \t]+\d\b(?=[ \t]*([(:,.;)]|$|(measured|ran|on|of)\b))")),
    ("issue number", re.compile(r"\bissues?[ \t_-]*#?\d+", re.IGNORECASE)),
    ("issue number", re.compile(r"(?:^|(?<=[\s(\[,;]))#\d+\b")),
    ("AI tool", re.compile(r"\b(C[l]aude|Anthro[p]ic|sub-?[a]gents?|ChatG[P]T|Co[p]ilot|Open[A]I|Code[x])\b",
                           re.IGNORECASE)),
]

#: what may stand right before a "#N" that names someone else's tracker: an owner/repo, a Gutenberg etext
PUBLIC_HASH_PREFIX = re.compile(r"([\w.-]+/[\w.-]+[ \t]?|\betext[ \t])$", re.IGNORECASE)


def line_hits(line: str) -> list[str]:
    """The names of the patterns that flag ``line`` (after the allowances), in PATTERNS order."""
    hits = []
    for name, pattern in PATTERNS:
        for m in pattern.finditer(line):
            if m.group(0).startswith("#") and PUBLIC_HASH_PREFIX.search(line[: m.start()]):
                continue
            hits.append(name)
            break
    return hits


def tracked_text_files() -> list[Path]:
    """git ls-files of the checkout, without binaries (a NUL byte or not UTF-8) and SKIPPED."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    files = []
    for rel in out.decode().split("\0"):
        if not rel or rel in SKIPPED:
            continue
        path = ROOT / rel
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def scan(files, root: Path = ROOT) -> list[str]:
    """Every hit as ``file:line:text``, the file relative to ``root``, the text cut at 160 characters."""
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line_hits(line):
                found.append(f"{path.relative_to(root)}:{number}:{line.strip()[:160]}")
    return found


FLAGGED = [
    "measured at st" "op 23 on the H200",
    "St" "ops 21–23 changed the loss",
    "the st" "op 22's figures",
    "the st" "op-20 profile",
    "two dev" "ice calls were left",
    "one GPU c" "all per kernel",
    "Dev" "ice calls of this week",
    "the le" "ase ran out",
    "the 2-GPU kind was not le" "nt",
    "measured in the next se" "ssion",
    "the se" "ssion's device time was spent",
    "Se" "ssion of 2026-12-01 (one H200)",
    "written in a se" "ssion without a GPU",
    "every earlier working se" "ssions' results",
    "ca" "ll 3 measured 94 µs",
    "ca" "lls 2 and 5 scatter",
    "(ca" "ll F3)",
    "R" "un 3 (one H200, the whole suite)",
    "in r" "un 5, forward+backward",
    "goals of is" "sue 15",
    "benchmarks/results/is" "sue13_variants.md",
    "see #" "13",
    "(#" "7)",
    "written with Cl" "aude",
    "an Anth" "ropic model",
    "a sub" "agent's report",
    "a he" "lper session",
]

ORDINARY = [
    "Each call of the op launches one kernel.",
    "a Meta-device call reports float32",
    "redraw a plot after a GPU run",
    "loads the library once for the whole session",
    "a pytest session, a profiler session, an ssh session",
    "torch.distributed with gloo on CPU ranks",
    "python benchmarks/bench_overhead.py --callgrind --calls 500",
    "median of 15 calls, 4 µs a call",
    "the benchmark runs 20 steps; it ran 3 times",
    "released under the MIT license; the release notes",
    "pytorch/pytorch#12345 and linkedin/Liger-Kernel #826 are public",
    "Project Gutenberg etext #" "11",
    "(at::TensorIteratorBase&)::{lambda()#3}",
    "the loop stops when the row ends; a stop token",
    "an issue with the driver: see the issues of transformers",
    "color: #fff; # comment",
]


@pytest.mark.parametrize("text", FLAGGED)
def test_pattern_flags_work_narration(text):
    assert line_hits(text), f"no pattern flags {text!r}"


@pytest.mark.parametrize("text", ORDINARY)
def test_pattern_leaves_ordinary_text_alone(text):
    assert not line_hits(text), f"{text!r} flagged as {line_hits(text)}"


def test_scan_finds_a_hit_in_a_file(tmp_path):
    (tmp_path / "note.md").write_text("fine line\nthe figure of st" "op 23\n", encoding="utf-8")
    assert scan([tmp_path / "note.md"], root=tmp_path) == ["note.md:2:the figure of st" "op 23"]


def test_no_tracked_file_names_how_the_project_is_worked_on():
    files = tracked_text_files()
    assert len(files) > 100, "git ls-files listed too few text files: is this a git checkout?"
    found = scan(files)
    assert not found, f"{len(found)} lines name how the project is worked on:\n" + "\n".join(found)
