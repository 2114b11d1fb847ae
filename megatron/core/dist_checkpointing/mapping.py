"""How a module's local tensors and objects map onto the global ones of a checkpoint.

A *sharded state dict* is a (nested) state dict whose leaves are, besides plain values (saved once, in the common
part):

* :class:`ShardedTensor` — this rank's block of a global tensor. The global tensor has
  ``len(global_shape)`` axes: the first ``prepend_axis_num`` of them are axes the local tensor lacks (the layer
  index of a stacked ``decoder.layers.*`` tensor, the expert index), the rest are the local tensor's. The block
  starts at ``global_offset`` (in elements) and has shape ``local_shape`` (1 along prepended axes). A regular
  grid (``axis_fragmentations`` = number of blocks along each axis) has every offset a multiple of the local
  size. Ranks holding the same block are *replicas*; only the *main* replica (``replica_id`` 0 or all zeros)
  is written.
* :class:`ShardedObject` — a piece of a global array of python objects, written under
  ``"{key}/shard_{offsets}_{shape}"`` (offsets and shape in pieces, joined by ``.``).
* :class:`ShardedTensorFactory` — a tensor saved as something else (``build_fn`` makes the sharded sub state
  dict to save, e.g. the two halves of a gated fc1 weight; ``merge_fn`` turns what was loaded back into the
  tensor). The optimizer builds its state with the same factories, so moments are split like their weights.
* :class:`LocalNonpersistentObject` — not saved; given back as it is on load.

Example: layer 3 of 8 of a column-parallel weight ``[F/2, h]`` on TP rank 1 of 2 is
``ShardedTensor.from_rank_offsets(key, w, (0, 3, 8), (1, 1, 2), prepend_axis_num=1)``: global shape
``[8, F, h]``, offset ``(3, F/2, 0)``.
"""
from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

logger = logging.getLogger(__name__)

StateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
ReplicaId = Union[int, Tuple[int, ...]]

__all__ = ["CheckpointingException", "CommonStateDict", "LocalNonpersistentObject", "ReplicaId", "ShardedBase",
           "ShardedObject", "ShardedStateDict", "ShardedTensor", "ShardedTensorFactory", "StateDict",
           "apply_factories", "apply_factory_merges", "is_main_replica"]


