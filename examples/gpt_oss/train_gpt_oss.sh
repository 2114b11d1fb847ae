#!/bin/bash
# gpt-oss with torchrun and pretrain_gpt.py: the flags of Megatron-LM HEAD's gpt-oss configurations (quick GeGLU with
# offset 1 and clamp 7, learnable attention sinks, a 128-token window on every other layer, YaRN, biases, 32 or 128
# experts top-4), every size read from the environment. Fine-tunes from a Hugging Face checkpoint (dequantised
# to bf16) converted once:
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver torch_dist \
#       --load-dir /path/to/gpt-oss-20b-bf16 --save-dir checkpoints/gpt_oss_20b
#   CHECKPOINT_PATH=checkpoints/gpt_oss_20b bash examples/gpt_oss/train_gpt_oss.sh
#
# Environment (defaults in brackets; sizes are gpt-oss-20b's unless GPT_OSS_MODEL=120b):
#   GPT_OSS_MODEL [20b]  CHECKPOINT_PATH [checkpoints/gpt_oss_<model>]  TOKENIZER_MODEL (HF tokenizer dir, or MOCK)
#   [MOCK]  DATA_PATH (dataset prefix, or MOCK) [MOCK]  VOCAB_SIZE (MOCK only) [201087]
#   NUM_LAYERS [24/36]  HIDDEN_SIZE [2880]  NUM_ATTENTION_HEADS [64]  NUM_QUERY_GROUPS [8]  KV_CHANNELS [64]
#   NUM_EXPERTS [32/128]  MOE_FFN_HIDDEN_SIZE [2880]  MOE_TOPK [4]  WINDOW_SIZE [127,0]  SEQ_LENGTH [4096]
#   MAX_POSITION_EMBEDDINGS [131072]  YARN_ORIGINAL_CONTEXT [4096: Hugging Face's; Megatron's --enable-gpt-oss: 131072]
#   PADDED_VOCAB_SIZE [201088]  TP [1]  PP [1]  EP [1]  MICRO_BATCH_SIZE [1]  GLOBAL_BATCH_SIZE [128]
#   TRAIN_ITERS [10000]  LR [1e-5]  GPUS_PER_NODE [8]  NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT (from SLURM too)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
# The expert biases need --expert-tensor-parallel-size 1 (set here); MoE with TP > 1 runs with --sequence-parallel.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
hf_family_setup
GPT_OSS_MODEL=${GPT_OSS_MODEL:-20b}
case "$GPT_OSS_MODEL" in
    20b) L=24 E=32 ;;
    120b) L=36 E=128 ;;
    *) echo "GPT_OSS_MODEL must be 20b or 120b, got $GPT_OSS_MODEL" >&2; exit 2 ;;
esac
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_oss_$GPT_OSS_MODEL}

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-$L}" --hidden-size "${HIDDEN_SIZE:-2880}" --ffn-hidden-size "${MOE_FFN_HIDDEN_SIZE:-2880}"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-64}" --group-query-attention --num-query-groups "${NUM_QUERY_GROUPS:-8}"
    --kv-channels "${KV_CHANNELS:-64}" --seq-length "${SEQ_LENGTH:-4096}"
    --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-131072}" --normalization RMSNorm
    --untie-embeddings-and-output-weights --padded-vocab-size "${PADDED_VOCAB_SIZE:-201088}"
    --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0
    --softmax-type learnable --window-size "${WINDOW_SIZE:-127,0}" --window-attn-skip-freq 2
    --enable-gpt-oss --yarn-original-max-position-embeddings "${YARN_ORIGINAL_CONTEXT:-4096}" --rotary-base 150000
    --num-experts "${NUM_EXPERTS:-$E}" --moe-ffn-hidden-size "${MOE_FFN_HIDDEN_SIZE:-2880}"
    --moe-router-topk "${MOE_TOPK:-4}" --moe-router-score-function softmax --moe-router-dtype fp32
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.0 --moe-token-dispatcher-type alltoall
    --expert-model-parallel-size "${EP:-1}" --expert-tensor-parallel-size 1
    --attention-dropout 0.0 --hidden-dropout 0.0
)

hf_family_args 201087 128
launch_pretrain_gpt "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"
