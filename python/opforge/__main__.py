"""``python -m opforge <command>``: command-line tools.

Commands:
    doctor   what is installed: torch, the opforge library and its build, devices, registered ops.
    demo     trains a small MLP made of opforge layers (opforge.nn.Linear + opforge.nn.Sigmoid) on
             scikit-learn's handwritten digits next to the same model in plain torch.nn (same seed,
             same initial weights, same batches) and prints both test accuracies. Needs scikit-learn
             and tqdm (``bash scripts/demo.sh`` installs them); downloads nothing.
    llama    trains a small Llama-style decoder of opforge layers (RMSNorm, SwiGLU MLP, linear) next to
             the same model in torch.nn on the bundled public-domain text (opforge/data/alice.txt),
             byte-level, and compares loss curves, tokens/s and memory (opforge.demo; ``--help``).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import opforge

_KEYS = ("CPU", "CUDA", "Meta", "Autograd", "CompositeExplicitAutograd", "CompositeImplicitAutograd")
_RUNS_ON_CPU = ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")


def _registered_ops() -> dict[str, list[str]]:
    """opforge op name -> dispatch keys that have a kernel for it."""
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("opforge::"))
    return {n: [k for k in _KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(n, k)] for n in names}


def doctor(args: argparse.Namespace) -> int:
    info = {}
    build_txt = opforge.library_path.parent / "opforge_build.txt"
    if build_txt.exists():
        info = dict(line.split("=", 1) for line in build_txt.read_text().split() if "=" in line)
    ops = _registered_ops()
    cuda_kernels = any("CUDA" in keys for keys in ops.values())
    print(f"opforge        {opforge.__version__}")
    print(f"library        {opforge.library_path}")
    print(f"built for      torch {info.get('torch', 'unknown')}, CUDA kernels: "
          f"{'yes' if cuda_kernels else 'no'}{'' if build_txt.exists() else ' (no opforge_build.txt: JIT build?)'}")
    print(f"torch          {torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU-only build'})")
    print(f"python         {sys.version.split()[0]}")
    print(f"cmake prefix   {opforge.cmake_prefix_path}")
    devices = ["cpu"] + [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    print(f"devices        {', '.join(devices)}")
    print(f"ops ({len(ops)})")
    width = max((len(n) for n in ops), default=0)
    for name, keys in ops.items():
        print(f"  {name:<{width}}  {' '.join(keys) if keys else '(schema only, no kernel)'}")
    problems = [n for n, keys in ops.items() if not set(keys) & set(_RUNS_ON_CPU)]
    if torch.cuda.is_available() and not cuda_kernels:
        problems.append("a GPU is present but the library has no CUDA kernels (rebuild with a CUDA torch and nvcc)")
    if problems:
        print("problems:\n  " + "\n  ".join(f"{p}: no CPU kernel" if "::" in p else p for p in problems))
    return 0


def _mlp(nn_module, in_features: int, hidden: int, classes: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(nn_module.Linear(in_features, hidden), nn_module.Sigmoid(),
                               nn_module.Linear(hidden, classes))


def demo(args: argparse.Namespace) -> int:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        from tqdm import tqdm
    except ImportError as e:
        print(f"opforge demo needs scikit-learn and tqdm ({e}); `bash scripts/demo.sh` installs them, "
              "or: pip install scikit-learn tqdm", file=sys.stderr)
        return 1

    device = torch.device(args.device)
    # A tiny model: intra-op threads only add overhead (and contend on a busy machine).
    torch.set_num_threads(1)
    digits = load_digits()  # 1797 8x8 images of handwritten digits, shipped with scikit-learn
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.25, random_state=args.seed, stratify=digits.target)
    as_tensor = lambda a, dtype: torch.as_tensor(a, dtype=dtype, device=device)  # noqa: E731
    x_train, x_test = as_tensor(x_train, torch.float32), as_tensor(x_test, torch.float32)
    y_train, y_test = as_tensor(y_train, torch.long), as_tensor(y_test, torch.long)

    torch.manual_seed(args.seed)
    models = {"opforge": _mlp(opforge.nn, x_train.shape[1], args.hidden, 10).to(device)}
    models["torch.nn"] = _mlp(torch.nn, x_train.shape[1], args.hidden, 10).to(device)
    models["torch.nn"].load_state_dict(copy.deepcopy(models["opforge"].state_dict()))  # same initial weights

    print(f"handwritten digits (scikit-learn): {len(x_train)} train / {len(x_test)} test images of 8x8 pixels, "
          f"10 classes; MLP 64-{args.hidden}-10 with sigmoid, SGD lr={args.lr} momentum=0.9, "
          f"{args.epochs} epochs of batches of {args.batch_size}, on {device}")
    results = {}
    for name, model in models.items():
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        start = time.perf_counter()
        losses = []
        for epoch in tqdm(range(args.epochs), desc=f"{name:>8}", unit="epoch", leave=True):
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(args.seed + epoch))
            total = 0.0
            for i in range(0, len(order), args.batch_size):
                idx = order[i:i + args.batch_size].to(device)
                loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
            losses.append(total / len(x_train))
        seconds = time.perf_counter() - start
        with torch.no_grad():
            logits = model(x_test)
        results[name] = dict(loss=losses[-1], first_loss=losses[0], logits=logits,
                             accuracy=(logits.argmax(1) == y_test).float().mean().item(), seconds=seconds)

    print(f"\n{'model':<10}{'first loss':>12}{'final loss':>12}{'test accuracy':>15}{'train time':>12}")
    for name, r in results.items():
        print(f"{name:<10}{r['first_loss']:>12.4f}{r['loss']:>12.4f}{r['accuracy']:>14.2%}{r['seconds']:>11.2f}s")
    a, b = results["opforge"], results["torch.nn"]
    agree = (a["logits"].argmax(1) == b["logits"].argmax(1)).float().mean().item()
    print(f"\nopforge test accuracy {a['accuracy']:.2%}, torch.nn test accuracy {b['accuracy']:.2%}; "
          f"the two models predict the same class for {agree:.1%} of the test images "
          f"(max logit difference {(a['logits'] - b['logits']).abs().max().item():.2e})")
    ok = a["accuracy"] >= 0.9 and abs(a["accuracy"] - b["accuracy"]) <= 0.02
    if not ok:
        print("demo: opforge's model did not match torch.nn's (accuracy below 90% or more than 2 points apart)",
              file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["llama"]:  # its own options: python -m opforge llama --help
        from . import demo as llama_demo

        return llama_demo.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m opforge", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("llama", help="train a Llama-style model of opforge layers next to torch.nn's on bundled text "
                                 "(options: python -m opforge llama --help)")
    sub.add_parser("doctor", help="torch and opforge versions, library, devices, registered ops")
    d = sub.add_parser("demo", help="train an opforge MLP and a torch.nn MLP on handwritten digits")
    d.add_argument("--epochs", type=int, default=30)
    d.add_argument("--hidden", type=int, default=128)
    d.add_argument("--lr", type=float, default=0.1)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    return {"doctor": doctor, "demo": demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
