#!/bin/bash
# Nemotron-3 (hybrid Mamba-2 / attention / mixture-of-experts layers) with torchrun and pretrain_mamba.py: the
# sizes of Megatron-LM HEAD's NVIDIA-Nemotron-3-Nano-30B-A3B configuration (52 layers, hidden 2688, 128 experts of
# squared-ReLU width 1856 with top-6 sigmoid routing, expert bias, scaling 2.5 and seq_aux_loss 1e-4, a shared
# expert of 3712, Mamba 64 heads of 64, no position embedding), set here as defaults of
# examples/nemotron_h/train_nemotron_h.sh, which runs the job. Every size is read from the environment (see that
# script's header): Super-120B is e.g.
#   HYBRID_LAYER_PATTERN=MEMEMEM*EMEMEMEM*... HIDDEN_SIZE=4096 FFN_HIDDEN_SIZE=2688 NUM_EXPERTS=512 \
#   MOE_ROUTER_TOPK=22 MOE_ROUTER_TOPK_SCALING_FACTOR=5.0 MOE_SHARED_EXPERT_INTERMEDIATE_SIZE=5376 \
#   MOE_LATENT_SIZE=1024 MAMBA_NUM_HEADS=128 bash examples/nemotron_3/train_nemotron_3.sh
set -euo pipefail

export HYBRID_LAYER_PATTERN=${HYBRID_LAYER_PATTERN:-MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME}
export HIDDEN_SIZE=${HIDDEN_SIZE:-2688} FFN_HIDDEN_SIZE=${FFN_HIDDEN_SIZE:-1856}
export NUM_ATTENTION_HEADS=${NUM_ATTENTION_HEADS:-32} NUM_QUERY_GROUPS=${NUM_QUERY_GROUPS:-2}
export KV_CHANNELS=${KV_CHANNELS:-128} INIT_METHOD_STD=${INIT_METHOD_STD:-0.0173}
export MAMBA_NUM_HEADS=${MAMBA_NUM_HEADS:-64} MAMBA_HEAD_DIM=${MAMBA_HEAD_DIM:-64}
export POSITION_EMBEDDING_TYPE=${POSITION_EMBEDDING_TYPE:-none} SEQ_LENGTH=${SEQ_LENGTH:-8192}
export MAX_POSITION_EMBEDDINGS=${MAX_POSITION_EMBEDDINGS:-8192}
export NUM_EXPERTS=${NUM_EXPERTS:-128} MOE_ROUTER_TOPK=${MOE_ROUTER_TOPK:-6}
export MOE_SHARED_EXPERT_INTERMEDIATE_SIZE=${MOE_SHARED_EXPERT_INTERMEDIATE_SIZE:-3712}
export MOE_ROUTER_TOPK_SCALING_FACTOR=${MOE_ROUTER_TOPK_SCALING_FACTOR:-2.5}
export CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/nemotron_3}

exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/nemotron_h/train_nemotron_h.sh" "$@"
