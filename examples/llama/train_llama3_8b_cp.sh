#!/bin/bash
# Long-context Llama-3 8B with context parallelism: examples/llama/train_llama3_8b.sh at a 32768-token sequence,
# every sequence split over CP_SIZE=4 ranks (Megatron's load-balanced split: rank r holds chunks r and 7-r of 8),
# tensor parallelism 2 with sequence parallelism; on 8 GPUs that is TP 2 x CP 4 x DP 1. Attention runs over the
# CP ring (--cp-comm-type p2p) or after an all-gather of K/V (CP_COMM_TYPE=all_gather), in pure PyTorch (see
# docs/context_parallel.md); it also runs on CPU with gloo.
#
#   bash examples/llama/train_llama3_8b_cp.sh                     # mock data + NullTokenizer, 8 processes
#   CP_SIZE=8 TP_SIZE=1 SEQ_LENGTH=65536 bash examples/llama/train_llama3_8b_cp.sh
#
# Environment: TP_SIZE [2], CP_SIZE [4], CP_COMM_TYPE [p2p], SEQ_LENGTH [32768] (divisible by 2 x CP_SIZE, and
# SEQ_LENGTH / CP_SIZE by TP_SIZE), CHECKPOINT_PATH [checkpoints/llama3_8b_cp], TENSORBOARD_LOGS_PATH
# [tensorboard_logs/llama3_8b_cp]; everything else as examples/llama/train_llama3_8b.sh (TOKENIZER_MODEL, DATA_PATH,
# DATA_CACHE_PATH, GPUS_PER_NODE, NNODES, MEGATRON_EXTRA_ARGS ...). GPUS_PER_NODE x NNODES must be a multiple of
# TP_SIZE x CP_SIZE.
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}
export TP_SIZE=${TP_SIZE:-2}
export CP_SIZE=${CP_SIZE:-4}
export CP_COMM_TYPE=${CP_COMM_TYPE:-p2p}
export SEQ_LENGTH=${SEQ_LENGTH:-32768}
export CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3_8b_cp}
export TENSORBOARD_LOGS_PATH=${TENSORBOARD_LOGS_PATH:-tensorboard_logs/llama3_8b_cp}
export DATA_CACHE_PATH=${DATA_CACHE_PATH:-$PWD/benchmark_cache_llama3_8b_cp}
exec bash "$MEGATRON_DIR/examples/llama/train_llama3_8b.sh" "$@"
