#!/bin/bash
# DeepSeek-V3 pretraining with torchrun: the model flags of Megatron-LM's DeepSeek-V3 recipe
# (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh, its DDP branch): 61 layers, hidden 7168, multi-latent
# attention (128 heads, q_lora_rank 1536, kv_lora_rank 512, qk 128 + 64 rotary, v 128, YaRN factor 40), the first 3
# layers dense (SwiGLU 18432) and 58 MoE layers (256 experts of 2048 + one shared expert, top-8 sigmoid routing
# within 4 of 8 groups, routed scaling 2.5, aux-loss-free expert bias, sequence-level aux loss 1e-4, router in fp32),
# one multi-token-prediction depth (loss weight 0.1); selective recompute of mlp, moe, mla_up_proj and layernorm;
# sequence parallelism and the distributed optimizer; bf16.
#
#   bash examples/deepseek_v3/pretrain_deepseek_v3.sh                          # 8 processes, EP 8, mock data
#   TOKENIZER_MODEL=deepseek-ai/DeepSeek-V3 DATA_PATH=data/dsv3_text_document bash examples/deepseek_v3/...
#
# Environment (defaults in brackets); every size can be shrunk, e.g. for a CPU run (see docs/models.md):
#   CHECKPOINT_PATH     --save and --load                                             [checkpoints/deepseek_v3]
#   TOKENIZER_MODEL     HuggingFaceTokenizer model, or MOCK                           [MOCK]
#   DATA_PATH           dataset prefix, or MOCK (--mock-data, NullTokenizer)         [MOCK]
#   GPUS_PER_NODE       processes per node                                            [8]
#   TP / PP / EP / CP   tensor / pipeline / expert / context parallel sizes            [1 / 1 / 8 / 1]
#   NUM_LAYERS HIDDEN_SIZE FFN_HIDDEN_SIZE NUM_HEADS Q_LORA_RANK KV_LORA_RANK QK_HEAD_DIM QK_POS_EMB_HEAD_DIM
#   V_HEAD_DIM NUM_EXPERTS MOE_FFN_HIDDEN_SIZE MOE_LAYER_FREQ TOPK NUM_GROUPS GROUP_TOPK MTP_NUM_LAYERS SEQ_LENGTH
#   VOCAB_SIZE (mock data) MICRO_BATCH_SIZE GLOBAL_BATCH_SIZE TRAIN_ITERS LR SAVE_INTERVAL
#                       the model and run sizes                                       [DeepSeek-V3's]
#   PRECISION_ARGS      [--bf16]; empty for fp32
#   MEGATRON_EXTRA_ARGS flags appended last; argparse keeps the last value of a repeated flag
#   LAUNCHER            the launcher [torchrun]; LAUNCHER=echo prints the command line instead of running it
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
# Not taken from the recipe: --moe-router-force-load-balancing (random routing for benchmarks) and the
# Megatron-FSDP / flex dispatcher flags of its FSDP branch (the alltoall dispatcher runs).
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
hf_family_setup
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/deepseek_v3}
NUM_LAYERS=${NUM_LAYERS:-61}
MOE_LAYER_FREQ=${MOE_LAYER_FREQ:-[0]*3+[1]*58}

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "${HIDDEN_SIZE:-7168}"
    --ffn-hidden-size "${FFN_HIDDEN_SIZE:-18432}"
    --num-attention-heads "${NUM_HEADS:-128}"
    --kv-channels 128
    --max-position-embeddings "${SEQ_LENGTH:-4096}"
    --seq-length "${SEQ_LENGTH:-4096}"
    --position-embedding-type rope
    --rotary-base 10000
    --make-vocab-size-divisible-by 3232
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
    --multi-latent-attention
    --qk-layernorm
    --q-lora-rank "${Q_LORA_RANK:-1536}"
    --kv-lora-rank "${KV_LORA_RANK:-512}"
    --qk-head-dim "${QK_HEAD_DIM:-128}"
    --qk-pos-emb-head-dim "${QK_POS_EMB_HEAD_DIM:-64}"
    --v-head-dim "${V_HEAD_DIM:-128}"
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    --mtp-num-layers "${MTP_NUM_LAYERS:-1}"
    --mtp-loss-scaling-factor 0.1
)

MOE_ARGS=(
    --num-experts "${NUM_EXPERTS:-256}"
    --moe-layer-freq "$MOE_LAYER_FREQ"
    --moe-ffn-hidden-size "${MOE_FFN_HIDDEN_SIZE:-2048}"
    --moe-shared-expert-intermediate-size "${MOE_FFN_HIDDEN_SIZE:-2048}"
    --moe-router-topk "${TOPK:-8}"
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-num-groups "${NUM_GROUPS:-8}"
    --moe-router-group-topk "${GROUP_TOPK:-4}"
    --moe-router-topk-scaling-factor 2.5
    --moe-router-pre-softmax
    --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm
    --moe-permute-fusion
    --moe-token-dispatcher-type alltoall
)

hf_family_args 129280 2048  # DATA_ARGS (mock data or $DATA_PATH with $TOKENIZER_MODEL); TRAINING_ARGS below

# shellcheck disable=SC2206  # PRECISION_ARGS is a list of flags (or empty)
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE:-1}"
    --global-batch-size "${GLOBAL_BATCH_SIZE:-2048}"
    --train-iters "${TRAIN_ITERS:-500000}"
    --lr "${LR:-1e-4}"
    --min-lr 1e-5
    --lr-decay-style cosine
    --lr-warmup-iters "${LR_WARMUP_ITERS:-2000}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --recompute-granularity selective
    --recompute-modules mlp moe mla_up_proj layernorm
    --no-check-for-nan-in-loss-and-grad
    ${PRECISION_ARGS---bf16}
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-1}"
    --pipeline-model-parallel-size "${PP:-1}"
    --expert-model-parallel-size "${EP:-8}"
    --expert-tensor-parallel-size 1
    --context-parallel-size "${CP:-1}"
    --sequence-parallel
    --use-distributed-optimizer
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval "${SAVE_INTERVAL:-1000}"
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --ckpt-format torch_dist
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
)

echo "DeepSeek-V3: TP ${TP:-1} PP ${PP:-1} EP ${EP:-8} CP ${CP:-1}"
launch_pretrain_gpt "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@"
