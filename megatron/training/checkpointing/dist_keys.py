"""Megatron-LM's ``torch_dist`` tensor keys and sharding for a megatron-core GPT/BERT model state dict.

The one table of this format (``_LAYER_RENAMES``) maps a per-layer name of the megatron-core module state dict to
the on-disk name Megatron-LM uses (its Transformer-Engine names, also used by its local spec)::

    decoder.layers.{i}.input_layernorm.{weight,bias}     -> decoder.layers.self_attention.linear_qkv.layer_norm_{weight,bias}
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}   -> decoder.layers.mlp.linear_fc1.layer_norm_{weight,bias}
    decoder.layers.{i}.<anything else>                   -> decoder.layers.<anything else>

Layers are *stacked*: a layer tensor of global shape ``S`` is stored as one tensor of shape ``[L] + S`` (L = total
number of layers) under the key without the layer number; layer ``i`` of pipeline stage ``p`` is the chunk at
offset ``i + first layer of p`` of the leading axis. Tensor-parallel tensors are chunks at ``tp_rank * local``
along their partition dim (rows for column-parallel, columns for row-parallel weights). Fused QKV rows are stored
as the model holds them: per query group ``[q heads of the group; k; v]``, ranks owning contiguous groups, so the
global tensor does not depend on TP. A SwiGLU ``linear_fc1`` of local rows ``[gate_r; up_r]`` is stored as two
chunks, ``gate_r`` at row ``r*F/t`` and ``up_r`` at row ``F + r*F/t`` of the global ``[gate (F); up (F)]``.
Non-layer tensors keep their names; a tied output layer on a later pipeline stage is the embedding
(``embedding.word_embeddings.weight``).

T5 (megatron-core names; the legacy model's are mapped by ``keys.legacy_to_mcore_key(.., 't5')``): ``encoder.layers``
and ``decoder.layers`` are two stacks, each with its own layer count ``L`` and global numbering (the decoder's
restarts at 0 after the split rank); decoder layers add ``pre_cross_attn_layernorm.*`` (stored under that name, as
megatron-core's local spec does) and ``cross_attention.linear_{q,kv,proj}``; the LM bias is
``lm_head.output_layer.bias`` and a tied ``lm_head.output_layer.weight`` is the embedding. megatron-core's T5Model
stores its aliases too (``position_embeddings.weight``, ``output_layer.bias``: the same tensors under a second key;
checked against megatron-core 0.16.1), so they are written for both T5 classes. Each linear layer also has an ``_extra_state`` object per layer, key
``decoder.layers.<linear>._extra_state/shard_{layer}_{L}``, payload ``[None]`` (no FP8 metadata).

Multi-latent attention, heterogeneous stacks and multi-token prediction (DeepSeek-V3; :class:`KeyLayout`):

* MLA layers keep ``input_layernorm.weight`` (a norm of its own, not fused into a QKV linear); their latent norms are
  stored under Transformer Engine's fused names ``self_attention.linear_q_up_proj.layer_norm_weight`` and
  ``self_attention.linear_kv_up_proj.layer_norm_weight``, and ``pre_mlp_layernorm`` is
  ``mlp.linear_fc1.layer_norm_weight`` in a dense layer but stays ``pre_mlp_layernorm.weight`` in an MoE layer
  (megatron-core's local spec writes the module names; loading accepts those too, :func:`stored_alias`);
* a stack whose layers differ (``--moe-layer-freq`` other than 1) is not stacked: layer ``i`` is stored under
  ``decoder.layers.{i}.<name>`` with no layer axis (experts keep their expert axis), and each linear's
  ``_extra_state`` is ``decoder.layers.{i}.<linear>._extra_state/shard_0_1`` (experts: ``shard_{e}_{E}``);
* the MTP depths are ``mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}.*`` and
  ``mtp.layers.{k}.transformer_layer.<name>``, renamed as a decoder layer of the last layer's kind, never stacked.

Experts (mixture of experts) get a second prepended axis, the *global* expert index: expert ``e`` of layer ``i`` is
the chunk at ``(i, e)`` of ``decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2F, h]`` (gate/up halves
split by *expert* TP as above) and ``...linear_fc2.weight [L, E, h, F]`` (expert-TP columns); this holds for the
``SequentialMLP`` names (``mlp.experts.local_experts.{j}.linear_fc*``, ``e = ep_rank * E/EP + j``) and for the
``GroupedMLP`` ``weight1 [h, n*2F/ETP]`` / ``weight2 [n*F/ETP, h]`` (each local expert's transposed slice), so
checkpoints move between EP, ETP, PP and both expert implementations. Their ``_extra_state`` objects are
``decoder.layers.mlp.experts.experts.linear_fc{1,2}._extra_state/shard_{layer}.{e}_{L}.{E}``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, FrozenSet, List, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.sharded_io import LocalShard

_LAYER = re.compile(r"^((?:decoder|encoder)\.layers)\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")
# Multi-latent attention's latent norms, stored as Transformer Engine fuses them into the up projections.
_MLA_RENAMES = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
                "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
# The same tensor under Transformer Engine's fused name and under megatron-core's local-spec module name.
_ALIASES = (("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
            ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
            ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
            ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"))
_LAYER_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
# The linears of a layer, each with an _extra_state object (and MTP's eh_proj).
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "cross_attention.linear_q",
           "cross_attention.linear_kv", "cross_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
           "self_attention.linear_q_proj", "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
           "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj", "mlp.shared_experts.linear_fc1",
           "mlp.shared_experts.linear_fc2")
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
T5_ALIASES = ("position_embeddings.", "output_layer.")  # megatron-core T5Model's duplicate module names
# On-disk alias key -> the key of the tensor it repeats (megatron-core's T5Model writes both).
T5_ALIAS_KEYS = {"position_embeddings.weight": "embedding.position_embeddings.weight",
                 "output_layer.bias": "lm_head.output_layer.bias"}
# fc1 of a gated MLP is stored [gate (all TP ranks); up (all TP ranks)], megatron-core's swiglu split; shared
# experts are an MLP there too, so theirs is split the same way.
_GATED = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.experts.experts.linear_fc1.weight",
          "mlp.experts.experts.linear_fc1.bias", "mlp.shared_experts.linear_fc1.weight",
          "mlp.shared_experts.linear_fc1.bias")


@dataclasses.dataclass
class Entry:
    """One tensor of a model chunk: its local name, on-disk key, global layer (None outside layers), tensor,
    parameter (None for buffers) and tensor-parallel partition dim (None when replicated)."""

    local_name: str
    key: str
    layer: Optional[int]
    tensor: torch.Tensor
    param: Optional[torch.nn.Parameter]
    tp_dim: Optional[int]
    # Experts: global expert index, number of experts, (expert TP size, rank), and for grouped weights the view
    # of the parameter-shaped tensor that is this expert's [out, in] weight.
    expert: Optional[int] = None
    num_experts: int = 0
    etp: Optional[Tuple[int, int]] = None
    view: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    num_layers: Optional[int] = None  # the layer count of this entry's stack when it is not the chunk's (T5)


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """How a model's layer tensors are keyed (module docstring): ``per_layer`` for a heterogeneous stack, ``mla``
    for multi-latent attention layers, ``moe_layers`` the global (0-based) indices of the MoE layers, ``num_layers``
    the stack's layer count (its last layer's kind is the MTP depths')."""

    per_layer: bool = False
    mla: bool = False
    moe_layers: FrozenSet[int] = frozenset()
    num_layers: int = 0


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


