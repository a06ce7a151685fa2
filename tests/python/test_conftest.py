"""tests/python/conftest.py's own options: --shard K/N keeps disjoint parts that together are the whole selection,
and a malformed value is a usage error (pytest exit code 4), never a silent run of everything."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _collect(tmp_path, *args):
    """Runs pytest --collect-only on a 40-test file beside a copy of this conftest; (rc, test ids, output)."""
    if not (tmp_path / "conftest.py").exists():
        shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
        (tmp_path / "test_many.py").write_text(
            "import pytest\n\n@pytest.mark.parametrize('i', range(40))\ndef test_case(i):\n    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        str(tmp_path / "test_many.py"), *args], cwd=tmp_path, capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    ids = sorted(line for line in r.stdout.splitlines() if "::" in line)
    return r.returncode, ids, r.stdout + r.stderr


def test_shard_parts_are_disjoint_and_complete(tmp_path):
    rc, everything, out = _collect(tmp_path)
    assert rc == 0 and len(everything) == 40, out
    parts = []
    for k in (1, 2, 3):
        rc, ids, out = _collect(tmp_path, "--shard", f"{k}/3")
        assert rc == 0, out
        assert ids, f"shard {k}/3 of 40 tests is empty"
        parts.append(ids)
    union = [i for p in parts for i in p]
    assert len(union) == len(set(union)), "a test is in two shards"
    assert sorted(union) == everything


@pytest.mark.parametrize("value", ["0/2", "3/2", "a/b", ""])
def test_shard_bad_values_are_usage_errors(tmp_path, value):
    rc, ids, out = _collect(tmp_path, f"--shard={value}")
    assert rc == 4, f"--shard={value!r}: rc {rc}\n{out}"
    assert "--shard: expected K/N" in out
