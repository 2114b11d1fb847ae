"""The ``torch_dist`` sharded backend: PyTorch Distributed Checkpoint files written through
:mod:`megatron.core.dist_checkpointing.sharded_io`.

On disk a :class:`ShardedTensor` ``t`` is the chunk ``t.data`` viewed with its prepended axes (``[1, ..., 1] +
local_shape``) at ``t.global_offset`` of the DCP tensor ``t.key`` of shape ``t.global_shape``; only main replicas are
written. A :class:`ShardedObject` is the pickled list ``[data]`` under its ``unique_key`` (one per piece). This is the
layout megatron-core's own torch_dist strategy reads and writes, so the checkpoints move both ways.
"""
from __future__ import annotations

import io
import itertools
import threading
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.strategies.checkpointable import (CheckpointableShardedTensor,
                                                                        LocalShardsContainer)
from megatron.core.dist_checkpointing.sharded_io import (LocalShard, ShardingError, load_sharded, read_dcp_metadata,
                                                         remove_entries, save_sharded)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy, LoadShardedStrategy,
                                                              StrategyAction, register_default_strategy)


class MCoreMetadata:
    """Kept importable for megatron-core checkpoints whose pickled DCP ``.metadata`` names this (empty) class."""


class MCoreSavePlan:
    """Kept importable for megatron-core checkpoints whose pickled DCP ``.metadata`` names this (empty) class."""


