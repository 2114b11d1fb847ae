"""Legacy import path ``megatron.checkpointing`` (re-exports of megatron.training.checkpointing)."""
from megatron.training.checkpointing import (  # noqa: F401
    check_checkpoint_args,
    find_checkpoint_rank_0,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    get_rng_state,
    load_args_from_checkpoint,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
