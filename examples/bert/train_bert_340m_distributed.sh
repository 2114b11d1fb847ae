#!/bin/bash
# The "340M" BERT-Large model with torchrun (today's Megatron-LM examples/bert/train_bert_340m_distributed.sh):
# TP 8 x PP 16 as upstream (clipped to the world size when fewer processes run); micro batch 4, global 32; fp16.
#
#   CHECKPOINT_PATH=ckpt/bert DATA_PATH=data/my-bert_text_sentence bash examples/bert/train_bert_340m_distributed.sh
#
# Environment (defaults in brackets; upstream takes the first four as positional arguments, in this order):
#   CHECKPOINT_PATH        --save and --load                                       [checkpoints/bert_340m]
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir                                       [tensorboard_logs/bert_340m]
#   VOCAB_FILE             BERT WordPiece vocab.txt (lower case)        [the shipped data/tokenizers/bert/vocab.txt]
#   DATA_PATH              sentence-split dataset prefix (tools/preprocess_data.py --split-sentences)
#                                                                                  [data/my-bert_text_sentence]
#   GPUS_PER_NODE          processes per node (NPROC is accepted as an alias)      [8]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM inside an allocation)
#   MEGATRON_EXTRA_ARGS    flags appended last; argparse keeps the last value of a repeated flag
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert_340m}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-tensorboard_logs/bert_340m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/bert/vocab.txt}
DATA_PATH=${DATA_PATH:-data/my-bert_text_sentence}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

BERT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
    --attention-backend auto  # or flash / fused / unfused / local
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 32
    --train-iters 1000000
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
    --lr 0.0001
    --lr-decay-iters 990000
    --lr-decay-style linear
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
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

echo "launching pretrain_bert.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_bert.py" \
    "${BERT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
