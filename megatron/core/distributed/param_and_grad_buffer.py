"""Contiguous gradient buffers split into buckets, and their data-parallel reduction.

Layout of one buffer (one per (param dtype, grad dtype) pair of a model chunk)::

    grad_data: [ bucket 0: p_k ... p_j | pad ][ bucket 1: p_i ... | pad ] ...

Parameters are laid out in *reverse* order of ``module.parameters()``, because backward produces the
gradients of the last layers first: the first bucket fills up first and its communication can start
while the rest of the backward pass still runs. Every parameter's ``main_grad`` is a view into
``grad_data``. A bucket closes when it holds at least ``bucket_size`` elements (a parameter is never
split across buckets).

With the distributed optimizer every bucket is padded to a multiple of the data-parallel size ``d`` and
split into ``d`` equal contiguous shards; rank ``r`` owns shard ``r`` of every bucket. The gradients are
reduce-scattered (rank ``r`` ends up with the DP-averaged shard ``r``) and the buffer also holds the
parameters themselves (``param_data``, the model parameters' storage is rebound to views of it) so the
updated shards can be all-gathered back in place.

Parameter all-gather (distributed optimizer): synchronously, bucket by bucket, right after the optimizer step
(``all_gather_params``); or, with ``overlap_param_gather``, deferred: the step only marks every bucket
"pending" (``mark_param_gather_pending``) and the next forward pass gathers each bucket when a module that
owns one of its parameters is about to run (``Bucket.finish_param_sync``: dispatch its asynchronous
all-gather if not yet dispatched, wait, then dispatch the next bucket's in forward order, so that one
all-gather is always in flight while the previous bucket's layers compute).
"""
from __future__ import annotations

import math
import os
from enum import Enum
from typing import Dict, List, Optional, Set

import torch

from megatron.core import device as _device
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.utils import all_gather_into_tensor, reduce_scatter_tensor


class BufferType(Enum):
    """Which of a buffer's two flat tensors: the parameters (``param_data``) or the gradients (``grad_data``)."""

    PARAM = 1
    GRAD = 2


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> List[torch.Tensor]:
    """Split a 1-D tensor whose size divides by the DP size into that many equal views."""
    assert buffer.numel() % data_parallel_world_size == 0
    size = buffer.numel() // data_parallel_world_size
    return [buffer[r * size:(r + 1) * size] for r in range(data_parallel_world_size)]


