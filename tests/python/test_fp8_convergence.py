"""FP8 in the demo's model: `Llama(fp8=...)` runs fp8_linear in exactly the four projections of every block and is
within the FP8 tolerance rule of the unquantized model; `python -m opforge demo --fp8` trains it and refuses what
cannot work; `--convergence` (FP8 tensorwise and rowwise against two bf16 runs from two init seeds, the CPU default
size) passes, and fails when a wrongly scaled gradient is injected into the FP8 projections.

The FP8 tolerance rule (as in tests/python/test_fp8_patch.py): against the float32 model without FP8, the FP8
model's norm-relative error of the logits, the loss and each parameter's gradient is at most 2 × that of torch's
own composition of the same FP8 math (conformance.py's `_fp8_linear_baseline`: the recipe's cast by torch ops and
`torch._scaled_mm`, as torchao composes them) in each projection of the same model, plus 2⁻⁴ · 10⁻²; the logits'
error is at least 10⁻⁴ (FP8 in effect: e4m3 rounds each operand by up to 2⁻⁴).
"""
import csv
import json

import pytest
import torch

import opforge
from opforge import demo
from opforge import testing as T
from opforge.demo import convergence as C
from opforge.models.llama import Llama, LlamaConfig

from conformance import _fp8_linear_baseline

GRANS = ["tensorwise", "rowwise"]
PROJECTIONS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
CFG = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=32)
SLACK = 2 ** -4 * 1e-2

pytestmark = pytest.mark.usefixtures("one_thread")


class _CountFP8(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the weight shape of every FP8 linear forward (fp8_linear, or its private forms below autograd: the
    forward that also returns q(inputᵀ), the one with the weight's operands precomputed)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if name.startswith(("opforge::fp8_linear", "opforge::_fp8_linear")) and "backward" not in name:
            self.shapes.append(tuple(args[1].shape))
        return func(*args, **(kwargs or {}))


def _model(device, fp8=None):
    torch.manual_seed(0)
    return Llama(LlamaConfig(**CFG), backend="opforge", device=device, fp8=fp8)


def _tokens(device):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 24), generator=g).to(device), torch.randint(0, 256, (2, 24), generator=g).to(device)


def _step(model, x, y):
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(x).float()
    loss = model.loss(x, y)
    loss.backward()
    return logits, loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _errors(run, ref):
    out = {"logits": T.relative_error(run[0], ref[0]), "loss": T.relative_error(run[1], ref[1])}
    out.update({n: T.relative_error(run[2][n], ref[2][n]) for n in ref[2]})
    return out


@pytest.mark.parametrize("granularity", GRANS)
def test_llama_fp8_within_the_rule_of_the_unquantized_model(device, granularity):
    ref = _model(device)
    ours = _model(device, granularity)
    base = _model(device)
    for block in base.layers:
        for name in PROJECTIONS:
            lin = block.get_submodule(name)
            lin.forward = (lambda x, lin=lin: _fp8_linear_baseline(x, lin.weight, lin.bias, granularity=granularity))
    x, y = _tokens(device)
    r = _step(ref, x, y)
    e_ours, e_base = _errors(_step(ours, x, y), r), _errors(_step(base, x, y), r)
    assert len(e_ours) == 2 + len(dict(ref.named_parameters()))
    for what, e in e_ours.items():
        assert e <= 2 * e_base[what] + SLACK, f"{what}: error {e:.3g} > 2 × torch's FP8 composition's {e_base[what]:.3g}"
    assert e_ours["logits"] >= 1e-4, "no FP8 rounding in the logits: FP8 not in effect"


@pytest.mark.parametrize("granularity", GRANS)
def test_llama_fp8_covers_the_block_projections_only(granularity):
    model = _model("cpu", granularity)
    assert model.fp8 == granularity and set(model.state_dict()) == set(_model("cpu").state_dict())
    for block in model.layers:
        for name in PROJECTIONS:
            lin = block.get_submodule(name)
            assert isinstance(lin, opforge.nn.Linear) and lin.fp8 == granularity, name
    assert model.lm_head.fp8 is None and not isinstance(model.embed, opforge.nn.Linear)
    cfg = model.config
    with _CountFP8() as rec:
        model.loss(*_tokens("cpu")).backward()
    per_block = [(3 * cfg.d_model, cfg.d_model), (cfg.d_model, cfg.d_model), (2 * cfg.d_ff, cfg.d_model),
                 (cfg.d_model, cfg.d_ff)]
    assert sorted(rec.shapes) == sorted(per_block * cfg.n_layers)  # no lm_head (loss: linear_cross_entropy)


