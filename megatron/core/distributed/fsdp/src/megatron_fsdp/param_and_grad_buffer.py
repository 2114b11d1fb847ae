"""Pieces of megatron-core's ``megatron_fsdp.param_and_grad_buffer`` that stand on their own: the bucketing policy,
bucket / prefetch enums, the gradient pre-scaling before a reduction, the meta-device reset context, and the
construction of a Megatron-FSDP DTensor from a rank's block.

Megatron-FSDP's flat buffers themselves (``DataParallelBuffer``, ``ParameterGroup``, ``ParamAndGradBuffer``, the
gather / reduce pipelines and bucket allocators) are not here: this library's Megatron-FSDP keeps each parameter's
shard as an FSDP2 DTensor (``megatron.core.distributed.fsdp.sharded_module``), which plays their role.

``make_fsdp_dtensor``'s placement: a block of a parameter sharded over the ``dp_shard_dim`` mesh is ``Shard(0)``
(rows of the parameter, uneven sizes allowed); an unsharded one ``Replicate()``; a Megatron tensor-parallel slice
(``tensor_model_parallel``, ``partition_dim``) adds the ``tp_dim`` mesh dimension with ``Shard(partition_dim)``
(``Replicate()`` for a TP-duplicated parameter), the data-parallel shard being taken inside the TP slice.
"""
from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from enum import Enum
from typing import List, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (update_uneven_dtensor_chunk_metadata,
                                                                             validate_uneven_dtensor)
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import (
    FSDPDistributedIndex, get_cuda_rng_tracker, get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel, is_mcore_tensor_parallel_duplicated)
from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME

logger = logging.getLogger(__name__)

__all__ = ["BucketingPolicy", "Bucket", "BucketStatus", "PrefetchOrder", "gradient_reduce_preprocessing",
           "check_gpu_memory", "ResetParametersContext", "to_local_if_dtensor", "make_fsdp_dtensor"]


@dataclasses.dataclass
class BucketingPolicy:
    """How parameters are grouped for communication: about ``suggested_bucket_size`` elements per bucket, each
    instance of a class in ``fsdp_unit_modules`` its own unit, under ``data_parallel_sharding_strategy``."""

    suggested_bucket_size: Optional[int] = 40_000_000
    fsdp_unit_modules: List[torch.nn.Module] = dataclasses.field(default_factory=list)
    data_parallel_sharding_strategy: str = "no_shard"


@dataclasses.dataclass
class Bucket:
    """The flat tensor ``data`` holding a group of parameters (or gradients) communicated together."""

    data: torch.Tensor


class BucketStatus(Enum):
    """A communication bucket is ``EMPTY``, ``COMMUNICATING`` or ``READY_TO_USE``."""

    EMPTY = 1
    COMMUNICATING = 2
    READY_TO_USE = 3


class PrefetchOrder(Enum):
    """Which order parameters are gathered ahead in: the forward pass's or the backward pass's."""

    FORWARD_PASS_ORDER = 0
    BACKWARD_PASS_ORDER = 1


def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
    """The reduce op for ``grad_data`` so that the reduction yields ``scaling_factor * sum`` over the ranks:
    ``SUM`` when ``scaling_factor`` is None (per-token loss: summed); ``AVG`` with ``average_in_collective``;
    NCCL's pre-multiplied sum with ``gradient_reduce_div_fusion`` (not for bf16, and only where NCCL runs: CUDA);
    otherwise ``grad_data`` is multiplied by ``scaling_factor`` in place and ``SUM`` returned."""
    if scaling_factor is None:
        return torch.distributed.ReduceOp.SUM
    if ddp_config.average_in_collective:
        return torch.distributed.ReduceOp.AVG
    if ddp_config.gradient_reduce_div_fusion and grad_data.dtype != torch.bfloat16 and grad_data.is_cuda:
        return torch.distributed._make_nccl_premul_sum(scaling_factor)
    grad_data.mul_(scaling_factor)
    return torch.distributed.ReduceOp.SUM


def check_gpu_memory(threshold=0.9):
    """Whether the current GPU's allocated or reserved memory is at least ``threshold`` of its total (logged when
    so); False without a GPU."""
    if not torch.cuda.is_available():
        return False
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    allocated = torch.cuda.memory_allocated(device) / total
    reserved = torch.cuda.memory_reserved(device) / total
    if allocated >= threshold or reserved >= threshold:
        logger.info(f"GPU Memory: Allocated: {allocated:.2%}, Reserved: {reserved:.2%}")
        return True
    return False


