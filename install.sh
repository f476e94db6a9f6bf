#!/usr/bin/env bash
# Set up (or update) the project's virtual environment: Python 3.12, torch, megatron-core 0.19.x,
# and this package with its test extras. Idempotent; fast when everything is already installed.
#   VENV=path (default .venv)   PYTHON=python3.12 interpreter to use
# Compatibility legs (docs/compatibility.md), e.g. megatron-core 0.16.1 on Python 3.11:
#   PYTHON=python3.11 MCORE_VERSION=0.16.1 VENV=.venv-py311 bash install.sh
#   (run again with another MCORE_VERSION to switch that venv's megatron-core in place)
#   MCORE_VERSION=0.13.1 | 0.16.1 | ... (default: the newest 0.19.x)
#   TORCH_VERSION=2.13.0 (default on Python 3.11: the CPU build on local disk; on 3.12: any)
# Megatron-Bridge (docs/megatron_bridge.md): VARIANT=bridge bash install.sh makes .venv-bridge with
#   the pinned megatron-bridge (--no-deps) and its curated dependencies, both from ONE file:
#   tools/bridge/requirements.txt
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VARIANT=${VARIANT:-}
case "$VARIANT" in
  "") VENV=${VENV:-.venv} ;;
  bridge) VENV=${VENV:-.venv-bridge} ;;
  *) echo "install.sh: VARIANT=$VARIANT is not known (use VARIANT=bridge, or leave it unset)" >&2; exit 1 ;;
esac
if [ -n "${PYTHON:-}" ]; then WANT_PY=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
  || { echo "install.sh: PYTHON=$PYTHON does not run" >&2; exit 1; }
else WANT_PY=3.12; fi

find_python() {
  local c
  for c in "${PYTHON:-}" python$WANT_PY "$HOME"/.pyenv/versions/$WANT_PY*/bin/python$WANT_PY /usr/bin/python$WANT_PY; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$WANT_PY'" 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  return 1
}

case "$WANT_PY" in
  3.12) TORCH_VERSION=${TORCH_VERSION:-} ;;
  3.10|3.11) TORCH_VERSION=${TORCH_VERSION:-2.13.0} ;;  # the CPU wheel on local disk, no CUDA download
  *) echo "install.sh: Python $WANT_PY is not supported (3.12; 3.11 for megatron-core < 0.17)" >&2; exit 1 ;;
esac
MCORE_SPEC="megatron-core>=0.19,<0.20"
[ -z "${MCORE_VERSION:-}" ] || MCORE_SPEC="megatron-core==$MCORE_VERSION"

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "install.sh: Python $WANT_PY not found; set PYTHON=/path/to/python$WANT_PY" >&2; exit 1; }
  echo "install.sh: creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
stamp="$VENV/.loco-installed"
# The stamp holds the versions asked for (empty by default), so a venv is switched in place when
# MCORE_VERSION / TORCH_VERSION change (the CI's compatibility legs share one Python 3.11 venv).
want="${MCORE_VERSION:+megatron-core==$MCORE_VERSION }${TORCH_VERSION:+torch==$TORCH_VERSION}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
   || [ install.sh -nt "$stamp" ] \
   || [ "$(cat "$stamp")" != "$want" ]; then
  # torch first: from the package index (its CUDA build also runs on CPU), or the pinned version.
  if [ -n "$TORCH_VERSION" ]; then
    "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null \
      || { echo "install.sh: installing torch==$TORCH_VERSION" >&2; "${PIP[@]}" "torch==$TORCH_VERSION"; }
  else
    "$VENV/bin/python" -c 'import torch' 2>/dev/null || { echo "install.sh: installing torch (large download)" >&2; "${PIP[@]}" torch; }
  fi
  echo "install.sh: installing loco-megatron with $MCORE_SPEC and its dependencies" >&2
  # A pinned torch stays as installed above (keeps pip from replacing it with a CUDA build).
  "${PIP[@]}" -e ".[test,bench]" "$MCORE_SPEC" ${TORCH_VERSION:+"torch==$TORCH_VERSION"}
  printf '%s' "$want" > "$stamp"
fi
if [ "$VARIANT" = bridge ]; then
  reqs=tools/bridge/requirements.txt
  bstamp="$VENV/.loco-bridge-installed"
  if [ ! -f "$bstamp" ] || [ "$reqs" -nt "$bstamp" ] || [ install.sh -nt "$bstamp" ]; then
    pin=$(grep -E '^megatron-bridge==' "$reqs")
    echo "install.sh: installing $pin (--no-deps) and the dependencies listed in $reqs" >&2
    "${PIP[@]}" --no-deps "$pin"
    # The installed torch and megatron-core stay: pip may not swap them for the deps' wishes.
    torch_pin="torch==$("$VENV/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')"
    "${PIP[@]}" -r <(grep -vE '^megatron-bridge==' "$reqs") "$MCORE_SPEC" "$torch_pin"
    touch "$bstamp"
  fi
fi
