#!/bin/bash
# Automatic restart after a lost rank: torchrun restarts the whole worker group (up to MAX_RESTARTS times) and
# the job resumes from its last complete checkpoint with the same command line. The trick is to pass the same
# directory to --save and --load: the first start finds no checkpoint there and starts from scratch (with a
# warning), every restart loads the newest complete one (the tracker never names a partial save). As in
# Megatron-LM, --load does not default to --save: pass both.
#
# A hung rank (deadlock, stopped process) is turned into a failure by --hang-timeout-minutes (below
# --distributed-timeout-minutes), so torchrun restarts it too. One node uses --standalone (tested); several
# nodes use the c10d rendezvous (not tested here). In our runs on one node, neither a static
# --master-addr/--master-port rendezvous nor --rdzv-endpoint localhost:PORT brought the restarted workers past
# process-group creation (torch 2.13, gloo); --standalone did.
#
# Under SLURM without torchrun restarts, requeue the job instead; the same flags make it resume:
#   #SBATCH --requeue
#   srun --kill-on-bad-exit=1 bash examples/pretrain_gpt_auto_restart.sh   (then `scontrol requeue $SLURM_JOB_ID`
#   from an epilog, or let the cluster's requeue policy rerun it after a node failure)
#
# Environment: CHECKPOINT_PATH [checkpoints/gpt_auto_restart], DATA_PATH [data/my-gpt2_text_document],
# NPROC (processes per node) [2], MAX_RESTARTS [3], NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT (see
# launch_helpers.sh), MEGATRON_EXTRA_ARGS (appended last). The model is tiny so that it runs on CPU (gloo).
set -euo pipefail

MEGATRON_DIR=${MEGATRON_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
# shellcheck source=examples/launch_helpers.sh
source "$MEGATRON_DIR/examples/launch_helpers.sh"
resolve_rendezvous

CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_auto_restart}
DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}
NPROC=${NPROC:-2}
MAX_RESTARTS=${MAX_RESTARTS:-3}

if [ "$NNODES" = 1 ]; then
    RDZV_ARGS=(--standalone)  # the configuration tests/training/test_rel_restart.py runs
else
    RDZV_ARGS=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
               --rdzv-id "${SLURM_JOB_ID:-megatron}")
fi
torchrun --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS" "${RDZV_ARGS[@]}" \
    "$MEGATRON_DIR/pretrain_gpt.py" \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 100 --lr-decay-style cosine \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$MEGATRON_DIR/data/tokenizers/gpt2/vocab.json" \
    --merge-file "$MEGATRON_DIR/data/tokenizers/gpt2/merges.txt" --data-path "$DATA_PATH" --split 98,1,1 \
    --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 10 \
    --distributed-timeout-minutes 10 --hang-timeout-minutes 5 \
    --log-interval 10 --eval-interval 50 --eval-iters 2 \
    "$@" ${MEGATRON_EXTRA_ARGS:-}
