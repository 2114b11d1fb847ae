"""Megatron-LM's ``torch_dist`` key names for the OFFLINE converter (tools/checkpoint/convert.py), which turns full
(unsharded) megatron-core state dicts into checkpoints and back without building a model. Training does not use
these: there every module declares its own checkpoint keys and sharding (``sharded_state_dict``).

What is a true rename here: a layer's norms are stored under Transformer Engine's fused names, as the layer specs'
``sharded_state_dict_keys_map`` say (megatron.core.transformer.transformer_layer: ``LOCAL_NORM_KEYS_MAP``, and
``MLA_NORM_KEYS_MAP`` for multi-latent attention layers, whose input norm is not renamed and whose pre-MLP norm is
fused only in a dense layer)::

    decoder.layers.{i}.input_layernorm.{weight,bias}     -> decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}   -> decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}
    MLA: self_attention.{q,kv}_layernorm.weight          -> self_attention.linear_{q,kv}_up_proj.layer_norm_weight

Layers are stacked (``[L] + S`` under the key without the layer number), experts too (``[L, E] + S`` under
``...mlp.experts.experts.linear_fc*``), except in a stack whose layers differ (``--moe-layer-freq`` other than 1:
``decoder.layers.{i}.<name>``, experts ``[E] + S``) and in the MTP depths (``mtp.layers.{k}.…``, the transformer
layer renamed as a decoder layer of the last layer's kind); a full (TP=1) tensor is the whole global tensor, gated
fc1 included (``[gate; up]``). megatron-core's T5Model also writes its aliases (``position_embeddings.weight``,
``output_layer.bias``). Each linear layer (``linear_*``, MTP's ``eh_proj``) has an empty ``_extra_state`` object per
layer (and expert).
"""
from __future__ import annotations

import dataclasses
import re
from typing import FrozenSet, Optional, Tuple

from megatron.core.transformer.transformer_layer import LOCAL_NORM_KEYS_MAP, MLA_NORM_KEYS_MAP

_LAYER = re.compile(r"^((?:decoder|encoder)\.layers)\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")
# A layer's linear modules are megatron-core's ``linear_*`` (attention, MLP, shared experts, MLA projections):
# each has an (empty) ``_extra_state`` object on disk.
_LINEAR_WEIGHT = re.compile(r"^(?:.+\.)?linear_[a-z0-9_]+\.weight$")
T5_ALIASES = ("position_embeddings.", "output_layer.")  # megatron-core T5Model's duplicate module names
# On-disk alias key -> the key of the tensor it repeats (megatron-core's T5Model writes both).
T5_ALIAS_KEYS = {"position_embeddings.weight": "embedding.position_embeddings.weight",
                 "output_layer.bias": "lm_head.output_layer.bias"}


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """How a model's layer tensors are keyed: ``per_layer`` for a heterogeneous stack, ``mla`` for multi-latent
    attention layers, ``moe_layers`` the global (0-based) indices of the MoE layers, ``num_layers`` the stack's layer
    count (its last layer's kind is the MTP depths')."""

    per_layer: bool = False
    mla: bool = False
    moe_layers: FrozenSet[int] = frozenset()
    num_layers: int = 0


DEFAULT_LAYOUT = KeyLayout()


def layout_of(config) -> KeyLayout:
    """The key layout of a model with ``config`` (a TransformerConfig, or args with Megatron's flag names)."""
    num_layers = getattr(config, "num_layers", 0) or 0
    experts = getattr(config, "num_moe_experts", None) or getattr(config, "num_experts", None)
    freq = getattr(config, "moe_layer_freq", 1)
    moe = frozenset()
    if experts:
        moe = frozenset(i for i in range(num_layers)
                        if (bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0))
    return KeyLayout(per_layer=bool(experts) and freq != 1, mla=bool(getattr(config, "multi_latent_attention", False)),
                     moe_layers=moe, num_layers=num_layers)


def _renames(layout: KeyLayout, moe: bool) -> dict:
    """{module name prefix: on-disk prefix} of a layer (the layer spec's key map)."""
    if not layout.mla:
        return LOCAL_NORM_KEYS_MAP
    renames = dict(MLA_NORM_KEYS_MAP)
    if not moe:
        renames["pre_mlp_layernorm."] = LOCAL_NORM_KEYS_MAP["pre_mlp_layernorm."]
    return renames


