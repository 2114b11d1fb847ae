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
