#!/bin/bash
# Llama 3.1 / 3.2 with torchrun and pretrain_gpt.py: the flags of Megatron-LM HEAD's Llama 3.1-8B / 3.2-1B
# configurations (GQA, SwiGLU, RoPE base 500000 with Llama 3's frequency scaling), every size read from the
# environment. Fine-tunes from a Hugging Face LlamaForCausalLM checkpoint converted once (its rope_scaling becomes
# --use-rope-scaling --rope-scaling-factor: 8 for Llama 3.1, 32 for Llama 3.2):
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver torch_dist \
#       --load-dir /path/to/Llama-3.2-1B --save-dir checkpoints/llama3.2_1b
#   LLAMA3_MODEL=3.2-1b CHECKPOINT_PATH=checkpoints/llama3.2_1b bash examples/llama/train_llama3.sh
#
# Environment (defaults in brackets; sizes are LLAMA3_MODEL's):
#   LLAMA3_MODEL 3.1-8b or 3.2-1b [3.1-8b]  CHECKPOINT_PATH [checkpoints/llama<model>]
#   TOKENIZER_MODEL (HF tokenizer directory, or MOCK) [MOCK]  DATA_PATH (dataset prefix, or MOCK) [MOCK]
#   VOCAB_SIZE (MOCK only) [128255]  NUM_LAYERS [32/16]  HIDDEN_SIZE [4096/2048]  FFN_HIDDEN_SIZE [14336/8192]
#   NUM_ATTENTION_HEADS [32]  NUM_QUERY_GROUPS [8]  ROPE_SCALING_FACTOR [8/32]  SEQ_LENGTH [4096]
#   MAX_POSITION_EMBEDDINGS [8192]  TP [1]  PP [1]  MICRO_BATCH_SIZE [1]  GLOBAL_BATCH_SIZE [128]
#   TRAIN_ITERS [10000]  LR [1e-5]  GPUS_PER_NODE [8]  NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT (SLURM too)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
hf_family_setup
LLAMA3_MODEL=${LLAMA3_MODEL:-3.1-8b}
case "$LLAMA3_MODEL" in
    3.1-8b) L=32 H=4096 F=14336 R=8.0 TIE=(--untie-embeddings-and-output-weights) ;;
    3.2-1b) L=16 H=2048 F=8192 R=32.0 TIE=() ;;
    *) echo "LLAMA3_MODEL must be 3.1-8b or 3.2-1b, got $LLAMA3_MODEL" >&2; exit 2 ;;
esac
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama$LLAMA3_MODEL}

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS:-$L}" --hidden-size "${HIDDEN_SIZE:-$H}" --ffn-hidden-size "${FFN_HIDDEN_SIZE:-$F}"
    --num-attention-heads "${NUM_ATTENTION_HEADS:-32}" --group-query-attention --num-query-groups "${NUM_QUERY_GROUPS:-8}"
    --seq-length "${SEQ_LENGTH:-4096}" --max-position-embeddings "${MAX_POSITION_EMBEDDINGS:-8192}"
    --position-embedding-type rope --rotary-base 500000 --use-rope-scaling
    --rope-scaling-factor "${ROPE_SCALING_FACTOR:-$R}" --normalization RMSNorm --swiglu --disable-bias-linear
    --make-vocab-size-divisible-by 1 --attention-dropout 0.0 --hidden-dropout 0.0 ${TIE[@]+"${TIE[@]}"}
)

hf_family_args 128255 128
launch_pretrain_gpt "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "$@"
