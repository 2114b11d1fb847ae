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

    megatron-core's other fields, accepted for the standalone Megatron-FSDP API
    (``megatron.core.distributed.fsdp.src.megatron_fsdp``), which builds this config:

    outer_dp_sharding_strategy: sharding over the outer DP dimension of hybrid FSDP (HSDP); only ``no_shard``
        (replicas over the outer dimension) exists here, ``optim`` is refused.
    preserve_fp32_weights: Megatron-FSDP keeps fp32 main weights of low-precision parameters (True); False keeps the
        parameters' own dtype as the optimizer's weights (honoured by the standalone ``MegatronFSDP``).
    check_for_large_grads, fp8_param_gather, reuse_grad_buf_for_mxfp8_param_ag: not implemented; True is refused.
    average_in_collective, pad_buckets_for_high_nccl_busbw, gradient_reduce_div_fusion,
    suggested_communication_unit_size, keep_fp8_transpose_cache, nccl_ub, fsdp_double_buffer,
    disable_symmetric_registration, fsdp_manual_registration, use_custom_fsdp: how NCCL / the GPU schedules the same
    collectives (the reduced values are the same: a mean over the DP x CP ranks); accepted, no effect here.
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
    check_for_large_grads: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_custom_fsdp: bool = False
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False

    def __post_init__(self):
        for name in ("check_for_large_grads", "fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag"):
            if getattr(self, name):
                raise ValueError(f"DistributedDataParallelConfig.{name}=True is not implemented in this library")
        if self.outer_dp_sharding_strategy != "no_shard":
            raise ValueError("DistributedDataParallelConfig.outer_dp_sharding_strategy: only 'no_shard' exists here "
                             "(hybrid FSDP replicates over the outer dimension; sharding over it is not implemented),"
                             f" got {self.outer_dp_sharding_strategy!r}")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"DistributedDataParallelConfig.bucket_size must be positive, got {self.bucket_size}")
        # Megatron-FSDP's sharded strategies gather parameters themselves (FSDP2 prefetches the next unit).
        if self.overlap_param_gather and not self.use_distributed_optimizer \
                and self.data_parallel_sharding_strategy not in ("optim_grads", "optim_grads_params"):
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
