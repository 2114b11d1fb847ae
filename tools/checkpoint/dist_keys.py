"""Megatron-LM's ``torch_dist`` key names for the OFFLINE converter (tools/checkpoint/convert.py), which turns full
(unsharded) megatron-core state dicts into checkpoints and back without building a model. Training does not use
these: there every module declares its own checkpoint keys and sharding (``sharded_state_dict``).

What is a true rename here: the local layer's norms are stored under Transformer Engine's fused names
(``LOCAL_NORM_KEYS_MAP`` of megatron.core.transformer.transformer_layer, the one table)::

    decoder.layers.{i}.input_layernorm.{weight,bias}     -> decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}   -> decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}

Layers are stacked (``[L] + S`` under the key without the layer number), experts too (``[L, E] + S`` under
``...mlp.experts.experts.linear_fc*``); a full (TP=1) tensor is the whole global tensor, gated fc1 included
(``[gate; up]``). megatron-core's T5Model also writes its aliases (``position_embeddings.weight``,
``output_layer.bias``). Each linear layer has an empty ``_extra_state`` object per layer (and expert).
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

from megatron.core.transformer.transformer_layer import LOCAL_NORM_KEYS_MAP

_LAYER = re.compile(r"^((?:decoder|encoder)\.layers)\.(\d+)\.(.+)$")
_LAYER_RENAMES = {f"{old}{kind}": f"{new}{kind}" for old, new in LOCAL_NORM_KEYS_MAP.items()
                  for kind in ("weight", "bias")}
# A layer's linear modules are megatron-core's ``linear_*`` (attention, MLP, shared experts, MLA projections):
# each has an (empty) ``_extra_state`` object on disk.
_LINEAR_WEIGHT = re.compile(r"^(?:.+\.)?linear_[a-z0-9_]+\.weight$")
T5_ALIASES = ("position_embeddings.", "output_layer.")  # megatron-core T5Model's duplicate module names
# On-disk alias key -> the key of the tensor it repeats (megatron-core's T5Model writes both).
T5_ALIAS_KEYS = {"position_embeddings.weight": "embedding.position_embeddings.weight",
                 "output_layer.bias": "lm_head.output_layer.bias"}


def linear_of_weight(rest: str) -> Optional[str]:
    """The linear module name of a layer tensor name ``rest`` when it is a linear layer's weight, else None."""
    return rest[:-len(".weight")] if _LINEAR_WEIGHT.match(rest) else None


def disk_key(name: str, layer_offset: int, tied_output: bool) -> Tuple[str, Optional[int]]:
    """(on-disk key, global layer number or None) of a megatron-core state-dict name."""
    m = _LAYER.match(name)
    if m:
        rest = m.group(3)
        return f"{m.group(1)}.{_LAYER_RENAMES.get(rest, rest)}", int(m.group(2)) + layer_offset
    if name in ("output_layer.weight", "lm_head.output_layer.weight") and tied_output:
        return "embedding.word_embeddings.weight", None
    return name, None


def expert_extra_state_key(block_key: str, linear: str, layer: int, expert: int, num_layers: int,
                           num_experts: int) -> str:
    return f"{block_key}.{linear}._extra_state/shard_{layer}.{expert}_{num_layers}.{num_experts}"


def extra_state_key(block_key: str, linear: str, layer: int, num_layers: int) -> str:
    """DCP key of a linear layer's ``_extra_state`` object (Megatron's ShardedObject ``unique_key``)."""
    return f"{block_key}.{linear}._extra_state/shard_{layer}_{num_layers}"


def t5_head_extra_state_keys():
    """megatron-core T5's ``_extra_state`` objects of its LM head (and the head's alias), outside the layers."""
    return [f"{name}._extra_state/shard_0_1" for name in ("lm_head.output_layer", "output_layer")]


def module_name(key: str, layer: Optional[int]) -> str:
    """Inverse of :func:`disk_key`: the megatron-core state-dict name of on-disk ``key`` (layer ``layer``)."""
    if layer is None:
        return key
    block, rest = key.split(".layers.", 1)
    inverse = {v: k for k, v in _LAYER_RENAMES.items()}
    return f"{block}.layers.{layer}.{inverse.get(rest, rest)}"
