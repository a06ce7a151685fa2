"""The demo's promise on a short run: the opforge and torch.nn models' loss curves agree by the demo's
rule (fp32: every logged loss within 1e-3 relative) and the loss falls; the outputs are written;
``python -m opforge demo`` (the README's main job) is this Llama demo."""
import csv
import math
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge import demo


def _run(tmp_path, *extra):
    args = demo.parse_args(["--size", "tiny", "--steps", "24", "--device", "cpu", "--quiet", "--eval-every", "8",
                            "--plot", str(tmp_path / "curves.png"), "--csv", str(tmp_path / "demo_<device>.csv"),
                            "--sample-bytes", "20", *extra])
    with demo._threads(1):  # tiny matrices: one thread is fastest, and robust on a loaded CI machine
        return demo.run(args)


def test_loss_curves_agree_and_fall(tmp_path):
    out = _run(tmp_path)
    a = out["agreement"]
    assert a["ok"], f"loss curves differ: max relative difference {a['max_rel']:.2e} ({a['rule']})"
    assert a["max_rel"] <= demo.FP32_REL_TOL
    for name in ("opforge", "torch"):
        r = out["results"][name]
        assert len(r["train_loss"]) == 24 and len(r["val_loss"]) == 3
        first, last = r["train_loss"][0], sum(r["train_loss"][-4:]) / 4
        assert first == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)  # uniform over bytes at init
        assert last < first - 1.0, f"{name}: loss did not fall ({first:.3f} -> {last:.3f})"
        assert r["val_loss"][-1] < r["val_loss"][0]
        assert r["tokens_per_s"] > 0 and r["peak_mem"] > 0
    assert (tmp_path / "curves.png").stat().st_size > 1000
    rows = list(csv.DictReader((tmp_path / "demo_cpu.csv").open()))
    assert [r["backend"] for r in rows] == ["opforge", "torch"]
    assert isinstance(out["sample"], str) and out["sample"].startswith("Alice ")


def test_bf16_loss_curves_agree_by_the_bf16_rule(tmp_path):
    out = _run(tmp_path, "--dtype", "bf16", "--steps", "16", "--sample-bytes", "0", "--plot", "", "--csv", "")
    a = out["agreement"]
    assert a["ok"] and a["max_rel"] <= demo.BF16_REL_TOL, a
    for name in ("opforge", "torch"):
        r = out["results"][name]
        assert r["train_loss"][-1] < r["train_loss"][0] - 0.5


def test_bundled_text_and_notice():
    tokens = demo.load_text()
    assert 100_000 < tokens.numel() <= 2 * 2**20 and int(tokens.max()) < 256
    notice = (demo.DATA_FILE.parent / "NOTICE").read_text()
    assert "public domain" in notice and "Project Gutenberg" in notice


def test_agreement_rule():
    a = demo.Result("opforge", False, train_loss=[5.0, 4.0], val_steps=[2], val_loss=[4.1])
    b = demo.Result("torch", False, train_loss=[5.0, 4.003], val_steps=[2], val_loss=[4.1])
    assert demo.check_agreement(a, b, "fp32")["ok"]
    b.train_loss[1] = 4.01
    assert not demo.check_agreement(a, b, "fp32")["ok"]
    assert demo.check_agreement(a, b, "bf16")["ok"]


def test_report_mode_runs_on_cpu_when_forced(tmp_path, capsys):
    args = demo.parse_args(["--report", "--allow-cpu-report", "--device", "cpu", "--d-model", "32", "--layers", "1",
                            "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "5", "--quiet", "--modes", "eager",
                            "--csv", str(tmp_path / "llama_report_<device>.csv")])
    out = demo.report(args)
    assert len(out["results"]) == 2 and all(r["tokens_per_s"] > 0 for r in out["results"])
    assert all(len(r["train_loss"]) == 5 for r in out["results"])  # every step's loss, read at the end
    assert out["agreement"]["eager"]["ok"], out["agreement"]
    assert "vs torch compiled" in capsys.readouterr().out
    rows = list(csv.DictReader((tmp_path / "llama_report_cpu.csv").open()))
    assert [(r["backend"], r["compiled"]) for r in rows] == [("opforge", "False"), ("torch", "False")]
    for key in ("device", "torch", "commit", "tokens_per_s", "tokens_per_s_vs_torch_same_mode", "peak_mem_bytes"):
        assert rows[0][key], key
    assert (tmp_path / "llama_report_cpu.png").stat().st_size > 1000


