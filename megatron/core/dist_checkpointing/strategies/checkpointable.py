"""A :class:`ShardedTensor` as PyTorch Distributed Checkpoint sees it (DCP's ``_Checkpointable`` protocol).

DCP plans a save or a load from three hooks of a value: ``__create_write_items__`` (what to write),
``__create_chunk_list__`` (which chunks this rank holds, for the read plan) and ``__get_tensor_shard__`` (the local
tensor of a chunk). :class:`CheckpointableShardedTensor` answers them for one block: the chunk at the block's
``global_offset`` with the block's ``local_shape``, in a tensor of ``global_shape`` (the same ``SHARD`` items the
torch_dist storage layer writes). DCP wants one value per key and rank, so :class:`LocalShardsContainer` holds the
several blocks of one key that a rank may have.

Both are tensor subclasses only in shape (the global shape): no tensor operation is defined on them.
"""
from __future__ import annotations

from typing import List

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.sharded_io import shard_write_item

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]


class _NoTensorOps:
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{cls.__name__}.__torch_dispatch__ not implemented. {cls.__name__} shouldn't be "
                                  "used with Tensor operations.")


class CheckpointableShardedTensor(_NoTensorOps, torch.Tensor):
    """The block ``sh_ten`` (its ``data``) as a DCP value of the global shape."""

    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(sh_ten.global_shape))

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor):
        self._data = data
        self._sh_ten = sh_ten

    def _check_local(self) -> None:
        if tuple(self._sh_ten.data.shape) != tuple(self._sh_ten.local_shape):
            raise ValueError(f"{self._sh_ten.key!r}: data of shape {tuple(self._sh_ten.data.shape)} is not the "
                             f"local shape {tuple(self._sh_ten.local_shape)}")

    def __create_write_items__(self, fqn: str, sh_ten: "CheckpointableShardedTensor", index: int = None) -> list:
        """One ``SHARD`` write item: the block at ``global_offset`` of the ``global_shape`` tensor ``fqn``."""
        sh_ten._check_local()
        inner = sh_ten._sh_ten
        return [shard_write_item(fqn, inner.data, inner.global_shape, inner.global_offset, index)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The one chunk this block covers."""
        self._check_local()
        return [ChunkStorageMetadata(offsets=torch.Size(self._sh_ten.global_offset),
                                     sizes=torch.Size(self._sh_ten.local_shape))]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The block's data (there is only one chunk)."""
        return self._sh_ten.data

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        if not isinstance(sh_ten, ShardedTensor):
            raise TypeError(f"expected a ShardedTensor, got {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def __repr__(self):
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(_NoTensorOps, torch.Tensor):
    """Several :class:`CheckpointableShardedTensor` blocks of one key held by this rank, as one DCP value."""

    @staticmethod
    def __new__(cls, local_shards: List[torch.Tensor]) -> "LocalShardsContainer":
        if not local_shards:
            raise ValueError("LocalShardsContainer needs at least one shard")
        return torch.Tensor._make_wrapper_subclass(cls, local_shards[0].size())

    def __init__(self, local_shards: List[torch.Tensor]):
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise TypeError(f"LocalShardsContainer holds CheckpointableShardedTensor, got {type(shard).__name__}")
        self._local_shards = local_shards

    def __create_write_items__(self, fqn: str, local_shards_cont: "LocalShardsContainer") -> list:
        """Every block's write item, each with its position as the lookup hint."""
        return [item for position, shard in enumerate(local_shards_cont._local_shards)
                for item in shard.__create_write_items__(fqn, shard, index=position)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The data of the block starting at ``index.offset`` (``index.index`` is tried first)."""
        if index.offset is None:
            raise ValueError(f"Cannot lookup {index.fqn} for a LocalShardsContainer without an offset")
        shards = self._local_shards
        if index.index is not None and index.index < len(shards):
            hinted = shards[index.index]
            if torch.Size(hinted._sh_ten.global_offset) == index.offset:
                return hinted.__get_tensor_shard__(index)
        for shard in shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard.__get_tensor_shard__(index)
        raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")

    def __repr__(self):
        return f"{type(self).__name__}({self._local_shards!r})"
