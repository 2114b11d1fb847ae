#!/bin/bash
# Qwen2.5 / Qwen3 / Qwen3-MoE with torchrun and pretrain_gpt.py: the flags of Megatron-LM HEAD's Qwen configurations
# (examples/post_training/modelopt/conf/Qwen/*.sh there), every size read from the environment. Fine-tunes from a
# Hugging Face checkpoint converted once:
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver torch_dist \
#       --load-dir /path/to/Qwen3-30B-A3B --save-dir checkpoints/qwen3_30b_a3b
#   QWEN_MODEL=qwen3_moe CHECKPOINT_PATH=checkpoints/qwen3_30b_a3b bash examples/qwen/train_qwen.sh
#
# Environment (defaults in brackets; the sizes default to the QWEN_MODEL's):
#   QWEN_MODEL   qwen2.5 (7B: q/k/v biases), qwen3 (8B: q/k norms) or qwen3_moe (30B-A3B)    [qwen3]
#   CHECKPOINT_PATH [checkpoints/<QWEN_MODEL>]  TOKENIZER_MODEL (HF tokenizer directory, or MOCK) [MOCK]
#   DATA_PATH (dataset prefix, or MOCK) [MOCK]  VOCAB_SIZE (MOCK only) [151935]
#   NUM_LAYERS  HIDDEN_SIZE  FFN_HIDDEN_SIZE  NUM_ATTENTION_HEADS  NUM_QUERY_GROUPS  KV_CHANNELS [128]
#   NUM_EXPERTS  MOE_FFN_HIDDEN_SIZE  MOE_TOPK (qwen3_moe)  SEQ_LENGTH [4096]  MAX_POSITION_EMBEDDINGS [40960]
#   PADDED_VOCAB_SIZE [152064 / 151936]  NORM_EPSILON [1e-6, Hugging Face's rms_norm_eps]
#   TP [1]  PP [1]  EP [1]  MICRO_BATCH_SIZE [1]  GLOBAL_BATCH_SIZE [256]  TRAIN_ITERS [10000]  LR [1e-5]
#   GPUS_PER_NODE [8]  NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM too)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
hf_family_setup
QWEN_MODEL=${QWEN_MODEL:-qwen3}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/$QWEN_MODEL}

case "$QWEN_MODEL" in
    qwen2.5) L=28 H=3584 F=18944 A=28 G=4 V=152064 FAMILY_ARGS=(--add-qkv-bias) ;;
    qwen3) L=36 H=4096 F=12288 A=32 G=8 V=151936 FAMILY_ARGS=(--qk-layernorm) ;;
    qwen3_moe) L=48 H=2048 F=6144 A=32 G=4 V=151936
        FAMILY_ARGS=(--qk-layernorm --num-experts "${NUM_EXPERTS:-128}" --moe-ffn-hidden-size "${MOE_FFN_HIDDEN_SIZE:-768}"
                     --moe-router-topk "${MOE_TOPK:-8}" --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3
                     --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss
                     --expert-model-parallel-size "${EP:-1}") ;;
    *) echo "QWEN_MODEL must be qwen2.5, qwen3 or qwen3_moe, got $QWEN_MODEL" >&2; exit 2 ;;
esac

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-$L}" --hidden-size "${HIDDEN_SIZE:-$H}" --ffn-hidden-size "${FFN_HIDDEN_SIZE:-$F}"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-$A}" --group-query-attention --num-query-groups "${NUM_QUERY_GROUPS:-$G}"
    --kv-channels "${KV_CHANNELS:-128}" --seq-length "${SEQ_LENGTH:-4096}"
    --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-40960}" --position-embedding-type rope
    --rotary-base 1000000 --rotary-percent 1.0 --normalization RMSNorm --norm-epsilon "${NORM_EPSILON:-1e-6}"
    --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --padded-vocab-size "${PADDED_VOCAB_SIZE:-$V}" --attention-dropout 0.0 --hidden-dropout 0.0
    "${FAMILY_ARGS[@]}"
)

hf_family_args 151935 256
launch_pretrain_gpt "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"
