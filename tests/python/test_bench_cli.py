"""`python -m opforge bench`: the quick run of one op family on the CPU prints the summary table and writes the
harness's one CSV schema and a PNG into --out (never into the package or the source tree); the torch.compile
peer is compiled once per shape and grad mode (no recompile-limit fallback) and says when it fell back."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge.bench import harness
from opforge.bench import cli

REPO = Path(__file__).resolve().parents[2]


def test_quick_rms_norm_on_cpu(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--quick", "--ops", "rms_norm", "--device", "cpu",
                        "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for column in ("opforge us", "opforge metric", "vs eager", "vs torch.compile"):
        assert column in p.stdout, column
    assert "1/1" in p.stderr  # the progress bar
    rows = list(csv.DictReader((out / "rms_norm.csv").open()))
    assert list(rows[0]) == harness.CONTEXT_COLUMNS + harness.ROW_COLUMNS
    assert {r["op"] for r in rows} == {"rms_norm", "fused_add_rms_norm"}
    compiled = [r for r in rows if r["impl"] == "torch.compile"]
    assert compiled and all(r["fallback"] == "" and float(r["time_us"]) > 0 for r in compiled), compiled
    assert (out / "rms_norm_cpu.png").stat().st_size > 1000
    assert not (tmp_path / "opforge_bench").exists()  # --out was honoured


def test_unknown_family_and_list(capsys):
    assert cli.main(["--ops", "no_such_op"]) == 2
    assert "expected --ops from" in capsys.readouterr().err
    assert cli.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert "rms_norm" in listed and "overhead" not in listed


def test_every_family_uses_the_harness():
    for family, path in cli.discover(REPO / "benchmarks").items():
        text = path.read_text()
        # common.start(...) makes the run whose finish() is common.finish (bench_<op>.py); the model-level scripts
        # with their own command line call common.finish directly
        assert "common.start(" in text or "common.finish(" in text, \
            f"{path.name} does not report through the harness (one CSV schema, PNG)"


def test_compiled_peer_is_keyed_per_shape_and_grad_mode():
    def f(x):
        return torch.sin(x) * 2

    peer = harness.compiled(f, fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (3, 5):
            x = torch.randn(n, requires_grad=True)
            with torch.no_grad():
                torch.testing.assert_close(peer(x), f(x))
            torch.testing.assert_close(peer(x), f(x))
    assert len(peer.compiled) == 4 and peer.failed == {}


def test_compiled_peer_fallback_is_recorded():
    def g(x):
        y = x * 2
        torch._dynamo.graph_break()  # fullgraph=True refuses a graph break
        return y + 1

    peer = harness.compiled(g, fullgraph=True)
    x = torch.tensor([0.0, 1.0, 2.0])
    t = harness.time_fn(lambda: peer(x), "cpu", warmup=1, reps=2)
    assert t > 0
    row = harness.Row("g", "3", "float32", "torch.compile", "fwd", t, 0.0, "GB/s")
    assert row.fallback, "a compile peer that ran eagerly must say so"
    assert harness.Row("g", "3", "float32", "eager", "fwd", t, 0.0, "GB/s").fallback == ""


def test_csv_of_an_older_schema_is_not_mixed(tmp_path):
    (tmp_path / "x.csv").write_text("date,device,op,mode\n1,2,3,4\n")
    row = harness.Row("x", "1x1", "float32", "opforge", "fwd", 1.0, 1.0, "GB/s")
    path = harness.write_csv([row], "x", "cpu", tmp_path)
    assert path.name == "x-2.csv" and harness.read_header(path) == harness.CONTEXT_COLUMNS + harness.ROW_COLUMNS


FAKE_COMMON = """import sys
from opforge.bench import harness
sys.modules[__name__] = harness
"""

FAKE_OK = """import common


def main(argv=None):
    run = common.start("{name}", "a fake family", argv, dtypes=[common.torch.float32], warmup=(1, 1),
                       reps=((1, 1), (1, 1)))
    run.add("{name}", (4,), common.torch.float32, "opforge", "fwd", 2.0, 1.0, "GB/s")
    run.add("{name}", (4,), common.torch.float32, "eager", "fwd", 3.0, 0.5, "GB/s")
    return run.finish()
"""

FAKE_RAISES = """import common


def main(argv=None):
    common._State.collected.append(common.Row("b_raises", "4", "float32", "opforge", "fwd", 5.0, 1.0, "GB/s"))
    raise ValueError("boom inside main")
"""

FAKE_DIES = """import os


def main(argv=None):
    print("c_dies: about to end its process", flush=True)
    os._exit(7)  # as a fatal CUDA error would: no exception, no result file
