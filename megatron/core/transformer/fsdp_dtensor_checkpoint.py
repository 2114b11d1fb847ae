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
   ``local_experts.{r*n + j}``;
4. grouped experts (``--moe-grouped-gemm``: GroupedMLP's ``weight1 [h, n*R]`` with expert ``j``'s fc1 transposed in
   columns ``j*R ...``, ``R`` = 2F/ETP gated or F/ETP, and ``weight2 [n*F/ETP, h]``) are stored per expert under
   Megatron's grouped names (TEGroupedMLP's): ``…mlp.experts.linear_fc1.weight{e}`` (``[2F, h]``, gated: ``_w`` /
   ``_v`` halves ``[F, h]``) and ``…mlp.experts.linear_fc2.weight{e}`` (``[h, F]``), ``e`` global; an FSDP row block
   ``[a, b)`` of ``weight1`` is the column block ``[a, b)`` of every local expert's fc1, a block of ``weight2`` the
   fc2 columns of the experts whose rows it holds.

Global shapes are tensor-parallel merged: a TP-split tensor of local shape ``S`` is ``S`` with the partition dim
times TP (the expert-TP size for experts), and TP rank ``t`` holds the block at ``t * S[dim]`` along it. FSDP's
block of a rank is a range of rows ``[a, b)`` of its TP-local tensor (DTensor ``Shard(0)``, ``torch.chunk`` sizes,
possibly empty), so the rank writes ``rows [a, b)`` at the global offset of those rows. Keys::

    model.module.<name>                                          weights (the fp32 main weights)
    optimizer.state.module.module.module.<name>.<exp_avg|exp_avg_sq|momentum_buffer>
    optimizer.param_to_group_meta.module.module.module.<name>    the param group of each parameter

with ``<name>`` the megatron-core module name after the changes above.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

MODEL_PREFIX = "model.module."
OPTIMIZER_STATE_PREFIX = "optimizer.state.module.module.module."
PARAM_GROUP_META_PREFIX = "optimizer.param_to_group_meta.module.module.module."

_GATED_FC1 = re.compile(r"(^|\.)mlp\.(shared_experts\.|experts\.local_experts\.\d+\.)?linear_fc1\.(weight|bias)$"
                        r"|(^|\.)mlp\.experts\.linear_fc1\.(weight|bias)\d+$")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(weight1|weight2)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)linear_fc([12])\.(weight|bias)(\d+)$")
GATE_SUFFIX, UP_SUFFIX = "_w", "_v"


def is_gated_fc1(name: str) -> bool:
    """Whether ``name`` is the first linear layer of an MLP (split into gate / up halves when the MLP is gated)."""
    return bool(_GATED_FC1.search(name))


def is_grouped_expert_weight(name: str) -> bool:
    """GroupedMLP's ``…mlp.experts.weight1`` / ``weight2`` (stored per expert, module docstring 4.)."""
    return bool(_GROUPED.match(name))


def grouped_to_sequential_name(name: str) -> str:
    """``…mlp.experts.linear_fc1.weight{e}`` (the grouped names on disk) as SequentialMLP's
    ``…mlp.experts.local_experts.{e}.linear_fc1.weight``; other names unchanged."""
    m = _GROUPED_EXPERT.match(name)
    return f"{m.group(1)}local_experts.{m.group(4)}.linear_fc{m.group(2)}.{m.group(3)}" if m else name


def sequential_to_grouped_name(name: str) -> str:
    """The inverse of :func:`grouped_to_sequential_name`."""
    m = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)$", name)
    return f"{m.group(1)}linear_fc{m.group(3)}.{m.group(4)}{m.group(2)}" if m else name


def global_expert_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """``…local_experts.{j}…`` of expert-parallel rank ``ep_rank`` as the global index ``ep_rank * n + j``."""
    return _LOCAL_EXPERT.sub(lambda m: f".mlp.experts.local_experts.{ep_rank * num_local_experts + int(m.group(1))}.",
                             name)


@dataclass
class Piece:
    """``take(block)`` (a view of this rank's block: rows ``[start, stop)``, or for grouped experts a transposed
    column or row range) is stored at ``global_offset`` of the tensor ``name`` (of shape ``global_shape``)."""

    name: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    start: int
    stop: int
    transpose_cols: Optional[Tuple[int, int]] = None  # grouped experts: block[start:stop, c0:c1].t()

    def take(self, block):
        part = block[self.start:self.stop]
        if self.transpose_cols is not None:
            part = part[:, self.transpose_cols[0]:self.transpose_cols[1]].t()
        return part


def pieces(name: str, local_shape: Tuple[int, ...], rows: Tuple[int, int], tp_dim: Optional[int], tp: Tuple[int, int],
           gated: bool, experts: Optional[Tuple[int, int]] = None) -> List[Piece]:
    """Where rows ``rows = (a, b)`` of this rank's TP-local tensor ``name`` (shape ``local_shape``) go.

    ``tp_dim``: the tensor-parallel partition dim (None when replicated); ``tp``: (size, rank) of the tensor's
    tensor-parallel group (expert TP for experts); ``gated``: the model's MLPs are gated (module docstring, 2.);
    ``experts``: (global index of the first local expert, number of local experts), for grouped expert weights."""
    a, b = rows
    size, rank = tp
    dims = len(local_shape)
    split = tp_dim is not None and size > 1
    if is_grouped_expert_weight(name):
        return _grouped_pieces(name, local_shape, rows, tp, gated, experts)
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


def _grouped_pieces(name: str, local_shape: Tuple[int, ...], rows: Tuple[int, int], tp: Tuple[int, int], gated: bool,
                    experts: Optional[Tuple[int, int]]) -> List[Piece]:
    """GroupedMLP's ``weight1 [h, n*R]`` / ``weight2 [n*F', h]`` rows ``[a, b)`` as per-expert pieces (module
    docstring 4.)."""
    if experts is None:
        raise ValueError(f"{name}: grouped expert weights need the global index of the first local expert")
    first, n = experts
    a, b = rows
    size, rank = tp
    prefix, which = _GROUPED.match(name).groups()
    out = []
    if which == "weight1":
        h, width = local_shape[0], local_shape[1] // n  # width R = this rank's fc1 rows of one expert
        halves = ((GATE_SUFFIX, 0), (UP_SUFFIX, width // 2)) if gated else (("", 0),)
        part = width // len(halves)
        if a >= b:
            return []
        for j in range(n):
            for suffix, lo in halves:
                out.append(Piece(f"{prefix}linear_fc1.weight{first + j}{suffix}", (part * size, h),
                                 (rank * part, a), 0, b - a, (j * width + lo, j * width + lo + part)))
        return out
    ffn, h = local_shape[0] // n, local_shape[1]  # F' = this rank's fc2 columns of one expert
    for j in range(n):
        lo, hi = max(a, j * ffn), min(b, (j + 1) * ffn)
        if lo < hi:
            out.append(Piece(f"{prefix}linear_fc2.weight{first + j}", (h, ffn * size), (0, rank * ffn + lo - j * ffn),
                             lo - a, hi - a, (0, h)))
    return out
