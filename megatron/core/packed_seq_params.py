"""``PackedSeqParams``: the cumulative sequence lengths of a batch of packed sequences (THD layout), megatron-core's
dataclass. ``qkv_format='thd'``: documents packed along one row ``[t, 1, h]``, document ``i`` in rows
``cu_seqlens_q_padded[i] ..`` (or ``cu_seqlens_q[i] ..``) of real length ``cu_seqlens_q[i+1] - cu_seqlens_q[i]``;
the local attention attends within each document and RoPE restarts at each (with context parallelism: each
padded document through the ring attention, a rank holding two chunks of each).
``qkv_format='sbhd'`` with ``cp_group`` / ``local_cp_size``: one hybrid-context-parallel sample, whose attention runs
over its own CP group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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
