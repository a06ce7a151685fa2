"""`python -m opforge bench`: the quick run of one op family on the CPU, from a folder outside the source tree,
prints the summary table (opforge against its peers only) and writes the harness's one CSV schema and a PNG redrawn
from it into --out; the suites live in the package, with thin entry points in benchmarks/; the torch.compile peer is
compiled once per shape and grad mode and says when it fell back; the timing statistics drop outliers and flag a
spread that stays large; a failing family is reported and the others still run."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge.bench import harness
from opforge.bench import cli, suites

REPO = Path(__file__).resolve().parents[2]


def test_quick_rms_norm_on_cpu(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--quick", "--ops", "rms_norm", "--device", "cpu",
                        "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = p.stdout[p.stdout.index("ratios are peer time"):]
    for column in ("opforge us", "opforge metric", "vs eager", "vs torch.compile"):
        assert column in summary, column
    assert "vs opforge" not in summary
    assert "1/1" in p.stderr  # the progress bar
    rows = list(csv.DictReader((out / "rms_norm.csv").open()))
    assert list(rows[0]) == harness.CONTEXT_COLUMNS + harness.ROW_COLUMNS
    assert {r["op"] for r in rows} == {"rms_norm", "fused_add_rms_norm"}
    assert {r["command"] for r in rows} == {"python -m opforge bench --quick --ops rms_norm --device cpu --out "
                                            + str(out)}
    assert all(r["spread"] == "" or float(r["spread"]) >= 0 for r in rows)
    compiled = [r for r in rows if r["impl"] == "torch.compile"]
    assert compiled and all(r["fallback"] == "" and float(r["time_us"]) > 0 for r in compiled), compiled
    assert (out / "rms_norm_cpu.png").stat().st_size > 1000
    assert not (tmp_path / "opforge_bench").exists()  # --out was honoured


def test_unknown_family_and_list(capsys):
    assert cli.main(["--ops", "no_such_op"]) == 2
    assert "expected --ops from" in capsys.readouterr().err
    assert cli.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == suites.families() and "rms_norm" in listed and "overhead" not in listed


def test_list_works_outside_a_source_tree(tmp_path):
    """The families are the package's suites: `--list` from an empty folder, with only the package importable (no
    benchmarks/ folder anywhere near), lists them all."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python")] + (
        [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.pop("OPFORGE_BENCHMARKS", None)
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--list"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == suites.families()


def test_every_family_has_a_suite_on_the_harness_and_an_entry_point():
    """Each suite's main() runs the harness (harness.start ... run.finish(): one CSV schema, a PNG); each
    benchmarks/bench_<family>.py of an op family is a thin entry point calling its suite, and every suite has one
    (scripts/gpu_check.sh runs them)."""
    package = Path(suites.__file__).parent
    for family in suites.families():
        text = (package / f"{family}.py").read_text()
        assert "harness.start(" in text and "run.finish()" in text, f"suites/{family}.py does not use the harness"
        entry = REPO / "benchmarks" / f"bench_{family}.py"
        assert entry.is_file(), f"no entry point {entry}"
        code = entry.read_text()
        assert f'suites.main("{family}")' in code and len(code.splitlines()) <= 10, entry
    tools = {"bench_hf_llama", "bench_overhead"}  # model-level and host-overhead tools, not op families
    entries = {p.stem[len("bench_"):] for p in (REPO / "benchmarks").glob("bench_*.py") if p.stem not in tools}
    assert entries == set(suites.families())


def test_entry_point_runs_its_suite(tmp_path):
    """benchmarks/bench_<family>.py from another folder: its suite's --help (the suite's docstring)."""
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_rms_norm.py"), "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "rms_norm and fused_add_rms_norm against" in p.stdout and "--quick" in p.stdout


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
    run = harness.BenchRun("g", argparse_namespace(), [torch.float32], 1, 2)
    row = run.add("g", (3,), torch.float32, "torch.compile", "fwd", t, 0.0, "GB/s")
    assert row.fallback, "a compile peer that ran eagerly must say so"
    assert run.add("g", (3,), torch.float32, "eager", "fwd", t, 0.0, "GB/s").fallback == ""


def test_csv_of_an_older_schema_is_upgraded_in_place(tmp_path):
    """A family CSV written before a column was added gets the schema's header, its rows keeping their values; no
    second file appears. A CSV with columns the schema lacks (another tool's) is refused, untouched."""
    old_columns = ["date", "device", "device_name", "torch", "commit", "op", "shape", "dtype", "impl", "pass",
                   "time_us", "metric", "unit"]
    (tmp_path / "x.csv").write_text(",".join(old_columns) + "\n2026-01-01T00:00:00,cpu,c,2.0,abc,x,1x1,float32,"
                                    "opforge,fwd,5.0,1.0,GB/s\n")
    row = harness.Row("x", "1x1", "float32", "opforge", "fwd", 1.0, 1.0, "GB/s", spread=0.1)
    path = harness.write_csv([row], "x", "cpu", tmp_path)
    assert path.name == "x.csv" and sorted(q.name for q in tmp_path.iterdir()) == ["x.csv"]
    records = harness.read_csv(path)
    assert harness.read_header(path) == harness.SCHEMA and len(records) == 2
    assert (records[0]["commit"], records[0]["time_us"], records[0]["command"]) == ("abc", "5.0", "")
    assert records[1]["spread"] == "0.1000" and records[1]["command"]
    (tmp_path / "y.csv").write_text("date,device,op,mode\n1,2,3,4\n")
    with pytest.raises(ValueError, match="mode"):
        harness.write_csv([row], "y", "cpu", tmp_path)
    assert (tmp_path / "y.csv").read_text() == "date,device,op,mode\n1,2,3,4\n"


def test_plot_is_redrawn_from_the_csv(tmp_path):
    """finish() appends the CSV and redraws <family>_<kind>.png from its latest run, replacing the earlier plot (no
    -2, -3 copies); --plot redraws it from the CSV alone."""
    pytest.importorskip("matplotlib")
    rows = [harness.Row("x", "4", "float32", "opforge", "fwd", 2.0, 1.0, "GB/s"),
            harness.Row("x", "4", "float32", "eager", "fwd", 3.0, 0.5, "GB/s")]
    for _ in range(2):
        harness.finish(rows, "x", "cpu", out=tmp_path)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["x.csv", "x_cpu.png"]
    assert len(harness.read_csv(tmp_path / "x.csv")) == 4
    (tmp_path / "x_cpu.png").unlink()
    assert cli.main(["--plot", str(tmp_path / "x.csv")]) == 0
    assert (tmp_path / "x_cpu.png").stat().st_size > 1000


def test_latest_run_picks_the_last_date_of_a_device_kind():
    recs = [dict(date="2026-01-01T00:00:00", device="cuda", op="a"), dict(date="2026-01-02T00:00:00", device="cpu",
            op="b"), dict(date="2026-01-03T00:00:00", device="cuda", op="c"), dict(date="2026-01-03T00:00:00",
            device="cuda", op="d")]
    assert [r["op"] for r in harness.latest_run(recs)] == ["c", "d"]
    assert [r["op"] for r in harness.latest_run(recs, "cpu")] == ["b"]
    assert harness.latest_run(recs, "mps") == []


FAKE_OK = """from opforge.bench import harness


def main(argv=None):
    run = harness.start("{name}", "a fake family", argv, dtypes=[harness.torch.float32], warmup=(1, 1),
                        reps=((1, 1), (1, 1)))
    run.add("{name}", (4,), harness.torch.float32, "opforge", "fwd", 2.0, 1.0, "GB/s")
    run.add("{name}", (4,), harness.torch.float32, "eager", "fwd", 3.0, 0.5, "GB/s")
    return run.finish()
"""

FAKE_RAISES = """from opforge.bench import harness


def main(argv=None):
    harness._State.collected.append(harness.Row("b_raises", "4", "float32", "opforge", "fwd", 5.0, 1.0, "GB/s"))
    raise ValueError("boom inside main")
"""

FAKE_DIES = """import os


def main(argv=None):
    print("c_dies: about to end its process", flush=True)
    os._exit(7)  # as a fatal CUDA error would: no exception, no result file
"""


def _fake_suites(tmp_path, **modules):
    """A package ``fake_suites`` in tmp_path with one module per keyword (name: source), and the environment that
    imports it and this checkout's opforge."""
    package = tmp_path / "fake_suites"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in modules.items():
        (package / f"{name}.py").write_text(source)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO / "python")] + (
                   [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    return env


def test_a_failing_family_is_reported_and_the_next_still_runs(tmp_path):
    """Each family runs in its own process: one raising inside main() or killing its process is a FAILED line (exit
    status 1), the rows it measured before failing stay in the table, and the families after it still run."""
    env = _fake_suites(tmp_path, a_ok=FAKE_OK.format(name="a_ok"), b_raises=FAKE_RAISES, c_dies=FAKE_DIES,
                       d_ok=FAKE_OK.format(name="d_ok"))
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--suites", "fake_suites", "--device", "cpu",
                        "--no-compile", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
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


def test_run_family_returns_the_childs_rows(tmp_path, monkeypatch):
    env = _fake_suites(tmp_path, x=FAKE_OK.format(name="x"))
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    out = tmp_path / "results"
    rows, failure, name = cli.run_family("fake_suites.x", ["--device", "cpu", "--out", str(out)], "the command")
    assert failure == "" and name
    assert [(r.op, r.impl, r.time_us) for r in rows] == [("x", "opforge", 2.0), ("x", "eager", 3.0)]
    assert isinstance(rows[0], harness.Row) and rows[0].pass_ == "fwd"
    assert {r["command"] for r in harness.read_csv(out / "x.csv")} == {"the command"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_failed_graph_capture_leaves_the_cuda_rng_and_later_captures_usable():
    """A step that synchronizes (.item()) invalidates the capture: time_cuda_graph times an eager loop instead, and
    afterwards random ops on the device and a new capture (with a random op in it) still work. On torch 2.11 a failed
    capture_end never runs the generator's capture epilogue, and unless the harness resets it the next
    torch.randn(device="cuda") raises "Offset increment outside graph capture encountered unexpectedly"."""
    x = torch.randn(4096, device="cuda")
    t, method = harness.time_cuda_graph(lambda i: (x * 2).sum().item(), 4, reps=2, warmup=1)
    assert method == "loop" and t > 0
    y = torch.randn(4096, device="cuda")  # raises when the generator is left capturing
    assert torch.isfinite(y).all() and y.std().item() > 0.5
    z = torch.empty(4096, device="cuda")
    t2, method2 = harness.time_cuda_graph(lambda i: z.normal_(), 4, reps=2, warmup=1)
    assert method2 == "graph" and t2 > 0
    torch.cuda.synchronize()
    assert z.std().item() > 0.5


def test_rows_carry_the_given_commit(tmp_path):
    """$OPFORGE_GIT_COMMIT (a tree copied without its git history, e.g. to a GPU machine) is the commit of the CSV
    rows and of the summary line."""
    env = _fake_suites(tmp_path, a_ok=FAKE_OK.format(name="a_ok"))
    env["OPFORGE_GIT_COMMIT"] = "abc1234"
    out = tmp_path / "results"
    p = subprocess.run([sys.executable, "-m", "opforge", "bench", "--suites", "fake_suites", "--device", "cpu",
                        "--no-compile", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "commit abc1234" in p.stdout, p.stdout[-2000:]
    assert {r["commit"] for r in csv.DictReader((out / "a_ok.csv").open())} == {"abc1234"}


def test_an_installed_copy_reports_no_commit_of_an_enclosing_repository(tmp_path):
    """A package that is no source tree (no csrc/library.cpp beside it, as in site-packages) reports the commit as
    "unknown", even inside another git repository (a virtual environment in a project's checkout)."""
    import shutil

    if shutil.which("git") is None:
        pytest.skip("git not installed")
    site = tmp_path / "venv" / "lib" / "site-packages"
    shutil.copytree(REPO / "python" / "opforge", site / "opforge", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    env = {k: v for k, v in os.environ.items() if k != "OPFORGE_GIT_COMMIT"}
    env["PYTHONPATH"] = str(site)
    code = "from opforge.bench import harness as h; print(h.SOURCE_TREE, h.git_commit(), h.RESULTS_DIR)"
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["None", "unknown", "opforge_bench"]


def test_summary_has_one_table_per_op_with_its_own_peers():
    R = harness.Row
    rows = [R("a", "4", "float32", "opforge", "fwd", 2.0, 1.0, "GB/s"), R("a", "4", "float32", "liger", "fwd", 4.0, 0.5, "GB/s"),
            R("b", "8", "float32", "opforge", "fwd", 1.0, 1.0, "GB/s"), R("b", "8", "float32", "eager", "fwd", 3.0, 0.3, "GB/s"),
            R("b", "8", "float32", "torchao", "fwd+bwd", 9.0, 0.1, "GB/s")]  # no opforge row there: no column
    tables = cli.summarize_by_op(rows)
    assert [t[0][6:] for t in tables] == [["vs liger"], ["vs eager"]]
    assert [t[1][:4] + t[1][6:] for t in tables] == [["a", "4", "float32", "fwd", "2.00x"], ["b", "8", "float32", "fwd", "3.00x"]]


def test_summary_compares_opforge_with_peers_only():
    """opforge's variants (another kernel, another activation, the op without its quantization) and the ceilings
    (copy, GEMM floor) get no column: each ratio is a peer's time over opforge's own."""
    R = harness.Row
    impls = {"opforge": 2.0, "opforge gelu": 1.0, "opforge.linear (no quant)": 1.5, "opforge(recompute)": 3.0,
             "copy": 1.0, "1 GEMM (floor)": 1.0, "eager": 5.0, "torch.compile": 4.0, "gelu(F.linear)": 6.0}
    rows = [R("a", "4", "float32", impl, "fwd", t, 1.0, "GB/s") for impl, t in impls.items()]
    (table,) = cli.summarize_by_op(rows)
    assert table[0][6:] == ["vs eager", "vs torch.compile", "vs gelu(F.linear)"]
    assert table[1][6:] == ["2.50x", "2.00x", "3.00x"]
    assert [harness.impl_role(i) for i in impls] == ["opforge", "variant", "variant", "variant", "ceiling", "ceiling",
                                                     "peer", "peer", "peer"]


def test_summary_marks_a_noisy_ratio():
    R = harness.Row
    quiet = [R("a", "4", "float32", "opforge", "fwd", 2.0, 1.0, "GB/s", spread=0.05),
             R("a", "4", "float32", "eager", "fwd", 4.0, 1.0, "GB/s", spread=0.1)]
    noisy = [R("a", "8", "float32", "opforge", "fwd", 2.0, 1.0, "GB/s", spread=0.05),
             R("a", "8", "float32", "eager", "fwd", 4.0, 1.0, "GB/s", spread=harness.NOISY_SPREAD + 0.2)]
    (table,) = cli.summarize_by_op(quiet + noisy)
    assert [line[6] for line in table[1:]] == ["2.00x", "2.00x?"]


def test_outliers_are_dropped_from_the_median():
    """Synthetic block times of a loaded machine: 20 samples near 100 µs and 4 stalls of 8-16 ms. The stalls are
    outside Tukey's fences, the median and spread are those of the rest."""
    samples = [100.0 + (i % 5) for i in range(20)] + [8000.0, 12000.0, 16000.0, 9000.0]
    t = harness.robust_median(samples)
    assert (t.kept, t.rejected) == (20, 4)
    assert t.median == 102.0 and t.spread < 0.05 and not t.noisy
    naive = sorted(samples)[len(samples) // 2]
    assert t.median < naive or naive == 102.0
    one = harness.robust_median([7.0])
    assert (one.median, one.spread, one.kept) == (7.0, 0.0, 1)
    with pytest.raises(ValueError, match="expected at least one sample"):
        harness.robust_median([])


def test_a_spread_that_stays_large_takes_more_rounds_and_is_reported(capsys):
    """measure() takes EXTRA_ROUNDS more rounds while the spread is above NOISY_SPREAD; a spread that stays large
    makes the row noisy, reported on stderr by BenchRun.add and marked in the table. A quiet timing takes one round."""
    rounds = []

    def noisy_round():
        rounds.append(1)
        return [100.0, 150.0, 200.0, 250.0, 300.0, 120.0, 280.0]  # IQR/median ≈ 0.6, no outlier

    t = harness.measure(noisy_round)
    assert len(rounds) == 1 + harness.EXTRA_ROUNDS and t.noisy and harness.last_spread() == t.spread
    run = harness.BenchRun("x", argparse_namespace(), [torch.float32], 1, 1)
    row = run.add("x", (4,), torch.float32, "opforge", "fwd", t.median, 1.0, "GB/s")
    assert row.noisy and row.spread == t.spread
    assert "[noisy] x fwd float32 4 opforge: spread" in capsys.readouterr().err
    harness.print_table([row])
    assert "timings kept a spread above" in capsys.readouterr().out
    rounds.clear()
    quiet = harness.measure(lambda: rounds.append(1) or [100.0, 101.0, 99.0, 100.5, 100.2])
    assert len(rounds) == 1 and not quiet.noisy
    assert not run.add("x", (4,), torch.float32, "eager", "fwd", quiet.median, 1.0, "GB/s").noisy


def test_cpu_blocks_span_the_window_within_the_budget():
    calls, blocks = harness.cpu_blocks(20e-6, 5)  # a 20 µs call: 10 a block, enough blocks for CPU_SPAN_S
    assert calls == 10 and blocks * calls * 20e-6 >= harness.CPU_SPAN_S * 0.99
    calls, blocks = harness.cpu_blocks(0.3, 3)  # a 300 ms call: one a block, within CPU_MAX_SPAN_S but at least 3
    assert calls == 1 and blocks == 3
    assert harness.cpu_blocks(0.3, 8) == (1, 8)  # never fewer than the suite's repetitions


def test_time_cpu_ignores_stalls():
    """A function that stalls on some calls (as a preempted process does): time_cpu's result is its quick time."""
    import time as _time

    calls = []

    def f():
        calls.append(1)
        if len(calls) % 9 == 0:
            _time.sleep(0.008)

    t = harness.time_cpu(f, warmup=1, reps=5)
    assert t < 2000, t  # a median of per-call times with the stalls in would be ≥ 8000 / 9 µs per call


def argparse_namespace():
    import argparse

    return argparse.Namespace(device="cpu", quick=True, no_save=True)
