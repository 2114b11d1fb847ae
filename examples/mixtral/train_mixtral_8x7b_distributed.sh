#!/bin/bash
# Mixtral 8x7B (mixture of experts) with torchrun: today's Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh.
# 32 layers, hidden 4096, 8 experts of SwiGLU 14336 with top-2 routing (aux-loss load balancing 1e-2), 32 heads with
# 8 query groups, RoPE base 1e6, sequence 4096; grouped GEMM experts, all-to-all token dispatcher; TP 1, PP 4,
# EP 8, distributed optimizer; bf16. Fine-tunes from a converted checkpoint (--no-load-optim --no-load-rng):
#   python tools/checkpoint/convert.py --model-type GPT --loader hf --saver torch_dist \
#       --load-dir /path/to/Mixtral-8x7B --save-dir checkpoints/mixtral_8x7b
#
#   CHECKPOINT_PATH=checkpoints/mixtral_8x7b TOKENIZER_MODEL=/path/to/tokenizer.model \
#       DATA_PATH=data/mixtral_text_document bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#
# Environment (defaults in brackets; upstream takes the first three as positional arguments, in this order):
#   CHECKPOINT_PATH   --save and --load                                              [checkpoints/mixtral_8x7b]
#   TOKENIZER_MODEL   the SentencePiece model of Llama2Tokenizer, or MOCK               [MOCK]
#   DATA_PATH         dataset prefix, or MOCK (--mock-data with NullTokenizer)        [MOCK]
#   GPUS_PER_NODE     processes per node (NPROC is accepted as an alias)             [8]
#   NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT  torchrun's rendezvous (from SLURM inside an allocation)
#   MEGATRON_EXTRA_ARGS  flags appended last; argparse keeps the last value of a repeated flag
# Extra command-line arguments of this script are passed on too (before MEGATRON_EXTRA_ARGS).
# Without CUDA the run falls back to gloo on CPU; export MEGATRON_FORCE_CPU=1 to force that on a GPU machine.
# TP x PP x EP must divide the world size (8 nodes x 8 GPUs upstream); shrink with MEGATRON_EXTRA_ARGS, e.g.
#   MEGATRON_EXTRA_ARGS="--pipeline-model-parallel-size 1 --expert-model-parallel-size 2" GPUS_PER_NODE=2
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-${NPROC:-8}}
resolve_rendezvous

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/mixtral_8x7b}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
DATA_PATH=${DATA_PATH:-MOCK}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 4096
    --max-position-embeddings 32768
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 8
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --split 99990,8,2
)
if [ "$TOKENIZER_MODEL" = MOCK ] || [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
else
    DATA_ARGS+=(--tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL" --data-path "$DATA_PATH")
fi

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --lr 1e-4
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 500
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --no-load-optim
    --no-load-rng
)

echo "launching pretrain_gpt.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
     "master $MASTER_ADDR:$MASTER_PORT"
# shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
torchrun "${DISTRIBUTED_ARGS[@]}" "$MEGATRON_DIR/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
