"""Former import path of the ``torch_dist`` format (re-exports of megatron.training.checkpointing.torch_dist and
megatron.training.checkpointing.dist_state); the code lives in the megatron.training.checkpointing package."""
from megatron.training.checkpointing.dist_state import (  # noqa: F401
    CHECKPOINT_VERSION,
    METADATA,
    DistCheckpointError,
    apply_loaded_model,
    model_sharded_state,
    read_common,
    safe_args,
)
from megatron.training.checkpointing.torch_dist import (  # noqa: F401
    checkpoint_dir,
    finalize_async_save,
    load,
    load_full_checkpoint,
    load_sharded_checked,
    save,
)
