#!/bin/bash
# Pretrain the 220M T5 model on one GPU (Megatron-LM's examples/pretrain_t5.sh), mainly for debugging.
#
#   DATA_PATH=my-t5_text_sentence CHECKPOINT_PATH=checkpoints/t5_220m bash examples/pretrain_t5.sh
#
# Environment (defaults in brackets):
#   CHECKPOINT_PATH  where to save and load checkpoints                       [checkpoints/t5_220m]
#   DATA_PATH        sentence-split dataset prefix (tools/preprocess_data.py --split-sentences, BERT vocab)
#                                                                             [data/my-t5_text_sentence]
#   VOCAB_FILE       BERT WordPiece vocab.txt (lower case; the script adds 100 sentinels with --vocab-extra-ids)
#                                                                             [the shipped data/tokenizers/bert/vocab.txt]
#   GPUS_PER_NODE    processes to start (NPROC is accepted as an alias)      [1]
#   MASTER_ADDR / MASTER_PORT  rendezvous for torchrun                       [localhost / 6000]
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag, so they
#                    override anything above (e.g. a tiny model, --train-iters 3, --distributed-backend gloo)
# Extra command-line arguments of this script are passed to pretrain_t5.py too (before MEGATRON_EXTRA_ARGS).
# The decoder has --num-layers layers unless --decoder-num-layers is given (Megatron 2023 needed that flag).
# On a machine without CUDA the run uses gloo on CPU; export MEGATRON_FORCE_CPU=1 to do so on a GPU machine.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export CUDA_DEVICE_MAX_CONNECTIONS=1

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/t5_220m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/bert/vocab.txt}
DATA_PATH=${DATA_PATH:-data/my-t5_text_sentence}
GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-1}}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

T5_ARGS=(
    --num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --kv-channels 64
    --ffn-hidden-size 3072
    --encoder-seq-length 512
    --decoder-seq-length 128
    --max-position-embeddings 512
    --micro-batch-size 16
    --global-batch-size 16
    --lr 0.0001
    --train-iters 1000000
    --lr-decay-iters 1000000
    --lr-decay-style linear
    --min-lr 0.00001
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --fp16
    --vocab-extra-ids 100
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --data-impl mmap
    --split 949,50,1
)

OUTPUT_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
)

# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun --nproc_per_node "$GPUS_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    "$MEGATRON_DIR/pretrain_t5.py" \
    "${T5_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
