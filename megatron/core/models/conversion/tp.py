"""Split a full (TP=1) model state dict into tensor-parallel shards and merge shards back.

Rules (those of Megatron-LM's ``tools/checkpoint`` converters): column-parallel tensors (fused QKV,
``dense_h_to_4h`` / ``linear_fc1``, word embeddings, untied output layer, the BERT LM-head bias, multi-latent
attention's query and up projections, the MTP ``eh_proj``) are split along dim 0; row-parallel weights (attention
output ``dense`` / ``linear_proj``, ``dense_4h_to_h`` / ``linear_fc2``) along dim 1; everything else is
replicated. The fused QKV rows are grouped per query group, so contiguous chunks give each rank whole groups. With a
gated MLP (swiglu) each rank's first MLP linear is ``[gate_shard; up_shard]``, so the TP=1 tensor ``[gate; up]`` is
split half by half.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

_COLUMN_SUFFIXES = (
    "query_key_value.weight", "query_key_value.bias", "linear_qkv.weight", "linear_qkv.bias",
    "attention.query.weight", "attention.query.bias", "key_value.weight", "key_value.bias",
    "linear_q.weight", "linear_q.bias", "linear_kv.weight", "linear_kv.bias",
    "dense_h_to_4h.weight", "dense_h_to_4h.bias", "linear_fc1.weight", "linear_fc1.bias",
    "word_embeddings.weight", "output_layer.weight", "output_layer.bias", "lm_head.bias",
    "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight", "eh_proj.weight",
)
_ROW_SUFFIXES = (
    "self_attention.dense.weight", "inter_attention.dense.weight", "linear_proj.weight",
    "dense_4h_to_h.weight", "linear_fc2.weight",
)
_GATED_SUFFIXES = ("dense_h_to_4h.weight", "dense_h_to_4h.bias", "linear_fc1.weight", "linear_fc1.bias")


def tp_partition_dim(key: str) -> Optional[int]:
    """0 for column-parallel tensors, 1 for row-parallel weights, None for replicated ones."""
    if key.endswith(_COLUMN_SUFFIXES):
        return 0
    if key.endswith(_ROW_SUFFIXES):
        return 1
    return None


def split_tensor_parallel(state_dict: Dict[str, torch.Tensor], tp_size: int,
                          gated_linear_unit: bool = False) -> List[Dict[str, torch.Tensor]]:
    """Per-rank state dicts (index = TP rank) from a full state dict."""
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(tp_size)]
    for key, tensor in state_dict.items():
        dim = tp_partition_dim(key) if torch.is_tensor(tensor) else None
        if dim is None:
            for shard in shards:
                shard[key] = tensor
            continue
        if tensor.shape[dim] % tp_size != 0:
            raise ValueError(f"{key}: dimension {dim} of shape {tuple(tensor.shape)} is not divisible by TP={tp_size}")
        if gated_linear_unit and key.endswith(_GATED_SUFFIXES):
            gate, up = torch.chunk(tensor, 2, dim=0)
            pieces = [torch.cat([g, u], dim=0) for g, u in zip(torch.chunk(gate, tp_size, 0), torch.chunk(up, tp_size, 0))]
        else:
            pieces = torch.chunk(tensor, tp_size, dim=dim)
        for rank, piece in enumerate(pieces):
            shards[rank][key] = piece.clone()
    return shards


def merge_tensor_parallel(shards: List[Dict[str, torch.Tensor]], gated_linear_unit: bool = False) -> Dict[str, torch.Tensor]:
    """The full state dict from per-rank state dicts (inverse of :func:`split_tensor_parallel`)."""
    merged = {}
    for key, first in shards[0].items():
        dim = tp_partition_dim(key) if torch.is_tensor(first) else None
        if dim is None:
            merged[key] = first
            continue
        pieces = [shard[key] for shard in shards]
        if gated_linear_unit and key.endswith(_GATED_SUFFIXES):
            halves = [torch.chunk(p, 2, dim=0) for p in pieces]
            merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            merged[key] = torch.cat(pieces, dim=dim)
    return merged
