#!/bin/bash
# Pretrain the "345M" GPT-2 model with tensor (TP 2) and pipeline (PP 2) model parallelism and sequence
# parallelism (Megatron-LM's examples/pretrain_gpt_distributed_with_mp.sh): DP = GPUS_PER_NODE x NNODES / (TP x PP).
#
# Environment (defaults in brackets):
#   CHECKPOINT_PATH  where to save and load checkpoints                       [checkpoints/gpt2_345m]
#   DATA_PATH        dataset prefix written by tools/preprocess_data.py      [data/my-gpt2_text_document]
#   VOCAB_FILE / MERGE_FILE  GPT-2 vocab.json / merges.txt          [the shipped data/tokenizers/gpt2 files]
#   GPUS_PER_NODE    processes per node (NPROC is accepted as an alias)      [8]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous; inside a SLURM allocation they
#                    default to SLURM_JOB_NUM_NODES / SLURM_NODEID / the first host of SLURM_JOB_NODELIST
#                    (one torchrun per node: srun --ntasks-per-node=1 bash examples/pretrain_gpt_distributed_with_mp.sh)  [1 / 0 / localhost / 6000]
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag, so they
#                    override anything above (e.g. a tiny model, --train-iters 3, --distributed-backend gloo)
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_345m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/vocab.json}
MERGE_FILE=${MERGE_FILE:-$MEGATRON_DIR/data/tokenizers/gpt2/merges.txt}
DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

GPT_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
    --micro-batch-size 4
    --global-batch-size 16
    --lr 0.00015
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --fp16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --data-impl mmap
    --split 949,50,1
)

OUTPUT_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
)

echo "launching pretrain_gpt.py: $NNODES node(s) x $GPUS_PER_NODE process(es) = world size $WORLD_SIZE," \
     "node rank $NODE_RANK, master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_gpt.py" \
    "${GPT_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --distributed-backend nccl \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
