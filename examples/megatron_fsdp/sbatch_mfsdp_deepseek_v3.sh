#!/bin/bash
# DeepSeek-V3 (671B, 37B active) with Megatron-FSDP on SLURM: the model and MoE flags of Megatron-LM's
# examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (MLA, MTP depth 1, 256 routed experts top-8 with sigmoid
# group routing and aux-loss-free expert bias, a shared expert, dense first 3 layers), expert parallelism 8, and
# Megatron-FSDP ZeRO-3 (optim_grads_params) over the data-parallel ranks, experts over the expert data-parallel
# ranks, checkpoints in --ckpt-format fsdp_dtensor. USE_MEGATRON_FSDP=0 runs it with the distributed optimizer.
#
#   sbatch examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh
#
# --moe-token-dispatcher-type flex, --moe-permute-fusion, --fsdp-double-buffer and --use-nccl-ub are performance-only
# here (the log says what runs instead); --megatron-fsdp-{grad-comm,main-grads}-dtype bf16 reduce the gradients in
# bf16 (as --grad-reduce-in-bf16).
#
# Environment (defaults in brackets):
#   MEGATRON_DIR       this repository (sbatch copies the script elsewhere: submit from the repository root)
#   TOKENIZER_MODEL    a local Hugging Face tokenizer directory of DeepSeek-V3, or MOCK                 [MOCK]
#   DATA_PATH          dataset prefix, or MOCK (--mock-data)                                         [MOCK]
#   CHECKPOINT_PATH    --save and --load                                           [checkpoints/deepseek_v3]
#   TP / EP            tensor- and expert-parallel sizes                                             [1 / 8]
#   USE_MEGATRON_FSDP  1: Megatron-FSDP (fsdp_dtensor); 0: distributed optimizer (torch_dist)         [1]
#   LOG_DIR            srun --output files                                                           [logs]
#   MASTER_PORT        rendezvous port                                                               [6000]
#   MEGATRON_EXTRA_ARGS  flags appended last (argparse keeps the last value of a repeated flag)
# Extra command-line arguments of this script are passed on to pretrain_gpt.py too.

#SBATCH --nodes=128
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --job-name=megatron_fsdp_deepseek_v3

set -euo pipefail

if [ -z "${MEGATRON_DIR:-}" ]; then
    MEGATRON_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
    if [ ! -f "$MEGATRON_DIR/pretrain_gpt.py" ]; then MEGATRON_DIR=${SLURM_SUBMIT_DIR:-$PWD}; fi
fi
if [ ! -f "$MEGATRON_DIR/pretrain_gpt.py" ]; then
    echo "error: $MEGATRON_DIR/pretrain_gpt.py not found: set MEGATRON_DIR to the repository" >&2
    exit 1
fi
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
unset CUDA_DEVICE_MAX_CONNECTIONS  # FSDP needs more than one (Megatron's check)

if [ -z "${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}" ]; then
    echo "error: not inside a SLURM allocation (SLURM_JOB_NODELIST is unset): submit with sbatch" >&2
    exit 1
fi
resolve_rendezvous
echo "SLURM job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s)," \
     "master $MASTER_ADDR:$MASTER_PORT"

DATETIME=$(date +'date_%y-%m-%d_time_%H-%M-%S')
LOG_DIR=${LOG_DIR:-logs}
mkdir -p "$LOG_DIR"
TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
DATA_PATH=${DATA_PATH:-MOCK}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/deepseek_v3}
TP=${TP:-1}
EP=${EP:-8}
USE_MEGATRON_FSDP=${USE_MEGATRON_FSDP:-1}

MODEL_ARGS=(
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
    --max-position-embeddings 4096 --seq-length 4096 --position-embedding-type rope --rotary-base 10000
    --make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
    --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
    --init-method-std 0.02
    --multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
)

MOE_ARGS=(
    --num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-num-groups 8
    --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-router-pre-softmax --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-grouped-gemm --moe-permute-fusion
    --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-router-force-load-balancing
)

TRAINING_ARGS=(
    --micro-batch-size 1 --global-batch-size 8192 --train-samples 585937500 --lr-decay-samples 584765624
    --lr-warmup-samples 1536000 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --clip-grad 1.0
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --no-check-for-nan-in-loss-and-grad
    --recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm
    --transformer-impl transformer_engine --manual-gc --manual-gc-interval 10
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP" --expert-tensor-parallel-size 1
    --context-parallel-size 1 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce
    --overlap-param-gather
)
if [ "$USE_MEGATRON_FSDP" = 1 ]; then
    PARALLEL_ARGS+=(
        --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion
        --calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor
        --fsdp-double-buffer --use-nccl-ub
        --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16
    )
else
    PARALLEL_ARGS+=(--ckpt-format torch_dist)
fi

DATA_ARGS=(--split 99,1,0 --num-workers 6 --vocab-size 129280)
if [ "$TOKENIZER_MODEL" = MOCK ] || [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer)
else
    DATA_ARGS+=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi

LOGGING_ARGS=(
    --log-interval 1 --log-throughput --eval-iters 32 --eval-interval 200 --save-interval 500
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --auto-detect-ckpt-format --dist-ckpt-strictness log_all
    --distributed-timeout-minutes 60
)

SRUN_ARGS=(-l "--output=$LOG_DIR/%x_%j_$DATETIME.log")
if [ -n "${CONTAINER_IMAGE:-}" ]; then
    SRUN_ARGS+=("--container-image=$CONTAINER_IMAGE")
    if [ -n "${CONTAINER_MOUNTS:-}" ]; then SRUN_ARGS+=("--container-mounts=$CONTAINER_MOUNTS"); fi
fi

# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
srun "${SRUN_ARGS[@]}" "${PYTHON:-python}" -u "$MEGATRON_DIR/pretrain_gpt.py" "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@" ${MEGATRON_EXTRA_ARGS:-}
echo "done: logs in $LOG_DIR/${SLURM_JOB_NAME:-megatron_fsdp_deepseek_v3}_${SLURM_JOB_ID:-}_$DATETIME.log"
