"""``torch_dist`` keys of hybrid (Mamba) models, as megatron-core writes them.

Hybrid stacks are never stacked: layer ``i`` (global, 0-based) is stored under ``decoder.layers.{i}.<name>``
without a layer axis, whatever the pipeline layout. Per layer type, the module's names become Megatron's
Transformer-Engine names (the pre-norm is fused into the following linear layer)::

    M  norm.weight               -> mixer.in_proj.layer_norm_weight
    *  input_layernorm.weight    -> self_attention.linear_qkv.layer_norm_weight
    -  pre_mlp_layernorm.weight  -> mlp.linear_fc1.layer_norm_weight
    E  pre_mlp_layernorm.weight     (kept: the MoE layer's norm is a separate module)

The mixer's ``in_proj.weight`` is five tensors ``mixer.in_proj.weight.{z,x,B,C,dt}`` (global ``[d_inner, h]``,
``[d_inner, h]``, ``[GN, h]``, ``[GN, h]``, ``[H, h]``), each split over TP on axis 0 (a rank's local rows are
``[z_r; x_r; B_r; C_r; dt_r]``); ``conv1d.{weight,bias}`` are ``.x``, ``.B``, ``.C`` likewise; ``A_log``, ``D``,
``dt_bias`` and ``norm.weight`` are split on axis 0, ``out_proj.weight`` on axis 1. The checkpoint therefore does
not depend on TP. Experts of an ``E`` layer: ``decoder.layers.{i}.mlp.experts.experts.linear_fc{1,2}.weight``
``[E, ...]`` (expert axis only). Each linear layer has an empty ``_extra_state`` object
``decoder.layers.{i}.<linear>._extra_state/shard_0_1`` (experts: ``shard_{e}_{E}``).
"""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional

import torch

from megatron.training.checkpointing import dist_keys

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_NORM_RENAMES = {"M": {"norm.weight": "mixer.in_proj.layer_norm_weight"},
                 "*": {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"},
                 "-": {"pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"},
                 "E": {}}
_LINEARS = {"M": ("mixer.in_proj", "mixer.out_proj"),
            "*": ("self_attention.linear_qkv", "self_attention.linear_proj"),
            "-": ("mlp.linear_fc1", "mlp.linear_fc2"),
            "E": ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2", "mlp.fc1_latent_proj",
                  "mlp.fc2_latent_proj")}
_ALL_LINEARS = tuple(sorted({name for names in _LINEARS.values() for name in names}))
_SPLIT = {"mixer.in_proj.weight": "in_proj", "mixer.conv1d.weight": "conv", "mixer.conv1d.bias": "conv"}


def is_hybrid(chunk) -> bool:
    return getattr(chunk, "hybrid_layer_pattern", None) is not None


def _parts(dims, which: str):
    return dims.in_proj_parts if which == "in_proj" else dims.conv_parts


def _renamed(symbol: str, rest: str) -> str:
    return _NORM_RENAMES[symbol].get(rest, rest)


def hybrid_entries(chunk, tied: bool, expert_entries) -> List[dist_keys.Entry]:
    """Every tensor of a MambaModel chunk as :class:`dist_keys.Entry` objects (keys of the module docstring).

    ``expert_entries(name, value, param)`` gives the stacked-format entries of an expert tensor (or None);
    they are re-keyed per layer here.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(chunk.named_parameters())
    decoder = chunk.decoder
    out = []
    for name, value in chunk.state_dict().items():
        if value is None or name.endswith("_extra_state"):
            continue
        param = params.get(name)
        m = _LAYER.match(name)
        if not m:
            out.append(dist_keys.Entry(name, dist_keys.disk_key(name, 0, tied)[0], None, value, param,
                                       _tp_dim(param)))
            continue
        local, rest = int(m.group(1)), m.group(2)
        layer = decoder.layers[local]
        index, symbol = layer.layer_number - 1, decoder.layer_type_list[local]
        prefix = f"decoder.layers.{index}."
        experts = expert_entries(name, value, param) if ".mlp.experts." in name else None
        if experts is not None:
            for e in experts:
                linear_key = e.key.split(".layers.", 1)[1]
                out.append(dist_keys.Entry(e.local_name, prefix + linear_key, None, e.tensor, e.param, e.tp_dim,
                                           e.expert, e.num_experts, e.etp, e.view))
            continue
        if rest in _SPLIT:
            start = 0
            for part, size in _parts(layer.mixer.dims, _SPLIT[rest]):
                rows = slice(start, start + size // tp)
                view = (lambda t, rows=rows: t[rows])
                out.append(dist_keys.Entry(name, f"{prefix}{rest}.{part}", None, view(value), param, 0, view=view))
                start += size // tp
            continue
        out.append(dist_keys.Entry(name, prefix + _renamed(symbol, rest), None, value, param, _tp_dim(param)))
    return out


def _tp_dim(param) -> Optional[int]:
    if param is not None and getattr(param, "tensor_model_parallel", False):
        return param.partition_dim
    return None


def extra_state_keys(stored_keys: Iterable[str], num_experts: int) -> List[str]:
    """The empty ``_extra_state`` objects of the linear layers whose weights are among ``stored_keys`` (on-disk
    keys; module docstring)."""
    keys = []
    for key in stored_keys:
        m = _LAYER.match(key)
        if not m:
            continue
        prefix, rest = f"decoder.layers.{m.group(1)}.", m.group(2)
        for linear in _ALL_LINEARS:
            if rest in (f"{linear}.weight", f"{linear}.weight.z"):
                keys.append(f"{prefix}{linear}._extra_state/shard_0_1")
        if rest in tuple(f"{linear}.weight" for linear in dist_keys.EXPERT_LINEARS):
            keys.extend(f"{prefix}{rest[:-len('.weight')]}._extra_state/shard_{e}_{num_experts}"
                        for e in range(num_experts))
    return keys


# ------------------------------------------------------------------ offline (tools/checkpoint, TP = 1, one process)
def full_to_disk(full: Dict[str, torch.Tensor], pattern: str, dims, tied: bool) -> Dict[str, torch.Tensor]:
    """A full (TP = 1, SequentialMLP) MambaModel state dict -> {on-disk key: tensor} (experts ``[E, ...]``)."""
    out, experts = {}, {}
    expert_name = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
    for name, value in full.items():
        if name.endswith("_extra_state"):
            continue
        m = _LAYER.match(name)
        if not m:
            key = dist_keys.disk_key(name, 0, tied)[0]
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
