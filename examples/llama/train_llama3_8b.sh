#!/bin/bash
# Llama-3 8B in bf16 with torchrun: today's Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh without its FP8
# flags (FP8 is not implemented in this library yet; --fp8-format stops with an error). 32 layers, hidden 4096,
# SwiGLU 14336, 32 heads with 8 query groups, RoPE base 1e6, sequence 8192; GBS 128; decoupled embedding/output LR;
# distributed optimizer with overlapped gradient reduction and parameter gathering.
#
#   bash examples/llama/train_llama3_8b.sh                       # mock data + NullTokenizer (vocabulary 128256)
#   TOKENIZER_MODEL=/path/to/hf_tokenizer_dir DATA_PATH=data/llama_text_document bash examples/llama/train_llama3_8b.sh
#
# Environment (defaults in brackets; upstream takes the first four as positional arguments, in this order):
#   CHECKPOINT_PATH        --save and --load                                       [checkpoints/llama3_8b]
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir                                       [tensorboard_logs/llama3_8b]
#   TOKENIZER_MODEL        a local Hugging Face tokenizer directory, or MOCK       [MOCK]
#   DATA_PATH              dataset prefix, or MOCK (--mock-data)                   [MOCK]
#   DATA_CACHE_PATH        --data-cache-path                                       [$PWD/benchmark_cache_llama3_8b]
#   GPUS_PER_NODE          processes per node (NPROC is accepted as an alias)      [8]
#   TP_SIZE / CP_SIZE      tensor- and context-parallel sizes                      [1 / 1]
#   CP_COMM_TYPE           --cp-comm-type: p2p (ring) or all_gather                [p2p]
#   SEQ_LENGTH             --seq-length and --max-position-embeddings              [8192]
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

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3_8b}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-tensorboard_logs/llama3_8b}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
DATA_PATH=${DATA_PATH:-MOCK}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-$PWD/benchmark_cache_llama3_8b}
mkdir -p "$DATA_CACHE_PATH"

TP_SIZE=${TP_SIZE:-1}
CP_SIZE=${CP_SIZE:-1}
CP_COMM_TYPE=${CP_COMM_TYPE:-p2p}
SEQ_LENGTH=${SEQ_LENGTH:-8192}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --train-samples 1953125000
    --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP_SIZE"
    --context-parallel-size "$CP_SIZE"
    --cp-comm-type "$CP_COMM_TYPE"
    --sequence-parallel
)

DATA_ARGS=(
    --data-cache-path "$DATA_CACHE_PATH"
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files
    --num-workers 1
    --vocab-size 128256
)
if [ "$TOKENIZER_MODEL" = MOCK ] || [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --tiktoken-pattern v2)
else
    DATA_ARGS+=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 32
    --eval-interval 100
    --save-interval 1000
    --log-throughput
    --profile
    --profile-step-start 4
    --profile-step-end 6
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

echo "launching pretrain_gpt.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
