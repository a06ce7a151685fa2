# Dependency bootstrap shared by .ci/run, scripts/test.sh and scripts/demo.sh. Source it, then call what you need:
#
#   source scripts/bootstrap.sh
#   ob_torch                          # torch 2.13.0 when no torch is installed (OB_TORCH_EXACT=1: unless 2.13.0)
#   ob_pip pytest tqdm sklearn=scikit-learn   # module[=requirement]: pip-installs the ones not importable
#   ob_build_tools                    # CMake >= 3.26 and ninja (from PyPI when missing or older)
#   ob_gtest                          # GoogleTest headers (apt-get, as root)
#   ob_apt ccache g++                 # system packages whose command is missing (apt-get, as root; it names
#                                     # them first, and without root prints the sudo command and fails)
#
# Everything goes into the Python of $PYTHON (default python3): a virtual environment when one is active
# (recommended: python3 -m venv .venv && . .venv/bin/activate), else the system's. ob_build_tools puts that
# Python's scripts folder (where pip puts cmake, ninja, pytest) first on PATH, and says so.
PY=${PYTHON:-python3}
OB_TORCH=${OB_TORCH:-torch==2.13.0}

ob_torch() {
  local want=${OB_TORCH#torch==}
  if [ "${OB_TORCH_EXACT:-0}" = 1 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$want' else 1)" 2>/dev/null \
      || "$PY" -m pip install -q "$OB_TORCH"
  else
    "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "$OB_TORCH"
  fi
}

ob_pip() {  # module[=requirement] ...: install the requirements whose module is not importable
  local need
  need=$("$PY" - "$@" <<'PYEOF'
import importlib.util, sys
out = []
for spec in sys.argv[1:]:
    mod, _, req = spec.partition("=")
    try:
        found = importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing (mkdocstrings_handlers.python)
        found = False
    if not found:
        out.append(req or mod)
print(" ".join(out))
PYEOF
)
  if [ -n "$need" ]; then "$PY" -m pip install -q $need; fi
}

ob_scripts_on_path() {
  local scripts
  scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  case ":$PATH:" in
    *":$scripts:"*) ;;
    *) echo "bootstrap: putting $scripts (pip's cmake, ninja, pytest) first on PATH for this script" >&2 ;;
  esac
  export PATH="$scripts:$PATH"
  hash -r
}

ob_build_tools() {  # CMake >= 3.26 (nvcc's C++20 flags; Debian 12 has 3.25) and ninja
  ob_scripts_on_path
  printf '3.26\n%s\n' "$(cmake --version 2>/dev/null | awk 'NR==1{print $3}')" | sort -V -C \
    || "$PY" -m pip install -q "cmake>=3.26"
  command -v ninja >/dev/null || "$PY" -m pip install -q ninja
  hash -r
}

ob_apt() {  # command names (or a path for a header); installs the Debian packages of the missing ones
  local pkgs=() c
  for c in "$@"; do
    case $c in
      gtest) [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] || pkgs+=(libgtest-dev) ;;
      ninja) command -v ninja >/dev/null || pkgs+=(ninja-build) ;;
      nm) command -v nm >/dev/null || pkgs+=(binutils) ;;
      *) command -v "$c" >/dev/null || pkgs+=("$c") ;;
    esac
  done
  [ ${#pkgs[@]} -gt 0 ] || return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "bootstrap: installing the system packages ${pkgs[*]} with apt-get (system packages need root; running as root)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
  else
    echo "bootstrap: missing the system packages ${pkgs[*]}; installing them needs root: run" \
         "sudo apt-get install ${pkgs[*]} (Debian/Ubuntu), then this script again" >&2
    return 1
  fi
}

ob_gtest() { ob_apt gtest; }
