#!/bin/bash
# The "175B" GPT-3 model with torchrun (today's Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh):
# TP 8 x PP 16 = 128 GPUs per model replica; global batch 1536, ramped up from 16 in steps of 16 over the first
# 5,859,375 samples; fp16; 500k iterations, cosine decay over 430k.
#
#   CHECKPOINT_PATH=ckpt/gpt3 DATA_PATH=data/my-gpt2_text_document bash examples/gpt3/train_gpt3_175b_distributed.sh
#
# Environment (defaults in brackets; upstream takes the first five as positional arguments, in this order):
#   CHECKPOINT_PATH        --save and --load                                       [checkpoints/gpt3_175b]
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir                                       [tensorboard_logs/gpt3_175b]
#   VOCAB_FILE / MERGE_FILE  GPT-2 vocab.json / merges.txt            [the shipped data/tokenizers/gpt2 files]
#   DATA_PATH              dataset prefix written by tools/preprocess_data.py      [data/my-gpt2_text_document]
#   RAMPUP_BATCH_SIZE      the --rampup-batch-size values; empty: no ramp-up       [16 16 5859375]
#   GPUS_PER_NODE          processes per node (NPROC is accepted as an alias)      [8]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM inside an allocation)
#   MEGATRON_EXTRA_ARGS    flags appended last; argparse keeps the last value of a repeated flag, so they
#                          override anything above (e.g. a tiny model, --train-iters 3, --distributed-backend gloo)
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt3_175b}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-tensorboard_logs/gpt3_175b}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/vocab.json}
MERGE_FILE=${MERGE_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/merges.txt}
DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}
RAMPUP_BATCH_SIZE=${RAMPUP_BATCH_SIZE-16 16 5859375}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto  # or flash / fused / unfused / local
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --train-iters 500000
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
)
if [ -n "$RAMPUP_BATCH_SIZE" ]; then
    # shellcheck disable=SC2206  # three numbers
    TRAINING_ARGS+=(--rampup-batch-size $RAMPUP_BATCH_SIZE)
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

echo "launching pretrain_gpt.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_gpt.py" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
