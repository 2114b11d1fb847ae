# Sourced by the example launch scripts: where the repository is, and the rendezvous of a multi-node job.
#
# Inside a SLURM allocation (SLURM_JOB_NODELIST set) the master address is the allocation's first host,
# read with `scontrol show hostnames` when scontrol is installed and otherwise with this library's own
# parser of SLURM host lists (megatron/training/launch_env.py); the number of nodes and this node's rank come
# from SLURM_JOB_NUM_NODES and SLURM_NODEID. Values already in the environment always win.

# The first host of a SLURM node list such as "node[01-04,07]".
slurm_first_host() {
    local nodelist=$1
    if command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$nodelist" | head -n 1
    else
        PYTHONPATH="$MEGATRON_DIR${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python}" -c \
            'import sys; from megatron.training.launch_env import first_slurm_host; print(first_slurm_host(sys.argv[1]))' \
            "$nodelist"
    fi
}

# Sets MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK (torchrun's rendezvous) for a one- or multi-node job.
resolve_rendezvous() {
    local nodelist=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    if [ -n "$nodelist" ]; then
        MASTER_ADDR=${MASTER_ADDR:-$(slurm_first_host "$nodelist")}
        NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}
        NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
    fi
    MASTER_ADDR=${MASTER_ADDR:-localhost}
    MASTER_PORT=${MASTER_PORT:-6000}
    NNODES=${NNODES:-1}
    NODE_RANK=${NODE_RANK:-0}
    export MASTER_ADDR MASTER_PORT
}

# The environment of the model-family scripts (examples/qwen, llama/train_llama3.sh, gpt_oss, llama4): 8 processes per
# node unless GPUS_PER_NODE says otherwise, the rendezvous, MOCK tokenizer and data unless given.
hf_family_setup() {
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    resolve_rendezvous
    TOKENIZER_MODEL=${TOKENIZER_MODEL:-MOCK}
    DATA_PATH=${DATA_PATH:-MOCK}
}

# The data and training flags the model-family scripts (examples/qwen, llama/train_llama3.sh, gpt_oss, llama4) share:
# DATA_ARGS reads $DATA_PATH with the Hugging Face tokenizer $TOKENIZER_MODEL, or mock data with a NullTokenizer of
# $1 tokens when either is MOCK; TRAINING_ARGS fine-tunes from $CHECKPOINT_PATH (torch_dist, bf16, distributed
# optimizer) with the sizes MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE [$2], TRAIN_ITERS, LR, TP, PP from the environment.
hf_family_args() {
    DATA_ARGS=(--split 99,1,0)
    if [ "$TOKENIZER_MODEL" = MOCK ] || [ "$DATA_PATH" = MOCK ]; then
        DATA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-$1}")
    else
        DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" --data-path "$DATA_PATH")
    fi
    TRAINING_ARGS=(
        --micro-batch-size "${MICRO_BATCH_SIZE:-1}" --global-batch-size "${GLOBAL_BATCH_SIZE:-$2}"
        --train-iters "${TRAIN_ITERS:-10000}" --lr "${LR:-1e-5}" --min-lr 1e-6 --lr-decay-style cosine
        --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
        --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}" --sequence-parallel
        --use-distributed-optimizer --log-interval 1 --save-interval 1000 --eval-interval 1000 --eval-iters 10
        --save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --ckpt-format torch_dist --no-load-optim --no-load-rng
    )
}

# torchrun pretrain_gpt.py on this node with the rendezvous of resolve_rendezvous: the flags given, then the
# script's own command-line arguments ($SCRIPT_ARGS) and $MEGATRON_EXTRA_ARGS (argparse keeps the last value).
# $LAUNCHER replaces torchrun (LAUNCHER=echo prints the command line instead of running it).
launch_pretrain_gpt() {
    echo "launching pretrain_gpt.py: $NNODES node(s) x $GPUS_PER_NODE process(es), node rank $NODE_RANK," \
         "master $MASTER_ADDR:$MASTER_PORT"
    # shellcheck disable=SC2086  # MEGATRON_EXTRA_ARGS is a list of flags: split it on spaces
    ${LAUNCHER:-torchrun} --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" "$MEGATRON_DIR/pretrain_gpt.py" \
        "$@" ${MEGATRON_EXTRA_ARGS:-}
}
