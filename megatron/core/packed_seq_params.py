"""``PackedSeqParams``: the cumulative sequence lengths of a batch of packed sequences (THD layout), megatron-core's
dataclass. The attention of this library refuses packed sequences (``packed_seq_params`` must be None): this is
the type callers build."""
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
