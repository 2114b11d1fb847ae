"""Cutting a batch along the sequence for context parallelism (CP); re-exported by :mod:`megatron.core.utils`.

* Fixed-length sequences (BSHD): the sequence of length ``S`` is cut into ``2 CP`` equal chunks; rank ``r`` keeps
  chunk ``r`` then chunk ``2 CP - 1 - r`` (the load-balanced "zigzag": under a causal mask an early chunk has
  little work and a late one much, so every rank gets one of each). Example, ``S = 8``, ``CP = 2``: rank 0 keeps
  ``[0, 1, 6, 7]``, rank 1 keeps ``[2, 3, 4, 5]``.
* Packed sequences (THD): ``cu_seqlens_padded = [0, L_0, L_0 + L_1, ...]`` delimits the sub-sequences of the
  packed token dimension; each sub-sequence (``L_i`` divisible by ``2 CP``) is cut the same zigzag way on its own
  and rank ``r`` keeps its two chunks of every sub-sequence, in order: ``T / CP`` tokens of the ``T`` packed.
* Hybrid CP: each sample runs on its own group of ``local_cp_size`` DP x CP ranks (its size picked by the data
  schedule from the sample's length); the sample gets a batch dimension of 1 and is cut as BSHD over that group.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from megatron.core.packed_seq_params import PackedSeqParams


def context_parallel_chunk_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions (along the sequence) that context-parallel rank ``cp_rank`` of ``cp_size`` holds (BSHD, module
    docstring)."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context-parallel size ({2 * cp_size})")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


def _cp_size_rank(cp_group):
    """(size, rank) of ``cp_group`` ((1, 0) without torch.distributed), else of parallel_state's CP group."""
    if cp_group is not None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return 1, 0
        return torch.distributed.get_world_size(cp_group), torch.distributed.get_rank(cp_group)
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def get_batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """This context-parallel rank's part of every tensor of ``batch`` (megatron-core's function; ``cp_group``
    defaults to parallel_state's CP group).

    Each tensor's sequence dimension (dim 1; dim 2 for ``attention_mask``, whose key dimension stays whole) keeps
    the positions of :func:`context_parallel_chunk_indices`: ``S / CP`` of them, chunk ``r`` first, then chunk
    ``2 CP - 1 - r``. ``None`` values pass through; with CP = 1 the batch is returned unchanged.
    """
    cp_size, cp_rank = _cp_size_rank(cp_group)
    if cp_size <= 1:
        return batch
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = value
            continue
        dim = 2 if key == "attention_mask" else 1
        index = context_parallel_chunk_indices(value.size(dim), cp_size, cp_rank).to(value.device)
        out[key] = value.index_select(dim, index)
    return out


def thd_partitioned_indices(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int,
                            cp_rank: int) -> torch.Tensor:
    """Positions of the packed token dimension (of ``total_tokens``) that CP rank ``cp_rank`` keeps (THD, module
    docstring); the pure-PyTorch form of Transformer Engine's ``thd_get_partitioned_indices``."""
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    if bounds[-1] > total_tokens:
        raise ValueError(f"cu_seqlens_padded ends at {bounds[-1]}, beyond the {total_tokens} packed tokens")
    parts = [start + context_parallel_chunk_indices(end - start, cp_size, cp_rank)
             for start, end in zip(bounds[:-1], bounds[1:])]
    index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return index.to(cu_seqlens_padded.device)


def get_thd_batch_on_this_cp_rank(batch: Dict[str, Any], cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                                  max_seqlen: torch.Tensor, cp_size: Optional[int] = None,
                                  cp_rank: Optional[int] = None):
    """``(batch, packed_seq_params)`` for packed sequences: every tensor of ``batch`` except ``attention_mask``,
    ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` keeps, along dim 1, this CP rank's tokens
    (:func:`thd_partitioned_indices` over ``batch['tokens'].size(1)``); ``packed_seq_params`` is THD with
    ``cu_seqlens`` for q and kv, ``cu_seqlens_padded`` as their padded forms and ``max_seqlen[0]`` as both maxima.
    ``cp_size`` / ``cp_rank`` default to parallel_state's. ``batch`` is changed in place and returned."""
    longest = int(max_seqlen[0].item())
    packed_seq_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                        cu_seqlens_q_padded=cu_seqlens_padded, cu_seqlens_kv_padded=cu_seqlens_padded,
                                        max_seqlen_q=longest, max_seqlen_kv=longest)
    if cp_size is None or cp_rank is None:
        default_size, default_rank = _cp_size_rank(None)
        cp_size = default_size if cp_size is None else cp_size
        cp_rank = default_rank if cp_rank is None else cp_rank
    if cp_size > 1:
        index = thd_partitioned_indices(cu_seqlens_padded, batch["tokens"].size(1), cp_size, cp_rank)
        for key, data in batch.items():
            if key not in ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
                batch[key] = data.index_select(1, index.to(data.device))
    return batch, packed_seq_params


def get_batch_on_this_hybrid_cp_rank(batch: Dict[str, Any], local_cp_size: int,
                                     cp_group: Optional[torch.distributed.ProcessGroup] = None):
    """``(batch, packed_seq_params)`` for one sample of hybrid CP (module docstring): every tensor except
    ``attention_mask`` gains a leading batch dimension of 1; with a group of more than one rank (``cp_group``, which
    must have ``local_cp_size`` ranks, else parallel_state's hybrid DP x CP group of that size) the batch is cut with
    :func:`get_batch_on_this_cp_rank`. ``packed_seq_params`` is SBHD with ``cu_seqlens = [0, S]`` (``S``: the
    sample's length), ``local_cp_size`` and the group."""
    if local_cp_size is None:
        raise AssertionError("get_batch_on_this_hybrid_cp_rank needs local_cp_size")
    if cp_group is None:
        if local_cp_size > 1:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_hybrid_data_context_parallel_groups(group_size=local_cp_size)
    elif cp_group.size() != local_cp_size:
        raise AssertionError(f"cp_group has {cp_group.size()} ranks but local_cp_size is {local_cp_size}")
    for key, data in batch.items():
        if key != "attention_mask":
            batch[key] = torch.stack([data], 0)
    length = batch["tokens"].shape[1]
    bounds = torch.tensor([0, length], device=batch["tokens"].device)
    packed_seq_params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds.clone(),
                                        cu_seqlens_q_padded=bounds.clone(), cu_seqlens_kv_padded=bounds.clone(),
                                        max_seqlen_q=length, max_seqlen_kv=length, local_cp_size=local_cp_size,
                                        cp_group=cp_group)
    if cp_group is not None and cp_group.size() > 1:
        batch = get_batch_on_this_cp_rank(batch, cp_group=cp_group)
    return batch, packed_seq_params
