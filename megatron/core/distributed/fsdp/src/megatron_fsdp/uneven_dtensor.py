"""Unevenly sharded DTensors (megatron-core's ``megatron_fsdp.uneven_dtensor``): DTensors whose ``Shard`` blocks have
sizes of the caller's choosing (not ``torch.chunk``'s), as Megatron-FSDP's flat buffers produce them.

The math. Along each sharded mesh dimension ``m`` (placement ``Shard(k)``), the ranks of ``m``'s group hold
consecutive ranges of tensor dimension ``k`` in rank order, so rank ``r``'s offset along ``k`` is the sum of the
sizes held by the ranks before it, and the extent covered is the sum of all of them. Mesh dimensions are resolved
inner first: a ``_StridedShard`` (at most one), then the others in mesh order, or in reverse of the mesh's
``_shard_order`` when it has one; a dimension's extent (after the inner ones) is what the next one exchanges.
``Replicate`` dimensions add nothing. The result is this rank's chunk ``(offsets, sizes)`` of the global tensor.

PyTorch's distributed checkpoint asks a DTensor for its chunk (``__create_chunk_list__``) and write items
(``__create_write_items__``); :func:`update_uneven_dtensor_chunk_metadata` hangs the true (uneven) ones on the
local tensor, which DTensor consults first. An empty block writes nothing.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import get_mesh_names

__all__ = ["gather_and_compute_chunk_metadata", "update_uneven_dtensor_chunk_metadata", "validate_uneven_dtensor",
           "filter_unflattened_state_dict", "get_unflattened_state_dict", "preprocess_state_dict_for_uneven_dtensor",
           "gather_uneven_dtensor_to_full_tensor", "split_dtensor"]


def _mesh_dims_inner_first(dtensor: DTensor) -> List[int]:
    order = getattr(dtensor.device_mesh, "_shard_order", None)
    if order is not None:
        return list(reversed(order))
    strided = [i for i, p in enumerate(dtensor.placements) if isinstance(p, _StridedShard)]
    if len(strided) > 1:
        raise ValueError(f"a DTensor with {len(strided)} strided shards is not supported (at most one)")
    return strided + [i for i in range(len(dtensor.placements)) if i not in strided]


def gather_and_compute_chunk_metadata(dtensor: DTensor) -> ChunkStorageMetadata:
    """This rank's chunk (offsets, sizes) of the global tensor, from every rank's local block shape (one
    ``all_gather_object`` per sharded mesh dimension; module docstring)."""
    local_shape = tuple(dtensor.to_local().shape)
    offsets, extent = [0] * len(local_shape), list(local_shape)
    for mesh_dim in _mesh_dims_inner_first(dtensor):
        placement = dtensor.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise ValueError(f"unsupported placement {placement} of a DTensor of shape {tuple(dtensor.shape)}")
        group, k = dtensor.device_mesh.get_group(mesh_dim), placement.dim
        extents = [None] * dist.get_world_size(group)
        dist.all_gather_object(extents, list(extent), group=group)
        offsets[k] += sum(e[k] for e in extents[:dist.get_rank(group)])
        extent[k] = sum(e[k] for e in extents)
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local_shape))


def update_uneven_dtensor_chunk_metadata(dtensor: DTensor) -> dict:
    """Attach this rank's true chunk (and the write item for it) to the DTensor's local tensor, where PyTorch's
    distributed checkpoint looks for them (collective over the sharded mesh dimensions)."""
    chunk = gather_and_compute_chunk_metadata(dtensor)

    def chunk_list():
        return [chunk]

    def write_items(fqn: str, tensor: DTensor) -> List[WriteItem]:
        local = tensor.to_local()
        if local.numel() == 0:
            return []
        data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=tensor.size())
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, chunk.offsets), tensor_data=data)]

    dtensor._local_tensor.__create_chunk_list__ = chunk_list
    dtensor._local_tensor.__create_write_items__ = write_items


def validate_uneven_dtensor(dtensor: DTensor) -> None:
    """Assert that this rank's chunk lies inside the global shape and that, over the sharded mesh dimensions, the
    chunks reach both ends of every dimension (AssertionError naming offsets, sizes and shapes otherwise)."""
    chunk = gather_and_compute_chunk_metadata(dtensor)
    shape = tuple(dtensor.shape)
    where = (f"offsets {tuple(chunk.offsets)}, sizes {tuple(chunk.sizes)}, global shape {shape}, "
             f"mesh {dtensor.device_mesh}")
    assert all(0 <= o and o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)), \
        f"uneven DTensor: a chunk outside the tensor: {where}"
    ends = torch.tensor([[int(o == 0), int(o + s == n)] for o, s, n in zip(chunk.offsets, chunk.sizes, shape)],
                        dtype=torch.int, device=dtensor.to_local().device)
    for mesh_dim, placement in enumerate(dtensor.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=dtensor.device_mesh.get_group(mesh_dim))
    assert bool(ends.all()), f"uneven DTensor: the chunks do not cover both ends of every dimension: {where}"


def filter_unflattened_state_dict(state_dict, key_chain=[], visit_condition=lambda x: False):  # noqa: B006
    """The key paths (lists of keys from the top) of the leaves of a nested dict that satisfy
    ``visit_condition``, in dict order; ``key_chain`` is prepended to each."""
    found = []
    for key, value in state_dict.items():
        path = list(key_chain) + [key]
        if isinstance(value, dict):
            found += filter_unflattened_state_dict(value, path, visit_condition)
        elif visit_condition(value):
            found.append(path)
    return found


def get_unflattened_state_dict(state_dict, key_chain=[]):  # noqa: B006
    """The value at the key path ``key_chain`` of a nested dict (KeyError naming the path if absent)."""
    node = state_dict
    for key in key_chain:
        if not (isinstance(node, dict) and key in node):
            raise KeyError(f"Key {key_chain} not found in state_dict")
        node = node[key]
    return node


def preprocess_state_dict_for_uneven_dtensor(state_dict: dict) -> dict:
    """Attach the uneven chunk metadata to every DTensor of a nested state dict (in place; returned)."""
    for path in filter_unflattened_state_dict(state_dict, visit_condition=lambda v: isinstance(v, DTensor)):
        update_uneven_dtensor_chunk_metadata(get_unflattened_state_dict(state_dict, path))
    return state_dict


def _flat_group(mesh):
    """The process group of all ranks of ``mesh``: its only dimension, an existing flattened mesh named by its
    dimensions joined with ``_``, or a new flattening."""
    names = mesh.mesh_dim_names
    if not names or len(names) == 1:
        return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    joined = "_".join(names)
    if joined in get_mesh_names(mesh):
        return mesh._get_root_mesh()._flatten_mapping[joined].get_group()
    return mesh._flatten().get_group()


def gather_uneven_dtensor_to_full_tensor(dtensor: DTensor, target_device: Optional[torch.device] = None) -> DTensor:
    """The whole tensor of an unevenly sharded DTensor, as a DTensor replicated over its mesh (every rank's block
    all-gathered and placed at its chunk offset); on ``target_device`` when given."""
    if not isinstance(dtensor, DTensor):
        raise TypeError("Input must be a DTensor.")
    local = dtensor.to_local()
    if not hasattr(dtensor._local_tensor, "__create_chunk_list__"):
        update_uneven_dtensor_chunk_metadata(dtensor)
    chunks = dtensor.__create_chunk_list__()
    if len(chunks) != 1:
        raise ValueError(f"Expected exactly one chunk metadata, got {len(chunks)}.")
    if not any(isinstance(p, (Shard, _StridedShard)) for p in dtensor.placements):
        full = local.clone()
    else:
        group = _flat_group(dtensor.device_mesh)
        blocks = [None] * group.size()
        dist.all_gather_object(blocks, (tuple(local.shape), tuple(chunks[0].offsets)), group=group)
        # Blocks differ in size: each is sent flat, padded to the largest (gloo gathers equal sizes only).
        width = max(torch.Size(shape).numel() for shape, _ in blocks)
        sent = torch.zeros(width, dtype=local.dtype, device=local.device)
        sent[:local.numel()] = local.reshape(-1)
        received = [torch.empty_like(sent) for _ in blocks]
        dist.all_gather(received, sent, group=group)
        full = torch.empty(tuple(dtensor.shape), dtype=local.dtype, device=local.device)
        for (shape, offset), flat in zip(blocks, received):
            block = flat[:torch.Size(shape).numel()].view(shape)
            full[tuple(slice(o, o + s) for o, s in zip(offset, shape))] = block
    if target_device is not None:
        full = full.to(target_device)
    return DTensor.from_local(full, device_mesh=dtensor.device_mesh, placements=[Replicate()] * len(dtensor.placements))


def split_dtensor(dtensor: DTensor, split_size_or_sections: Union[int, List[int]], dim: int = 0,
                  update_uneven_dtensor_chunk_meta: bool = False) -> Iterable[DTensor]:
    """Split along ``dim`` like ``torch.split`` (pieces of ``split_size_or_sections`` elements, or the listed
    sizes), without communication: each piece keeps the DTensor's placements and holds the part of this rank's
    block that falls in it (possibly empty). Yields the pieces; with ``update_uneven_dtensor_chunk_meta`` each
    gets its uneven chunk metadata."""
    n = dtensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        bounds = list(range(0, n, split_size_or_sections)) + [n]
    else:
        bounds = [0]
        for size in split_size_or_sections:
            bounds.append(bounds[-1] + size)
    chunk = gather_and_compute_chunk_metadata(dtensor)
    mine_lo = chunk.offsets[dim]
    mine_hi = mine_lo + chunk.sizes[dim]
    local = dtensor.to_local()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        a, b = max(lo, mine_lo), min(hi, mine_hi)
        start, length = (a - mine_lo, b - a) if a < b else (0, 0)
        piece = local.narrow(dim, start, length)
        shape = list(dtensor.shape)
        shape[dim] = hi - lo
        out = DTensor.from_local(piece, device_mesh=dtensor.device_mesh, placements=dtensor.placements,
                                 shape=torch.Size(shape), stride=piece.stride())
        if update_uneven_dtensor_chunk_meta:
            update_uneven_dtensor_chunk_metadata(out)
        yield out