def test_llama_fp8_refusals():
    with pytest.raises(ValueError, match="needs backend='opforge'"):
        Llama(LlamaConfig(**CFG), backend="torch", fp8="tensorwise")
    with pytest.raises(ValueError, match="expected fp8 to be None, 'tensorwise' or 'rowwise', but got 'blockwise'"):
        Llama(LlamaConfig(**CFG), fp8="blockwise")


def test_demo_fp8_trains_the_opforge_model_alone(tmp_path):
    args = demo.parse_args(["--size", "tiny", "--steps", "12", "--device", "cpu", "--quiet", "--eval-every", "6",
                            "--fp8", "tensorwise", "--plot", "", "--csv", str(tmp_path / "d.csv"), "--sample-bytes", "0"])
    assert args.backends == ["opforge"]
    with demo._threads(1):
        out = demo.run(args)
    r = out["results"]["opforge"]
    assert set(out["results"]) == {"opforge"} and "agreement" not in out
    assert r["train_loss"][-1] < r["train_loss"][0] - 0.5
    assert [row["backend"] for row in csv.DictReader((tmp_path / "d.csv").open())] == ["opforge fp8 tensorwise"]


@pytest.mark.parametrize("argv, message", [
    (["--fp8", "tensorwise", "--backends", "opforge,torch"], "--fp8 tensorwise trains the opforge model only"),
    (["--convergence", "--backends", "torch"], "--convergence trains the opforge model only"),
    (["--fp8", "rowwise", "--report"], "expected no --fp8 with it"),
    (["--convergence", "--report"], "expected no --convergence with it"),
    (["--convergence", "--parallel", "ddp"], "--convergence trains on one device"),
])
def test_demo_fp8_refuses_what_cannot_work(argv, message):
    with pytest.raises(SystemExit, match=message):
        demo.parse_args(["--device", "cpu", *argv])