DEFAULT_LAYOUT = KeyLayout()


def _rename(rest: str, layout: KeyLayout, moe: bool) -> str:
    if not layout.mla:
        return _LAYER_RENAMES.get(rest, rest)
    if rest.startswith("pre_mlp_layernorm.") and not moe:
        return "mlp.linear_fc1.layer_norm_" + rest.split(".", 1)[1]
    return _MLA_RENAMES.get(rest, rest)


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


def stored_alias(key: str, stored) -> Optional[str]:
    """The key under which ``stored`` (a checkpoint's keys) holds ``key``'s tensor when it was written with the other
    of Transformer Engine's fused norm names and megatron-core's local-spec names; None when it has neither."""
    for a, b in _ALIASES:
        for mine, theirs in ((a, b), (b, a)):
            if mine in key:
                other = key.replace(mine, theirs)
                if other in stored:
                    return other
    return None


def shards(entry: Entry, num_layers: int, tp_size: int, tp_rank: int, gated: bool,
           tensor: Optional[torch.Tensor] = None) -> List[LocalShard]:
    """This rank's chunk(s) of ``entry`` (or of ``tensor``, a same-shaped companion such as an Adam moment) in the
    global on-disk tensor."""
    data = entry.tensor if tensor is None else tensor
    num_layers = entry.num_layers or num_layers
    if tensor is not None and entry.view is not None:
        data = entry.view(tensor)
    if entry.etp is not None:
        tp_size, tp_rank = entry.etp
    shape, offset = list(data.shape), [0] * data.dim()
    pieces = [(data, offset)]
    if entry.tp_dim is not None and tp_size > 1 or gated and entry.key.endswith(_GATED):
        dim = entry.tp_dim if entry.tp_dim is not None else 0
        if gated and entry.key.endswith(_GATED):
            half = shape[0] // 2
            total = half * tp_size  # F
            rest = [0] * (data.dim() - 1)
            pieces = [(data[:half], [tp_rank * half] + rest), (data[half:], [total + tp_rank * half] + rest)]
        else:
            offset[dim] = tp_rank * shape[dim]
        shape[dim] *= tp_size
    out = []
    for piece, off in pieces:
        if entry.expert is not None and entry.layer is None:  # a per-layer expert key (heterogeneous or hybrid stacks, MTP)
            out.append(LocalShard(piece.unsqueeze(0), (entry.num_experts, *shape), (entry.expert, *off)))
        elif entry.expert is not None:
            out.append(LocalShard(piece.unsqueeze(0).unsqueeze(0), (num_layers, entry.num_experts, *shape),
                                  (entry.layer, entry.expert, *off)))
        elif entry.layer is not None:
            out.append(LocalShard(piece.unsqueeze(0), (num_layers, *shape), (entry.layer, *off)))
        else:
            out.append(LocalShard(piece, tuple(shape), tuple(off)))
    return out


