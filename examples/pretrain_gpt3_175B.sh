#!/bin/bash
# GPT-3 175B on 1024 GPUs with SLURM (Megatron-LM's examples/pretrain_gpt3_175B.sh, with --bf16):
# TP 8 x PP 16 = 128 GPUs per model replica, 128 nodes x 8 GPUs -> DP 8; global batch 1536 reached by a
# ramp-up from 16 sequences in steps of 16 over the first 5,859,375 samples.
#
#   sbatch examples/pretrain_gpt3_175B.sh
#
# srun starts one python process per GPU (8 tasks per node); every task finds its rank, the world size and its
# local rank in SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (megatron/training/launch_env.py), and the
# rendezvous host is the first node of the allocation (scontrol show hostnames, else our own parser).
#
# Environment (defaults in brackets):
#   MEGATRON_DIR       this repository (sbatch copies the script elsewhere: submit from the repository root)
#   DATASET_1/2/3      dataset prefixes blended 0.2 / 0.3 / 0.5                    [data/dataset_{1,2,3}_text_document]
#   DATASET            the whole --data-path value (overrides the blend above)
#   VOCAB_FILE / MERGE_FILE  GPT-2 vocab.json / merges.txt          [the shipped data/tokenizers/gpt2 files]
#   CHECKPOINT_PATH    --save and --load                                          [checkpoints/gpt3_175b]
#   TENSORBOARD_DIR    --tensorboard-dir                                          [tensorboard/gpt3_175b]
#   LOG_DIR            srun --output files                                        [logs]
#   CONTAINER_IMAGE / CONTAINER_MOUNTS  run inside a container with pyxis (srun --container-image)  [unset]
#   MASTER_PORT        rendezvous port                                            [6000]
#   MEGATRON_EXTRA_ARGS  flags appended last (argparse keeps the last value of a repeated flag)
# Extra command-line arguments of this script are passed on to pretrain_gpt.py too.

#SBATCH --nodes=128
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --job-name=megatron_gpt3_175b

set -euo pipefail

if [ -z "${MEGATRON_DIR:-}" ]; then
    MEGATRON_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    if [ ! -f "$MEGATRON_DIR/pretrain_gpt.py" ]; then MEGATRON_DIR=${SLURM_SUBMIT_DIR:-$PWD}; fi
fi
if [ ! -f "$MEGATRON_DIR/pretrain_gpt.py" ]; then
    echo "error: $MEGATRON_DIR/pretrain_gpt.py not found: set MEGATRON_DIR to the repository" >&2
    exit 1
fi
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

if [ -z "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" ]; then
    echo "error: not inside a SLURM allocation (SLURM_JOB_NODELIST is unset): submit with sbatch" >&2
    exit 1
fi
resolve_rendezvous
echo "SLURM job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s)," \
     "master $MASTER_ADDR:$MASTER_PORT"

DATETIME=$(date +'date_%y-%m-%d_time_%H-%M-%S')
LOG_DIR=${LOG_DIR:-logs}
mkdir -p "$LOG_DIR"

DATASET_1=${DATASET_1:-data/dataset_1_text_document}
DATASET_2=${DATASET_2:-data/dataset_2_text_document}
DATASET_3=${DATASET_3:-data/dataset_3_text_document}
DATASET=${DATASET:-"0.2 ${DATASET_1} 0.3 ${DATASET_2} 0.5 ${DATASET_3}"}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/vocab.json}
MERGE_FILE=${MERGE_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/merges.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt3_175b}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-tensorboard/gpt3_175b}

# shellcheck disable=SC2206  # DATASET is "weight prefix weight prefix ...": one flag value per word
options=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-samples 146484375
    --lr-decay-samples 126953125
    --lr-warmup-samples 183105
    --lr 6.0e-5
    --min-lr 6.0e-6
    --lr-decay-style cosine
    --log-interval 10
    --eval-iters 40
    --eval-interval 1000
    --data-path $DATASET
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --save-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --split 98,2,0
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --tensorboard-dir "$TENSORBOARD_DIR"
    --bf16
)

SRUN_ARGS=(-l "--output=$LOG_DIR/%x_%j_$DATETIME.log")
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    SRUN_ARGS+=("--container-image=$CONTAINER_IMAGE")
    if [ -n "${CONTAINER_MOUNTS:-}" ]; then SRUN_ARGS+=("--container-mounts=$CONTAINER_MOUNTS"); fi
fi

# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
srun "${SRUN_ARGS[@]}" "${PYTHON:-python}" -u "$MEGATRON_DIR/pretrain_gpt.py" "${options[@]}" "$@" ${MEGATRON_EXTRA_ARGS:-}
echo "done: logs in $LOG_DIR/${SLURM_JOB_NAME:-megatron_gpt3_175b}_${SLURM_JOB_ID:-}_$DATETIME.log"