class Bucket:
    """A contiguous range of a buffer whose gradients are reduced with one collective."""

    def __init__(self, ddp_config: DistributedDataParallelConfig, params: List[torch.nn.Parameter],
                 grad_data: torch.Tensor, param_data: Optional[torch.Tensor], offset: int, numel_unpadded: int,
                 data_parallel_group, data_parallel_world_size: int, gradient_scaling_factor: float):
        self.ddp_config = ddp_config
        self.params_list = params
        self.params = set(params)
        self.grad_data = grad_data
        self.param_data = param_data
        self.offset = offset  # start of this bucket inside the buffer
        self.numel_unpadded = numel_unpadded  # elements used by parameters (the rest is padding)
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_world_size
        self.data_parallel_rank = (torch.distributed.get_rank(group=data_parallel_group)
                                   if data_parallel_world_size > 1 else 0)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.reset()

        # Deferred parameter all-gather (overlap_param_gather): the bucket whose all-gather follows this one in
        # forward order, whether this one still has to be gathered, and the in-flight all-gather.
        self.next_param_gather_bucket: Optional["Bucket"] = None
        self.param_gather_pending = False
        self.param_gather_handle = None

    def reset(self):
        self.params_with_grad: Set[torch.nn.Parameter] = set()
        self.communication_handle = None
        self.communication_issued = False

    # ------------------------------------------------------------------ deferred parameter all-gather
    def start_param_sync(self, force_sync: bool = False):
        """Dispatch this bucket's parameter all-gather (asynchronous unless ``force_sync``) if it is pending
        and not dispatched yet."""
        if not self.param_gather_pending or self.param_gather_handle is not None:
            if force_sync:
                self.finish_param_sync(skip_next=True)
            return
        if self.data_parallel_world_size == 1:
            self.param_gather_pending = False
            return
        local = shard_buffer(self.param_data, self.data_parallel_world_size)[self.data_parallel_rank]
        handle = all_gather_into_tensor(self.param_data, local, group=self.data_parallel_group,
                                        async_op=not force_sync)
        if force_sync:
            self.param_gather_pending = False
        else:
            self.param_gather_handle = handle

    def finish_param_sync(self, skip_next: bool = False):
        """Make this bucket's parameters whole (dispatch and wait), then dispatch the next bucket's all-gather."""
        if not self.param_gather_pending:
            return
        if self.param_gather_handle is None:
            self.start_param_sync()
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None
        self.param_gather_pending = False
        if not skip_next and self.next_param_gather_bucket is not None:
            self.next_param_gather_bucket.start_param_sync()

    def mark_param_gather_pending(self):
        """After an optimizer step: this bucket's parameters hold only the local shard's new values."""
        if self.param_gather_handle is not None:  # dispatched but never waited for (module not run)
            self.param_gather_handle.wait()
            self.param_gather_handle = None
        self.param_gather_pending = True

    def _check_for_nan(self):
        norm = self.grad_data.norm(p=2)
        if not torch.isfinite(norm).item():
            raise RuntimeError(
                f"Rank {torch.distributed.get_rank()}: found NaN or inf in the local gradient (norm {norm.item()}) "
                f"before the data-parallel reduction (--check-for-nan-in-grad). Node: {os.uname().nodename}"
            )

    def start_grad_sync(self):
        """Average this bucket's gradients over the data-parallel group (asynchronously when overlapping)."""
        if self.communication_issued:
            raise RuntimeError("the gradient reduction of this bucket was already started: call "
                               "zero_grad_buffer() before the next iteration's backward pass")
        if self.ddp_config.check_for_nan_in_grad:
            self._check_for_nan()
        if self.gradient_scaling_factor != 1.0:
            self.grad_data.mul_(self.gradient_scaling_factor)
        if self.data_parallel_world_size > 1:
            async_op = self.ddp_config.overlap_grad_reduce
            if self.ddp_config.use_distributed_optimizer:
                local = shard_buffer(self.grad_data, self.data_parallel_world_size)[self.data_parallel_rank]
                self.communication_handle = reduce_scatter_tensor(local, self.grad_data,
                                                                  group=self.data_parallel_group, async_op=async_op)
            else:
                self.communication_handle = torch.distributed.all_reduce(self.grad_data,
                                                                         group=self.data_parallel_group,
                                                                         async_op=async_op)
            if not async_op:
                self.communication_handle = None
        self.communication_issued = True

    def finish_grad_sync(self):
        """Wait for the reduction; start it now if backward hooks did not (no overlap, or unused params)."""
        if not self.communication_issued:
            self.start_grad_sync()
        if self.communication_handle is not None:
            self.communication_handle.wait()
            self.communication_handle = None

    def register_grad_ready(self, param: torch.nn.Parameter):
        """Called by the backward hook of ``param`` in the last micro-batch; starts the bucket when complete."""
        if param in self.params_with_grad:
            raise RuntimeError("a parameter's gradient was marked ready twice in one backward pass")
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params) and self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync()


class _BucketListSync:
    """Gradient reduction of ``self.buckets`` in list order (a bucket already dispatched is not dispatched again)."""

    buckets: List[Bucket]

    def start_grad_sync(self):
        for bucket in self.buckets:
            if not bucket.communication_issued:
                bucket.start_grad_sync()

    def finish_grad_sync(self):
        for bucket in self.buckets:
            bucket.finish_grad_sync()


