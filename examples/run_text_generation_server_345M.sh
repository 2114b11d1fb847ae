#!/bin/bash
# Serve the 345M GPT-2 model over Megatron's REST API (Megatron-LM's examples/run_text_generation_server_345M.sh):
# tools/run_text_generation_server.py loads the checkpoint and answers `PUT /api` on port 5000, e.g.
#
#   CHECKPOINT=checkpoints/gpt2_345m bash examples/run_text_generation_server_345M.sh
#   python tools/text_generation_cli.py localhost:5000
#
# Environment (defaults in brackets):
#   CHECKPOINT       the checkpoint directory to --load                        [checkpoints/gpt2_345m]
#   VOCAB_FILE / MERGE_FILE  GPT-2 vocab.json / merges.txt          [the shipped data/tokenizers/gpt2 files]
#   GPUS_PER_NODE    processes (= --tensor-model-parallel-size here; NPROC is an alias)   [1]
#   MASTER_ADDR / MASTER_PORT  torchrun's rendezvous                           [localhost / 6000]
#   MEGATRON_EXTRA_ARGS  flags appended last (argparse keeps the last value of a repeated flag), e.g. --port
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-1}}
resolve_rendezvous
CHECKPOINT=${CHECKPOINT:-checkpoints/gpt2_345m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/vocab.json}
MERGE_FILE=${MERGE_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/merges.txt}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/tools/run_text_generation_server.py" \
    --tensor-model-parallel-size "$GPUS_PER_NODE" \
    --pipeline-model-parallel-size 1 \
    --num-layers 24 \
    --hidden-size 1024 \
    --load "$CHECKPOINT" \
    --num-attention-heads 16 \
    --max-position-embeddings 1024 \
    --tokenizer-type GPT2BPETokenizer \
    --fp16 \
    --micro-batch-size 1 \
    --seq-length 1024 \
    --out-seq-length 1024 \
    --temperature 1.0 \
    --vocab-file "$VOCAB_FILE" \
    --merge-file "$MERGE_FILE" \
    --top_p 0.9 \
    --seed 42 \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
