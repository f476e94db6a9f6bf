#!/usr/bin/env bash
# One node's launch of a Megatron-LM checkout's pretrain_gpt.py with LoCo (the wrapper
# `python -m loco_megatron.training.run_megatron_lm`); slurm/pretrain.sbatch runs it on every node when
# MEGATRON_LM is set. Your arguments go to pretrain_gpt.py unchanged (add --loco-bits 4).
#
#   MEGATRON_LM=/path/to/Megatron-LM NNODES=2 NODE_RANK=0 MASTER_ADDR=host \
#     bash slurm/megatron_lm_node.sh <pretrain_gpt.py flags> --loco-bits 4
#
# Environment: MEGATRON_LM (required), NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1),
# MASTER_PORT (29517), GPUS_PER_NODE (else the GPUs are counted), NPROC (ranks per node; default
# the GPUs, 2 without a GPU: the wrapper then adds the CPU-compatible Megatron flags you did not pass),
# LOCO_PYTHON (the Python with loco-megatron installed; default this repository's .venv, built by
# install.sh), LOCO_DRY_RUN=1 (print the command instead of running it).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to the root of your Megatron-LM clone (the directory holding pretrain_gpt.py)}"
checkout=$(cd "$MEGATRON_LM" 2>/dev/null && pwd) || {
  echo "megatron_lm_node.sh: MEGATRON_LM=$MEGATRON_LM is not a directory: set it to the root of your Megatron-LM clone" >&2
  exit 2; }
if [ -z "${LOCO_PYTHON:-}" ]; then
  bash "$repo/install.sh"
  LOCO_PYTHON=$repo/.venv/bin/python
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
ngpu=${GPUS_PER_NODE:-$("$LOCO_PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)}
[ "$ngpu" -gt 0 ] && NPROC=${NPROC:-$ngpu} || NPROC=${NPROC:-2}
# Megatron asserts this for tensor parallelism on pre-Blackwell GPUs (and under the emulation).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# Triton compiles LoCo's kernels into a node-local cache, one per job (Slurm job id, else this
# launch), unless TRITON_CACHE_DIR is set: concurrent compiles into a shared ~/.triton on NFS fail.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/loco-triton-${SLURM_JOB_ID:-$$}}
# The job runs inside the checkout (below): a relative --config FILE is meant from here.
args=() config_next=0
for a in "$@"; do
  if [ "$config_next" = 1 ]; then [[ "$a" = /* ]] || a="$PWD/$a"; config_next=0
  elif [ "$a" = --config ]; then config_next=1
  elif [[ "$a" = --config=* && "${a#--config=}" != /* ]]; then a="--config=$PWD/${a#--config=}"
  fi
  args+=("$a")
done
launch=("$LOCO_PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK"
        --nproc-per-node "$NPROC" --master-addr "${MASTER_ADDR:-127.0.0.1}"
        --master-port "${MASTER_PORT:-29517}"
        -m loco_megatron.training.run_megatron_lm --megatron-lm "$checkout" ${args[@]+"${args[@]}"})
if [ -n "${LOCO_DRY_RUN:-}" ]; then
  printf 'node-env %s: TRITON_CACHE_DIR=%q\n' "$NODE_RANK" "$TRITON_CACHE_DIR"
  printf 'node %s:' "$NODE_RANK"; printf ' %q' "${launch[@]}"; printf '\n'
  exit 0
fi
cd "$checkout"  # as when running its pretrain_gpt.py by hand (relative data paths)
exec "${launch[@]}"
