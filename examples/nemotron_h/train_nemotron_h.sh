#!/bin/bash
# Nemotron-H (hybrid Mamba-2 / attention / squared-ReLU MLP layers) with torchrun and pretrain_mamba.py. The sizes
# default to Megatron-LM HEAD's Nemotron-H-8B-Base-8K configuration; every size is read from the environment, so
# the other Nemotron-H models (4B, 47B, 56B, Nemotron-Nano-9B-v2) and tiny test models use the same script.
# Nemotron-3 (the mixture-of-experts hybrids) is examples/nemotron_3/train_nemotron_3.sh, which sets the MoE sizes
# below and runs this script. Fine-tune from a Hugging Face checkpoint converted with
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver torch_dist \
#       --load-dir /path/to/Nemotron-H-8B-Base-8K --save-dir checkpoints/nemotron_h
#
# Environment (defaults in brackets):
#   CHECKPOINT_PATH   --save and --load                                                   [checkpoints/nemotron_h]
#   TOKENIZER_MODEL   a Hugging Face tokenizer directory (HuggingFaceTokenizer), or MOCK  [MOCK]
#   DATA_PATH         dataset prefix, or MOCK (--mock-data with NullTokenizer of VOCAB_SIZE) [MOCK]
#   HYBRID_LAYER_PATTERN  one character per layer: M Mamba, * attention, - MLP, E MoE; | pipeline segments
#                                                            [M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-]
#   HIDDEN_SIZE [4096]  FFN_HIDDEN_SIZE [21504]  NUM_ATTENTION_HEADS [32]  NUM_QUERY_GROUPS [8]  KV_CHANNELS [128]
#   MAMBA_NUM_HEADS [128]  MAMBA_HEAD_DIM [64]  MAMBA_NUM_GROUPS [8]  MAMBA_STATE_DIM [128]
#   POSITION_EMBEDDING_TYPE [rope]  ROTARY_PERCENT [0.5]  ROTARY_BASE [500000]  SEQ_LENGTH [4096]
#   MAX_POSITION_EMBEDDINGS [8192]  VOCAB_SIZE (MOCK only) [131072]  INIT_METHOD_STD [0.02]
#   NUM_EXPERTS (unset: no MoE layers), MOE_ROUTER_TOPK [6], MOE_FFN_HIDDEN_SIZE [FFN_HIDDEN_SIZE],
#   MOE_SHARED_EXPERT_INTERMEDIATE_SIZE [3712], MOE_ROUTER_TOPK_SCALING_FACTOR [2.5], MOE_AUX_LOSS_COEFF [1e-4],
#   MOE_LATENT_SIZE (unset: none)
#   TP [1]  PP [1]  EP [1]  MICRO_BATCH_SIZE [1]  GLOBAL_BATCH_SIZE [768]  TRAIN_ITERS [100000]  LR [3e-4]
#   GPUS_PER_NODE [8]  NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM too)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS). Without CUDA the run
# uses gloo on CPU (the Mamba scan is pure PyTorch either way); export MEGATRON_FORCE_CPU=1 to force that on a GPU.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
resolve_rendezvous

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/nemotron_h}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
DATA_PATH=${DATA_PATH:-MOCK}
FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-21504}

MODEL_ARGS=(
    --hybrid-layer-pattern "${HYBRID_LAYER_PATTERN:-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-}"
    --hidden-size "${HIDDEN_SIZE:-4096}"
    --ffn-hidden-size "$FFN_HIDDEN_SIZE"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-32}"
    --group-query-attention
    --num-query-groups "${NUM_QUERY_GROUPS:-8}"
    --kv-channels "${KV_CHANNELS:-128}"
    --mamba-num-heads "${MAMBA_NUM_HEADS:-128}"
    --mamba-head-dim "${MAMBA_HEAD_DIM:-64}"
    --mamba-num-groups "${MAMBA_NUM_GROUPS:-8}"
    --mamba-state-dim "${MAMBA_STATE_DIM:-128}"
    --position-embedding-type "${POSITION_EMBEDDING_TYPE:-rope}"
    --rotary-percent "${ROTARY_PERCENT:-0.5}"
    --rotary-base "${ROTARY_BASE:-500000}"
    --seq-length "${SEQ_LENGTH:-4096}"
    --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-8192}"
    --squared-relu
    --normalization RMSNorm
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --init-method-std "${INIT_METHOD_STD:-0.02}"
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

MOE_ARGS=()
if [ -n "${NUM_EXPERTS:-}" ]; then
    MOE_ARGS=(
        --num-experts "$NUM_EXPERTS"
        --moe-router-topk "${MOE_ROUTER_TOPK:-6}"
        --moe-ffn-hidden-size "${MOE_FFN_HIDDEN_SIZE:-$FFN_HIDDEN_SIZE}"
        --moe-shared-expert-intermediate-size "${MOE_SHARED_EXPERT_INTERMEDIATE_SIZE:-3712}"
        --moe-router-score-function sigmoid
        --moe-router-enable-expert-bias
        --moe-router-topk-scaling-factor "${MOE_ROUTER_TOPK_SCALING_FACTOR:-2.5}"
        --moe-router-dtype fp32
        --moe-router-load-balancing-type seq_aux_loss
        --moe-aux-loss-coeff "${MOE_AUX_LOSS_COEFF:-1e-4}"
        --moe-grouped-gemm
        --moe-token-dispatcher-type alltoall
        --expert-model-parallel-size "${EP:-1}"
    )
    if [ -n "${MOE_LATENT_SIZE:-}" ]; then
        MOE_ARGS+=(--moe-latent-size "$MOE_LATENT_SIZE")
    fi
fi

DATA_ARGS=(--split 99,1,0)
if [ "$TOKENIZER_MODEL" = MOCK ] || [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-131072}")
else
    DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --data-path "$DATA_PATH")
fi

TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}"
    --global-batch-size "${GLOBAL_BATCH_SIZE:-768}"
    --train-iters "${TRAIN_ITERS:-100000}"
    --lr "${LR:-3e-4}"
    --min-lr 3e-6
    --lr-decay-style cosine
    --lr-warmup-iters 100
    --weight-decay 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-1}"
    --pipeline-model-parallel-size "${PP:-1}"
    --use-distributed-optimizer
)
if [ "${TP:-1}" -gt 1 ]; then
    MODEL_PARALLEL_ARGS+=(--sequence-parallel)
fi

LOGGING_ARGS=(
    --log-interval 1
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --ckpt-format torch_dist
    --no-load-optim
    --no-load-rng
)

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

echo "launching pretrain_mamba.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_mamba.py" \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
