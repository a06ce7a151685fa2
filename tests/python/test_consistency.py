"""Every public schema of csrc/library.cpp comes with all its pieces (docs/adding_an_op.md, "Checklist").

A schema is public unless its name starts with ``_`` (a private forward) or ends with ``_backward`` (a backward
op, tested through its forward's conformance entry). For each public op this test wants:

1. a functional wrapper ``opforge.functional.<op>``, listed in its ``__all__`` and exported as ``opforge.<op>``;
2. a C++ declaration ``<op>(`` in include/opforge/opforge.h;
3. a float64 reference ``opforge.testing.<op>_reference``, listed in its ``__all__``;
4. a conformance entry ``OpEntry(name="<op>", ...)`` in tests/python/conformance.py;
5. a docs entry: docs/ops/<op>.md, or a Markdown heading naming the op (as a word, backticks optional) in a page
   under docs/ops/ (the family's page: "# rms_norm and fused_add_rms_norm" in docs/ops/rms_norm.md covers both);
6. a benchmark: a benchmarks/bench_*.py that names the op (benchmarks/bench_<op>.py, or the family's script).

Each missing piece is its own failing case whose message says which file to edit and what to add.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import opforge
import opforge.functional
import opforge.testing
from conformance import ENTRIES

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "csrc" / "library.cpp"
HEADER = ROOT / "include" / "opforge" / "opforge.h"
FUNCTIONAL = ROOT / "python" / "opforge" / "functional.py"
TESTING = ROOT / "python" / "opforge" / "testing.py"
CONFORMANCE = ROOT / "tests" / "python" / "conformance.py"
DOCS = ROOT / "docs" / "ops"
BENCHMARKS = ROOT / "benchmarks"
GUIDE = "docs/adding_an_op.md"

_DEF = re.compile(r'm\.def\(\s*"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\.[A-Za-z0-9_]+)?\(')


def schemas():
    """[(name, line number)] of every m.def in csrc/library.cpp."""
    out = []
    for i, line in enumerate(LIBRARY.read_text().splitlines(), 1):
        m = _DEF.search(line)
        if m:
            out.append((m.group("name"), i))
    return out


def is_public(name: str) -> bool:
    return not name.startswith("_") and not name.endswith("_backward")


PUBLIC = [(n, line) for n, line in schemas() if is_public(n)]
CHECKS = ["functional", "cpp_declaration", "reference", "conformance_entry", "docs", "benchmark"]

# Pieces known to be missing on main, each with the one who adds it. strict: once the piece exists, the xfail
# turns into a failure, so the entry here is removed with it.
KNOWN_GAPS: dict = {}


def _line_of(path: Path, pattern: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if re.search(pattern, line):
            return i
    return 1


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _missing(op: str, line: int, check: str):
    """None when `op` has the piece `check`, else the message saying where to add it."""
    where = f"opforge::{op} (csrc/library.cpp:{line})"
    if check == "functional":
        f = getattr(opforge.functional, op, None)
        if f is None or op not in opforge.functional.__all__:
            return (f"{where} has no functional wrapper: add `def {op}(...)` with its full docstring to "
                    f"{_rel(FUNCTIONAL)} (calling torch.ops.opforge.{op}) and list \"{op}\" in its __all__ "
                    f"({_rel(FUNCTIONAL)}:{_line_of(FUNCTIONAL, r'^__all__')}). See {GUIDE}, checklist item 5.")
        if getattr(opforge, op, None) is not f:
            return (f"{where}: opforge.{op} is not the functional wrapper: export it in python/opforge/__init__.py "
                    f"(`from .functional import {op}`). See {GUIDE}, checklist item 5.")
        if not (f.__doc__ or "").strip():
            return f"{where}: opforge.functional.{op} has no docstring (DESIGN.md §4). See {GUIDE}, checklist item 5."
        return None
    if check == "cpp_declaration":
        if re.search(rf"\b{op}\s*\(", HEADER.read_text()):
            return None
        return (f"{where} has no C++ declaration: add `/// <what it computes, shapes, dtypes>` and "
                f"`at::Tensor {op}(...);` inside namespace opforge in {_rel(HEADER)} (before "
                f"{_rel(HEADER)}:{_line_of(HEADER, r'}  // namespace opforge')}), defined in csrc/ops/<family>/"
                f"<family>.cpp through typed_op. See {GUIDE}, checklist item 2.")
    if check == "reference":
        name = f"{op}_reference"
        if hasattr(opforge.testing, name) and name in opforge.testing.__all__:
            return None
        return (f"{where} has no float64 reference: add `def {name}(...)` (the readable eager math in float64, "
                f"op's signature) to {_rel(TESTING)} and list \"{name}\" in its __all__ "
                f"({_rel(TESTING)}:{_line_of(TESTING, r'^__all__')}). See {GUIDE}, checklist item 6.")
    if check == "conformance_entry":
        if any(e.name == op for e in ENTRIES):
            return None
        marker = _line_of(CONFORMANCE, r"entries of the ops added in parallel")
        return (f"{where} has no conformance entry: append `ENTRIES.append(OpEntry(name=\"{op}\", op=F.{op}, "
                f"reference=T.{op}_reference, ...))` with its sample generator and >= 10 bad inputs at the end of "
                f"{_rel(CONFORMANCE)} (after line {marker}; its docstring shows the block). See {GUIDE}, checklist item 7.")
    if check == "docs":
        heading = re.compile(rf"^#+ .*(?<![A-Za-z0-9_]){op}(?![A-Za-z0-9_])", re.M)
        if (DOCS / f"{op}.md").is_file() or (
                DOCS.is_dir() and any(heading.search(p.read_text()) for p in sorted(DOCS.glob("*.md")))):
            return None
        return (f"{where} has no docs entry: add a page docs/ops/{op}.md (or a heading naming {op} in its family's "
                f"page under docs/ops/, e.g. \"## {op}\") with its formula, shapes, dtypes, gradients, autocast "
                f"policy and limits. See {GUIDE}, checklist item 8.")
    if check == "benchmark":
        word = re.compile(rf"\b{op}\b")
        if any(word.search(p.read_text()) for p in sorted(BENCHMARKS.glob("bench_*.py"))):
            return None
        return (f"{where} has no benchmark: add benchmarks/bench_{op}.py on benchmarks/common.py (or a case in "
                f"its family's benchmarks/bench_<family>.py) that times opforge.{op} against torch's "
                f"composition. See {GUIDE}, checklist item 9.")
    raise ValueError(check)


def _params():
    out = []
    for op, line in PUBLIC:
        for check in CHECKS:
            marks = []
            if (op, check) in KNOWN_GAPS:
                marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[(op, check)])]
            out.append(pytest.param(op, line, check, marks=marks, id=f"{op}-{check}"))
    return out


@pytest.mark.parametrize("op,line,check", _params())
def test_public_op_has(op, line, check):
    msg = _missing(op, line, check)
    assert msg is None, msg


def test_library_parses():
    names = [n for n, _ in schemas()]
    assert len(names) >= 7 and "linear" in names and "rms_norm_backward" in names, names
    assert len(set(names)) == len(names), "a schema is defined twice in csrc/library.cpp"


def test_every_schema_has_its_comment_line():
    lines = LIBRARY.read_text().splitlines()
    for name, line in schemas():
        prev = lines[line - 2].strip() if line >= 2 else ""
        assert prev.startswith("//"), (f"csrc/library.cpp:{line}: opforge::{name} has no comment line above its "
                                       f"m.def (one `// <what it computes>` line per schema)")


def test_every_backward_op_belongs_to_a_public_op():
    names = {n for n, _ in schemas()}
    for name, line in schemas():
        if name.endswith("_backward"):
            fwd = name[: -len("_backward")]
            assert fwd in names, (f"csrc/library.cpp:{line}: opforge::{name} has no forward op opforge::{fwd} "
                                  f"(name a backward op after its forward: <op>_backward)")


def test_conformance_entries_name_real_ops():
    public = {n for n, _ in PUBLIC}
    for e in ENTRIES:
        assert e.name in public, (f"tests/python/conformance.py: entry {e.name!r} is not a public schema of "
                                  f"csrc/library.cpp")


def test_references_are_named_after_ops():
    ops = {n for n, _ in schemas()}
    helpers = {"activation_reference", "assert_matches_reference", "fake_quant_qparams_reference",
               "fake_quantize_per_token_reference", "rope_cos_sin_reference"}  # pieces of the rule, not ops
    for name in opforge.testing.__all__:
        if name.endswith("_reference") and name not in helpers:
            assert name[: -len("_reference")] in ops, (f"opforge.testing.{name}: no op {name[:-10]!r} in "
                                                       f"csrc/library.cpp (references are named <op>_reference)")
