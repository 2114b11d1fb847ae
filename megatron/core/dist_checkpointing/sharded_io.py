"""Save and load *sharded* state dicts with PyTorch Distributed Checkpoint (DCP), without DTensor.

Every rank describes what it holds as a flat ``{key: LocalShard | [LocalShard, ...] | object}`` dict (a list
when this rank holds several disjoint pieces of one tensor, e.g. the gate and up halves of a SwiGLU weight). A :class:`LocalShard` is a
local tensor plus the global shape of the tensor it belongs to and this piece's offset in it. The save planner
turns each shard into a DCP ``SHARD`` write item (``ChunkStorageMetadata(offsets, sizes)`` and the global size),
so DCP's ``.metadata`` records, per key, the global shape and every stored chunk. Identical chunks offered by
several ranks (data-parallel replicas, the tied embedding copy) have the same ``(key, offset)`` index and are
written once (DCP's plan de-duplication). Other values (python objects) are pickled ``BYTE_IO`` items.

On load every rank again describes the slices it wants; DCP's resharding helper
(``create_read_items_for_chunk_list``) computes which parts of which stored chunks overlap them. That is what lets
a checkpoint saved with one TP/PP/DP layout load into another. :func:`load_full_state_dict` does the same in one
process without a process group: every tensor at its full global shape (the offline reader).
"""
from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclasses.dataclass
class LocalShard:
    """``data`` is the block ``[offset, offset + data.shape)`` of a tensor of shape ``global_shape``."""

    data: torch.Tensor
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]

    def __post_init__(self):
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.global_offset = tuple(int(x) for x in self.global_offset)
        if len(self.global_shape) != self.data.dim() or len(self.global_offset) != self.data.dim():
            raise ValueError(f"shard of shape {tuple(self.data.shape)} needs a global shape and offset of the same "
                             f"rank, got {self.global_shape} and {self.global_offset}")


def shard_write_item(fqn: str, data: torch.Tensor, global_shape, global_offset, index: Optional[int] = None
                     ) -> WriteItem:
    """The DCP write item of the block ``data`` at ``global_offset`` of the tensor ``fqn`` of ``global_shape``
    (a ``SHARD`` item: chunk offsets and sizes, the tensor's properties and global size). ``index``: a lookup
    hint among several blocks of one key on this rank."""
    offsets = torch.Size(global_offset)
    return WriteItem(index=MetadataIndex(fqn, offsets, index), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=data.size()),
                                                 properties=TensorProperties.create_from_tensor(data),
                                                 size=torch.Size(global_shape)))


def _is_shards(obj) -> bool:
    return isinstance(obj, LocalShard) or (isinstance(obj, list) and bool(obj)
                                           and all(isinstance(x, LocalShard) for x in obj))


def _as_list(obj):
    return obj if isinstance(obj, list) else [obj]


def _find_shard(obj, offset) -> LocalShard:
    """The shard of ``obj`` (one shard or a list of shards of one key) that starts at ``offset``."""
    if isinstance(obj, LocalShard):
        return obj
    for shard in obj:
        if offset is None or tuple(shard.global_offset) == tuple(offset):
            return shard
    raise KeyError(f"no shard at offset {tuple(offset)}")


class ShardingError(RuntimeError):
    """A checkpoint does not hold what the loading layout asks for; the message names the key."""


class _ShardSavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, obj in self.state_dict.items():
            if _is_shards(obj):
                items += [shard_write_item(key, shard.data, shard.global_shape, shard.global_offset)
                          for shard in _as_list(obj)]
            else:
                items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        obj = self.state_dict[write_item.index.fqn]
        if _is_shards(obj):
            return _find_shard(obj, write_item.index.offset).data.detach().contiguous()
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        return buffer


class _ShardLoadPlanner(DefaultLoadPlanner):
    """Reads into the ``data`` of each requested :class:`LocalShard` (zero where the checkpoint has nothing:
    the rows of a larger vocabulary padding) and replaces object entries by their unpickled values."""

    def __init__(self, allow_shape_mismatch: Sequence[str] = ()):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.allow_shape_mismatch = set(allow_shape_mismatch)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's set-up walks the dict with DCP's own types and turns unknown values into None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        requests = []
        for key, obj in self.state_dict.items():
            if key not in stored:
                raise ShardingError(f"the checkpoint has no entry {key!r}")
            md = stored[key]
            if _is_shards(obj):
                if not isinstance(md, TensorStorageMetadata):
                    raise ShardingError(f"checkpoint entry {key!r} is not a tensor")
                shards = _as_list(obj)
                if tuple(md.size) != shards[0].global_shape and key not in self.allow_shape_mismatch:
                    raise ShardingError(f"checkpoint tensor {key!r} has global shape {tuple(md.size)}, this model "
                                        f"expects {shards[0].global_shape}: the model configuration differs")
                chunks = [ChunkStorageMetadata(offsets=torch.Size(sh.global_offset), sizes=sh.data.size())
                          for sh in shards]
                requests += create_read_items_for_chunk_list(key, md, chunks)
            else:
                if not isinstance(md, BytesStorageMetadata):
                    raise ShardingError(f"checkpoint entry {key!r} is a tensor, an object was expected")
                requests.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                         dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                         storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def resolve_tensor(self, read_item: ReadItem):
        data = _find_shard(self.state_dict[read_item.dest_index.fqn], read_item.dest_index.offset).data
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            data = data.narrow(dim, start, length)
        return data

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor returned a view of the destination: the reader copied into it


