#!/bin/bash
# Nemotron-Mini-4B (a GPT model: LayerNorm with zero-centred gamma, squared-ReLU MLP, RoPE on half of each head,
# grouped-query attention) with torchrun and pretrain_gpt.py, with the sizes of Megatron-LM HEAD's
# Nemotron-Mini-4B-Instruct configuration as defaults; every size is read from the environment.
#
# Environment (defaults in brackets):
#   CHECKPOINT_PATH [checkpoints/nemotron_mini]  TOKENIZER_MODEL (Hugging Face tokenizer directory, or MOCK) [MOCK]
#   DATA_PATH (dataset prefix, or MOCK) [MOCK]  VOCAB_SIZE (MOCK only) [256000]
#   NUM_LAYERS [32]  HIDDEN_SIZE [3072]  FFN_HIDDEN_SIZE [9216]  NUM_ATTENTION_HEADS [24]  NUM_QUERY_GROUPS [8]
#   SEQ_LENGTH [4096]  MAX_POSITION_EMBEDDINGS [4096]  ROTARY_PERCENT [0.5]  ROTARY_BASE [10000]
#   TP [1]  PP [1]  MICRO_BATCH_SIZE [1]  GLOBAL_BATCH_SIZE [512]  TRAIN_ITERS [100000]  LR [3e-4]
#   GPUS_PER_NODE [8]  NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM too)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
resolve_rendezvous
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/nemotron_mini}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
DATA_PATH=${DATA_PATH:-MOCK}

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-32}"
    --hidden-size "${HIDDEN_SIZE:-3072}"
    --ffn-hidden-size "${FFN_HIDDEN_SIZE:-9216}"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-24}"
    --group-query-attention
    --num-query-groups "${NUM_QUERY_GROUPS:-8}"
    --seq-length "${SEQ_LENGTH:-4096}"
    --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-4096}"
    --position-embedding-type rope
    --rotary-percent "${ROTARY_PERCENT:-0.5}"
    --rotary-base "${ROTARY_BASE:-10000}"
    --normalization LayerNorm
    --apply-layernorm-1p
    --squared-relu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

DATA_ARGS=(--split 99,1,0)
if [ "$TOKENIZER_MODEL" = MOCK ] || [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-256000}")
else
    DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --data-path "$DATA_PATH")
fi

TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-512}"
    --train-iters "${TRAIN_ITERS:-100000}" --lr "${LR:-3e-4}" --min-lr 3e-6 --lr-decay-style cosine
    --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
    --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" --use-distributed-optimizer
    --log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist --no-load-optim --no-load-rng
)

echo "launching pretrain_gpt.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$MEGATRON_DIR/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@" ${MEGATRON_EXTRA_ARGS:-}
