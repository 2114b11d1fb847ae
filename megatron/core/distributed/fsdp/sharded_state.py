"""The sharded checkpoint state (``sharded_state_dict``, torch_dist) of a model sharded by the FSDP2 engine.

Every module declares its tensors for the *tensor-parallel-local* parameter ``W`` (shape ``S``): a ShardedTensor
(key, global shape, offset of ``W`` in it, replica id) or a factory that cuts ``W`` into several such tensors (a gated
``linear_fc1`` into its gate and up halves, a Mamba ``in_proj`` into its five parts). Under FSDP2 a rank holds only
the rows ``[a, b)`` of ``W`` (its DTensor block, ``torch.chunk`` sizes over the DP x CP mesh, possibly uneven or
empty), so each declared tensor is cut once more:

* a ShardedTensor of ``W`` keeps rows ``[a, b)``: local shape ``(b - a,) + S[1:]``, offset along the first
  non-prepended axis ``+ a``, an irregular grid (``axis_fragmentations=None``: the blocks of the DP ranks need not
  be equal), and the data-parallel component of its replica id (the last) set to 0, since the DP ranks now hold
  different rows (the tensor-parallel component still makes one TP rank write a replicated tensor);
* a factory is built on a row-index probe of ``W``'s shape (``arange(S[0])`` expanded, no memory): every tensor it
  produces that is a range of ``W``'s rows ``[r0, r1)`` keeps ``[max(a, r0), min(b, r1))``, at the offset shifted
  by ``max(a, r0) - r0``. A factory whose tensors are not row ranges of ``W`` (grouped experts reorder ``W``) is
  refused with a message naming it.

The result, :class:`Piece` per (tensor, rank block), is the same for every state tensor of the parameter (Adam's
moments have its sharding), so the optimizer state is saved with the same pieces under
``optimizer.state.<kind>.<key>``. While the modules declare, each DTensor parameter is replaced by a meta tensor of
its TP-local shape (no storage), so the declarations are exactly those of the unsharded model.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Dict, List, Tuple

import torch
from torch.distributed.tensor import DTensor

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory


PIECE_MARK = ".fsdp_piece"  # the sharded state dict's entries of FSDP2-sharded parameters: <name>.fsdp_piece[i]


class FsdpCheckpointError(RuntimeError):
    """The FSDP2 model's sharded state cannot be expressed (the message names the tensor)."""


@dataclasses.dataclass
class Piece:
    """Rows ``rows`` of ``param``'s local block (its DTensor shard), stored as ``template`` (a ShardedTensor without
    data) of the checkpoint; ``name`` is its entry in the module's sharded state dict."""

    name: str
    template: ShardedTensor
    param: torch.nn.Parameter
    rows: Tuple[int, int]

    def leaf(self, tensor: torch.Tensor, key_prefix: str = "") -> ShardedTensor:
        """The piece of ``tensor`` (the parameter's local block, or a state tensor of the same shape)."""
        data = tensor[self.rows[0]:self.rows[1]]
        return dataclasses.replace(self.template, key=key_prefix + self.template.key, data=data, dtype=data.dtype)


