#!/bin/bash
# Zero-shot evaluation of a GPT checkpoint (Megatron-LM's examples/evaluate_zeroshot_gpt.sh): LAMBADA accuracy
# (--strict-lambada: the whole last word must be predicted) or, with TASK=WIKITEXT103, WikiText-103 perplexity
# (with --overlapping-eval windows and the adjusted, per-word perplexity). See docs/tasks.md.
#
#   VALID_DATA=lambada_test.jsonl CHECKPOINT=checkpoints/gpt2_345m bash examples/evaluate_zeroshot_gpt.sh
#   TASK=WIKITEXT103 VALID_DATA=wikitext-103/wiki.test.tokens CHECKPOINT=... bash examples/evaluate_zeroshot_gpt.sh
#
# Environment (defaults in brackets):
#   TASK             LAMBADA or WIKITEXT103                                                      [LAMBADA]
#   VALID_DATA       the LAMBADA JSON-lines file, or the WikiText file (its name must contain "wiki")
#                                                                                [data/lambada/lambada_test.jsonl]
#   CHECKPOINT       the GPT checkpoint directory (--load)                                 [checkpoints/gpt2_345m]
#   VOCAB_FILE / MERGE_FILE  GPT-2 vocab.json / merges.txt                    [the shipped data/tokenizers/gpt2 files]
#   GPUS_PER_NODE    processes (NPROC is accepted as an alias)                                             [8]
#   MASTER_ADDR / MASTER_PORT  rendezvous for torchrun                                         [localhost / 6000]
#   MEGATRON_EXTRA_ARGS  flags appended last (argparse keeps the last value of a repeated flag), e.g. the shape
#                    of a smaller model: the model flags must match the checkpoint's
# Megatron's script passed --batch-size 8, which its own argument checks reject; --micro-batch-size 8 is what its
# README uses. Without CUDA the run falls back to gloo on CPU.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous
TASK=${TASK:-LAMBADA}
VALID_DATA=${VALID_DATA:-data/lambada/lambada_test.jsonl}
CHECKPOINT=${CHECKPOINT:-checkpoints/gpt2_345m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/vocab.json}
MERGE_FILE=${MERGE_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/merges.txt}

DISTRIBUTED_ARGS=(--nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
                  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")

# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/tasks/main.py" \
    --task "$TASK" \
    --valid-data "$VALID_DATA" \
    --tokenizer-type GPT2BPETokenizer \
    --strict-lambada \
    --vocab-file "$VOCAB_FILE" \
    --merge-file "$MERGE_FILE" \
    --load "$CHECKPOINT" \
    --tensor-model-parallel-size 1 \
    --num-layers 24 \
    --hidden-size 1024 \
    --num-attention-heads 16 \
    --micro-batch-size 8 \
    --seq-length 1024 \
    --max-position-embeddings 1024 \
    --log-interval 10 \
    --fp16 \
    --no-load-optim \
    --no-load-rng \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
