"""Distributed (sharded) checkpoints, megatron-core's API: modules describe their tensors with
:class:`ShardedTensor` / :class:`ShardedObject` / factories (``module.sharded_state_dict()``), and
:func:`save` / :func:`load` write and read them in the ``torch_dist`` format (PyTorch Distributed Checkpoint
files + ``common.pt`` + ``metadata.json``), reshardable on load.

The storage layer (:mod:`.sharded_io`: ``LocalShard`` chunks in DCP, used by both) is re-exported for older
callers; it (and PyTorch DCP) is imported on first use.
"""
from megatron.core.dist_checkpointing.core import CheckpointingException, check_is_distributed_checkpoint
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedObject, ShardedTensor,
                                                      ShardedTensorFactory)
from megatron.core.dist_checkpointing.serialization import (load, load_common_state_dict, load_content_metadata,
                                                            load_plain_tensors, load_sharded_metadata,
                                                            load_tensors_metadata, save)
from megatron.core.dist_checkpointing.validation import StrictHandling

_STORAGE = ("LocalShard", "ShardingError", "load_full_state_dict", "load_sharded", "save_sharded", "stored_shapes")


def __getattr__(name):
    # The storage layer pulls in torch.distributed.checkpoint (seconds to import): loaded on first use.
    if name in _STORAGE:
        from megatron.core.dist_checkpointing import sharded_io

        return getattr(sharded_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["CheckpointingException", "LocalNonpersistentObject", "LocalShard", "ShardedObject", "ShardedTensor",
           "ShardedTensorFactory", "ShardingError", "StrictHandling", "check_is_distributed_checkpoint", "load",
           "load_common_state_dict", "load_content_metadata", "load_full_state_dict", "load_plain_tensors",
           "load_sharded", "load_sharded_metadata", "load_tensors_metadata", "save", "save_sharded",
           "stored_shapes"]