def block_rows(param: DTensor) -> Tuple[int, int]:
    """The rows ``[a, b)`` of the DTensor's global (TP-local) tensor that this rank holds (``torch.chunk`` blocks)."""
    mesh, total = param.device_mesh, param.shape[0]
    chunk = -(-total // mesh.size()) if total else 0
    start = min(mesh.get_local_rank() * chunk, total)
    stop = min(start + chunk, total)
    if param.to_local().shape[0] != stop - start:
        raise FsdpCheckpointError(f"a DTensor block of {param.to_local().shape[0]} rows where FSDP2 places "
                                  f"{stop - start}")
    return start, stop


def _dp_main(replica_id):
    """The replica id with its data-parallel (last) component 0: every DP rank writes its own rows."""
    if isinstance(replica_id, tuple):
        return replica_id[:-1] + (0,)
    return 0


@contextmanager
def _tp_local_placeholders(module: torch.nn.Module):
    """Within the block, every DTensor parameter of ``module`` is a meta tensor of its TP-local shape (same
    attributes); yields ``{id(placeholder): the DTensor parameter}``."""
    swapped, holders, param_of = [], {}, {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in holders:
                    holder = torch.nn.Parameter(torch.empty(tuple(param.shape), dtype=param.dtype, device="meta"),
                                                requires_grad=param.requires_grad)
                    holder.__dict__.update(vars(param))
                    holders[id(param)] = holder
                    param_of[id(holder)] = param
                swapped.append((sub, name, param))
                sub._parameters[name] = holders[id(param)]
    try:
        yield param_of
    finally:
        for sub, name, param in swapped:
            sub._parameters[name] = param


def _tensor_pieces(name: str, leaf: ShardedTensor, param: DTensor, rows: Tuple[int, int],
                   source_rows: Tuple[int, int]) -> List[Piece]:
    """``leaf`` holds rows ``source_rows`` of the TP-local tensor; this rank keeps their overlap with ``rows``."""
    lo, hi = max(rows[0], source_rows[0]), min(rows[1], source_rows[1])
    if lo >= hi:
        return []
    axis = leaf.prepend_axis_num
    offset = list(leaf.global_offset)
    offset[axis] += lo - source_rows[0]
    template = dataclasses.replace(leaf, data=None, dtype=param.dtype,
                                   local_shape=(hi - lo,) + tuple(leaf.local_shape[1:]), global_offset=tuple(offset),
                                   axis_fragmentations=None, replica_id=_dp_main(leaf.replica_id))
    return [Piece(name, template, param, (lo - rows[0], hi - rows[0]))]


def _factory_pieces(name: str, factory: ShardedTensorFactory, param: DTensor,
                    rows_of_block: Tuple[int, int]) -> List[Piece]:
    shape = tuple(param.shape)
    probe = torch.arange(shape[0], dtype=torch.int64).view((-1,) + (1,) * (len(shape) - 1)).expand(shape)
    try:
        built = factory.build_fn(factory.key, probe, factory.replica_id, None)
    except RuntimeError as e:
        raise FsdpCheckpointError(f"{factory.key}: its checkpoint layout is not a set of row ranges of the "
                                  f"parameter ({e})") from e
    out = []
    for i, leaf in enumerate(nested_values(built)):
        data = leaf.data
        rows = data[(slice(None),) + (0,) * (data.dim() - 1)] if data.numel() else data.new_zeros(0)
        first = int(rows[0]) if rows.numel() else 0
        # A range of W's rows: the rows are consecutive and every other axis is W's, untouched (stride 0 in the probe).
        if tuple(data.shape[1:]) != shape[1:] or any(st != 0 for st, n in zip(data.stride()[1:], data.shape[1:])
                                                     if n > 1) \
                or not torch.equal(rows, torch.arange(first, first + rows.numel())):
            raise FsdpCheckpointError(f"{factory.key}: its checkpoint layout reorders the parameter (not row ranges): "
                                      "save this model with --ckpt-format torch_dcp")
        out += _tensor_pieces(f"{name}{PIECE_MARK}{i}", leaf, param, rows_of_block, (first, first + rows.numel()))
    return out


def fsdp_pieces(module: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                metadata: dict = None) -> Tuple[List[Piece], Dict[str, object]]:
    """(the pieces of the FSDP2-sharded parameters of ``module``, the other entries of its sharded state dict:
    buffers, ``_extra_state`` objects) (module docstring)."""
    with _tp_local_placeholders(module) as param_of:
        declared = module.sharded_state_dict(prefix, sharded_offsets, metadata)
    pieces, others = [], {}
    for name, leaf in declared.items():
        param = param_of.get(id(getattr(leaf, "data", None)))
        if param is None:
            others[name] = leaf
        elif isinstance(leaf, ShardedTensorFactory):
            pieces += _factory_pieces(name, leaf, param, block_rows(param))
        elif isinstance(leaf, ShardedTensor):
            total = param.shape[0]
            pieces += _tensor_pieces(f"{name}{PIECE_MARK}", leaf, param, block_rows(param), (0, total))
        else:
            raise FsdpCheckpointError(f"{name}: a {type(leaf).__name__} of an FSDP2-sharded parameter")
    return pieces, others
