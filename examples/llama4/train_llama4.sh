#!/bin/bash
# Llama 4 (text) with torchrun and pretrain_gpt.py: the flags of Megatron-LM HEAD's Llama 4 configurations (top-1
# sigmoid routing whose weight scales the expert input, a shared expert, interleaved RoPE; Scout: 16 experts in every
# layer, QK L2 norm, llama3 RoPE scaling; Maverick: 128 experts in every other layer, NoPE every 4th layer), every
# size read from the environment. Fine-tunes from a Hugging Face Llama4ForCausalLM checkpoint converted once:
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver torch_dist \
#       --load-dir /path/to/llama4-scout-text --save-dir checkpoints/llama4_scout
#   CHECKPOINT_PATH=checkpoints/llama4_scout bash examples/llama4/train_llama4.sh
#
# Environment (defaults in brackets; sizes are Scout's, or Maverick's with LLAMA4_MODEL=maverick):
#   LLAMA4_MODEL [scout]  CHECKPOINT_PATH [checkpoints/llama4_<model>]  TOKENIZER_MODEL (HF tokenizer dir, or MOCK)
#   [MOCK]  DATA_PATH (dataset prefix, or MOCK) [MOCK]  VOCAB_SIZE (MOCK only) [202047]
#   NUM_LAYERS [48]  HIDDEN_SIZE [5120]  FFN_HIDDEN_SIZE [16384]  NUM_ATTENTION_HEADS [40]  NUM_QUERY_GROUPS [8]
#   NUM_EXPERTS [16/128]  MOE_FFN_HIDDEN_SIZE [8192]  MOE_LAYER_FREQ [1 / ([0,1]*24)]  NO_ROPE_FREQ [- / 4]
#   ROPE_SCALING_FACTOR [8.0]  SEQ_LENGTH [4096/2048]  PADDED_VOCAB_SIZE [202048]  TP [1]  PP [1]  EP [1]
#   MICRO_BATCH_SIZE [1]  GLOBAL_BATCH_SIZE [128]  TRAIN_ITERS [10000]  LR [1e-5]
#   GPUS_PER_NODE [8]  NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM too)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
hf_family_setup
LLAMA4_MODEL=${LLAMA4_MODEL:-scout}
case "$LLAMA4_MODEL" in
    scout) E=16 S=4096 VARIANT_ARGS=(--qk-l2-norm --use-rope-scaling --rope-scaling-factor "${ROPE_SCALING_FACTOR:-8.0}"
                                     --moe-layer-freq "${MOE_LAYER_FREQ:-1}") ;;
    maverick) E=128 S=2048 VARIANT_ARGS=(--moe-layer-freq "${MOE_LAYER_FREQ:-([0,1]*24)}" --no-rope-freq "${NO_ROPE_FREQ:-4}") ;;
    *) echo "LLAMA4_MODEL must be scout or maverick, got $LLAMA4_MODEL" >&2; exit 2 ;;
esac
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama4_$LLAMA4_MODEL}

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-48}" --hidden-size "${HIDDEN_SIZE:-5120}" --ffn-hidden-size "${FFN_HIDDEN_SIZE:-16384}"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-40}" --group-query-attention --num-query-groups "${NUM_QUERY_GROUPS:-8}"
    --seq-length "${SEQ_LENGTH:-$S}" --max-position-embeddings "${SEQ_LENGTH:-$S}" --position-embedding-type rope
    --rotary-interleaved --rotary-base 500000 --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --padded-vocab-size "${PADDED_VOCAB_SIZE:-202048}"
    --num-experts "${NUM_EXPERTS:-$E}" --moe-ffn-hidden-size "${MOE_FFN_HIDDEN_SIZE:-8192}"
    --moe-shared-expert-intermediate-size "${MOE_FFN_HIDDEN_SIZE:-8192}" --moe-router-score-function sigmoid
    --moe-router-topk 1 --moe-router-topk-scaling-factor 1.0 --moe-router-dtype fp32 --moe-apply-probs-on-input
    --moe-aux-loss-coeff 1e-3 --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
    --expert-model-parallel-size "${EP:-1}" --attention-dropout 0.0 --hidden-dropout 0.0
    "${VARIANT_ARGS[@]}"
)

hf_family_args 202047 128
launch_pretrain_gpt "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"
