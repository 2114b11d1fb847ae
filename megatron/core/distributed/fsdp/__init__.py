"""Megatron-FSDP (``--use-megatron-fsdp``) and the FSDP2 engine shared with ``--use-torch-fsdp2``."""
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.fsdp.sharded_module import FULLY_SHARDED_STRATEGIES, FullyShardedModule, local_tensor

__all__ = ["FullyShardedDataParallel", "FullyShardedModule", "FULLY_SHARDED_STRATEGIES", "local_tensor"]
