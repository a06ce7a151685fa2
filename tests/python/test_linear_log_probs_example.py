"""examples/post_training.py at its tiny size: DPO fine-tuning on opforge.linear_preference_loss and JSD distillation
on opforge.linear_jsd each train like the eager PyTorch math from the same initialisation on the same batches (every
logged loss within the example's REL_TOL), and the losses move (the runs train at all)."""
import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "post_training.py"


def _load():
    spec = importlib.util.spec_from_file_location("post_training_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_post_training_example_curves_agree(tmp_path, capsys):
    ex = _load()
    curves = ex.run(ex.TINY)
    for name in ("dpo", "distill"):
        pair = curves[name]
        assert len(pair["opforge"]) == len(pair["eager"]) == ex.TINY.steps
        d = ex.disagreement(pair["opforge"], pair["eager"])
        assert d <= ex.REL_TOL, f"{name}: the opforge and eager curves differ by {d:.2e} > {ex.REL_TOL}"
        assert pair["eager"][-1] < pair["eager"][0], f"{name}: the eager run did not train"
    assert ex.disagreement([1.0, 0.5], [1.0, 0.6]) > ex.REL_TOL  # the rule sees a real difference
    png = tmp_path / "curves.png"
    ex.plot(curves, png)
    assert png.stat().st_size > 0


def test_post_training_example_rule_sees_a_wrong_loss():
    """A slightly wrong DPO loss (β 5 % off in the eager run) moves the curve past REL_TOL: the rule can fail."""
    ex = _load()
    size = ex.TINY
    tokens = ex.load_text()
    base = ex.pretrain(ex._model(size.d_model, size.layers, 0), tokens, size, size.pretrain_steps, 1)
    batches = ex.dpo_batches(tokens, size, size.steps, 2)
    ours = ex.run_dpo(base, batches, size, ex.opforge_dpo_loss)
    wrong = ex.run_dpo(base, batches, size, ex.eager_dpo_loss, beta=0.105)
    assert ex.disagreement(ours, wrong) > ex.REL_TOL