class ParamAndGradBuffer(_BucketListSync):
    """Gradient (and, with the distributed optimizer, parameter) storage of parameters of one dtype."""

    def __init__(self, ddp_config: DistributedDataParallelConfig, param_dtype: torch.dtype, grad_dtype: torch.dtype,
                 params: List[torch.nn.Parameter], data_parallel_group, bucket_size: Optional[int],
                 param_to_name: Dict[torch.nn.Parameter, str], gradient_scaling_factor: float,
                 own_bucket_params: Optional[Set[torch.nn.Parameter]] = None):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = torch.distributed.get_world_size(group=data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.is_last_microbatch = True
        own_bucket_params = own_bucket_params or set()

        # Pass 1: the index range of every parameter and the boundaries of every bucket.
        self.param_index_map: Dict[torch.nn.Parameter, tuple] = {}  # param -> (start, end, bucket id)
        bucket_ranges = []  # (start, end_padded, end_unpadded, [params])
        offset, bucket_start, bucket_params = 0, 0, []

        def close_bucket():
            nonlocal offset, bucket_start, bucket_params
            end = self._pad(offset) if ddp_config.use_distributed_optimizer else offset
            bucket_ranges.append((bucket_start, end, offset, bucket_params))
            offset = bucket_start = end
            bucket_params = []

        for param in reversed(params):
            # Parameters synchronised across pipeline stages (the shared word embedding) get a bucket of their
            # own with the distributed optimizer, so that every stage shards them identically and the
            # embedding-group all-reduce after the reduce-scatter combines matching shards.
            alone = ddp_config.use_distributed_optimizer and param in own_bucket_params
            if alone and bucket_params:
                close_bucket()
            self.param_index_map[param] = (offset, offset + param.numel(), len(bucket_ranges))
            offset += param.numel()
            bucket_params.append(param)
            if alone or (bucket_size is not None and offset - bucket_start >= bucket_size):
                close_bucket()
        if bucket_params:
            close_bucket()

        self.numel = offset
        self.numel_unpadded = sum(p.numel() for p in params)
        # The buffers live with the parameters (the model is moved to its device before being wrapped).
        dev = params[0].device if params else _device.current_device()
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=dev)
        self.param_data = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=dev)

        # Pass 2: views. The parameter storage moves into param_data (keeping its values).
        for param, (start, end, _) in self.param_index_map.items():
            if self.param_data is not None:
                with torch.no_grad():
                    self.param_data[start:end].copy_(param.data.reshape(-1))
                param.data = self.param_data[start:end].view(param.data.shape)
            param.main_grad = self.grad_data[start:end].view(param.data.shape)

        self.buckets: List[Bucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, Bucket] = {}
        for start, end, end_unpadded, bparams in bucket_ranges:
            bucket = Bucket(
                ddp_config, bparams, self.grad_data[start:end],
                self.param_data[start:end] if self.param_data is not None else None,
                start, end_unpadded - start, data_parallel_group, self.data_parallel_world_size,
                gradient_scaling_factor,
            )
            self.buckets.append(bucket)
            for p in bparams:
                self.param_to_bucket[p] = bucket

        self._describe(param_to_name)

    def _pad(self, index: int) -> int:
        return int(math.ceil(index / self.data_parallel_world_size)) * self.data_parallel_world_size

    def _describe(self, param_to_name):
        if os.environ.get("MEGATRON_LOG_DDP_BUCKETS", "0") != "1":
            return
        if torch.distributed.get_rank() != 0:
            return
        print(f"> DDP buffer ({self.param_dtype} params, {self.grad_dtype} grads): {len(self.buckets)} bucket(s), "
              f"{self.numel} elements ({self.numel_unpadded} used)", flush=True)
        for i, bucket in enumerate(self.buckets):
            names = [param_to_name.get(p, "?") for p in bucket.params_list]
            print(f"    bucket {i}: offset {bucket.offset}, {bucket.grad_data.numel()} elements: {', '.join(names)}",
                  flush=True)

    def reset(self):
        """Zero the gradients and forget which ones were ready; the next backward is a last micro-batch."""
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
        self.is_last_microbatch = True

    def register_grad_ready(self, param: torch.nn.Parameter):
        if self.is_last_microbatch and self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket[param].register_grad_ready(param)

    def mark_param_gather_pending(self):
        """Defer the all-gather of every bucket to the next forward pass (overlap_param_gather)."""
        if self.param_data is None:
            raise RuntimeError("overlap_param_gather needs DistributedDataParallelConfig(use_distributed_optimizer=True)")
        for bucket in self.buckets:
            bucket.mark_param_gather_pending()

    def all_gather_params(self):
        """Distributed optimizer: every rank contributes its updated shard of every bucket's parameters."""
        if self.param_data is None:
            raise RuntimeError("all_gather_params needs DistributedDataParallelConfig(use_distributed_optimizer=True)")
        if self.data_parallel_world_size == 1:
            return
        for bucket in self.buckets:
            local = shard_buffer(bucket.param_data, self.data_parallel_world_size)[bucket.data_parallel_rank]
            all_gather_into_tensor(bucket.param_data, local, group=self.data_parallel_group)