def test_report_defaults():
    """--report: bf16, the h200 size (d_model 2048, 8 layers, sequence 2048), eager and compiled, both models,
    results in ./llama_report_cuda.csv (never the source tree's benchmarks/results unless --out says so)."""
    args = demo.parse_args(["--report", "--device", "cuda"])
    assert (args.dtype, args.size, args.d_model, args.layers, args.seq) == ("bf16", "h200", 2048, 8, 2048)
    assert args.modes == ["eager", "compiled"] and args.backends == ["opforge", "torch"]
    assert Path(args.csv) == Path(".") / "llama_report_<device>.csv"
    args = demo.parse_args(["--report", "--device", "cuda", "--out", "benchmarks/results"])
    assert Path(args.csv) == Path("benchmarks/results/llama_report_<device>.csv")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        demo.report(demo.parse_args(["--report", "--device", "cpu"]))


def _python_m_opforge(*argv, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "opforge", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("command", ["demo", "llama"])
def test_python_m_opforge_demo_is_the_llama_job(command, tmp_path):
    p = _python_m_opforge(command, "--size", "tiny", "--steps", "8", "--eval-every", "4", "--device", "cpu",
                          "--sample-bytes", "20", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    assert "opforge demo: Llama d_model=64" in out
    for column in ("train loss", "val loss", "tokens/s", "vs torch.nn", "peak memory"):
        assert column in out, column
    assert "loss agreement (fp32: every logged loss within 0.001 relative)" in out and "-> OK" in out
    assert "sample from the opforge model" in out and "\nAlice " in out
    assert (tmp_path / "opforge_demo_cpu.png").stat().st_size > 1000  # default PNG, in the current directory
    assert "8/8" in p.stderr  # the progress bar
    # a second run keeps the first run's plot and says where its own went
    p = _python_m_opforge(command, "--size", "tiny", "--steps", "2", "--eval-every", "1", "--device", "cpu",
                          "--sample-bytes", "0", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "opforge_demo_cpu-2.png").stat().st_size > 1000 and "opforge_demo_cpu-2.png" in p.stdout
    assert not (tmp_path / "benchmarks").exists()


def test_device_name_counts_threads_in_words():
    from opforge.demo.report import _device_name

    with demo._threads(1):
        assert _device_name(torch.device("cpu")) == "cpu (1 thread)"
    with demo._threads(2):
        assert _device_name(torch.device("cpu")) == "cpu (2 threads)"


def test_unique_path(tmp_path):
    assert demo.unique_path(tmp_path / "a.png") == tmp_path / "a.png"
    (tmp_path / "a.png").write_bytes(b"x")
    assert demo.unique_path(tmp_path / "a.png") == tmp_path / "a-2.png"
    (tmp_path / "a-2.png").write_bytes(b"x")
    assert demo.unique_path(tmp_path / "a.png") == tmp_path / "a-3.png"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line_and_exit_2(tmp_path):
    p = _python_m_opforge("demo", "--device", "cuda", "--size", "tiny", cwd=tmp_path)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--device cuda" in lines[0] and "--device cpu" in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_python_m_opforge_demo_module(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "opforge.demo", "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "python -m opforge.demo" in p.stdout and "--out" in p.stdout


def test_python_m_opforge_help_lists_the_commands(tmp_path):
    p = _python_m_opforge("--help", cwd=tmp_path)
    assert p.returncode == 0
    for command in ("demo", "llama", "digits", "doctor"):
        assert command in p.stdout
    p = _python_m_opforge("demo", "--help", cwd=tmp_path)
    assert p.returncode == 0 and "python -m opforge demo" in p.stdout and "h200" in p.stdout


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="needs scikit-learn (pip install scikit-learn)")
def test_digits_command(tmp_path):
    p = _python_m_opforge("digits", "--device", "cpu", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "test accuracy" in p.stdout


def test_report_keeps_the_other_runs_when_one_fails(tmp_path, monkeypatch):
    step = demo.Trainer.step

    def failing_step(self, i, record=True):
        if self.backend == "torch":
            raise RuntimeError("injected failure")
        return step(self, i, record)

    monkeypatch.setattr(demo.Trainer, "step", failing_step)
    argv = ["--report", "--allow-cpu-report", "--device", "cpu", "--d-model", "32", "--layers", "1", "--heads", "2",
            "--seq", "16", "--batch", "2", "--steps", "4", "--quiet", "--modes", "eager", "--csv", str(tmp_path / "r.csv")]
    out = demo.report(demo.parse_args(argv))
    assert [r["backend"] for r in out["results"]] == ["opforge"]
    assert len(out["failures"]) == 1 and "torch eager: RuntimeError: injected failure" in out["failures"][0]
    assert demo.main(argv) == 1


def test_readme_python_example_runs(tmp_path):
    """The README's ```python block (its "From Python" example) runs as written and prints a finite loss."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert blocks, "README.md has no ```python example"
    env = dict(os.environ)
    for i, code in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(code)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300)
        assert r.returncode == 0, f"README python block {i} failed:\n{r.stdout}\n{r.stderr}"
        assert r.stdout.strip(), f"README python block {i} printed nothing"
        loss = float(r.stdout.split()[0])  # the example prints the loss first
        assert math.isfinite(loss) and loss > 0, r.stdout
