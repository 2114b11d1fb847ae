"""Megatron-FSDP's ``DistributedDataParallelConfig``: the one of ``megatron.core.distributed`` (megatron-core's
standalone copy has the same fields; here there is one class)."""
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig

__all__ = ["DistributedDataParallelConfig"]
