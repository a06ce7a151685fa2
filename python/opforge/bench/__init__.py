"""Benchmarks: the shared harness (:mod:`opforge.bench.harness`) and ``python -m opforge bench``
(:mod:`opforge.bench.cli`), which runs every op family's benchmark (benchmarks/bench_<family>.py) on this
machine and prints one table with the ratios of opforge to eager, torch.compile and each installed peer."""
from . import harness
from .harness import CompiledPeer, Row, compiled, finish, time_fn

__all__ = ["harness", "CompiledPeer", "Row", "compiled", "finish", "time_fn"]
