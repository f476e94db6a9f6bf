#!/usr/bin/env bash
# Pretrain a small GPT with LoCo 4-bit gradient reduce-scatter through Megatron's own training loop.
#
#   bash run_pretrain.sh [--config configs/FILE.yaml] [Megatron-LM / --loco-* flags ...]
#
# Sets up .venv if needed, prepares the default real corpus (this Python's standard-library
# sources -> locally trained BPE tokenizer -> Megatron indexed dataset, cached) unless you pass
# --data-path or --mock-data, then launches torch.distributed.run:
#   * GPUs present: one rank per local GPU, NCCL;
#   * no GPU: 2 CPU ranks (DP=2) with gloo through the CUDA emulation.
# Your flags come after the defaults, so they win (e.g. --loco-bits 16 --train-iters 50); a
# --config YAML file sits in between (docs/configs.md).
# Environment: NPROC (ranks per node), LOCO_DATA_DIR (corpus cache), OUT_DIR (default
# runs/<time>), MASTER_PORT; multi-node (slurm/pretrain.sbatch sets these): NNODES, NODE_RANK,
# MASTER_ADDR, GPUS_PER_NODE (skips probing the GPUs); LOCO_DRY_RUN=1 prints the launch command
# instead of running it.
set -euo pipefail
caller_dir=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")"
bash install.sh
PY=.venv/bin/python
# megatron-core < 0.17 has no megatron.training: say so before preparing the corpus.
"$PY" -c 'import sys; from loco_megatron.megatron.compat import missing_megatron_training as m
sys.exit(m("run_pretrain.sh") and "error: " + m("run_pretrain.sh"))'

# --config FILE (YAML; docs/configs.md; a relative FILE is found from where you ran this script)
# is expanded here, so the file's flags come after this script's defaults and before your other
# flags: command line > YAML > defaults.
for a in "$@"; do
  case "$a" in --config|--config=*)
    line=$(repo=$PWD; cd "$caller_dir" && PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" \
           "$repo/$PY" -m loco_megatron.cli.yaml_config "$@")
    eval "set -- $line"
    break ;;
  esac
done

user_data=0 loco_default=(--loco-bits 4)
for a in "$@"; do
  # (any of Megatron's data flags: with the default corpus's --data-path added, Megatron would
  # silently train on it instead of --train/valid/test-data-path or --per-split-data-args-path)
  case "$a" in --data-path|--data-path=*|--mock-data|--train-data-path|--train-data-path=*|\
    --valid-data-path|--valid-data-path=*|--test-data-path|--test-data-path=*|--data-args-path|\
    --data-args-path=*|--per-split-data-args-path|--per-split-data-args-path=*) user_data=1 ;; esac
  # Megatron's --yaml-cfg replaces the whole namespace; a default --loco-bits on the command line
  # would then count as yours and beat the YAML's loco: section.
  case "$a" in --yaml-cfg|--yaml-cfg=*) loco_default=() ;; esac
done
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
ngpu=${GPUS_PER_NODE:-$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)}
if [ "$ngpu" -gt 0 ]; then
  NPROC=${NPROC:-$ngpu}
  hw_args=(--distributed-backend nccl)
  "$PY" -c 'import transformer_engine' 2>/dev/null && hw_args+=(--transformer-impl transformer_engine) \
    || hw_args+=(--transformer-impl local --no-gradient-accumulation-fusion)
else
  NPROC=${NPROC:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  hw_args=(--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion
           --use-cpu-initialization --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion
           --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm)
fi

# Bad --loco-* values, and settings the ranks would refuse, fail here, in a second, before the
# corpus is prepared or ranks start, with the ranks' own line: the preflight sees the defaults
# LoCo's checks read (--use-distributed-optimizer, the default --loco-bits) and the world size.
WORLD_SIZE=$((NPROC * NNODES)) "$PY" -m loco_megatron.cli.preflight --use-distributed-optimizer \
  ${loco_default[@]+"${loco_default[@]}"} "$@" || exit 2

data_args=()
if [ "$user_data" = 0 ]; then
  echo "run_pretrain.sh: preparing the default corpus (cached after the first run)" >&2
  line=$("$PY" -m loco_megatron.data.prepare | tail -n 1)
  eval "$line"   # sets DATA_PREFIX and TOKENIZER_DIR
  data_args=(--data-path "$DATA_PREFIX" --tokenizer-type HuggingFaceTokenizer
             --tokenizer-model "$TOKENIZER_DIR")
fi

# Megatron asserts this for tensor parallelism on pre-Blackwell GPUs (and under the emulation).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# Triton compiles LoCo's kernels into a node-local cache, one per job (Slurm job id, else this
# launch), unless TRITON_CACHE_DIR is set: concurrent compiles into a shared ~/.triton on NFS fail.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/loco-triton-${SLURM_JOB_ID:-$$}}
OUT_DIR=${OUT_DIR:-runs/$(date +%Y%m%d-%H%M%S)}
model_args=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
            --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size $((4 * NPROC * NNODES))
            --train-iters 300 --split 98,1,1 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20
            --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --use-distributed-optimizer
            --log-interval 10 --eval-interval 100 --eval-iters 10 --tensorboard-dir "$OUT_DIR/tensorboard"
            ${loco_default[@]+"${loco_default[@]}"})
# A run shorter than the learning-rate warm-up fails here in a line, not in Megatron's assertion.
"$PY" -m loco_megatron.cli.schedule "${model_args[@]}" "$@" || exit 2
launch=("$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK"
        --nproc-per-node "$NPROC" --master-addr "${MASTER_ADDR:-127.0.0.1}"
        --master-port "${MASTER_PORT:-29517}"
        -m loco_megatron.training.pretrain_gpt "${hw_args[@]}" "${model_args[@]}" "${data_args[@]}" "$@")
if [ -n "${LOCO_DRY_RUN:-}" ]; then
  printf 'node-env %s: TRITON_CACHE_DIR=%q\n' "$NODE_RANK" "$TRITON_CACHE_DIR"
  printf 'node %s:' "$NODE_RANK"; printf ' %q' "${launch[@]}"; printf '\n'
  exit 0
fi
mkdir -p "$OUT_DIR"
echo "run_pretrain.sh: $NNODES node(s) x $NPROC ranks, logs and TensorBoard in $OUT_DIR" >&2
exec "${launch[@]}"