class _ParamAndGradBucketGroup(_BucketListSync):
    """Buckets whose communication belongs together (see :func:`partition_buckets`). Its sync calls run the
    buckets' own collectives one after another, in list order (no coalescing into one kernel)."""

    def __init__(self, buckets: List[Bucket], ddp_config: DistributedDataParallelConfig, data_parallel_group,
                 data_parallel_world_size: int):
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_world_size
        self.params = set().union(*(bucket.params for bucket in buckets)) if buckets else set()

    def start_param_sync(self, force_sync: bool = False):
        for bucket in self.buckets:
            bucket.start_param_sync(force_sync=force_sync)

    def finish_param_sync(self, skip_next: bool = False):
        for bucket in self.buckets:
            bucket.finish_param_sync(skip_next=skip_next)


def partition_buckets(buffers: List[ParamAndGradBuffer],
                      force_single_bucket_group: bool = False) -> List[_ParamAndGradBucketGroup]:
    """Group the buckets of ``buffers`` (one buffer per parameter dtype) for communication.

    * ``force_single_bucket_group``: one group of every bucket of every buffer (they must share the DDP config,
      the DP group and its size);
    * no fp8 buffer (param dtype ``torch.uint8``): one group per bucket, in buffer then bucket order;
    * an fp8 buffer: one group per fp8 bucket, and every bucket of the other buffers (the small non-fp8
      parameters, e.g. biases) joins the LAST fp8 group, i.e. the one of the first layers, whose gradients
      are ready last anyway (joining an earlier group would delay its reduction until the whole backward).

    Two buffers of one param dtype are refused (``ValueError``).
    """
    if not buffers:
        return []
    by_dtype: Dict[torch.dtype, ParamAndGradBuffer] = {}
    for buffer in buffers:
        if buffer.param_dtype in by_dtype:
            raise ValueError(f"partition_buckets: two buffers hold {buffer.param_dtype} parameters")
        by_dtype[buffer.param_dtype] = buffer

    def group_of(buckets, buffer):
        return _ParamAndGradBucketGroup(buckets, buffer.ddp_config, buffer.data_parallel_group,
                                        buffer.data_parallel_world_size)

    if force_single_bucket_group:
        first = buffers[0]
        for buffer in buffers[1:]:
            if (buffer.ddp_config != first.ddp_config or buffer.data_parallel_group != first.data_parallel_group
                    or buffer.data_parallel_world_size != first.data_parallel_world_size):
                raise ValueError("partition_buckets(force_single_bucket_group=True): the buffers differ in DDP "
                                 "config or data-parallel group")
        return [group_of([bucket for buffer in buffers for bucket in buffer.buckets], first)]
    fp8_buffer = by_dtype.get(torch.uint8)
    if fp8_buffer is None:
        return [group_of([bucket], buffer) for buffer in buffers for bucket in buffer.buckets]
    others = [bucket for buffer in buffers if buffer is not fp8_buffer for bucket in buffer.buckets]
    groups = [[bucket] for bucket in fp8_buffer.buckets]
    if groups:
        groups[-1].extend(others)
    elif others:
        groups.append(others)
    return [group_of(buckets, fp8_buffer) for buckets in groups]
