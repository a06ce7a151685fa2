#!/usr/bin/env bash
# Quick start: installs what opforge's demo needs (torch 2.13.0 if no torch is installed, the build tools,
# tqdm, matplotlib, numpy), builds and installs opforge with pip against that torch, then runs the main job,
# `python -m opforge demo`: a Llama-style decoder built from opforge layers trained next to the same model in
# plain torch.nn on the bundled text (about two minutes on 2 CPU cores; on CUDA when a GPU is present),
# ending with a table (losses, tokens/s, peak memory), a PNG of both loss curves (opforge_demo_<device>.png in
# the current directory) and a generated sample. Arguments go to the demo (bash scripts/demo.sh --help).
# Safe to run again: what is installed already is kept (ccache makes a rebuild quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install torch==2.13.0
fi
need=$("$PY" -c "import importlib.util as u; print(' '.join(r for m, r in [('scikit_build_core', 'scikit-build-core'), ('tqdm', 'tqdm'), ('matplotlib', 'matplotlib'), ('numpy', 'numpy')] if u.find_spec(m) is None))")
[ -z "$need" ] || "$PY" -m pip install $need
# CMake >= 3.26 and ninja: from PyPI when the machine's are missing or older.
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
printf '3.26\n%s\n' "$(cmake --version 2>/dev/null | awk 'NR==1{print $3}')" | sort -V -C || "$PY" -m pip install "cmake>=3.26"
command -v ninja >/dev/null || "$PY" -m pip install ninja

# --no-build-isolation: build against the torch installed above (an isolated build would fetch another
# torch, and the library would not match the ABI of the torch you run).
# CMake finds torch through the interpreter's own prefix too (a venv that sees a system torch, for one).
export CMAKE_PREFIX_PATH="$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)')${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
"$PY" -m pip install --no-build-isolation .
# The commit recorded in --csv rows (the installed package has no .git to ask).
export OPFORGE_GIT_COMMIT=${OPFORGE_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}
# Run where the script was started (the PNG lands there), unless an opforge/ folder there would shadow the
# installed package.
cd "$OLDPWD" 2>/dev/null && [ ! -e opforge ] || cd /tmp
exec "$PY" -m opforge demo "$@"
