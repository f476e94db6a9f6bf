#!/usr/bin/env bash
# One-shot GPU check (docs/gpu_check.md): Triton kernel throughput vs copy bandwidth, the Triton
# kernels against the torch reference on CUDA, the kernels' compile check, pytest -m gpu, and the main job (run_pretrain.sh,
# bf16, --loco-bits 4, 50 iterations) on one GPU; at most 8 minutes; one report.
#
#   bash benchmarks/gpu_check.sh [--out benchmarks/results/gpu_check.md] [--budget 460]
#                                [--only throughput kernels compile pytest pretrain] [--logs DIR]
#
# Needs the venv of `bash install.sh`. Without a GPU it prints one line and exits 0.
# The logic: benchmarks/gpu_check.py (--help lists the options).
set -euo pipefail
export GPU_CHECK_CWD=$PWD   # relative --out / --logs are from where you ran this
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${VENV:-.venv}/bin/python
if [ ! -x "$PY" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no GPU on this machine (nvidia-smi not found; no $PY either); nothing to check"
    exit 0
  fi
  echo "gpu_check: $PY not found: run bash install.sh first" >&2
  exit 2
fi
exec "$PY" -m benchmarks.gpu_check "$@"
