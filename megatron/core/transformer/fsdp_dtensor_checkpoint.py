"""The ``fsdp_dtensor`` checkpoint layout (Megatron-FSDP's ``--ckpt-format fsdp_dtensor``): key names and how this
rank's block of a parameter lands in the global tensors.

Every tensor of the model is stored under its module name (layers *not* stacked) with three changes, applied the
same way to the optimizer state of the tensor:

1. ``_extra_state`` entries are dropped;
2. gated MLPs (``--swiglu``): ``…mlp.linear_fc1.{weight,bias}``, ``…mlp.shared_experts.linear_fc1.*`` and
   ``…mlp.experts.local_experts.{e}.linear_fc1.*`` are split into ``<name>_w`` (the gate half, ``F`` rows) and
   ``<name>_v`` (the up half), each a plain row-split over tensor parallelism. (A TP rank holds
   ``[gate_r; up_r]``, so the whole tensor is no concatenation of TP pieces; its halves are.);
3. expert indices are global: local expert ``j`` of expert-parallel rank ``r`` (``n`` local experts) is
   ``local_experts.{r*n + j}``.

Global shapes are tensor-parallel merged: a TP-split tensor of local shape ``S`` is ``S`` with the partition dim
times TP (the expert-TP size for experts), and TP rank ``t`` holds the block at ``t * S[dim]`` along it. FSDP's
block of a rank is a range of rows ``[a, b)`` of its TP-local tensor (DTensor ``Shard(0)``, ``torch.chunk`` sizes,
possibly empty), so the rank writes ``rows [a, b)`` at the global offset of those rows. Keys::

    model.module.<name>                                          weights (the fp32 main weights)
    optimizer.state.module.module.module.<name>.<exp_avg|exp_avg_sq|momentum_buffer>
    optimizer.param_to_group_meta.module.module.module.<name>    the param group of each parameter

with ``<name>`` the megatron-core module name after the three changes above.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

MODEL_PREFIX = "model.module."
OPTIMIZER_STATE_PREFIX = "optimizer.state.module.module.module."
PARAM_GROUP_META_PREFIX = "optimizer.param_to_group_meta.module.module.module."

_GATED_FC1 = re.compile(r"(^|\.)mlp\.(shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc1\.(weight|bias)$")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
GATE_SUFFIX, UP_SUFFIX = "_w", "_v"


def is_gated_fc1(name: str) -> bool:
    """Whether ``name`` is the first linear layer of an MLP (split into gate / up halves when the MLP is gated)."""
    return bool(_GATED_FC1.search(name))


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """``…local_experts.{j}…`` of expert-parallel rank ``ep_rank`` as the global index ``ep_rank * n + j``."""
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{ep_rank * num_local_experts + int(m.group(1))}.",
                             name)


@dataclass
class Piece:
    """Rows ``[start, stop)`` of this rank's block are stored at ``global_offset`` of the tensor ``name``
    (of shape ``global_shape``)."""

    name: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    start: int
    stop: int


def pieces(name: str, local_shape: Tuple[int, ...], rows: Tuple[int, int], tp_dim: Optional[int], tp: Tuple[int, int],
           gated: bool) -> List[Piece]:
    """Where rows ``rows = (a, b)`` of this rank's TP-local tensor ``name`` (shape ``local_shape``) go.

    ``tp_dim``: the tensor-parallel partition dim (None when replicated); ``tp``: (size, rank) of the tensor's
    tensor-parallel group (expert TP for experts); ``gated``: the model's MLPs are gated (module docstring, 2.)."""
    a, b = rows
    size, rank = tp
    dims = len(local_shape)
    split = tp_dim is not None and size > 1
    if gated and is_gated_fc1(name):
        half = local_shape[0] // 2
        shape = (half * (size if split else 1),) + tuple(local_shape[1:])
        out = []
        for suffix, lo in ((GATE_SUFFIX, 0), (UP_SUFFIX, half)):
            start, stop = max(a, lo), min(b, lo + half)
            if start < stop:
                offset = (rank * half * split + start - lo,) + (0,) * (dims - 1)
                out.append(Piece(name + suffix, shape, offset, start - a, stop - a))
        return out
    if a >= b:
        return []
    shape = list(local_shape)
    offset = [0] * dims
    offset[0] = a
    if split:
        shape[tp_dim] *= size
        offset[tp_dim] += rank * local_shape[tp_dim]
    return [Piece(name, tuple(shape), tuple(offset), 0, b - a)]
