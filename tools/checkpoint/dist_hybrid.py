"""``torch_dist`` keys of hybrid (Mamba) models for the OFFLINE converter (tools/checkpoint/convert.py): full (TP = 1)
MambaModel state dicts to Megatron's on-disk keys and back, without building a model. Training does not use this:
there the modules declare their keys (MambaStack / MambaLayer / MambaMixer ``sharded_state_dict``).

Hybrid stacks are never stacked: layer ``i`` (global, 0-based) is stored under ``decoder.layers.{i}.<name>``
without a layer axis. Per layer type, the pre-norm is stored under Transformer Engine's fused name (the specs'
``sharded_state_dict_keys_map``)::

    M  norm.weight               -> mixer.in_proj.layer_norm_weight
    *  input_layernorm.weight    -> self_attention.linear_qkv.layer_norm_weight
    -  pre_mlp_layernorm.weight  -> mlp.linear_fc1.layer_norm_weight
    E  pre_mlp_layernorm.weight     (kept: the MoE layer's norm is a separate module)

The mixer's ``in_proj.weight`` is five tensors ``mixer.in_proj.weight.{z,x,B,C,dt}``, ``conv1d.{weight,bias}`` are
``.x``, ``.B``, ``.C``. Experts of an ``E`` layer: ``decoder.layers.{i}.mlp.experts.experts.linear_fc{1,2}.weight``
``[E, ...]``. Each linear layer has an empty ``_extra_state`` object ``decoder.layers.{i}.<linear>._extra_state/
shard_0_1`` (experts: ``shard_{e}_{E}``); so has the output layer (``output_layer._extra_state/shard_0_1``,
which megatron-core's GPTModel drops and its MambaModel keeps).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List

import torch

from tools.checkpoint.dist_keys import disk_key

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _spec_norm_renames() -> Dict[str, Dict[str, str]]:
    """Per layer symbol, {module name: on-disk name} of the norm weights: the ``sharded_state_dict_keys_map`` of
    the hybrid stack spec's layers (the one table)."""
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    sub = mamba_stack_spec.submodules
    layers = {"M": sub.mamba_layer, "*": sub.attention_layer, "-": sub.mlp_layer, "E": sub.moe_layer}
    return {symbol: {f"{old}weight": f"{new}weight" for old, new in spec.submodules.sharded_state_dict_keys_map.items()}
            for symbol, spec in layers.items()}


_NORM_RENAMES = _spec_norm_renames()
_LINEARS = {"M": ("mixer.in_proj", "mixer.out_proj"),
            "*": ("self_attention.linear_qkv", "self_attention.linear_proj"),
            "-": ("mlp.linear_fc1", "mlp.linear_fc2"),
            "E": ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2", "mlp.fc1_latent_proj",
                  "mlp.fc2_latent_proj")}
_ALL_LINEARS = tuple(sorted({name for names in _LINEARS.values() for name in names}))
_EXPERT_LINEARS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
_SPLIT = {"mixer.in_proj.weight": "in_proj", "mixer.conv1d.weight": "conv", "mixer.conv1d.bias": "conv"}


def _parts(dims, which: str):
    return dims.in_proj_parts if which == "in_proj" else dims.conv_parts


def _renamed(symbol: str, rest: str) -> str:
    return _NORM_RENAMES[symbol].get(rest, rest)


def extra_state_keys(stored_keys: Iterable[str], num_experts: int) -> List[str]:
    """The empty ``_extra_state`` objects of the linear layers whose weights are among ``stored_keys`` (on-disk
    keys; module docstring), and the output layer's (megatron-core's MambaModel keeps it, tied or not)."""
    keys = ["output_layer._extra_state/shard_0_1"]
    for key in stored_keys:
        m = _LAYER.match(key)
        if not m:
            continue
        prefix, rest = f"decoder.layers.{m.group(1)}.", m.group(2)
        for linear in _ALL_LINEARS:
            if rest in (f"{linear}.weight", f"{linear}.weight.z"):
                keys.append(f"{prefix}{linear}._extra_state/shard_0_1")
        if rest in tuple(f"{linear}.weight" for linear in _EXPERT_LINEARS):
            keys.extend(f"{prefix}{rest[:-len('.weight')]}._extra_state/shard_{e}_{num_experts}"
                        for e in range(num_experts))
    return keys


def full_to_disk(full: Dict[str, torch.Tensor], pattern: str, dims, tied: bool) -> Dict[str, torch.Tensor]:
    """A full (TP = 1, SequentialMLP) MambaModel state dict -> {on-disk key: tensor} (experts ``[E, ...]``)."""
    out, experts = {}, {}
    expert_name = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
    for name, value in full.items():
        if name.endswith("_extra_state"):
            continue
        m = _LAYER.match(name)
        if not m:
            key = disk_key(name, 0, tied)[0]
            out.setdefault(key, value)
            continue
        index, rest = int(m.group(1)), m.group(2)
        prefix = f"decoder.layers.{index}."
        expert = expert_name.match(rest)
        if expert:
            experts.setdefault(f"{prefix}mlp.experts.experts.{expert.group(2)}", {})[int(expert.group(1))] = value
        elif rest in _SPLIT:
            start = 0
            for part, size in _parts(dims, _SPLIT[rest]):
                out[f"{prefix}{rest}.{part}"] = value[start:start + size]
                start += size
        else:
            out[prefix + _renamed(pattern[index], rest)] = value
    for key, by_expert in experts.items():
        out[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def disk_to_full(stored: Dict[str, torch.Tensor], pattern: str) -> Dict[str, torch.Tensor]:
    """Inverse of :func:`full_to_disk` (experts as SequentialMLP names, EP = 1)."""
    inverse = {symbol: {v: k for k, v in renames.items()} for symbol, renames in _NORM_RENAMES.items()}
    out, split = {}, {}
    for key, value in stored.items():
        if not torch.is_tensor(value):
            continue
        m = _LAYER.match(key)
        if not m:
            out[key] = value
            continue
        index, rest = int(m.group(1)), m.group(2)
        prefix = f"decoder.layers.{index}."
        base, _, part = rest.rpartition(".")
        if base in _SPLIT:
            split.setdefault(prefix + base, {})[part] = value
        elif rest.startswith("mlp.experts.experts."):
            for e in range(value.shape[0]):
                out[f"{prefix}mlp.experts.local_experts.{e}.{rest[len('mlp.experts.experts.'):]}"] = value[e]
        else:
            out[prefix + inverse[pattern[index]].get(rest, rest)] = value
    for name, parts in split.items():
        order = ("z", "x", "B", "C", "dt") if name.endswith("in_proj.weight") else ("x", "B", "C")
        out[name] = torch.cat([parts[p] for p in order])
    return out
