"""Megatron-FSDP (``--use-megatron-fsdp``): ``FullyShardedDataParallel(config, ddp_config, module)`` with the four
strategies of ``ddp_config.data_parallel_sharding_strategy``, each built on the engine that gives Megatron's
behaviour with the least code:

============================  ==========  ================================================================
strategy                      ZeRO stage  engine
============================  ==========  ================================================================
``no_shard``                  DDP         our DDP buckets: one fp32 gradient buffer all-reduced once per step
``optim``                     1           our DDP buckets with the distributed optimizer: the buffer is
                                          reduce-scattered once per step (last micro-batch), each rank updates
                                          its fp32 main shard, the parameters are all-gathered after the step
``optim_grads``               2           FSDP2 ``fully_shard`` (``fsdp/sharded_module.py``): weights kept
                                          whole between steps, gradients reduce-scattered every micro-batch
``optim_grads_params``        3           FSDP2 ``fully_shard``: weights gathered per unit just in time
============================  ==========  ================================================================

Why two engines: ``no_shard`` and ``optim`` keep one whole gradient that is reduced once per step, which is
exactly what the bucketed buffer (and, for ZeRO-1, the distributed optimizer over it) does; FSDP2 has no
unsharded-gradient mode with sharded main weights. ZeRO-2/3 free whole gradients after every micro-batch, which
is FSDP2's reduce-scatter in backward.

FSDP units (ZeRO-2/3): every ``TransformerLayer`` (and classes named ``MoETransformerLayer`` / ``MambaLayer``),
or the classes passed as ``fsdp_unit_modules``; the embedding, final norm and output layer stay in the root unit
(so a tied embedding / output weight is one parameter of one unit). Experts are sharded over the expert
data-parallel group.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.sharded_module import (FULLY_SHARDED_STRATEGIES, FullyShardedModule,
                                                           units_of_types)
from megatron.core.utils import log_once
from megatron.core.transformer.transformer_layer import TransformerLayer

UNIT_CLASS_NAMES = ("MoETransformerLayer", "MambaLayer")


class FullyShardedDataParallel(torch.nn.Module):
    """Megatron-FSDP's wrapper. Constructing it gives an instance of one of two subclasses (both are instances of
    this class): the bucketed engine for ``no_shard`` / ``optim``, the FSDP2 engine for ``optim_grads`` /
    ``optim_grads_params`` (module docstring)."""

    def __new__(cls, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module, *args, **kwargs):
        if cls is FullyShardedDataParallel:
            strategy = ddp_config.data_parallel_sharding_strategy
            cls = _FullyShardedFSDP if strategy in FULLY_SHARDED_STRATEGIES else _BucketedFSDP
        return super().__new__(cls)

    @property
    def data_parallel_sharding_strategy(self) -> str:
        return self.ddp_config.data_parallel_sharding_strategy


class _BucketedFSDP(FullyShardedDataParallel, DistributedDataParallel):
    """``no_shard`` and ``optim``: DDP's buckets (reduce-scatter and the distributed optimizer for ``optim``)."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 fsdp_unit_modules: Optional[List[type]] = None, disable_bucketing: bool = False, device=None,
                 pg_collection=None):
        strategy = ddp_config.data_parallel_sharding_strategy
        ddp_config = dataclasses.replace(ddp_config, use_distributed_optimizer=strategy == "optim")
        DistributedDataParallel.__init__(self, config, ddp_config, module, disable_bucketing=disable_bucketing)
        log_once(f"megatron-fsdp-{strategy}", f"Megatron-FSDP {strategy}: DDP gradient buckets"
                 + (" with the distributed optimizer (ZeRO-1)" if strategy == "optim" else " (all-reduce)"))


class _FullyShardedFSDP(FullyShardedDataParallel, FullyShardedModule):
    """``optim_grads`` and ``optim_grads_params``: FSDP2 units over the DP x CP mesh."""

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 fsdp_unit_modules: Optional[List[type]] = None, disable_bucketing: bool = False, device=None,
                 pg_collection=None):
        if fsdp_unit_modules is None:
            units = units_of_types(module, (TransformerLayer,), UNIT_CLASS_NAMES)
        else:
            units = units_of_types(module, tuple(fsdp_unit_modules))
        groups = {}
        if pg_collection is not None:
            groups = dict(dp_cp_group=getattr(pg_collection, "dp_cp", None), tp_group=getattr(pg_collection, "tp", None),
                          expert_dp_group=getattr(pg_collection, "expt_dp", None))
        FullyShardedModule.__init__(self, config, ddp_config, module, units,
                                    strategy=ddp_config.data_parallel_sharding_strategy, **groups)
