"""Megatron-FSDP under megatron-core's package path: the standalone API (:func:`fully_shard`,
:func:`fully_shard_model`, :func:`fully_shard_optimizer`), :class:`MegatronFSDP`, its config and distributed index,
the uneven-DTensor helpers. One implementation: the FSDP2 engine of ``megatron.core.distributed.fsdp``.
(megatron-core's ``mixed_precision`` module, Transformer Engine FP8 internals, is not here.)"""
from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
    DistributedDataParallelConfig)
from megatron.core.distributed.fsdp.src.megatron_fsdp.fully_shard import (fully_shard, fully_shard_model,
                                                                          fully_shard_optimizer)
from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.src.megatron_fsdp.package_info import (
    __contact_emails__, __contact_names__, __description__, __download_url__, __homepage__, __keywords__,
    __license__, __package_name__, __repository_url__, __shortversion__, __version__)
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

__all__ = ["DistributedDataParallelConfig", "MegatronFSDP", "FSDPDistributedIndex", "fully_shard", "fully_shard_model",
           "fully_shard_optimizer", "__contact_emails__", "__contact_names__", "__description__", "__download_url__",
           "__homepage__", "__keywords__", "__license__", "__package_name__", "__repository_url__",
           "__shortversion__", "__version__"]
