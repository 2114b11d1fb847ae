#!/bin/bash
# Llama-3 8B in bf16 with fully sharded data parallelism (torchrun): the model and training flags of
# examples/llama/train_llama3_8b.sh, the data-parallel part replaced by Megatron-FSDP (--use-megatron-fsdp, ZeRO-3
# by default, checkpoints in --ckpt-format fsdp_dtensor) or, with FSDP=torch, PyTorch FSDP2 (--use-torch-fsdp2,
# checkpoints in torch_dcp). Parameters, gradients and optimizer state are sharded over the data-parallel ranks,
# so the model trains without tensor or pipeline parallelism on 8 GPUs
# (python tools/report_theoretical_memory.py --world-size 8 <these flags> --memory-budget-gb 80 shows the split).
#
#   bash examples/megatron_fsdp/train_llama3_8b_fsdp.sh                 # mock data + NullTokenizer (vocab 128256)
#   SHARDING_STRATEGY=optim_grads bash examples/megatron_fsdp/train_llama3_8b_fsdp.sh        # ZeRO-2
#   FSDP=torch bash examples/megatron_fsdp/train_llama3_8b_fsdp.sh                           # PyTorch FSDP2
#   TOKENIZER_MODEL=/path/to/hf_tokenizer_dir DATA_PATH=data/llama_text_document bash examples/megatron_fsdp/...
#
# Environment (defaults in brackets):
#   FSDP                   megatron (--use-megatron-fsdp) or torch (--use-torch-fsdp2)        [megatron]
#   SHARDING_STRATEGY      --data-parallel-sharding-strategy: no_shard, optim, optim_grads, optim_grads_params
#                          (Megatron-FSDP only)                                               [optim_grads_params]
#   CHECKPOINT_PATH        --save and --load                                       [checkpoints/llama3_8b_fsdp]
#   TENSORBOARD_LOGS_PATH  --tensorboard-dir                                       [tensorboard_logs/llama3_8b_fsdp]
#   TOKENIZER_MODEL        a local Hugging Face tokenizer directory, or MOCK       [MOCK]
#   DATA_PATH              dataset prefix, or MOCK (--mock-data)                   [MOCK]
#   DATA_CACHE_PATH        --data-cache-path                                       [$PWD/benchmark_cache_llama3_8b]
#   GPUS_PER_NODE          processes per node                                      [8]
#   TP_SIZE / CP_SIZE      tensor- and context-parallel sizes (FSDP shards over DP x CP)   [1 / 1]
#   SEQ_LENGTH             --seq-length and --max-position-embeddings              [8192]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM inside an allocation)
#   MEGATRON_EXTRA_ARGS    flags appended last; argparse keeps the last value of a repeated flag
# FSDP needs CUDA_DEVICE_MAX_CONNECTIONS above 1 (Megatron's check): this script leaves it unset.
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
unset CUDA_DEVICE_MAX_CONNECTIONS

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
resolve_rendezvous

FSDP=${FSDP:-megatron}
SHARDING_STRATEGY=${SHARDING_STRATEGY:-optim_grads_params}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3_8b_fsdp}
TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-tensorboard_logs/llama3_8b_fsdp}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
DATA_PATH=${DATA_PATH:-MOCK}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-$PWD/benchmark_cache_llama3_8b}
mkdir -p "$DATA_CACHE_PATH"
TP_SIZE=${TP_SIZE:-1}
CP_SIZE=${CP_SIZE:-1}
SEQ_LENGTH=${SEQ_LENGTH:-8192}

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
    --normalization RMSNorm
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
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --calculate-per-token-loss
    --manual-gc
    --exit-duration-in-mins 235
)

if [ "$FSDP" = torch ]; then
    FSDP_ARGS=(
        --use-torch-fsdp2
        --no-gradient-accumulation-fusion
        --ckpt-format torch_dcp
    )
elif [ "$FSDP" = megatron ]; then
    FSDP_ARGS=(
        --use-megatron-fsdp
        --data-parallel-sharding-strategy "$SHARDING_STRATEGY"
        --no-gradient-accumulation-fusion
        --ckpt-format fsdp_dtensor
        --overlap-grad-reduce
        --overlap-param-gather
    )
else
    echo "error: FSDP must be megatron or torch, got '$FSDP'" >&2
    exit 1
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP_SIZE"
    --context-parallel-size "$CP_SIZE"
)
if [ "$TP_SIZE" -gt 1 ]; then MODEL_PARALLEL_ARGS+=(--sequence-parallel); fi

DATA_ARGS=(
    --data-cache-path "$DATA_CACHE_PATH"
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
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
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

echo "FSDP=$FSDP"
launch_pretrain_gpt "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${FSDP_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
