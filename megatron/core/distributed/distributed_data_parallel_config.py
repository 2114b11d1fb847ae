"""DistributedDataParallelConfig: how Megatron's DDP lays out and reduces gradients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Elements per bucket when --overlap-grad-reduce is on and no bucket size is given.
DEFAULT_BUCKET_SIZE = 40_000_000
# Megatron-FSDP's sharding strategies, from nothing sharded (DDP) to everything (ZeRO-3).
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass
class DistributedDataParallelConfig:
    """Settings of :class:`megatron.core.distributed.DistributedDataParallel`.

    grad_reduce_in_fp32: keep the gradient buffer (``param.main_grad``) in fp32 whatever the parameter
        dtype, so micro-batch accumulation and the data-parallel reduction happen in fp32
        (``--accumulate-allreduce-grads-in-fp32``; forced on with bf16).
    overlap_grad_reduce: launch each bucket's asynchronous all-reduce (reduce-scatter with the distributed
        optimizer) as soon as every gradient in it is ready during the last micro-batch's backward pass.
    use_distributed_optimizer: reduce-scatter instead of all-reduce, pad every bucket to a multiple of the
        data-parallel size and keep a parameter buffer that the distributed optimizer all-gathers into.
    bucket_size: maximum elements per bucket; ``None`` means 40M when overlapping and one bucket per buffer
        otherwise.
    check_for_nan_in_grad: raise before the reduction if a bucket's local gradient norm is NaN/inf.
    overlap_param_gather: with the distributed optimizer, all-gather the updated parameters during the next
        forward pass (forward pre-hooks, bucket by bucket) instead of right after the optimizer step.
    align_param_gather: with overlap_param_gather and an interleaved pipeline, the schedule launches each
        chunk's all-gathers (``config.param_sync_func``) and the hooks only wait (no "dispatch next").
    use_megatron_fsdp: the model is wrapped in Megatron-FSDP
        (:class:`megatron.core.distributed.fsdp.FullyShardedDataParallel`, ``--use-megatron-fsdp``).
    data_parallel_sharding_strategy: what Megatron-FSDP shards over the DP x CP ranks: ``no_shard`` (DDP),
        ``optim`` (ZeRO-1: optimizer state and main weights), ``optim_grads`` (ZeRO-2: also the gradients),
        ``optim_grads_params`` (ZeRO-3: also the weights). The dataclass default is ``no_shard``, the command line's
        ``optim_grads_params``, as in Megatron.
    num_distributed_optimizer_instances: more than 1 (hybrid sharding over an outer DP dimension) is refused.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: Optional[int] = None
    check_for_nan_in_grad: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    num_distributed_optimizer_instances: int = 1

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"DistributedDataParallelConfig.bucket_size must be positive, got {self.bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("DistributedDataParallelConfig.overlap_param_gather needs use_distributed_optimizer")
        if self.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"DistributedDataParallelConfig.data_parallel_sharding_strategy must be one of "
                             f"{SHARDING_STRATEGIES}, got {self.data_parallel_sharding_strategy!r}")
        if self.num_distributed_optimizer_instances != 1:
            raise ValueError("DistributedDataParallelConfig.num_distributed_optimizer_instances > 1 (hybrid sharded "
                             "data parallelism) is not implemented in this library")

    def effective_bucket_size(self, disable_bucketing: bool = False) -> Optional[int]:
        """Elements per bucket, or None for one bucket per buffer (no overlap, or bucketing disabled)."""
        if disable_bucketing or not self.overlap_grad_reduce:
            return None
        return self.bucket_size if self.bucket_size is not None else DEFAULT_BUCKET_SIZE
