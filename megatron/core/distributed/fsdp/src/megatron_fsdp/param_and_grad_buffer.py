"""Pieces of megatron-core's ``megatron_fsdp.param_and_grad_buffer`` that stand on their own: the bucketing policy,
bucket / prefetch enums, the layout of a flat data-parallel buffer (:func:`build_data_parallel_buffer_index`), the
temporary-bucket allocators, the gradient pre-scaling before a reduction, the meta-device reset context, and the
construction of a Megatron-FSDP DTensor from a rank's block.

Buffer layout. Items (tensor shapes) are laid end to end in a flat buffer cut into cells of ``chunk_size_factor``
(``c``) elements. Items of at least ``c`` elements are placed in order; one that does not fill its last cell leaves
a gap of ``c - (n mod c)``, into which the first later item whose own remainder fits is pulled (its remainder
ending exactly at the cell boundary, so it spans whole cells after), then the small items (fewer than ``c``
elements, in their order) that still fit. Small items left over go at the end. The buffer is padded to a multiple
of ``world_size * c`` unless nothing is sharded (``no_shard``), and rank ``r``'s shard is elements
``[r * size / world, (r + 1) * size / world)`` (a sharded buffer stores only those, from local index 0).

:class:`DataParallelBuffer` is one such flat bucket with this rank's (possibly virtual) shard stored, and the maps
between an item, the bucket and the shard; :class:`ParameterGroup` the record of a group of parameters and their
buffers. The engine built from them in megatron-core (``ParamAndGradBuffer``, the all-gather / gradient-reduce
pipelines) is not here: this library's Megatron-FSDP keeps each parameter's shard as an FSDP2 DTensor
(``megatron.core.distributed.fsdp.sharded_module``), which plays its role.

``make_fsdp_dtensor``'s placement: a block of a parameter sharded over the ``dp_shard_dim`` mesh is ``Shard(0)``
(rows of the parameter, uneven sizes allowed); an unsharded one ``Replicate()``; a Megatron tensor-parallel slice
(``tensor_model_parallel``, ``partition_dim``) adds the ``tp_dim`` mesh dimension with ``Shard(partition_dim)``
(``Replicate()`` for a TP-duplicated parameter), the data-parallel shard being taken inside the TP slice.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections import defaultdict, namedtuple
from contextlib import ExitStack, nullcontext
from enum import Enum
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (update_uneven_dtensor_chunk_metadata,
                                                                             validate_uneven_dtensor)
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import (
    FSDPDistributedIndex, get_cuda_rng_tracker, get_global_memory_buffer, get_mcore_tensor_parallel_partition_dim,
    is_mcore_tensor_model_parallel, is_mcore_tensor_parallel_duplicated)
from megatron.core.tensor_parallel.random import _MODEL_PARALLEL_RNG_TRACKER_NAME
from megatron.core.utils import to_local_if_dtensor

logger = logging.getLogger(__name__)

__all__ = ["BucketingPolicy", "Bucket", "BucketStatus", "PrefetchOrder", "build_data_parallel_buffer_index",
           "TemporaryBucketAllocator", "StorageResizeBasedBucketAllocator", "RotaryBucketAllocator",
           "FixedPoolAllocator", "DataParallelBuffer", "ParameterGroup", "gradient_reduce_preprocessing",
           "check_gpu_memory", "ResetParametersContext",
           "override_sharded_param_methods_with_safety_checks", "to_local_if_dtensor", "make_fsdp_dtensor"]

TensorItemIndex = namedtuple("TensorItemIndex", ["global_data_index", "size", "item_id", "bucket_id", "shape"])
BucketIndex = namedtuple("BucketIndex", ["bucket_id", "global_data_index", "size", "items"])
ShardBucketIndex = namedtuple("ShardBucketIndex",
                              ["bucket_id", "global_data_index", "local_data_index", "bucket_data_index", "size"])


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


def build_data_parallel_buffer_index(elements: List[torch.Size], data_parallel_rank: int,
                                     data_parallel_world_size: int, is_data_distributed: bool,
                                     ddp_config, bucket_id: int = 0,
                                     chunk_size_factor: int = 1) -> Tuple[dict, BucketIndex, ShardBucketIndex]:
    """The layout of ``elements`` in one flat bucket (module docstring): ``({item_id: TensorItemIndex}`` in
    placement order``, BucketIndex, this rank's ShardBucketIndex)``."""
    c = chunk_size_factor
    index = {}

    def place(item_id, shape, offset):
        index[item_id] = TensorItemIndex(offset, shape.numel(), item_id, bucket_id, shape)

    small = [(i, e) for i, e in enumerate(elements) if e.numel() < c]
    large = [(i, e) for i, e in enumerate(elements) if e.numel() >= c]
    end = 0
    while large:
        item_id, shape = large.pop(0)
        place(item_id, shape, end)
        remainder = shape.numel() % c
        if remainder == 0:
            end += shape.numel()
            continue
        gap_at, gap = end + shape.numel(), c - remainder
        end += (shape.numel() // c + 1) * c
        partner = next(((j, e) for j, e in large if 0 < e.numel() % c <= gap), None)
        if partner is not None:
            large.remove(partner)
            place(partner[0], partner[1], end - partner[1].numel() % c)
            gap -= partner[1].numel() % c
            end += partner[1].numel() // c * c
        for item in list(small):
            if item[1].numel() <= gap:
                place(item[0], item[1], gap_at)
                gap -= item[1].numel()
                gap_at += item[1].numel()
                small.remove(item)
    for item_id, shape in small:
        place(item_id, shape, end)
        end += shape.numel()
    if ddp_config.data_parallel_sharding_strategy != "no_shard":
        end = math.ceil(end / (data_parallel_world_size * c)) * data_parallel_world_size * c
    bucket = BucketIndex(bucket_id, 0, end, list(index.values()))
    shard_size = end // data_parallel_world_size
    in_bucket = shard_size * data_parallel_rank
    start = bucket.global_data_index + in_bucket
    shard = ShardBucketIndex(bucket_id, start, 0 if is_data_distributed else start, in_bucket, shard_size)
    return index, bucket, shard


def _resize_storage(tensor: torch.Tensor, numel: int) -> None:
    """Give ``tensor``'s storage ``numel`` elements (0 frees it; the tensor object and its views stay)."""
    with torch.no_grad():
        storage = tensor.untyped_storage()
        if storage.nbytes() != numel * tensor.element_size():
            if numel and storage.nbytes():
                raise RuntimeError("a bucket's storage is resized from empty to full or back, never in between")
            storage.resize_(numel * tensor.element_size())


class TemporaryBucketAllocator:
    """Temporary buckets (all-gathered parameters, gradients before their reduction) by bucket id: ``allocate``
    creates one of ``size`` elements unless the id has one; ``free`` releases its storage and forgets it."""

    def __init__(self):
        self.buckets = {}

    def allocate(self, bucket_id: int, size: int, dtype: torch.dtype, device: torch.device,
                 mem_alloc_context: Optional[Callable] = None) -> Bucket:
        if bucket_id not in self.buckets:
            self.buckets[bucket_id] = Bucket(data=torch.empty(size, dtype=dtype, device=device))
        return self.buckets[bucket_id]

    def free(self, bucket_id: int):
        bucket = self.buckets.pop(bucket_id, None)
        if bucket is not None:
            _resize_storage(bucket.data, 0)


class StorageResizeBasedBucketAllocator(TemporaryBucketAllocator):
    """Keeps each bucket's tensor object; ``free`` resizes its storage to nothing and ``allocate`` back to
    ``size`` elements (references to the tensor stay valid across steps)."""

    def allocate(self, bucket_id: int, size: int, dtype: torch.dtype, device: torch.device,
                 mem_alloc_context: Optional[Callable] = None) -> Bucket:
        bucket = super().allocate(bucket_id, size, dtype, device, mem_alloc_context)
        _resize_storage(bucket.data, size)
        return bucket

    def free(self, bucket_id: int):
        if bucket_id in self.buckets:
            _resize_storage(self.buckets[bucket_id].data, 0)


class RotaryBucketAllocator(TemporaryBucketAllocator):
    """A pool of global scratch buffers (``<name>_<k>`` in :func:`get_global_memory_buffer`) handed out in turn:
    a bucket takes the oldest idle buffer (a new one when none is idle) and gives it back on ``free``."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.num_global_buffer = 0
        self.idle_buffer = []
        self.using_buffer = {}

    def _get_gbuf_name(self, buffer_id: int):
        return f"{self.name}_{buffer_id}"

    def allocate(self, bucket_id: int, size: int, dtype: torch.dtype, device: torch.device,
                 mem_alloc_context: Optional[Callable] = None) -> Bucket:
        if bucket_id not in self.using_buffer:
            if not self.idle_buffer:
                self.idle_buffer.append(self.num_global_buffer)
                self.num_global_buffer += 1
            self.using_buffer[bucket_id] = self.idle_buffer.pop(0)
        name = self._get_gbuf_name(self.using_buffer[bucket_id])
        return Bucket(data=get_global_memory_buffer().get_tensor([size], dtype=dtype, name=name,
                                                                 mem_alloc_context=mem_alloc_context))

    def free(self, bucket_id: int):
        if bucket_id in self.using_buffer:
            self.idle_buffer.append(self.using_buffer.pop(bucket_id))


class FixedPoolAllocator(TemporaryBucketAllocator):
    """``size`` sets of global buffers (double buffering by default) shared by the FSDP units whose buckets match
    one another (same count, dtypes and element counts): the largest such family of units. A bucket of one of those
    units takes buffer ``(set, its position in the unit)`` from the first set where it is idle; other buckets go to
    a plain :class:`TemporaryBucketAllocator`. ``fsdp_param_groups[i]`` describes bucket ``i`` (``fsdp_unit_id``,
    ``dtype``, ``params``)."""

    def __init__(self, name: str, fsdp_param_groups: List["ParameterGroup"], size: int = 2):  # noqa: F821
        self.name = name
        self.fsdp_param_groups = fsdp_param_groups
        self.size = size
        self.allocation_tracker = {}
        self.fsdp_unit_buckets = defaultdict(list)
        for bucket_id, group in enumerate(fsdp_param_groups):
            if group.fsdp_unit_id not in (None, -1):
                self.fsdp_unit_buckets[group.fsdp_unit_id].append(bucket_id)
        families = [[u for u in self.fsdp_unit_buckets if self._is_two_bucket_group_equal(
            self.fsdp_unit_buckets[u], buckets)] for buckets in self.fsdp_unit_buckets.values()]
        self.fsdp_double_buffer_units = max(families, key=len, default=[])
        if not self.fsdp_double_buffer_units:
            raise AssertionError("Found no FSDP units to use fixed-size buffering")
        per_unit = len(self.fsdp_unit_buckets[self.fsdp_double_buffer_units[0]])
        self.idle_buffer = [(k, j) for k in range(size) for j in range(per_unit)]
        self.using_buffer = {}
        self.backup_allocator = TemporaryBucketAllocator()

    def _is_two_bucket_group_equal(self, group_a, group_b):
        def signature(bucket_ids):
            return [(self.fsdp_param_groups[b].dtype, sum(p.numel() for p in self.fsdp_param_groups[b].params))
                    for b in bucket_ids]

        return signature(group_a) == signature(group_b)

    def _get_gbuf_name(self, buf_group_id: int, bucket_index: int):
        return f"{self.name}_{buf_group_id}_{bucket_index}"

    def allocate(self, bucket_id: int, size: int, dtype: torch.dtype, device: torch.device,
                 mem_alloc_context: Optional[Callable] = None) -> Bucket:
        unit = self.fsdp_param_groups[bucket_id].fsdp_unit_id
        if unit not in self.fsdp_double_buffer_units:
            return self.backup_allocator.allocate(bucket_id=bucket_id, size=size, dtype=dtype, device=device)
        if bucket_id not in self.using_buffer:
            position = self.fsdp_unit_buckets[unit].index(bucket_id)
            free = next(((k, position) for k in range(self.size) if (k, position) in self.idle_buffer), None)
            if free is None:
                raise AssertionError(f"[{self.name}] no idle buffer for bucket {bucket_id} (FSDP unit {unit}, "
                                     f"position {position}); in use: {self.using_buffer}")
            self.idle_buffer.remove(free)
            self.using_buffer[bucket_id] = free
        name = self._get_gbuf_name(*self.using_buffer[bucket_id])
        if mem_alloc_context not in (None, nullcontext) and self.allocation_tracker.get((name, dtype), -1) < size:
            self.allocation_tracker[(name, dtype)] = size  # a new registered allocation: wait for the device first
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        return Bucket(data=get_global_memory_buffer().get_tensor([size], dtype=dtype, name=name,
                                                                 mem_alloc_context=mem_alloc_context))

    def free(self, bucket_id: int):
        unit = self.fsdp_param_groups[bucket_id].fsdp_unit_id
        if unit not in self.fsdp_double_buffer_units:
            self.backup_allocator.free(bucket_id)
        elif bucket_id in self.using_buffer:
            self.idle_buffer.append(self.using_buffer.pop(bucket_id))


class DataParallelBuffer:
    """One flat bucket of ``params`` (one dtype) laid out by :func:`build_data_parallel_buffer_index`, of which
    this rank stores its shard (``is_data_distributed``) or the whole bucket (then the shard is *virtual*: the
    same coordinates, read from the whole). ``data`` (given to :meth:`init_data`) holds ``data_size`` elements.

    Coordinates: item ``i`` occupies ``[g_i, g_i + n_i)`` of the bucket; the shard ``[s, s + m)``; the part of
    the item in the shard is the intersection, which sits at ``local_data_index + (g_i - s)`` of ``data`` (0-based
    for a stored shard, the bucket position for a whole bucket). Communication is the caller's: a whole bucket comes
    from :meth:`fetch_bucket` (this buffer itself when it stores the whole bucket in its own dtype, else a temporary
    bucket of ``temporary_bucket_allocator``)."""

    def __init__(self, ddp_config: DistributedDataParallelConfig, params: List[torch.nn.Parameter],
                 is_data_distributed: bool, bucket_id: int, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None,
                 data_parallel_group: Optional[torch.distributed.ProcessGroup] = None, dp_rank: Optional[int] = None,
                 temporary_bucket_allocator: Optional[TemporaryBucketAllocator] = None,
                 is_transpose_buffer: bool = False, gradient_scaling_factor: Optional[float] = None,
                 chunk_size_factor: int = 1, mem_alloc_context: Optional[Callable] = None,
                 item_index_map: Optional[Dict[int, TensorItemIndex]] = None,
                 bucket_index: Optional[BucketIndex] = None,
                 shard_bucket_index: Optional[ShardBucketIndex] = None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise AssertionError(f"params have different dtypes: {dtypes}")
        self.ddp_config = ddp_config
        self.params = params
        self.is_data_distributed = is_data_distributed
        self.bucket_id = bucket_id
        self.dtype = dtype or next(iter(dtypes))
        self.device = device
        self.data_parallel_group = data_parallel_group
        self.dp_rank = dp_rank if dp_rank is not None else torch.distributed.get_rank(data_parallel_group)
        self.dp_world_size = torch.distributed.get_world_size(data_parallel_group)
        self.temporary_bucket_allocator = temporary_bucket_allocator or TemporaryBucketAllocator()
        self.is_transpose_buffer = is_transpose_buffer
        self.gradient_scaling_factor = gradient_scaling_factor
        self.mem_alloc_context = mem_alloc_context or nullcontext
        given = (item_index_map, bucket_index, shard_bucket_index)
        if any(x is not None for x in given):
            if any(x is None for x in given):
                raise AssertionError("item_index_map, bucket_index and shard_bucket_index are given together")
            self.item_index_map, self.bucket_index, self.shard_bucket_index = given
        else:
            self.item_index_map, self.bucket_index, self.shard_bucket_index = build_data_parallel_buffer_index(
                [to_local_if_dtensor(p).shape for p in params], self.dp_rank, self.dp_world_size,
                is_data_distributed, ddp_config, bucket_id=bucket_id, chunk_size_factor=chunk_size_factor)
        self.data_size = self.shard_bucket_index.size if is_data_distributed else self.bucket_index.size
        self.param_idx = {p: i for i, p in enumerate(params)}

    def init_data(self, data: torch.Tensor):
        """Use ``data`` (``data_size`` elements of ``dtype``) as this buffer's storage."""
        if data.dtype != self.dtype or data.numel() != self.data_size:
            raise AssertionError(f"DataParallelBuffer {self.bucket_id}: data of {data.numel()} x {data.dtype}, "
                                 f"expected {self.data_size} x {self.dtype}")
        self.data = data

    def fetch_bucket(self, dtype: Optional[torch.dtype] = None, set_param_data: bool = False) -> Bucket:
        """The whole bucket to communicate into (see the class docstring); with ``set_param_data`` every
        parameter's ``.data`` becomes its view of the bucket."""
        dtype = dtype or self.dtype
        index = self.bucket_index
        if not self.is_data_distributed and dtype == self.dtype:
            bucket = Bucket(data=self.data[index.global_data_index:index.global_data_index + index.size])
        else:
            bucket = self.temporary_bucket_allocator.allocate(bucket_id=index.bucket_id, size=index.size,
                                                              dtype=dtype, device=self.device,
                                                              mem_alloc_context=self.mem_alloc_context)
        if set_param_data:
            for param in self.params:
                local = to_local_if_dtensor(param)
                local.data = self.get_item_from_bucket(bucket, self.param_idx[param]).view(local.shape)
        return bucket

    def free_bucket_storage(self):
        """Release the temporary bucket of a sharded buffer (and the parameters' ``main_grad`` views of it)."""
        if not self.is_data_distributed:
            return
        self.temporary_bucket_allocator.free(self.bucket_index.bucket_id)
        for param in self.params:
            if hasattr(param, "main_grad"):
                param.main_grad = None

    def _get_item_slice_in_shard(self, item_id: int) -> Tuple[int, int]:
        """The part of item ``item_id`` inside this (possibly virtual) shard, in the item's coordinates
        (``(0, 0)`` when none)."""
        item, shard = self.item_index_map[item_id], self.shard_bucket_index
        lo = max(item.global_data_index, shard.global_data_index)
        hi = min(item.global_data_index + item.size, shard.global_data_index + shard.size)
        return (lo - item.global_data_index, hi - item.global_data_index) if lo < hi else (0, 0)

    def locate_item_in_global_item(self, item_id: int) -> Tuple[int, int]:
        """The part of the item this buffer stores, in the item's coordinates (all of it when not sharded)."""
        if not self.is_data_distributed:
            return (0, self.item_index_map[item_id].size)
        return self._get_item_slice_in_shard(item_id)

    def _get_item_local_shard_index(self, item_id: int) -> Tuple[int, int]:
        """Where the item's part in the shard lies in ``data`` (``(0, 0)`` when none)."""
        start, end = self._get_item_slice_in_shard(item_id)
        if start == end:
            return (0, 0)
        item, shard = self.item_index_map[item_id], self.shard_bucket_index
        offset = item.global_data_index - shard.global_data_index + shard.local_data_index
        return (offset + start, offset + end)

    def _get_item_local_index(self, item_id: int) -> Tuple[int, int]:
        """Where the item's stored part lies in ``data`` (the whole item when not sharded)."""
        if not self.is_data_distributed:
            item = self.item_index_map[item_id]
            return (item.global_data_index, item.global_data_index + item.size)
        return self._get_item_local_shard_index(item_id)

    def set_item(self, item_id: int, item_data: torch.Tensor) -> None:
        """Store ``item_data`` (the whole item) into this buffer: its part in the shard, or all of it."""
        flat = item_data.flatten()
        if self.is_data_distributed:
            start, end = self._get_item_slice_in_shard(item_id)
            flat = flat[start:end]
        lo, hi = self._get_item_local_index(item_id)
        if hi > lo:
            with torch.no_grad():
                self.data[lo:hi].copy_(flat)

    def get_item(self, item_id: int, only_shard: bool = False) -> torch.Tensor:
        """The stored part of the item (a view of ``data``); ``only_shard``: its part in the (virtual) shard."""
        lo, hi = self._get_item_local_shard_index(item_id) if only_shard else self._get_item_local_index(item_id)
        return self.data[lo:hi]

    def get_item_from_bucket(self, bucket: Bucket, item_id: int):
        """The item's elements in a whole ``bucket``."""
        item = self.item_index_map[item_id]
        start = item.global_data_index - self.bucket_index.global_data_index
        return bucket.data[start:start + item.size]

    def get_shard_from_bucket(self, bucket: Bucket):
        """This rank's shard of a whole ``bucket``."""
        shard = self.shard_bucket_index
        return bucket.data[shard.bucket_data_index:shard.bucket_data_index + shard.size]

    def get_shard_from_local_buffer(self) -> torch.Tensor:
        """This rank's (virtual) shard in ``data``."""
        shard = self.shard_bucket_index
        return self.data[shard.local_data_index:shard.local_data_index + shard.size]


@dataclasses.dataclass
class ParameterGroup:
    """Parameters grouped for communication and their buffers: ``dtype``, whether they are experts'
    (``is_expert_param``), ``requires_grad``, their FSDP unit (``fsdp_unit_id``), the layout cell
    (``chunk_size_factor``), and the :class:`DataParallelBuffer` of the model weights (and their transposes), the
    main weights, the main gradients, and hybrid FSDP's weight / gradient buffers."""

    params: List[torch.nn.Parameter]
    dtype: Optional[torch.dtype] = None
    is_expert_param: bool = False
    requires_grad: Optional[bool] = None
    fsdp_unit_id: Optional[int] = None
    chunk_size_factor: int = 1
    model_weight_buffer: Optional[DataParallelBuffer] = None
    transpose_weight_buffer: Optional[DataParallelBuffer] = None
    main_weight_buffer: Optional[DataParallelBuffer] = None
    main_grad_buffer: Optional[DataParallelBuffer] = None
    hsdp_wbuf: Optional[DataParallelBuffer] = None
    hsdp_gbuf: Optional[DataParallelBuffer] = None


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


def override_sharded_param_methods_with_safety_checks(params, all_gather_pipeline):
    """Make ``p.to(...)`` / ``p.cpu()`` of each parameter warn and return an empty tensor while its storage is
    freed (sharded away between uses) instead of failing inside torch; otherwise they behave as before."""
    for p in params:
        for method, device in (("to", None), ("cpu", "cpu")):
            original = getattr(p, method)

            def guarded(*args, _p=p, _original=original, _method=method, _device=device, **kwargs):
                if _p.untyped_storage().nbytes() == 0:
                    warnings.warn(f"The parameter may be sharded by Megatron-FSDP, no actual '{_method}' operation "
                                  "is performed.")
                    return torch.empty([], device=_device) if _device else torch.empty([])
                return _original(*args, **kwargs)

            setattr(p, method, guarded)


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