def _rename(rest: str, layout: KeyLayout, moe: bool) -> str:
    for old, new in _renames(layout, moe).items():
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def _inverse(rest: str, layout: KeyLayout, moe: bool) -> str:
    for old, new in _renames(layout, moe).items():
        if rest.startswith(new):
            return old + rest[len(new):]
    return rest


def disk_key(name: str, layer_offset: int, tied_output: bool,
             layout: KeyLayout = DEFAULT_LAYOUT) -> Tuple[str, Optional[int]]:
    """(on-disk key, global layer number of a stacked tensor or None) of a megatron-core state-dict name."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(2)) + layer_offset
        rest = _rename(m.group(3), layout, layer in layout.moe_layers)
        if layout.per_layer:
            return f"{m.group(1)}.{layer}.{rest}", None
        return f"{m.group(1)}.{rest}", layer
    m = _MTP_LAYER.match(name)
    if m:
        return f"{m.group(1)}.{_rename(m.group(2), layout, layout.num_layers - 1 in layout.moe_layers)}", None
    if name in ("output_layer.weight", "lm_head.output_layer.weight") and tied_output:
        return "embedding.word_embeddings.weight", None
    return name, None


def module_name(key: str, layer: Optional[int], layout: KeyLayout = DEFAULT_LAYOUT) -> str:
    """Inverse of :func:`disk_key`: the megatron-core state-dict name of on-disk ``key`` (of stacked layer ``layer``;
    None for an unstacked key)."""
    if layer is not None:
        block, rest = key.split(".layers.", 1)
        return f"{block}.layers.{layer}.{_inverse(rest, layout, layer in layout.moe_layers)}"
    m = _LAYER.match(key)
    if m:
        return f"{m.group(1)}.{m.group(2)}.{_inverse(m.group(3), layout, int(m.group(2)) in layout.moe_layers)}"
    m = _MTP_LAYER.match(key)
    if m:
        return f"{m.group(1)}.{_inverse(m.group(2), layout, layout.num_layers - 1 in layout.moe_layers)}"
    return key


def linear_of_weight(rest: str) -> Optional[str]:
    """The linear module name of a layer tensor name ``rest`` when it is a linear layer's weight, else None."""
    return rest[:-len(".weight")] if _LINEAR_WEIGHT.match(rest) else None


def expert_extra_state_key(block_key: str, linear: str, layer: int, expert: int, num_layers: int,
                           num_experts: int) -> str:
    return f"{block_key}.{linear}._extra_state/shard_{layer}.{expert}_{num_layers}.{num_experts}"


def extra_state_key(block_key: str, linear: str, layer: int, num_layers: int) -> str:
    """DCP key of a linear layer's ``_extra_state`` object (Megatron's ShardedObject ``unique_key``)."""
    return f"{block_key}.{linear}._extra_state/shard_{layer}_{num_layers}"


def unstacked_extra_state_key(weight_key: str, expert: Optional[int] = None, num_experts: int = 0) -> Optional[str]:
    """DCP key of the ``_extra_state`` object of the linear whose weight is stored unstacked under ``weight_key``
    (a layer of a heterogeneous stack, an MTP depth), or None when that is not a linear layer's weight."""
    if not weight_key.endswith(".weight") or not weight_key.startswith(("decoder.layers.", "encoder.layers.",
                                                                         "mtp.layers.")):
        return None
    linear = weight_key[: -len(".weight")]
    if expert is not None:
        return f"{linear}._extra_state/shard_{expert}_{num_experts}"
    if linear_of_weight(weight_key) is None and not linear.endswith(".eh_proj"):
        return None
    return f"{linear}._extra_state/shard_0_1"


def t5_head_extra_state_keys():
    """megatron-core T5's ``_extra_state`` objects of its LM head (and the head's alias), outside the layers."""
    return [f"{name}._extra_state/shard_0_1" for name in ("lm_head.output_layer", "output_layer")]
