"""Benchmarks: the shared harness (`opforge.bench.harness`), the op families' suites
(`opforge.bench.suites`) and ``python -m opforge bench`` (`opforge.bench.cli`), which runs every suite on
this machine and prints one table per op with the ratios of opforge to eager PyTorch, torch.compile and each
installed peer."""
from . import harness
from .harness import CompiledPeer, Row, compiled, finish, time_fn

__all__ = ["harness", "CompiledPeer", "Row", "compiled", "finish", "time_fn"]
