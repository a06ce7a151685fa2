"""Registers, spills and stack frame of every kernel in one CUDA source file, from ptxas, on a machine without a GPU.

A kernel variant's occupancy is decided by its registers per thread; on rope every candidate kernel that
needed more registers than the one it meant to replace measured slower on the H200, which a local compile tells
before any GPU time is spent. This recompiles one object of the CUDA build in build/cuda (configured by
``bash scripts/cuda_compile_check.sh``; its TORCH_CUDA_ARCH_LIST, 9.0 by default) with ``-Xptxas -v`` into a
temporary folder (the build's own object and dependency file are left alone) and prints one line per kernel:
registers, spill stores and loads (bytes), stack frame (bytes), the demangled name (``c++filt`` when installed), and,
when the build compiles for several architectures (ptxas then reports each kernel once per arch), its arch first.
The source is a path relative to the current folder, or else to the repository root, or absolute.

    python3 scripts/kernel_resources.py csrc/ops/rope/rope_cuda.cu
    python3 scripts/kernel_resources.py csrc/ops/rope/rope_cuda.cu --filter token_kernel --filter BFloat16

Exit status: 0 when the file compiled, 2 when there is no configured build, no ninja, or no object of that file in
the build, else the compiler's status (its output printed).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_ptxas(text: str) -> list:
    """[(registers, spill_stores, spill_loads, stack, mangled name, arch)] from ptxas -v output, one per compiled entry
    and arch (e.g. "sm_90")."""
    out, name, arch, frame = [], None, "", (0, 0, 0)
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            name, arch, frame = m.group(1), m.group(2), (0, 0, 0)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out.append((int(m.group(1)), frame[1], frame[2], frame[0], name, arch))
            name = None
    return out


def demangle(names: list) -> list:
    """The names through c++filt (as given where it is not installed)."""
    if not names or shutil.which("c++filt") is None:
        return names
    p = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    lines = p.stdout.splitlines()
    return lines if p.returncode == 0 and len(lines) == len(names) else names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", help="a .cu file of the library, e.g. csrc/ops/rope/rope_cuda.cu")
    ap.add_argument("--build", default=str(ROOT / "build" / "cuda"), help="the configured CUDA build folder")
    ap.add_argument("--filter", action="append", default=[], help="keep kernels whose name contains this (repeatable)")
    a = ap.parse_args(argv)
    build = Path(a.build)
    if not (build / "build.ninja").exists():
        print(f"kernel_resources: no {build}/build.ninja; configure it with: bash scripts/cuda_compile_check.sh",
              file=sys.stderr)
        return 2
    source = Path(a.source)
    if not source.is_absolute() and not source.exists() and (ROOT / source).exists():
        source = ROOT / source  # relative to the repository root
    rel = os.path.relpath(source.resolve(), ROOT)
    target = f"CMakeFiles/opforge.dir/{rel}.o"
    if Path(rel).name.startswith("gemm_sm90_"):  # the CUTLASS kernels' object library (cmake/sm90/CMakeLists.txt)
        target = f"sm90/CMakeFiles/opforge_sm90.dir/__/__/{rel}.o"
    if shutil.which("ninja") is None:
        print("kernel_resources: no ninja on PATH (pip's is in the folder of python3 -c 'import sysconfig; "
              "print(sysconfig.get_path(\"scripts\"))')", file=sys.stderr)
        return 2
    p = subprocess.run(["ninja", "-C", str(build), "-t", "commands", target], capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        print(f"kernel_resources: ninja knows no object {target}:\n{p.stderr}", file=sys.stderr)
        return 2
    command = p.stdout.strip().splitlines()[-1]
    compiled = re.search(r"\s-c\s+(\S+)", command)
    if compiled and Path(build, compiled.group(1)).resolve() != source.resolve():
        print(f"kernel_resources: {build} compiles {compiled.group(1)}, not {source.resolve()}: its figures follow",
              file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        obj, dep = os.path.join(tmp, "kernel.o"), os.path.join(tmp, "kernel.o.d")
        # the output and the dependency file (-MD -MF) into the temporary folder: the build's own stay as they are
        command = re.sub(r"\s-o\s+\S+", lambda m: f" -o {obj}", command, count=1)
        command = re.sub(r"\s-MF\s+\S+", lambda m: f" -MF {dep}", command, count=1) + " -Xptxas -v"
        c = subprocess.run(command, shell=True, cwd=build, capture_output=True, text=True)
    if c.returncode != 0:
        print(c.stdout + c.stderr, file=sys.stderr)
        return c.returncode
    rows = parse_ptxas(c.stdout + c.stderr)
    names = demangle([r[4] for r in rows])
    archs = len({r[5] for r in rows}) > 1  # one line per kernel and arch: say which
    print(f"{'arch':8s}" * archs + f"{'regs':>4} {'spill st':>8} {'spill ld':>8} {'stack':>5}  kernel ({rel})")
    for (regs, st, ld, stack, _, arch), name in zip(rows, names):
        if all(f in name for f in a.filter):
            print(f"{arch:8s}" * archs + f"{regs:4d} {st:8d} {ld:8d} {stack:5d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