def save_sharded(state_dict: Dict[str, Any], checkpoint_dir: str, process_group=None, no_dist: bool = False,
                 separation_hint: Optional[str] = None) -> None:
    """Collective: write every rank's shards and objects under ``checkpoint_dir`` (DCP files + ``.metadata``):
    one data file per rank, ``__<rank>_0.distcp``; with ``separation_hint`` the entries whose keys begin with it
    go to a second file ``<hint>__<rank>_1.distcp``. ``no_dist``: one process writes everything (offline tools),
    even where a process group exists."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    writer = FileSystemWriterAsync(checkpoint_dir, thread_count=1 if separation_hint is None else 2,
                                   separation_hint=separation_hint)
    dcp.save(state_dict, storage_writer=writer, planner=_ShardSavePlanner(), process_group=process_group,
             no_dist=no_dist)


def load_sharded(state_dict: Dict[str, Any], checkpoint_dir: str, allow_shape_mismatch: Sequence[str] = (),
                 no_dist: bool = False, process_group=None) -> Dict[str, Any]:
    """Fill the :class:`LocalShard` entries of ``state_dict`` in place; object entries are replaced by the stored
    values. Collective unless ``no_dist``. Returns ``state_dict``."""
    planner = _ShardLoadPlanner(allow_shape_mismatch)
    try:
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(checkpoint_dir), planner=planner, no_dist=no_dist,
                 process_group=process_group)
    except CheckpointException as e:  # DCP wraps every rank's planning error: surface ours with its message
        for failure in e.failures.values():
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, ShardingError):
                raise ShardingError(str(failure)) from e
        raise
    for key, value in state_dict.items():  # dcp.load hands the planner a copy of the dict: bring objects back
        if not _is_shards(value):
            state_dict[key] = planner.state_dict[key]
    return state_dict


def read_dcp_metadata(checkpoint_dir: str):
    """The DCP ``.metadata`` of ``checkpoint_dir`` (every entry's storage metadata)."""
    return dcp.FileSystemReader(checkpoint_dir).read_metadata()


def shard_file_problem(checkpoint_dir: str, keys=None, metadata=None, sizes=None) -> Optional[str]:
    """The first problem of the DCP data files that hold ``keys`` (all keys when None): a file that is missing or
    shorter than the bytes the metadata says it holds; None when every file is complete. ``sizes`` caches file
    sizes between calls."""
    metadata = metadata or read_dcp_metadata(checkpoint_dir)
    wanted = None if keys is None else set(keys)
    sizes = {} if sizes is None else sizes
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: (kv[0].fqn, str(kv[0].offset))):
        if wanted is not None and index.fqn not in wanted:
            continue
        name = info.relative_path
        if name not in sizes:
            path = os.path.join(checkpoint_dir, name)
            sizes[name] = os.path.getsize(path) if os.path.isfile(path) else -1
        if sizes[name] < 0:
            return f"shard file {name} of key {index.fqn!r} is missing"
        if sizes[name] < info.offset + info.length:
            return (f"shard file {name} of key {index.fqn!r} is truncated ({sizes[name]} bytes, "
                    f"{info.offset + info.length} needed)")
    return None


def remove_entries(checkpoint_dir: str, key_prefix: str) -> bool:
    """Drop from a DCP checkpoint the data files whose names begin with ``key_prefix`` and the metadata entries
    whose keys do: the new ``.metadata`` is written (fsync'ed) beside the old one, swapped in, then the files are
    removed; on an error the old metadata is put back. False (nothing changed) when no file name begins with
    ``key_prefix`` (files are named by prefix only when a save separated them, e.g. with a separation hint)."""
    import pickle
    import warnings

    from torch.distributed.checkpoint.metadata import Metadata

    doomed = [f for f in os.listdir(checkpoint_dir) if f.endswith("distcp") and f.startswith(key_prefix)]
    if not doomed:
        warnings.warn(f'There are no files in {checkpoint_dir} that begin with "{key_prefix}". Skipping removal.')
        return False
    old = read_dcp_metadata(checkpoint_dir)
    new = Metadata(
        state_dict_metadata={k: v for k, v in old.state_dict_metadata.items() if not k.startswith(key_prefix)},
        planner_data={k: v for k, v in (old.planner_data or {}).items() if not k.startswith(key_prefix)},
        storage_data={k: v for k, v in (old.storage_data or {}).items() if not k.fqn.startswith(key_prefix)})
    path = os.path.join(checkpoint_dir, ".metadata")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(new, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path, path + ".bck")
    try:
        os.replace(path + ".tmp", path)
        for name in doomed:
            os.remove(os.path.join(checkpoint_dir, name))
    except Exception:
        os.replace(path + ".bck", path)
        raise
    os.remove(path + ".bck")
    return True


def stored_shapes(checkpoint_dir: str) -> Dict[str, Optional[Tuple[int, ...]]]:
    """Global shape of every tensor entry (None for object entries), from the DCP metadata alone."""
    md = read_dcp_metadata(checkpoint_dir)
    return {key: tuple(v.size) if isinstance(v, TensorStorageMetadata) else None
            for key, v in md.state_dict_metadata.items()}


def load_full_state_dict(checkpoint_dir: str) -> Dict[str, Any]:
    """Offline, one process, no process group: every entry, tensors at their full global shape."""
    md = read_dcp_metadata(checkpoint_dir)
    request: Dict[str, Any] = {}
    for key, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            request[key] = LocalShard(torch.zeros(tuple(v.size), dtype=v.properties.dtype), tuple(v.size),
                                      (0,) * len(v.size))
        else:
            request[key] = None
    load_sharded(request, checkpoint_dir, no_dist=True)
    return {key: (v.data if isinstance(v, LocalShard) else v) for key, v in request.items()}