class ResetParametersContext:
    """The context a module's ``reset_parameters()`` runs in when Megatron-FSDP materialises a meta-device model:
    with ``with_cuda_rng_tracker``, inside the model-parallel RNG tracker's fork when that state is registered.
    ``init_param_with_fp8`` (Transformer Engine's quantized init) is refused: FP8 parameters are not here."""

    def __init__(self, init_param_with_fp8=False, with_cuda_rng_tracker=False):
        if init_param_with_fp8:
            raise NotImplementedError("ResetParametersContext(init_param_with_fp8=True) needs Transformer Engine's "
                                      "FP8 parameters, which this library does not implement")
        self.init_param_with_fp8 = init_param_with_fp8
        self.with_cuda_rng_tracker = with_cuda_rng_tracker

    def __enter__(self):
        self.stack = ExitStack()
        if self.with_cuda_rng_tracker:
            tracker = get_cuda_rng_tracker()
            if _MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.get_states():
                self.stack.enter_context(tracker.fork())
        return self

    def __exit__(self, *exc_details):
        return self.stack.__exit__(*exc_details)


def to_local_if_dtensor(tensor):
    """This rank's local tensor of a DTensor (the same storage); any other tensor unchanged."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def make_fsdp_dtensor(local_tensor: torch.Tensor, param: torch.nn.Parameter, dist_index: FSDPDistributedIndex,
                      is_sharded_param: bool = True, is_expert_param: bool = False, run_check: bool = False,
                      update_uneven_dtensor_chunk_meta: bool = False, force_sync_tp_duplicated_param: bool = False):
    """The DTensor of ``param``'s global shape whose block on this rank is ``local_tensor`` (flat or shaped;
    reshaped to ``(-1, *param.shape[1:])``), placed as the module docstring says. ``run_check`` validates the
    blocks' coverage (:func:`validate_uneven_dtensor`); ``update_uneven_dtensor_chunk_meta`` attaches the uneven
    chunk metadata; ``force_sync_tp_duplicated_param`` broadcasts a TP-duplicated block from TP rank 0."""
    if not is_sharded_param and param.numel() != local_tensor.numel():
        raise ValueError(f"make_fsdp_dtensor: an unsharded parameter of shape {tuple(param.shape)} with a local "
                         f"tensor of shape {tuple(local_tensor.shape)}: they must have the same elements")
    dp_dims = (dist_index.dp_outer_dim, dist_index.dp_shard_dim) if dist_index.use_hybrid_fsdp \
        else (dist_index.dp_shard_dim,)
    if not is_sharded_param:
        dp_places = [Replicate()] * len(dp_dims)
    elif dist_index.use_hybrid_fsdp:
        dp_places = [Shard(0) if dist_index.hsdp_outer_dp_shard else Replicate(), Shard(0)]
    else:
        dp_places = [Shard(0)]
    dims, places, global_shape = dp_dims, dp_places, tuple(param.shape)
    if is_mcore_tensor_model_parallel(param):
        if isinstance(param, DTensor):
            raise ValueError("make_fsdp_dtensor: a DTensor parameter marked tensor_model_parallel")
        tp_mesh = dist_index.get_submesh(dist_index.tp_dim, is_expert_parallel=is_expert_param)
        if tp_mesh.size() > 1:
            if is_mcore_tensor_parallel_duplicated(param):
                tp_place = Replicate()
                if force_sync_tp_duplicated_param and local_tensor.numel() > 0:
                    torch.distributed.broadcast(local_tensor, group=tp_mesh.get_group(), group_src=0)
            else:
                tp_dim = get_mcore_tensor_parallel_partition_dim(param)
                tp_place = Shard(tp_dim)
                shape = list(global_shape)
                shape[tp_dim] *= tp_mesh.size()
                global_shape = tuple(shape)
            dims, places = dp_dims + (dist_index.tp_dim,), dp_places + [tp_place]
    mesh = dist_index.get_submesh(dims, is_expert_parallel=is_expert_param)
    if is_sharded_param and len(dims) > len(dp_dims):  # the DP shard is taken inside the TP slice
        mesh._shard_order = list(range(len(dims)))[::-1]
    block = local_tensor.view((-1,) + tuple(param.shape[1:]))
    stride = torch.empty(global_shape, device="meta").stride()
    out = DTensor.from_local(block, device_mesh=mesh, placements=places, run_check=False,
                             shape=torch.Size(global_shape), stride=stride)
    if run_check:
        validate_uneven_dtensor(out)
    if update_uneven_dtensor_chunk_meta:
        update_uneven_dtensor_chunk_metadata(out)
    return out
