#!/bin/bash
# Finetune a BERT checkpoint on RACE (Megatron-LM's examples/finetune_race_distributed.sh): the MultipleChoice
# model (BERT + pooler + one score per option), 3 epochs on the middle-school training set, accuracy on the middle-
# and high-school dev sets after each epoch. The RACE data is the user's (its directories of *.txt JSON lines).
# See docs/tasks.md.
#
#   RACE_DIR=data/RACE PRETRAINED_CHECKPOINT=checkpoints/bert_345m bash examples/finetune_race_distributed.sh
#
# Environment (defaults in brackets):
#   RACE_DIR         directory holding train/middle, dev/middle, dev/high                               [data/RACE]
#   TRAIN_DATA / VALID_DATA  the directories themselves (VALID_DATA: space-separated)     [from RACE_DIR]
#   PRETRAINED_CHECKPOINT  the BERT checkpoint to start from (torch format)              [checkpoints/bert_345m]
#   CHECKPOINT_PATH  where the finetuned model is saved                              [checkpoints/bert_345m_race]
#   VOCAB_FILE       BERT WordPiece vocab.txt (lower case)             [the shipped data/tokenizers/bert/vocab.txt]
#   GPUS_PER_NODE    processes (NPROC is accepted as an alias)                                             [8]
#   MASTER_ADDR / MASTER_PORT  rendezvous for torchrun                                         [localhost / 6000]
#   MEGATRON_EXTRA_ARGS  flags appended last (argparse keeps the last value of a repeated flag)
# Without CUDA the run falls back to gloo on CPU.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous
RACE_DIR=${RACE_DIR:-data/RACE}
TRAIN_DATA=${TRAIN_DATA:-$RACE_DIR/train/middle}
VALID_DATA=${VALID_DATA:-"$RACE_DIR/dev/middle $RACE_DIR/dev/high"}
PRETRAINED_CHECKPOINT=${PRETRAINED_CHECKPOINT:-checkpoints/bert_345m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/bert/vocab.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert_345m_race}

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

# shellcheck disable=SC2086  # VALID_DATA and MEGATRON_EXTRA_ARGS are lists: split them on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/tasks/main.py" \
    --task RACE \
    --seed 1234 \
    --train-data "$TRAIN_DATA" \
    --valid-data $VALID_DATA \
    --tokenizer-type BertWordPieceLowerCase \
    --vocab-file "$VOCAB_FILE" \
    --epochs 3 \
    --pretrained-checkpoint "$PRETRAINED_CHECKPOINT" \
    --tensor-model-parallel-size 1 \
    --num-layers 24 \
    --hidden-size 1024 \
    --num-attention-heads 16 \
    --micro-batch-size 4 \
    --lr 1.0e-5 \
    --lr-decay-style linear \
    --lr-warmup-fraction 0.06 \
    --seq-length 512 \
    --max-position-embeddings 512 \
    --save-interval 100000 \
    --save "$CHECKPOINT_PATH" \
    --log-interval 10 \
    --eval-interval 100 \
    --eval-iters 50 \
    --weight-decay 1.0e-1 \
    --clip-grad 1.0 \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --fp16 \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