class ShardedBase(ABC):
    """What every sharded leaf has: a global ``key``, local ``data`` and a ``replica_id``."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise :class:`CheckpointingException` when the fields contradict each other."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy with ``data=None`` (the metadata alone)."""


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (the one that is written) has replica id 0 or all zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclasses.dataclass
class ShardedTensor(ShardedBase):
    """This rank's block ``data`` of the global tensor ``key`` (see the module docstring).

    ``allow_shape_mismatch``: on load the stored global shape may differ (a padded vocabulary): the overlap is
    read, the rest stays zero. ``flattened_range`` must be None (as in megatron-core 0.16.1 and later).
    """

    key: str
    data: Optional[torch.Tensor] = dataclasses.field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if self.flattened_range is not None:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: flattened_range is not supported (it must "
                                         "be None; shard whole tensors instead)")
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(f"ShardedTensor {self.key!r}: data dtype {self.data.dtype} is not "
                                             f"the declared {self.dtype}")
            if tuple(self.data.shape) != tuple(self.local_shape):
                raise CheckpointingException(f"ShardedTensor {self.key!r}: data shape {tuple(self.data.shape)} is "
                                             f"not the declared local shape {tuple(self.local_shape)}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"ShardedTensor {self.key!r}: global shape {self.global_shape} and "
                                         f"offset {self.global_offset} have different lengths")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(
                f"ShardedTensor {self.key!r}: local shape {self.local_shape} plus {self.prepend_axis_num} "
                f"prepended axes does not give the {len(self.global_shape)} axes of {self.global_shape}")
        if self.axis_fragmentations is not None:
            for offset, size in zip(self.global_offset[self.prepend_axis_num:], self.local_shape):
                if size != 0 and offset % size != 0:
                    raise CheckpointingException(f"ShardedTensor {self.key!r}: offset {offset} is not a multiple "
                                                 f"of the local size {size} (irregular grid)")

    @property
    def has_regular_grid(self) -> bool:
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of this block in the global tensor: an int per prepended axis, a slice per local axis."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            slice(off, off + size) for off, size in zip(self.global_offset[p:], self.local_shape))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Position of this block in the grid of blocks."""
        p = self.prepend_axis_num
        out = list(self.global_offset[:p])
        for off, size in zip(self.global_offset[p:], self.local_shape):
            if off % size:
                raise CheckpointingException(f"ShardedTensor {self.key!r} is not on a regular grid")
            out.append(off // size)
        return tuple(out)

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Size of one block along each axis of the regular grid."""
        out = []
        for size, fragments in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and size % fragments:
                raise CheckpointingException(f"ShardedTensor {self.key!r}: axis of size {size} is not divisible "
                                             f"into {fragments} blocks")
            out.append(size // fragments)
        return tuple(out)

    def without_data(self) -> "ShardedTensor":
        return dataclasses.replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable = torch.empty) -> None:
        """Allocate ``data`` (only when it is None) with ``init_fn(local_shape, dtype=, device=)``."""
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """``torch.narrow`` of the local block along local axis ``dim``, applied on every rank alike: the global
        shape and offset along that axis shrink by ``length / local size`` (a one-element list)."""
        axis = dim + self.prepend_axis_num
        local = self.local_shape[dim]
        if self.global_shape[axis] % local or self.global_offset[axis] % local:
            raise CheckpointingException(f"ShardedTensor {self.key!r}: narrow needs a regular grid")
        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[axis] = self.global_shape[axis] // local * length
        global_offset[axis] = self.global_offset[axis] // local * length
        data = self.data.narrow(dim, start, length)
        return [dataclasses.replace(self, data=data, local_shape=tuple(data.shape), global_shape=tuple(global_shape),
                                    global_offset=tuple(global_offset))]

    @classmethod
    def from_rank_offsets(cls, key: str, data: torch.Tensor, *rank_offsets: Tuple[int, int, int],
                          replica_id: ReplicaId = 0, prepend_axis_num: int = 0, flattened_range: None = None,
                          **init_kwargs) -> "ShardedTensor":
        """The block ``data`` described by ``(axis, rank_offset, fragments)`` triples: along global ``axis`` the
        tensor is cut into ``fragments`` equal blocks and ``data`` is block ``rank_offset``. Axes not named are
        whole; prepended axes (``axis < prepend_axis_num``) have local size 1."""
        if flattened_range is not None:
            raise ValueError("from_rank_offsets cannot build a flattened ShardedTensor (flattened_range must be None)")
        ndim = data.dim() + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragmentations = [1] * ndim
        for axis, rank_offset, fragments in rank_offsets:
            if axis < 0 or axis >= ndim or rank_offset < 0 or fragments < 1 or rank_offset >= fragments:
                raise CheckpointingException(f"invalid rank offsets {rank_offsets} for {key!r} "
                                             f"({ndim} global axes)")
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = fragments * local
            global_offset[axis] = rank_offset * local
            fragmentations[axis] = fragments
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape), tuple(global_offset),
                   tuple(fragmentations), replica_id, prepend_axis_num, **init_kwargs)


class LocalNonpersistentObject:
    """A value left out of the checkpoint: ``load`` puts the local object back in its place."""

    def __init__(self, obj):
        self.obj = obj

    def unwrap(self):
        return self.obj


@dataclasses.dataclass
class ShardedObject(ShardedBase):
    """Piece ``global_offset`` of a global array (shape ``global_shape``, in pieces) of python objects ``key``.
    Unlike tensors, objects cannot be resharded: a load asks for the same pieces."""

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"ShardedObject {self.key!r}: global shape {self.global_shape} and offset "
                                         f"{self.global_offset} have different lengths")

    def without_data(self) -> "ShardedObject":
        return dataclasses.replace(self, data=None)

    @property
    def unique_key(self) -> str:
        offsets = ".".join(str(x) for x in self.global_offset)
        shape = ".".join(str(x) for x in self.global_shape)
        return f"{self.key}/shard_{offsets}_{shape}"

    def __str__(self):
        return f"ShardedObject(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """The (data-less) object stored under ``unique_key``. Older keys lacking the last shape entry get -1."""
        key, shard = unique_key.rsplit("/", 1)
        tag, offsets, shape = shard.split("_")
        if tag != "shard":
            raise CheckpointingException(f"{unique_key!r} is not a sharded-object key")
        offset = tuple(int(x) for x in offsets.split("."))
        global_shape = tuple(int(x) for x in shape.split("."))
        if len(global_shape) + 1 == len(offset):
            global_shape += (-1,)
        return cls(key, None, global_shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclasses.dataclass
class ShardedTensorFactory(ShardedBase):
    """The tensor ``data`` saved as ``build_fn(key, data, replica_id, flattened_range)`` (a sharded sub state dict)
    and restored on load by ``merge_fn(loaded sub state dict)``. ``build_fn`` may depend only on its arguments, so
    that the optimizer can build its states (other ``data``, ``key`` prefixed) the same way."""

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before ``build``."""

    def without_data(self) -> "ShardedTensorFactory":
        return dataclasses.replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds, in place."""
    dict_list_map_inplace(lambda x: x.build() if isinstance(x, ShardedTensorFactory) else x, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: Tuple = ()) -> StateDict:
    """Where ``x2`` (the factories, nested as in the request; lists may appear as ``{index: value}`` dicts) has a
    factory, replace the loaded sub state dict of ``x1`` by ``factory.merge_fn(it)``; returns ``x1``."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise ValueError(f"apply_factory_merges: {key + (k,)} was not loaded")
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"apply_factory_merges: lists of lengths {len(x1)} and {len(x2)} at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for i, v2 in x2.items():
            if not isinstance(i, int) or i >= len(x1):
                raise ValueError(f"apply_factory_merges: index {i!r} does not fit a list of {len(x1)} at {key}")
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    else:
        raise ValueError(f"apply_factory_merges: two values at {key}: {type(x1).__name__} and {type(x2).__name__}")
    return x1
