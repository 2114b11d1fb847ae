#!/bin/bash
# Finetune a BERT checkpoint on MNLI (Megatron-LM's examples/finetune_mnli_distributed.sh): the Classification
# model (BERT + pooler + 3-way linear head), 5 epochs, accuracy on dev_matched and dev_mismatched after each epoch,
# a checkpoint after each epoch. The GLUE files are the user's (https://gluebenchmark.com). See docs/tasks.md.
#
#   GLUE_DIR=data/glue_data PRETRAINED_CHECKPOINT=checkpoints/bert_345m bash examples/finetune_mnli_distributed.sh
#
# Environment (defaults in brackets):
#   GLUE_DIR         directory holding MNLI/train.tsv, MNLI/dev_matched.tsv, MNLI/dev_mismatched.tsv [data/glue_data]
#   TRAIN_DATA / VALID_DATA  the files themselves (VALID_DATA: space-separated)           [from GLUE_DIR]
#   PRETRAINED_CHECKPOINT  the BERT checkpoint to start from (torch format)              [checkpoints/bert_345m]
#   CHECKPOINT_PATH  where the finetuned model is saved                              [checkpoints/bert_345m_mnli]
#   VOCAB_FILE       BERT WordPiece vocab.txt (lower case)             [the shipped data/tokenizers/bert/vocab.txt]
#   GPUS_PER_NODE    processes (NPROC is accepted as an alias)                                             [8]
#   MASTER_ADDR / MASTER_PORT  rendezvous for torchrun                                         [localhost / 6000]
#   MEGATRON_EXTRA_ARGS  flags appended last (argparse keeps the last value of a repeated flag); add
#                    --load "$CHECKPOINT_PATH" to resume an interrupted finetuning
# Without CUDA the run falls back to gloo on CPU.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous
GLUE_DIR=${GLUE_DIR:-data/glue_data}
TRAIN_DATA=${TRAIN_DATA:-$GLUE_DIR/MNLI/train.tsv}
VALID_DATA=${VALID_DATA:-"$GLUE_DIR/MNLI/dev_matched.tsv $GLUE_DIR/MNLI/dev_mismatched.tsv"}
PRETRAINED_CHECKPOINT=${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/bert/vocab.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert_345m_mnli}

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

# shellcheck disable=SC2086  # VALID_DATA and MEGATRON_EXTRA_ARGS are lists: split them on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/tasks/main.py" \
    --task MNLI \
    --seed 1234 \
    --train-data "$TRAIN_DATA" \
    --valid-data $VALID_DATA \
    --tokenizer-type BertWordPieceLowerCase \
    --vocab-file "$VOCAB_FILE" \
    --epochs 5 \
    --pretrained-checkpoint "$PRETRAINED_CHECKPOINT" \
    --tensor-model-parallel-size 1 \
    --num-layers 24 \
    --hidden-size 1024 \
    --num-attention-heads 16 \
    --micro-batch-size 8 \
    --lr 5.0e-5 \
    --lr-decay-style linear \
    --lr-warmup-fraction 0.065 \
    --seq-length 512 \
    --max-position-embeddings 512 \
    --save-interval 500000 \
    --save "$CHECKPOINT_PATH" \
    --log-interval 10 \
    --eval-interval 100 \
    --eval-iters 50 \
    --weight-decay 1.0e-1 \
    --fp16 \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
