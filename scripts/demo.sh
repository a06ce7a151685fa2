#!/usr/bin/env bash
# Quick start: installs what opforge's demo needs into the current Python -- a virtual environment if one is
# active, else the system's (torch 2.13.0 if no torch is installed, the build tools -- pip's cmake and ninja,
# whose folder goes first on PATH --, tqdm, matplotlib, numpy; scripts/bootstrap.sh), builds and installs
# opforge with pip against that torch, then runs the main job, `python -m opforge demo`: a Llama-style decoder
# built from opforge layers trained next to the same model in plain torch.nn on the bundled text (about two
# minutes on 2 CPU cores; on CUDA when a GPU is present), ending with a table (losses, tokens/s, peak memory), a
# PNG of both loss curves (opforge_demo_<device>.png in the current directory, -2, -3, ... when taken) and a
# generated sample. Arguments go to the demo (bash scripts/demo.sh --help).
# System packages: the pip build needs a C++ compiler; without one it installs g++ with apt-get, which needs root
# (it says so first; without root it prints the sudo command and stops). ccache, when installed
# (apt-get install ccache), serves a rebuild from its cache; without it the first build takes 4.5-6 minutes on
# 2 cores. The build stays in build/<wheel tag>/, which scripts/test.sh then reuses.
# Safe to run again: what is installed already is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

. scripts/bootstrap.sh
ob_torch
ob_pip scikit_build_core=scikit-build-core tqdm matplotlib numpy
ob_build_tools
# The pip build's C++ compiler (CMake takes $CXX, else c++): g++ from apt-get where there is none.
command -v "${CXX:-c++}" >/dev/null || command -v g++ >/dev/null || ob_apt g++

# --no-build-isolation: build against the torch installed above (an isolated build would fetch another
# torch, and the library would not match the ABI of the torch you run).
# CMake finds torch through the interpreter's own prefix too (a venv that sees a system torch, for one).
export CMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
# pip shows nothing of the build until it ends (a few minutes the first time on 2 cores): say so, and with
# OPFORGE_BUILD_VERBOSE=1 show the compiler's progress (pip -v)
echo "demo.sh: building and installing opforge with pip (the first build compiles the C++ library: about 4.5-6 min on 2 cores without ccache, quiet until it ends; OPFORGE_BUILD_VERBOSE=1 shows it)"
pip_v=(); [ "${OPFORGE_BUILD_VERBOSE:-0}" = 1 ] && pip_v=(-v)
"$PY" -m pip install "${pip_v[@]}" --no-build-isolation .
# The commit recorded in --csv rows (the installed package has no .git to ask).
export OPFORGE_GIT_COMMIT=${OPFORGE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}
# Run where the script was started (the PNG lands there), unless an opforge/ folder there would shadow the
# installed package.
cd "$OLDPWD" 2>/dev/null && [ ! -e opforge ] || cd /tmp
exec "$PY" -m opforge demo "$@"
