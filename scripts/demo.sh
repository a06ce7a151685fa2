#!/usr/bin/env bash
# Quick start: installs what opforge's demo needs (torch 2.13.0 if no torch is installed, the build tools,
# scikit-learn and tqdm), builds and installs opforge with pip against that torch, then runs the demo:
# a small MLP made of opforge layers trained on scikit-learn's handwritten digits, next to the same model
# in plain torch.nn. Safe to run again: what is installed already is kept (ccache makes a rebuild quick).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install torch==2.13.0
fi
need=$("$PY" -c "import importlib.util as u; print(' '.join(r for m, r in [('scikit_build_core', 'scikit-build-core'), ('sklearn', 'scikit-learn'), ('tqdm', 'tqdm'), ('numpy', 'numpy')] if u.find_spec(m) is None))")
[ -z "$need" ] || "$PY" -m pip install $need
# CMake >= 3.26 and ninja: from PyPI when the machine's are missing or older.
export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
printf '3.26\n%s\n' "$(cmake --version 2>/dev/null | awk 'NR==1{print $3}')" | sort -V -C || "$PY" -m pip install "cmake>=3.26"
command -v ninja >/dev/null || "$PY" -m pip install ninja

# --no-build-isolation: build against the torch installed above (an isolated build would fetch another
# torch, and the library would not match the ABI of the torch you run).
"$PY" -m pip install --no-build-isolation .
cd /tmp && exec "$PY" -m opforge demo "$@"