"""


def test_a_failing_family_is_reported_and_the_next_still_runs(tmp_path):
    """Each family runs in its own process: one raising inside main() or killing its process is a FAILED line (exit
    status 1), the rows it measured before failing stay in the table, and the families after it still run."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "common.py").write_text(FAKE_COMMON)
    (bench / "bench_a_ok.py").write_text(FAKE_OK.format(name="a_ok"))
    (bench / "bench_b_raises.py").write_text(FAKE_RAISES)
    (bench / "bench_c_dies.py").write_text(FAKE_DIES)
    (bench / "bench_d_ok.py").write_text(FAKE_OK.format(name="d_ok"))
    out = tmp_path / "results"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPFORGE_BENCHMARKS=str(bench),
               PYTHONPATH=os.pathsep.join([str(REPO / "python")] + ([os.environ["PYTHONPATH"]]
                                                                    if os.environ.get("PYTHONPATH") else [])))
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--device", "cpu", "--no-compile", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "FAILED: b_raises: ValueError: boom inside main" in p.stdout, p.stdout
    assert "FAILED: c_dies: its process ended without a result (exit status 7)" in p.stdout, p.stdout
    assert "FAILED: a_ok" not in p.stdout and "FAILED: d_ok" not in p.stdout
    assert "c_dies: about to end its process" in p.stdout  # the child's output is streamed through
    assert "boom inside main" in p.stderr  # with the traceback
    assert "4/4" in p.stderr  # the progress bar counted every family
    summary = p.stdout[p.stdout.index("ratios are peer time"):]
    for op in ("a_ok", "b_raises", "d_ok"):
        assert op in summary, summary
    assert "1.50x" in summary  # eager 3.0 us / opforge 2.0 us, from the child's rows
    assert {r["op"] for r in csv.DictReader((out / "d_ok.csv").open())} == {"d_ok"}


def test_run_family_returns_the_childs_rows(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "common.py").write_text(FAKE_COMMON)
    (bench / "bench_x.py").write_text(FAKE_OK.format(name="x"))
    rows, failure, name = cli.run_family(bench / "bench_x.py", ["--device", "cpu", "--no-save"])
    assert failure == "" and name
    assert [(r.op, r.impl, r.time_us) for r in rows] == [("x", "opforge", 2.0), ("x", "eager", 3.0)]
    assert isinstance(rows[0], harness.Row) and rows[0].pass_ == "fwd"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_graph_capture_leaves_the_cuda_rng_and_later_captures_usable():
    """A step that synchronizes (.item()) invalidates the capture: time_cuda_graph times an eager loop instead, and
    afterwards random ops on the device and a new capture (with a random op in it) still work. Before the fix, on
    torch 2.11, the next torch.randn(device="cuda") raised "Offset increment outside graph capture encountered
    unexpectedly" (the failed capture_end never ran the generator's capture epilogue)."""
    x = torch.randn(4096, device="cuda")
    t, method = harness.time_cuda_graph(lambda i: (x * 2).sum().item(), 4, reps=2, warmup=1)
    assert method == "loop" and t > 0
    y = torch.randn(4096, device="cuda")  # raised before the fix
    assert torch.isfinite(y).all() and y.std().item() > 0.5
    z = torch.empty(4096, device="cuda")
    t2, method2 = harness.time_cuda_graph(lambda i: z.normal_(), 4, reps=2, warmup=1)
    assert method2 == "graph" and t2 > 0
    torch.cuda.synchronize()
    assert z.std().item() > 0.5


def test_rows_carry_the_commit_of_the_benchmarks_checkout(tmp_path):
    """An installed opforge has no git tree of its own: `opforge bench` records the commit of the checkout whose
    benchmarks/ it runs (here a fresh repository), in the CSV rows and the summary line."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "common.py").write_text(FAKE_COMMON)
    (bench / "bench_a_ok.py").write_text(FAKE_OK.format(name="a_ok"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != "OPFORGE_GIT_COMMIT"}
    env.update(OMP_NUM_THREADS="1", OPFORGE_BENCHMARKS=str(bench),
               PYTHONPATH=os.pathsep.join([str(REPO / "python")] + ([os.environ["PYTHONPATH"]]
                                                                    if os.environ.get("PYTHONPATH") else [])))
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--device", "cpu", "--no-compile", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"commit {commit}" in p.stdout, p.stdout[-2000:]
    assert {r["commit"] for r in csv.DictReader((out / "a_ok.csv").open())} == {commit}


def test_summary_has_one_table_per_op_with_its_own_peers():
    R = harness.Row
    rows = [R("a", "4", "float32", "opforge", "fwd", 2.0, 1.0, "GB/s"), R("a", "4", "float32", "liger", "fwd", 4.0, 0.5, "GB/s"),
            R("b", "8", "float32", "opforge", "fwd", 1.0, 1.0, "GB/s"), R("b", "8", "float32", "eager", "fwd", 3.0, 0.3, "GB/s"),
            R("b", "8", "float32", "torchao", "fwd+bwd", 9.0, 0.1, "GB/s")]  # no opforge row there: no column
    tables = cli.summarize_by_op(rows)
    assert [t[0][6:] for t in tables] == [["vs liger"], ["vs eager"]]
    assert [t[1][:4] + t[1][6:] for t in tables] == [["a", "4", "float32", "fwd", "2.00x"], ["b", "8", "float32", "fwd", "3.00x"]]
