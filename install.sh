#!/usr/bin/env bash
# Set up (or update) the project's virtual environment: Python 3.12, torch, megatron-core 0.19.x,
# and this package with its test extras. Idempotent; fast when everything is already installed.
#   VENV=path (default .venv)   PYTHON=python3.12 interpreter to use
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=${VENV:-.venv}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "install.sh: Python 3.12 not found; set PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "install.sh: creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
stamp="$VENV/.loco-installed"
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ install.sh -nt "$stamp" ]; then
  # torch first: from the package index (its CUDA build also runs on CPU).
  "$VENV/bin/python" -c 'import torch' 2>/dev/null || { echo "install.sh: installing torch (large download)" >&2; "${PIP[@]}" torch; }
  echo "install.sh: installing loco-megatron and its dependencies" >&2
  "${PIP[@]}" -e ".[test]"
  touch "$stamp"
fi