def flatten_state_dict(state_dict) -> Tuple[dict, Dict[str, tuple]]:
    """``(flat, mappings)``: ``state_dict``'s leaves under dotted keys (``{'a': {'b': [x, y]}}`` -> ``a.b.0``,
    ``a.b.1`` when the list holds tensors; lists of plain values stay whole) and each key's original path, as
    torch DCP's ``flatten_state_dict`` with sharded leaves (:class:`ShardedBase`) terminal like tensors. A key
    reached twice raises ``ValueError``."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    flat, mappings = {}, {}

    def visit(path, value):
        key = ".".join(str(p) for p in path)
        if key in flat:
            raise ValueError(f"duplicated flatten key {key}")
        flat[key], mappings[key] = value, path

    traverse_state_dict(state_dict, visit, lambda x: isinstance(x, (torch.Tensor, ShardedBase)))
    return flat, mappings


def _chunk(sh_ten: ShardedTensor, data: torch.Tensor) -> LocalShard:
    return LocalShard(data.reshape((1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape)),
                      sh_ten.global_shape, sh_ten.global_offset)


def to_storage(sharded_state_dict, only_main_replica: bool = True, snapshot: bool = False) -> Dict[str, object]:
    """The flat ``{DCP key: [LocalShard, ...] | [object, ...]}`` that :func:`save_sharded` writes for the sharded
    leaves of ``sharded_state_dict`` (factories already applied). ``snapshot`` copies the tensors (a background
    write must not see later in-place updates)."""
    storage: Dict[str, list] = {}
    for leaf in nested_values(sharded_state_dict):
        if only_main_replica and not is_main_replica(leaf.replica_id):
            continue
        if isinstance(leaf, ShardedTensor):
            if leaf.data is None:
                raise CheckpointingException(f"ShardedTensor {leaf.key!r} has no data to save")
            data = leaf.data.detach()
            storage.setdefault(leaf.key, []).append(_chunk(leaf, data.clone() if snapshot else data))
        elif isinstance(leaf, ShardedObject):
            storage.setdefault(leaf.unique_key, []).append(leaf.data)
        else:
            raise CheckpointingException(f"cannot save a {type(leaf).__name__} leaf ({getattr(leaf, 'key', '')!r}): "
                                         "apply the factories first")
    return storage


class StorageRequest:
    """What a load asks the storage layer for: ``items`` ``{DCP key: [LocalShard zero buffers] | None}`` for the
    sharded leaves of a request (factories applied; every replica, not only main ones). A block asked twice on
    one rank is read once. After the read, :meth:`fill` replaces the leaves by the loaded values; a leaf whose key
    is not in ``items`` (a strictness rule dropped it) becomes None."""

    def __init__(self, sharded_state_dict):
        self.items: Dict[str, object] = {}
        self._mismatch = set()
        seen = set()
        for leaf in nested_values(sharded_state_dict):
            if isinstance(leaf, ShardedTensor):
                index = (leaf.key, tuple(leaf.global_offset), tuple(leaf.local_shape))
                if index not in seen:
                    seen.add(index)
                    chunk = _chunk(leaf, torch.zeros(leaf.local_shape, dtype=leaf.dtype))
                    self.items.setdefault(leaf.key, []).append(chunk)
                if leaf.allow_shape_mismatch:
                    self._mismatch.add(leaf.key)
            elif isinstance(leaf, ShardedObject):
                self.items[leaf.unique_key] = None
            else:
                raise CheckpointingException(f"cannot load into a {type(leaf).__name__} leaf "
                                             f"({getattr(leaf, 'key', '')!r}): apply the factories first")

    def shape_mismatch_keys(self) -> List[str]:
        return sorted(k for k in self._mismatch if k in self.items)

    def fill(self, sharded_state_dict, items: Optional[Dict[str, object]] = None):
        """Replace the leaves of ``sharded_state_dict`` (in place) by the values read into ``items`` (default: this
        request's; any request made from the same sharded state dict works)."""
        items = self.items if items is None else items
        taken = set()

        def value(leaf):
            if isinstance(leaf, ShardedTensor):
                if items.get(leaf.key) is None:
                    return None
                offset, shape = tuple(leaf.global_offset), (1,) * leaf.prepend_axis_num + tuple(leaf.local_shape)
                chunk = next((c for c in items[leaf.key] if tuple(c.global_offset) == offset
                              and tuple(c.data.shape) == shape), None)
                if chunk is None:
                    raise CheckpointingException(f"{leaf.key!r} at offset {offset} was not read")
                out = chunk.data.reshape(leaf.local_shape)
                if id(chunk) in taken:
                    out = out.clone()
                taken.add(id(chunk))
                return out
            if isinstance(leaf, ShardedObject):
                payload = items.get(leaf.unique_key)
                return payload[0] if isinstance(payload, list) and len(payload) == 1 else payload
            return leaf

        return dict_list_map_inplace(value, sharded_state_dict)


# ------------------------------------------------------------------- megatron-core's DCP-compatible state dicts
def sharded_tensor_to_torch_sharded_tensor(sh_tens: List[ShardedTensor], rank: Optional[int] = None,
                                           load_legacy_1d_flatten_tensors: bool = False):
    """PyTorch's (``torch.distributed._shard``) ShardedTensor holding this rank's blocks ``sh_tens`` of one key
    on a regular grid: each block's data viewed with its prepended axes (``[1, ..., 1] + local_shape``) at its
    ``global_offset``; every other grid cell is declared as a block of the same size on another rank (DCP only
    uses this rank's). No communication. The result carries ``mcore_sh_ten`` (the last block without data)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardedTensorProperties

    # load_legacy_1d_flatten_tensors: accepted and without effect, as in megatron-core 0.16.1 (no flattened blocks)
    rank = torch.distributed.get_rank() if rank is None else rank
    world = torch.distributed.get_world_size()
    first = sh_tens[0]
    by_offset: Dict[tuple, List[ShardedTensor]] = {}
    for sh_ten in sh_tens:
        sh_ten.data = sh_ten.data.contiguous().view((1,) * first.prepend_axis_num + tuple(sh_ten.local_shape))
        by_offset.setdefault(tuple(sh_ten.global_offset), []).append(sh_ten)
    block = tuple(first.data.shape)
    device = first.data.device.type
    local = [Shard.from_tensor_and_offsets(t.data, list(t.global_offset), rank) for t in sh_tens]
    shards_md = []
    for cell in itertools.product(*(range(f) for f in first.axis_fragmentations)):
        offset = tuple(c * b for c, b in zip(cell, block))
        if offset in by_offset:
            shards_md += [ShardMetadata(list(offset), list(t.data.shape), f"rank:{rank}/{device}")
                          for t in by_offset[offset]]
        else:  # someone else's block: only its place matters
            shards_md.append(ShardMetadata(list(offset), list(block), f"rank:{(rank + 1) % world}/{device}"))
    data = first.data
    md = ShardedTensorMetadata(shards_metadata=shards_md, size=torch.Size(first.global_shape),
                               tensor_properties=ShardedTensorProperties(
                                   dtype=data.dtype, layout=data.layout, requires_grad=data.requires_grad,
                                   memory_format=torch.contiguous_format, pin_memory=data.is_pinned()))
    out = TorchShardedTensor._init_from_local_shards_and_global_metadata(local, sharded_tensor_metadata=md,
                                                                         process_group=None)
    out.mcore_sh_ten = sh_tens[-1].without_data()
    return out


def mcore_to_pyt_state_dict(state_dict: Dict[str, List[ShardedBase]], is_loading: bool = False,
                            init_device: torch.device = torch.device("cpu"),
                            load_legacy_1d_flatten_tensors: bool = False) -> Dict[str, Union[torch.Tensor, io.BytesIO]]:
    """``{key: [ShardedTensor, ...] | [ShardedObject, ...]}`` (one key's blocks on this rank) as values PyTorch DCP
    saves and loads: tensors without prepended axes (or off a regular grid) as
    :class:`CheckpointableShardedTensor` (:class:`LocalShardsContainer` for several blocks), others as PyTorch
    ShardedTensors (:func:`sharded_tensor_to_torch_sharded_tensor`); objects as ``io.BytesIO`` of
    ``torch.save([data, ...])``. ``is_loading``: blocks without data get a buffer on ``init_device`` (zeros when
    ``allow_shape_mismatch``, whose existing data is zeroed too); saving a block without data is an error."""
    rank = torch.distributed.get_rank()

    def tensors(blocks: List[ShardedTensor]):
        for sh_ten in blocks:
            if sh_ten.data is None:
                if not is_loading:
                    raise CheckpointingException(f"`data` attr is None for {sh_ten}")
                sh_ten.init_data(init_device, init_fn=torch.zeros if sh_ten.allow_shape_mismatch else torch.empty)
            else:
                sh_ten.data = sh_ten.data.detach()
                if sh_ten.allow_shape_mismatch and is_loading:
                    sh_ten.data.zero_()
        first = blocks[0]
        if not first.prepend_axis_num or not first.has_regular_grid:
            wrapped = [CheckpointableShardedTensor.from_sh_ten(b) for b in blocks]
            return wrapped[0] if len(wrapped) == 1 else LocalShardsContainer(wrapped)
        torch_sh_ten = sharded_tensor_to_torch_sharded_tensor(blocks, rank, load_legacy_1d_flatten_tensors)
        torch_sh_ten.key = first.key
        return torch_sh_ten

    def objects(blocks: List[ShardedObject]) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save([b.data for b in blocks], buffer)
        return buffer

    return {key: tensors(v) if isinstance(v[0], ShardedTensor) else objects(v) for key, v in state_dict.items()}


def _unwrap_pyt_sharded_tensor(value) -> Union[List[torch.Tensor], object]:
    """The local tensors of a value made by :func:`mcore_to_pyt_state_dict` (prepended axes squeezed); other
    values as they are."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

    if isinstance(value, CheckpointableShardedTensor):
        return [value._sh_ten.data]
    if isinstance(value, LocalShardsContainer):
        return [shard._sh_ten.data for shard in value._local_shards]
    if not isinstance(value, TorchShardedTensor):
        return value
    prepended = value.mcore_sh_ten.prepend_axis_num
    return [shard.tensor.reshape(shard.tensor.shape[prepended:]) for shard in value.local_shards()]


class MCoreSavePlanner(DefaultSavePlanner):
    """DCP's save planner for :func:`mcore_to_pyt_state_dict` values: every rank writes its own items (objects
    are per-rank pieces, not common values), objects are already serialized (written as they are).
    ``can_run_decentralized_global_plan``: the global plan is the local one (needs ``flatten_state_dict=False``
    and no replica de-duplication)."""

    def __init__(self, *args, dedup_replicated_tensors: Optional[bool] = None,
                 can_run_decentralized_global_plan: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan
        if can_run_decentralized_global_plan and (dedup_replicated_tensors or self.flatten_state_dict):
            raise ValueError("Cannot run decentralized plan with dedup_replicated_tensors=True or "
                             "flatten_state_dict=True")

    def create_local_plan(self) -> SavePlan:
        """A write item for every value on every rank (tensor blocks through their DCP hooks, bytes as bytes)."""
        from torch.distributed.checkpoint.planner_helpers import _create_write_items

        items = [item for fqn, obj in self.state_dict.items() for item in _create_write_items(fqn, obj)]
        self.plan = SavePlan(items=items, planner_data=self.mappings)
        return self.plan

    def create_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The local plan unchanged (no coordinator round)."""
        if self.flatten_state_dict or local_plan.planner_data:
            raise CheckpointingException("a decentralized plan needs flatten_state_dict=False and no planner data")
        return local_plan

    def transform_object(self, write_item, object):
        """Objects arrive serialized (``io.BytesIO``): nothing to do."""
        return object


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with a check of global shapes: every tensor of ``shapes_validation_sharded_tensors``
    must exist in the checkpoint with its ``global_shape`` (KeyError / CheckpointingException). Tensors of
    ``allow_shape_mismatch_sharded_tensors`` (``{key: ShardedTensor}``) are planned as if stored at the expected
    shape (what overlaps is read)."""

    def __init__(self, *args, shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
                 allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors
        self._intermediate_read_item_and_target = None

    def _validate_global_shapes(self, metadata, sharded_tensors) -> None:
        stored = metadata.state_dict_metadata
        for sh_ten in sharded_tensors:
            if sh_ten.key not in stored:
                raise KeyError(f"{sh_ten.key} from model not in state dict: {sorted(stored)}")
            if tuple(stored[sh_ten.key].size) != tuple(sh_ten.global_shape):
                raise CheckpointingException(f"Global shape mismatch for loaded ({stored[sh_ten.key].size}) and "
                                             f"expected ({sh_ten.global_shape}) tensor for key {sh_ten.key}")

    @contextmanager
    def _temporarily_bypass_shape_validation(self):
        """While planning, the tensors allowed to differ look stored at their expected shapes."""
        saved = []
        for key, sh_ten in (self.allow_shape_mismatch_sharded_tensors or {}).items():
            md = self.metadata.state_dict_metadata[key]
            saved.append((md, md.size))
            md.size = torch.Size(sh_ten.global_shape)
        try:
            yield
        finally:
            for md, size in saved:
                md.size = size

    def create_local_plan(self) -> LoadPlan:
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        with self._temporarily_bypass_shape_validation():
            return super().create_local_plan()


_async_group = None
_async_group_lock = threading.Lock()


def async_process_group():
    """A gloo group of all ranks for background writes (created once, collectively, on first use)."""
    global _async_group
    with _async_group_lock:
        if _async_group is None and torch.distributed.is_initialized():
            _async_group = torch.distributed.new_group(backend="gloo")
    return _async_group


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes main replicas with PyTorch DCP. ``process_group``: the group of the collective write (default: all
    ranks)."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False, separation_hint: Optional[str] = None,
                 process_group=None):
        super().__init__(backend, version)
        self.separation_hint = separation_hint  # keys beginning with it are written to their own files
        self.thread_count = thread_count  # DCP writes one file per rank here; kept for megatron-core's signature
        self.cached_metadata = cached_metadata
        self.keep_only_main_replica = keep_only_main_replica
        self.process_group = process_group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict, checkpoint_dir: str) -> None:
        save_sharded(to_storage(sharded_state_dict, self.keep_only_main_replica), str(checkpoint_dir),
                     process_group=self.process_group, separation_hint=self.separation_hint)

    def async_save(self, sharded_state_dict, checkpoint_dir: str) -> AsyncRequest:
        storage = to_storage(sharded_state_dict, self.keep_only_main_replica, snapshot=True)
        group = self.process_group if self.process_group is not None else async_process_group()
        return AsyncRequest(save_sharded, (storage, str(checkpoint_dir)), [],
                            {"process_group": group, "separation_hint": self.separation_hint})


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Reads any layout's chunks into the requested ones (resharding on load)."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(self, sharded_state_dict, checkpoint_dir: str):
        """Replace every ShardedTensor of ``sharded_state_dict`` (in place) by its loaded local tensor (a new
        tensor of its dtype; zero where the checkpoint has nothing, with ``allow_shape_mismatch``) and every
        ShardedObject by its stored object; returns the dict."""
        request = StorageRequest(sharded_state_dict)
        try:
            load_sharded(request.items, str(checkpoint_dir), allow_shape_mismatch=request.shape_mismatch_keys(),
                         no_dist=not torch.distributed.is_initialized(), process_group=self.process_group)
        except ShardingError as e:
            raise CheckpointingException(f"torch_dist checkpoint {checkpoint_dir}: {e}") from e
        return request.fill(sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str, metadata=None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = metadata or read_dcp_metadata(str(checkpoint_dir))
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                meta = torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")
                out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: str):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        metadata = read_dcp_metadata(str(checkpoint_dir))
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and "/shard_" in key:
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Remove the data files whose names begin with ``key_prefix`` and the entries whose keys do (a warning
        and nothing else when no file name begins with it)."""
        remove_entries(str(checkpoint_dir), key_prefix)


def get_reformulation_metadata(sharded_state_dict, checkpoint_dir):
    """Reformulated (re-chunked) tensors do not exist in this library's checkpoints: always empty."""
    return {}


def register_default_torch_strategies() -> None:
    """Register this module's strategies as the defaults of their backend (done on import)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy)
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy)


register_default_torch_strategies()
