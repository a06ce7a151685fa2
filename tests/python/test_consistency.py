"""Every public schema of csrc/library.cpp comes with all its pieces (docs/adding_an_op.md, "Checklist").

A schema is public unless its name starts with ``_`` (a private forward) or ends with ``_backward`` (a backward
op, tested through its forward's conformance entry). For each public op this test wants:

1. a functional wrapper ``opforge.functional.<op>`` with a docstring, listed in its ``__all__``, exported as
   ``opforge.<op>`` and listed in ``opforge.__all__``;
2. a C++ declaration ``<op>(`` in include/opforge/opforge.h, outside comments (and ``<op>_backward(`` when the
   library defines that schema);
3. a float64 reference ``opforge.testing.<op>_reference``, listed in its ``__all__``;
4. a conformance entry ``OpEntry(name="<op>", ...)`` in tests/python/conformance.py (read as text, so that a missing
   wrapper is reported here rather than as an import error of conformance.py);
5. a docs entry: docs/ops/<op>.md, or a Markdown heading naming the op (as a word, backticks optional) in a page
   under docs/ops/ (the family's page: "# rms_norm and fused_add_rms_norm" in docs/ops/rms_norm.md covers both);
   that page in mkdocs.yml's nav; and a call ``opforge.<op>(`` in README.md's API table;
6. a benchmark: a suite python/opforge/bench/suites/*.py whose code (comments and strings aside) calls the op as an
   attribute (``opforge.<op>``, ``F.<op>``, ``torch.ops.opforge.<op>``).

The schemas are read from the whole text of csrc/library.cpp (an ``m.def(`` may span lines, two may share one), and
test_loaded_library_matches_library_cpp compares them with the operators the built library registers, so a
schema defined anywhere else (a TORCH_LIBRARY_FRAGMENT in another file) cannot slip past the checklist.
Each missing piece is its own failing case whose message says which file to edit and what to add.
"""
from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

import opforge
import opforge.functional
import opforge.testing

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "csrc" / "library.cpp"
HEADER = ROOT / "include" / "opforge" / "opforge.h"
FUNCTIONAL = ROOT / "python" / "opforge" / "functional.py"
TESTING = ROOT / "python" / "opforge" / "testing.py"
CONFORMANCE = ROOT / "tests" / "python" / "conformance.py"
DOCS = ROOT / "docs" / "ops"
SUITES = ROOT / "python" / "opforge" / "bench" / "suites"
MKDOCS = ROOT / "mkdocs.yml"
README = ROOT / "README.md"
GUIDE = "docs/adding_an_op.md"

_DEF = re.compile(r'm\.def\(\s*"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\.[A-Za-z0-9_]+)?\(')
# schemas defined outside csrc/library.cpp on purpose: name -> where and why
OTHER_SCHEMAS = {"_set_knob": "csrc/core/knobs.cpp: the tests' knob setter, not an op",
                 "_has_cutlass": "csrc/core/knobs.cpp: the build's CUTLASS flag (doctor, tests), not an op"}


def schemas():
    """[(name, line number)] of every m.def in csrc/library.cpp (read as one text: across lines, several a line)."""
    text = LIBRARY.read_text()
    return [(m.group("name"), text.count("\n", 0, m.start()) + 1) for m in _DEF.finditer(text)]


def _strip_cpp_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", "", text), flags=re.S)


