"""The demo's promise on a short run: the opforge and torch.nn models' loss curves agree by the demo's
rule (fp32: every logged loss within 1e-3 relative) and the loss falls; the outputs are written."""
import csv

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
                            "--csv", str(tmp_path / "r.csv")])
    out = demo.report(args)
    assert len(out["results"]) == 2 and all(r["tokens_per_s"] > 0 for r in out["results"])
    assert "vs torch compiled" in capsys.readouterr().out
