"""TorchFullyShardedDataParallelConfig: the settings of ``--use-torch-fsdp2``."""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """reshard_after_forward: free each unit's all-gathered weights after its forward pass and gather them again for
    the backward pass (``True``, the default); ``False`` (``--torch-fsdp2-no-reshard-after-forward``) keeps them
    until the unit's backward pass (more memory, one all-gather fewer per unit and micro-batch)."""

    reshard_after_forward: bool = True