def merge_loaded(entry: Entry, loaded: List[LocalShard]) -> torch.Tensor:
    """The local tensor from the chunk(s) :func:`shards` described, after they were read."""
    lead = (entry.expert is not None) + (entry.layer is not None)
    parts = [sh.data.reshape(sh.data.shape[lead:]) for sh in loaded]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.weight([12])$")
EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")


def expert_entries(name: str, value: torch.Tensor, param, layer_offset: int, ep_rank: int, num_local: int,
                   num_experts: int, etp: Tuple[int, int],
                   layout: KeyLayout = DEFAULT_LAYOUT) -> Optional[List[Entry]]:
    """The on-disk entries of an expert tensor (None when ``name`` is not one): one per local expert."""
    m = _LAYER.match(name)
    if m:
        block, layer, rest = m.group(1), int(m.group(2)) + layer_offset, m.group(3)
        if layout.per_layer:  # decoder.layers.{i}.mlp.experts.experts.*, the expert axis only
            block, layer = f"{block}.{layer}", None
    else:
        m = _MTP_LAYER.match(name)
        if not m:
            return None
        block, layer, rest = m.group(1), None, m.group(2)
    local = _LOCAL_EXPERT.match(rest)
    if local:
        j, linear, kind = int(local.group(1)), local.group(2), local.group(3)
        tp_dim = 0 if linear == "linear_fc1" or kind == "bias" else 1
        return [Entry(name, f"{block}.mlp.experts.experts.{linear}.{kind}", layer, value, param, tp_dim,
                      ep_rank * num_local + j, num_experts, etp)]
    grouped = _GROUPED_EXPERT.match(rest)
    if grouped:
        which = grouped.group(1)
        out = []
        for j in range(num_local):
            if which == "1":  # weight1 [h, n * X] -> expert j's fc1 [X, h]
                view = (lambda t, j=j: t.view(t.shape[0], num_local, -1)[:, j, :].t())
                tp_dim = 0
            else:             # weight2 [n * X, h] -> expert j's fc2 [h, X]
                view = (lambda t, j=j: t.view(num_local, -1, t.shape[-1])[j].t())
                tp_dim = 1
            out.append(Entry(name, f"{block}.mlp.experts.experts.linear_fc{which}.weight", layer, view(value), param,
                             tp_dim, ep_rank * num_local + j, num_experts, etp, view))
        return out
    return None


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
    return f"{linear}._extra_state/shard_0_1" if linear.endswith(LINEARS + ("eh_proj",)) else None


def t5_head_extra_state_keys():
    """megatron-core T5's ``_extra_state`` objects of its LM head (and the head's alias), outside the layers."""
    return [f"{name}._extra_state/shard_0_1" for name in ("lm_head.output_layer", "output_layer")]


def rng_key(pp_rank: int, tp_rank: int, pp: int, tp: int) -> str:
    return f"rng_state/shard_{pp_rank}.{tp_rank}_{pp}.{tp}"


def module_name(key: str, layer: Optional[int], layout: KeyLayout = DEFAULT_LAYOUT) -> str:
    """Inverse of :func:`disk_key`: the megatron-core state-dict name of on-disk ``key`` (of stacked layer ``layer``;
    None for an unstacked key)."""
    def inverse(rest: str) -> str:
        for name in ("input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight",
                     "pre_mlp_layernorm.bias", *_MLA_RENAMES):
            if rest in (_rename(name, layout, False), _rename(name, layout, True)):
                return name
        return rest

    if layer is not None:
        block, rest = key.split(".layers.", 1)
        return f"{block}.layers.{layer}.{inverse(rest)}"
    m = _LAYER.match(key) or _MTP_LAYER.match(key)
    if m is None:
        return key
    return key[: m.start(m.lastindex)] + inverse(m.group(m.lastindex))
