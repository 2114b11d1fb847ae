#!/bin/bash
# Pretrain the 220M T5 model with tensor model parallelism 2 (Megatron-LM's
# examples/pretrain_t5_distributed_with_mp.sh): DP = GPUS_PER_NODE x NNODES / 2.
# Environment (defaults in brackets):
#   CHECKPOINT_PATH  where to save and load checkpoints                       [checkpoints/t5_220m]
#   DATA_PATH        sentence-split dataset prefix (tools/preprocess_data.py --split-sentences, BERT vocab)
#                                                                             [data/my-t5_text_sentence]
#   VOCAB_FILE       BERT WordPiece vocab.txt (lower case; the script adds 100 sentinels with --vocab-extra-ids)
#                                                                             [the shipped data/tokenizers/bert/vocab.txt]
#   GPUS_PER_NODE    processes per node (NPROC is accepted as an alias)      [8]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous; inside a SLURM allocation they
#                    default to SLURM_JOB_NUM_NODES / SLURM_NODEID / the first host of SLURM_JOB_NODELIST
#                    (one torchrun per node: srun --ntasks-per-node=1 bash examples/<this script>)  [1 / 0 / localhost / 6000]
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

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/t5_220m}
VOCAB_FILE=${VOCAB_FILE:-$MEGATRON_DIR/data/tokenizers/bert/vocab.txt}
DATA_PATH=${DATA_PATH:-data/my-t5_text_sentence}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

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
    --global-batch-size 128
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

echo "launching pretrain_t5.py: $NNODES node(s) x $GPUS_PER_NODE process(es) = world size $WORLD_SIZE," \
     "node rank $NODE_RANK, master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_t5.py" \
    "${T5_ARGS[@]}" \
    --tensor-model-parallel-size 2 \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --distributed-backend nccl \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
