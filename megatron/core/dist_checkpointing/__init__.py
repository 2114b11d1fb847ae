"""Sharded checkpoints on PyTorch Distributed Checkpoint (the ``torch_dist`` format's storage layer)."""
from megatron.core.dist_checkpointing.sharded_io import (LocalShard, ShardingError, load_full_state_dict,
                                                         load_sharded, save_sharded, stored_shapes)

__all__ = ["LocalShard", "ShardingError", "load_full_state_dict", "load_sharded", "save_sharded", "stored_shapes"]
