"""``PackedSeqParams``: the cumulative sequence lengths of a batch of packed sequences (THD layout), megatron-core's
dataclass. ``qkv_format='thd'``: documents packed along one row ``[t, 1, h]``, document ``i`` in rows
``cu_seqlens_q_padded[i] ..`` (or ``cu_seqlens_q[i] ..``) of real length ``cu_seqlens_q[i+1] - cu_seqlens_q[i]``;
the local attention attends within each document and RoPE restarts at each (with context parallelism: each
padded document through the ring attention, a rank holding two chunks of each).
``qkv_format='sbhd'`` with ``cp_group`` / ``local_cp_size``: one hybrid-context-parallel sample, whose attention runs
over its own CP group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from torch import Tensor


@dataclass
class PackedSeqParams:
    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_kv: Optional[Tensor] = None
    cu_seqlens_q_padded: Optional[Tensor] = None
    cu_seqlens_kv_padded: Optional[Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    local_cp_size: Optional[int] = None
    cp_group: Optional[object] = None


def packed_max_seqlen(packed_seq_params: PackedSeqParams) -> int:
    """The longest document of a packed batch, the length of its rotary angles: ``max(max_seqlen_q,
    max_seqlen_kv)`` (megatron-core's; at least the longest padded document), else the largest step of
    ``cu_seqlens_*_padded`` / ``cu_seqlens_*``."""
    p = packed_seq_params
    given = [int(m) for m in (p.max_seqlen_q, p.max_seqlen_kv) if m is not None]
    padded = [int((c[1:] - c[:-1]).max()) for c in (p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded)
              if c is not None and c.numel() > 1]
    if given:
        return max(given + padded)
    steps = padded + [int((c[1:] - c[:-1]).max()) for c in (p.cu_seqlens_q, p.cu_seqlens_kv)
                      if c is not None and c.numel() > 1]
    if not steps:
        raise ValueError("packed_seq_params has neither max_seqlen_q / max_seqlen_kv nor cu_seqlens")
    return max(steps)


def packed_layout_cu_seqlens(packed_seq_params: PackedSeqParams) -> Tuple[Tensor, Tensor]:
    """``(queries, keys)`` document bounds in the packed tensors: ``cu_seqlens_*_padded`` when given, else
    ``cu_seqlens_*`` (keys default to the queries'); what the rotary angles of each document follow."""
    p = packed_seq_params
    cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
    cu_kv = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
    return cu_q, (cu_kv if cu_kv is not None else cu_q)