def test_demo_fp8_refuses_where_fp8_linear_does(monkeypatch, capsys):
    assert demo.fp8_unavailable_message("rowwise", "cpu", "bf16") is None

    def refuse(*args, **kwargs):
        raise RuntimeError("opforge::fp8_linear: this device has no FP8 GEMM\nsecond line")

    monkeypatch.setattr(opforge.functional, "fp8_linear", refuse)
    msg = demo.fp8_unavailable_message("tensorwise", "cpu", "fp32")
    assert msg == ("opforge demo: --fp8 tensorwise on cpu with --dtype fp32: opforge.fp8_linear refused it: "
                   "RuntimeError: opforge::fp8_linear: this device has no FP8 GEMM")
    assert demo.main(["--fp8", "tensorwise", "--device", "cpu", "--size", "tiny", "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "opforge.fp8_linear refused it" in err[0]


def test_convergence_defaults():
    a = demo.parse_args(["--convergence", "--device", "cpu"])
    assert (a.size, a.d_model, a.layers, a.steps, a.lr, a.dtype, a.backends, a.threads) == \
        ("tiny", 64, 2, C.CPU_STEPS, 1e-3, "bf16", ["opforge"], 1)
    a = demo.parse_args(["--convergence", "--device", "cuda"])
    assert (a.size, a.d_model, a.layers, a.seq, a.batch, a.steps, a.lr, a.dtype) == \
        ("h200", 2048, 8, 2048, 8, C.CUDA_STEPS, 1e-4, "bf16")
    assert C.CUDA_STEPS >= 500
    a = demo.parse_args(["--convergence", "--device", "cpu", "--size", "small"])  # a named size keeps its own run
    assert (a.steps, a.lr) == (450, 1.5e-3)
    assert [s["label"] for s in C.run_specs(3, None, "bf16")] == ["bf16 A", "bf16 B", "fp8 tensorwise A", "fp8 rowwise A"]
    assert [(s["init_seed"], s["fp8"]) for s in C.run_specs(3, "rowwise", "bf16")] == [(3, None), (4, None), (3, "rowwise")]


def test_seed_spread_and_check_rules():
    a = demo.Result("opforge", False, train_loss=[5.5, 5.0, 4.0, 3.0], val_steps=[2, 4], val_loss=[4.9, 3.1])
    b = demo.Result("opforge", False, train_loss=[5.0, 5.1, 4.1, 3.3], val_steps=[2, 4], val_loss=[5.0, 3.2])
    s = demo.seed_spread(a, b, skip=1)  # step 1's 0.5 left out
    assert s["bound"] == pytest.approx((0.1 + 0.1 + 0.3) / 3) and s["max"] == pytest.approx(0.3)
    run = demo.Result("opforge", False, train_loss=[5.5, 5.1, 3.9, 3.1], val_steps=[2, 4], val_loss=[4.95, 3.0])
    c = demo.check_run(run, a, s["bound"])
    assert c["ok"] and c["over"] == 0 and c["max_diff"] == pytest.approx(0.1)
    run.val_loss[1] = 3.3  # one validation loss past the bound
    c = demo.check_run(run, a, s["bound"])
    assert not c["ok"] and c["over"] == 1 and c["worst"] == "val step 4"
    run.val_loss[1], run.train_loss[2] = 3.0, float("nan")
    assert not demo.check_run(run, a, s["bound"])["ok"]
    assert not demo.check_run(demo.Result("opforge", False, train_loss=[5.5, 5.0, 4.0], val_steps=[2, 4],
                                          val_loss=[4.9, 3.1]), a, s["bound"])["ok"]  # fewer logged steps
    with pytest.raises(ValueError, match="expected more than 4 logged steps"):
        demo.seed_spread(a, b, skip=4)


def test_convergence_cpu_default_passes(tmp_path):
    """The CI run: `python -m opforge demo --convergence --device cpu` (size tiny, 150 steps, lr 1e-3, bf16)."""
    assert demo.main(["--convergence", "--device", "cpu", "--quiet", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "fp8_convergence_cpu.json").read_text())
    assert out["ok"] and set(out["checks"]) == {"fp8 tensorwise A", "fp8 rowwise A"}
    bound = out["spread"]["bound"]
    assert 0 < bound == out["spread"]["mean"] and out["spread"]["skip"] == 15
    runs = out["runs"]
    a = runs["bf16 A"]
    assert len(a["train_loss"]) == 150 and a["val_steps"] == [30, 60, 90, 120, 150]
    assert a["train_loss"][-1] < a["train_loss"][0] - 2.0  # it trains (from ln 256 ≈ 5.5)
    for label, c in out["checks"].items():
        r = runs[label]
        diffs = [abs(p - q) for p, q in zip(r["train_loss"] + r["val_loss"], a["train_loss"] + a["val_loss"])]
        assert c["ok"] and max(diffs) == pytest.approx(c["max_diff"]) and max(diffs) <= bound, label
        assert max(diffs) > 0, f"{label}: the same losses as bf16: FP8 not in effect"
    rows = list(csv.DictReader((tmp_path / "fp8_convergence_cpu.csv").open()))
    assert len(rows) == 4 * (150 + 5) and {r["run"] for r in rows} == set(runs)
    assert (tmp_path / "fp8_convergence_cpu.png").stat().st_size > 10_000


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the embedding: its input (tokens) has no grad
def test_convergence_fails_with_a_wrongly_scaled_fp8_gradient(tmp_path):
    """A test-only fault: the input gradient of every FP8 projection doubled (a scale applied twice). The FP8 run
    leaves the band within the run, and the command exits 1."""
    calls = []

    def double_grad_input(module, grad_input, grad_output):
        if isinstance(module, opforge.nn.Linear) and module.fp8:
            calls.append(1)
            return tuple(None if g is None else 2 * g for g in grad_input)
        return None

    handle = torch.nn.modules.module.register_module_full_backward_hook(double_grad_input)
    try:
        rc = demo.main(["--convergence", "--device", "cpu", "--fp8", "tensorwise", "--steps", "80", "--quiet",
                        "--out", str(tmp_path), "--plot", ""])
    finally:
        handle.remove()
    out = json.loads((tmp_path / "fp8_convergence_cpu.json").read_text())
    c = out["checks"]["fp8 tensorwise A"]
    assert calls, "the fault was never injected"
    assert rc == 1 and not out["ok"] and not c["ok"]
    assert c["max_diff"] > 3 * out["spread"]["bound"] and c["over"] > 10, c
