#!/bin/bash
# The 220M T5 model with torchrun (today's Megatron-LM examples/t5/train_t5_220m_distributed.sh): 12 + 12 layers,
# hidden 768, encoder 512 / decoder 128 tokens, micro batch 64, global 512, bf16, BERT cased vocabulary with 100
# sentinels.
#
#   CHECKPOINT_PATH=ckpt/t5 DATA_PATH=data/my-t5_text_document bash examples/t5/train_t5_220m_distributed.sh
#
# Environment (defaults in brackets; upstream takes the first four as positional arguments, in this order):
#   CHECKPOINT_PATH        --save and --load                                       [checkpoints/t5_220m]
#   TENSORBOARD_DIR        --tensorboard-dir                                       [tensorboard_logs/t5_220m]
#   VOCAB_FILE             BERT WordPiece vocab.txt (cased upstream: bert-large-cased-vocab.txt)
#                                                                   [the shipped data/tokenizers/bert/vocab.txt]
#   DATA_PATH              dataset prefix (tools/preprocess_data.py; _text_document or _text_sentence)
#                                                                                  [data/my-t5_text_document]
#   GPUS_PER_NODE          processes per node (NPROC is accepted as an alias)      [8]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM inside an allocation)
#                                                                                  [1 / 0 / localhost / 29500]
#   MEGATRON_EXTRA_ARGS    flags appended last; argparse keeps the last value of a repeated flag
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
# --transformer-impl transformer_engine falls back to local when Transformer Engine is not installed.
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
MASTER_PORT=${MASTER_PORT:-29500}
resolve_rendezvous

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/t5_220m}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-tensorboard_logs/t5_220m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/bert/vocab.txt}
DATA_PATH=${DATA_PATH:-data/my-t5_text_document}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

T5_ARGS=(
    --encoder-num-layers 12
    --decoder-num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --kv-channels 64
    --ffn-hidden-size 3072
    --encoder-seq-length 512
    --decoder-seq-length 128
    --max-position-embeddings 512
    --micro-batch-size 64
    --global-batch-size 512
    --lr 0.0001
    --train-iters 1000000
    --lr-decay-iters 1000000
    --lr-decay-style linear
    --min-lr 0.00001
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --bf16
    --vocab-extra-ids 100
    --init-method-std 0.015
    --transformer-impl transformer_engine
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --attention-backend auto
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --tokenizer-type BertWordPieceCase
    --split 99982,9,9
)

OUTPUT_ARGS=(
    --log-interval 100
    --tensorboard-dir "$TENSORBOARD_DIR"
    --save-interval 500
    --eval-interval 1000
    --eval-iters 10
)

echo "launching pretrain_t5.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_t5.py" \
    "${T5_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --distributed-backend nccl \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