def _python_code(path: Path) -> str:
    """The source of `path` without comments and string literals (docstrings included): the code that runs."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)):
            out.append(tok.string)
    return " ".join(out)


def _entry_names():
    """Names of the OpEntry(...) of tests/python/conformance.py, read from its text."""
    return set(re.findall(r'OpEntry\(\s*name\s*=\s*"([A-Za-z_][A-Za-z0-9_]*)"', CONFORMANCE.read_text()))


def is_public(name: str) -> bool:
    return not name.startswith("_") and not name.endswith("_backward")


PUBLIC = [(n, line) for n, line in schemas() if is_public(n)]
CHECKS = ["functional", "cpp_declaration", "reference", "conformance_entry", "docs", "docs_nav", "readme_api",
          "benchmark"]

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
            return (f"{where}: opforge.{op} is not the functional wrapper opforge.functional.{op}: "
                    f"python/opforge/__init__.py exports functional.__all__ with `from .functional import *`; "
                    f"something there rebinds the name. See {GUIDE}, checklist item 5.")
        if op not in getattr(opforge, "__all__", ()):
            return (f"{where}: \"{op}\" is not in opforge.__all__ (python/opforge/__init__.py:"
                    f"{_line_of(ROOT / 'python' / 'opforge' / '__init__.py', r'^__all__')} builds it from "
                    f"functional.__all__), so `from opforge import *` misses it. See {GUIDE}, checklist item 5.")
        if not (f.__doc__ or "").strip():
            return (f"{where}: opforge.functional.{op} has no docstring (shapes, dtypes, errors, source). "
                    f"See {GUIDE}, checklist item 5.")
        return None
    if check == "cpp_declaration":
        code = _strip_cpp_comments(HEADER.read_text())
        missing = [n for n in (op, f"{op}_backward") if (n == op or n in dict(schemas()))
                   and not re.search(rf"(?<![A-Za-z0-9_:.]){n}\s*\(", code)]
        if not missing:
            return None
        if missing == [f"{op}_backward"]:
            return (f"{where}: its backward op opforge::{op}_backward has no C++ declaration: add "
                    f"`/// <its gradients, shapes, dtypes>` and its declaration inside namespace opforge in "
                    f"{_rel(HEADER)} (outside comments), defined through typed_op next to {op}'s. "
                    f"See {GUIDE}, checklist item 2.")
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
        if op in _entry_names():
            return None
        marker = _line_of(CONFORMANCE, r"entries of the ops added in parallel")
        return (f"{where} has no conformance entry: append `ENTRIES.append(OpEntry(name=\"{op}\", op=F.{op}, "
                f"reference=T.{op}_reference, ...))` with its sample generator and >= 10 bad inputs in a block of "
                f"its own at the end of {_rel(CONFORMANCE)} (the section that starts at line {marker}; the file's "
                f"docstring shows the block), and a strategy in tests/python/test_properties.py's _args (or list it "
                f"in WITHOUT_STRATEGY there, with why). See {GUIDE}, checklist item 7.")
    if check == "docs":
        if _docs_page(op) is not None:
            return None
        return (f"{where} has no docs entry: add a page docs/ops/{op}.md headed `# {op}` (or a heading naming {op} "
                f"in its family's page under docs/ops/, e.g. \"## {op}\") with its formula, shapes, dtypes, "
                f"gradients, autocast policy and limits. See {GUIDE}, checklist item 8.")
    if check == "docs_nav":
        page = _docs_page(op)
        if page is None or f"ops/{page.name}" in MKDOCS.read_text():
            return None  # no page: the docs case says so
        return (f"{where}: its docs page {_rel(page)} is not in {_rel(MKDOCS)}'s nav: add `      - {page.stem}: "
                f"ops/{page.name}` under \"Ops\" ({_rel(MKDOCS)}:{_line_of(MKDOCS, r'ops/')}). "
                f"See {GUIDE}, checklist item 8.")
    if check == "readme_api":
        api = README.read_text().split("\n## API", 1)[-1].split("\n## ", 1)[0]
        if f"opforge.{op}(" in api:
            return None
        return (f"{where} is not in README.md's API table: add a row (or, for a family member, a call in its "
                f"family's row) with `opforge.{op}(...)`, its C++ call, math, dtypes and backends "
                f"(README.md:{_line_of(README, r'^## API')}). See {GUIDE}, checklist item 8.")
    if check == "benchmark":
        call = re.compile(rf"\.\s*{op}(?![A-Za-z0-9_])")
        if any(call.search(_python_code(p)) for p in sorted(SUITES.glob("[!_]*.py"))):
            return None
        return (f"{where} has no benchmark: add a suite python/opforge/bench/suites/{op}.py (and its entry point "
                f"benchmarks/bench_{op}.py), or a case in its family's suite, whose code calls opforge.{op} (a name "
                f"in a comment or string does not count) and times it against torch's composition. See {GUIDE}, checklist item 9.")
    raise ValueError(check)


def _docs_page(op: str):
    """The docs page of `op`: docs/ops/<op>.md with a heading naming it, else the first page under docs/ops/ with a
    heading naming it (as a word, backticks optional); None when there is none."""
    heading = re.compile(rf"^#+ .*(?<![A-Za-z0-9_]){op}(?![A-Za-z0-9_])", re.M)
    own = DOCS / f"{op}.md"
    pages = ([own] if own.is_file() else []) + sorted(p for p in DOCS.glob("*.md") if p != own)
    return next((p for p in pages if heading.search(p.read_text())), None)


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


def test_backward_ops_are_named_op_backward():
    for name, line in schemas():
        for suffix in ("_grad", "_bwd", "_backward_op", "_grad_input"):
            assert not name.endswith(suffix), (
                f"csrc/library.cpp:{line}: opforge::{name} looks like a backward op: name it "
                f"{name[: -len(suffix)]}_backward (PyTorch's naming; the checklist treats every other name as a "
                f"public op). See {GUIDE}.")


def test_loaded_library_matches_library_cpp():
    loaded = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("opforge::")}
    parsed = {n for n, _ in schemas()}
    extra = sorted(loaded - parsed - set(OTHER_SCHEMAS))
    assert not extra, (f"the built library registers opforge::{extra} but csrc/library.cpp has no m.def for "
                       f"{'it' if len(extra) == 1 else 'them'} (as this test reads it): define every schema in "
                       f"csrc/library.cpp, one `m.def(\"<schema>\")` with a comment line above. See {GUIDE}.")
    missing = sorted(parsed - loaded)
    assert not missing, f"csrc/library.cpp defines opforge::{missing}, which the built library does not register"


def test_conformance_entries_name_real_ops():
    public = {n for n, _ in PUBLIC}
    for name in sorted(_entry_names()):
        assert name in public, (f"tests/python/conformance.py: entry {name!r} is not a public schema of "
                                f"csrc/library.cpp")


def test_references_are_named_after_ops():
    # the ops, and the losses composed on them in Python (opforge.losses: preference_loss, grpo_loss, ...)
    ops = {n for n, _ in schemas()} | set(opforge.losses.__all__)
    helpers = {"activation_reference", "assert_matches_reference", "fake_quant_qparams_reference",
               "fake_quantize_per_token_reference", "rope_cos_sin_reference"}  # pieces of the rule, not ops
    for name in opforge.testing.__all__:
        if name.endswith("_reference") and name not in helpers:
            assert name[: -len("_reference")] in ops, (f"opforge.testing.{name}: no op {name[:-10]!r} in "
                                                       f"csrc/library.cpp nor loss in opforge.losses (references are named <op>_reference)")
