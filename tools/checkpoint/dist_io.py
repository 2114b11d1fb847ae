"""Offline reader and writer of Megatron-LM ``torch_dist`` checkpoints for tools/checkpoint/convert.py.

The reader returns the full (unsharded) megatron-core state dict: stacked layer tensors ``[L, ...]`` are split back
into ``decoder.layers.{i}.…`` with the module names of tools.checkpoint.dist_keys (unstacked layers of a
heterogeneous stack and MTP depths are read under their own keys, experts along their expert axis). The writer does
the reverse in one process: every tensor is one chunk covering its whole global shape (the format is
TP/PP-independent), plus an empty ``_extra_state`` object per linear layer, ``common.pt`` (args, checkpoint_version
3.0, iteration, content_metadata), ``metadata.json`` and the tracker file. No optimizer or RNG state is written.
"""
from __future__ import annotations

import copy
import json
import os
import re
from typing import Dict, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.sharded_io import LocalShard, save_sharded
from megatron.core.models.conversion.keys import legacy_to_mcore
from tools.checkpoint import dist_hybrid, dist_keys
from megatron.training.checkpointing.dist_state import CHECKPOINT_VERSION, METADATA, DistCheckpointError, safe_args
from megatron.training.checkpointing.torch_dist import load_full_checkpoint
from tools.checkpoint.legacy_io import ConversionError, is_t5, read_tracker, stack_layer_counts


_EXPERT_KEY = re.compile(r"^((?:decoder|encoder)\.layers)\.mlp\.experts\.experts\.(linear_fc[12]\.(?:weight|bias))$")
_LOCAL_EXPERT_NAME = re.compile(r"^((?:decoder|encoder)\.layers)\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\."
                                r"(linear_fc[12]\.(?:weight|bias))$")
# An unstacked layer's experts (a heterogeneous stack's layer, an MTP depth): [E, ...] under the layer's own key.
_UNSTACKED_EXPERT_KEY = re.compile(r"^((?:decoder|encoder)\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)"
                                   r"\.mlp\.experts\.experts\.(linear_fc[12]\.(?:weight|bias))$")
_UNSTACKED_EXPERT_NAME = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.local_experts\.(\d+)\."
                                    r"(linear_fc[12]\.(?:weight|bias))$")


def is_dist_checkpoint(load_dir: str) -> bool:
    try:
        iteration, release = read_tracker(load_dir)
    except (ConversionError, OSError):
        return False
    iter_dir = os.path.join(load_dir, "release" if release else "iter_{:07d}".format(iteration))
    return os.path.isfile(os.path.join(iter_dir, "metadata.json"))


def load_dist(load_dir: str) -> Tuple[Dict[str, torch.Tensor], object, dict]:
    """(full megatron-core state dict, the checkpoint's args, info {'iteration', 'release', 'tp', 'pp'})."""
    iteration, release = read_tracker(load_dir)
    iter_dir = os.path.join(load_dir, "release" if release else "iter_{:07d}".format(iteration))
    if not os.path.isfile(os.path.join(iter_dir, "metadata.json")):
        raise ConversionError(f"{iter_dir} is not a torch_dist checkpoint (no metadata.json): use --loader legacy")
    try:
        ckpt = load_full_checkpoint(iter_dir)
    except DistCheckpointError as e:
        raise ConversionError(str(e)) from e
    args = ckpt.get("args")
    if args is None:
        raise ConversionError(f"{iter_dir}/common.pt holds no 'args': the converter needs the model's shape")
    args = copy.deepcopy(args)
    args.use_mcore_models = True  # the names below are megatron-core's
    info = {"iteration": ckpt.get("iteration", iteration), "release": release,
            "tp": getattr(args, "tensor_model_parallel_size", 1), "pp": getattr(args, "pipeline_model_parallel_size", 1)}
    if getattr(args, "hybrid_layer_pattern", None):  # per-layer keys (dist_hybrid)
        return dist_hybrid.disk_to_full(ckpt["model"], hybrid_layers(args)), args, info
    return unstack(ckpt["model"], args), args, info


def unstack(stacked: Dict[str, torch.Tensor], args) -> Dict[str, torch.Tensor]:
    """torch_dist tensors (Megatron's keys, layers stacked ``[L, ...]``, experts ``[L, E, ...]``) under their
    megatron-core module names (``decoder.layers.{i}.…``, experts as SequentialMLP's global ``local_experts.{e}``)."""
    full = {}
    t5 = any(".cross_attention." in key for key in stacked)
    layout = dist_keys.layout_of(args)
    for key, value in stacked.items():
        if t5 and key in dist_keys.T5_ALIAS_KEYS:
            continue  # megatron-core T5's second copy of embedding.position_embeddings / lm_head.output_layer.bias
        unstacked = _UNSTACKED_EXPERT_KEY.match(key)
        if unstacked:  # [E, ...] -> SequentialMLP names (EP = 1)
            for e in range(value.shape[0]):
                full[f"{unstacked.group(1)}.mlp.experts.local_experts.{e}.{unstacked.group(2)}"] = value[e].clone()
            continue
        if key.startswith("mtp.layers.") or re.match(r"^(?:decoder|encoder)\.layers\.\d+\.", key):
            full[dist_keys.module_name(key, None, layout)] = value  # an unstacked layer's tensor
            continue
        expert = _EXPERT_KEY.match(key)
        if expert:  # [L, E, ...] -> SequentialMLP names (EP = 1)
            for layer in range(value.shape[0]):
                for e in range(value.shape[1]):
                    full[f"{expert.group(1)}.{layer}.mlp.experts.local_experts.{e}.{expert.group(2)}"] = \
                        value[layer, e].clone()
        elif ".layers." in key:
            for layer in range(value.shape[0]):
                full[dist_keys.module_name(key, layer, layout)] = value[layer].clone()
        else:
            full[key] = value
    return full


def hybrid_layers(args) -> str:
    """The layer symbols of a hybrid model's ``args`` (its pattern without pipeline boundaries)."""
    from megatron.core.ssm.mamba_hybrid_layer_allocation import parse_hybrid_pattern

    return parse_hybrid_pattern(args.hybrid_layer_pattern).layers


def _hybrid_state(full, args) -> dict:
    """{key: LocalShard or [None]} of a hybrid model (dist_hybrid's keys, one chunk per tensor)."""
    import types

    from megatron.core.ssm.mamba_mixer import mamba_dims

    dims = mamba_dims(types.SimpleNamespace(
        hidden_size=args.hidden_size, mamba_head_dim=args.mamba_head_dim, mamba_num_groups=args.mamba_num_groups,
        mamba_num_heads=args.mamba_num_heads, mamba_state_dim=args.mamba_state_dim, tensor_model_parallel_size=1))
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    stored = dist_hybrid.full_to_disk(full, hybrid_layers(args), dims, tied)
    state = {key: LocalShard(v.contiguous(), tuple(v.shape), (0,) * v.dim()) for key, v in stored.items()}
    for key in dist_hybrid.extra_state_keys(stored, getattr(args, "num_experts", None) or 0):
        state[key] = [None]
    return state


def save_dist(full: Dict[str, torch.Tensor], args, save_dir: str, tp: int, pp: int, iteration: int,
              release: bool = False, optimizer: Optional[Dict[str, Dict[str, torch.Tensor]]] = None,
              common: Optional[dict] = None, objects: Optional[dict] = None) -> None:
    """Write ``full`` (legacy or megatron-core names, per ``args.use_mcore_models``) as a torch_dist checkpoint;
    ``optimizer`` ({kind: {name: tensor}}, megatron-core names) is stacked the same way under
    ``optimizer.state.<kind>.<key>``, ``common`` is added to common.pt, ``objects`` ({key: value}) are written as
    DCP objects (the RNG states)."""
    if getattr(args, "hybrid_layer_pattern", None):
        if optimizer:
            raise ConversionError("hybrid (Mamba) checkpoints convert with their model state only")
        _write(_hybrid_state(full, args), args, save_dir, tp, pp, iteration, release)
        return
    t5 = is_t5(full)
    if not getattr(args, "use_mcore_models", False):
        full = legacy_to_mcore(full, "t5" if t5 else "gpt")
    state = stack(full, args, t5)
    for kind, tensors in (optimizer or {}).items():
        stacked = stack(tensors, args, t5, extra_state=False)
        state.update({f"optimizer.state.{kind}.{key}": value for key, value in stacked.items()})
    state.update(objects or {})
    _write(state, args, save_dir, tp, pp, iteration, release, common)


def stack(full: Dict[str, torch.Tensor], args, t5: bool, extra_state: bool = True) -> Dict[str, object]:
    """The inverse of :func:`unstack`: ``{torch_dist key: LocalShard of the whole tensor}`` (plus the empty
    ``_extra_state`` objects of the linear layers when ``extra_state``)."""
    tied = not getattr(args, "untie_embeddings_and_output_weights", False)
    layout = dist_keys.layout_of(args)
    counts = {prefix[:-1]: n for prefix, n in stack_layer_counts(args, full).items()}  # 'decoder.layers' -> L
    stacked: Dict[str, Dict[int, torch.Tensor]] = {}
    state = {}
    experts: Dict[str, Dict[Tuple[int, int], torch.Tensor]] = {}
    unstacked_experts: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, value in full.items():
        if name.endswith("_extra_state") or (t5 and name.startswith(dist_keys.T5_ALIASES)):
            continue
        m = _LOCAL_EXPERT_NAME.match(name)
        if m and layout.per_layer:  # expert e of layer i -> [E, ...] under the layer's own key
            unstacked_experts.setdefault(f"{m.group(1)}.{m.group(2)}.mlp.experts.experts.{m.group(4)}", {})[
                int(m.group(3))] = value
            continue
        if m:  # expert e of layer i -> [L, E, ...] under Megatron's expert key
            experts.setdefault(f"{m.group(1)}.mlp.experts.experts.{m.group(4)}", {})[
                (int(m.group(2)), int(m.group(3)))] = value
            continue
        m = _UNSTACKED_EXPERT_NAME.match(name)
        if m:  # an MTP depth's expert e
            unstacked_experts.setdefault(f"{m.group(1)}.mlp.experts.experts.{m.group(3)}", {})[int(m.group(2))] = value
            continue
        key, layer = dist_keys.disk_key(name, 0, tied, layout)
        if layer is None:
            if key not in state:
                state[key] = LocalShard(value.contiguous(), tuple(value.shape), (0,) * value.dim())
                extra = dist_keys.unstacked_extra_state_key(key) if extra_state else None
                if extra is not None:
                    state[extra] = [None]
        else:
            stacked.setdefault(key, {})[layer] = value
    if t5:  # megatron-core's T5Model reads (and writes) its aliases too
        for alias, target in dist_keys.T5_ALIAS_KEYS.items():
            if target in state:
                state[alias] = state[target]
        if "lm_head.output_layer.bias" in state and extra_state:
            for key in dist_keys.t5_head_extra_state_keys():
                state[key] = [None]
    for key, layers in stacked.items():
        num_layers = counts[key.split(".layers.", 1)[0] + ".layers"]
        if sorted(layers) != list(range(num_layers)):
            raise ConversionError(f"{key}: found layers {sorted(layers)}, args.num_layers is {num_layers}")
        value = torch.stack([layers[i] for i in range(num_layers)])
        state[key] = LocalShard(value, tuple(value.shape), (0,) * value.dim())
        block, rest = key.split(".layers.", 1)
        linear = dist_keys.linear_of_weight(rest) if extra_state else None
        if linear is not None:
            for layer in range(num_layers):
                state[dist_keys.extra_state_key(f"{block}.layers", linear, layer, num_layers)] = [None]
    for key, pieces in experts.items():
        num_experts = 1 + max(e for _, e in pieces)
        if sorted(pieces) != [(i, e) for i in range(num_layers) for e in range(num_experts)]:
            raise ConversionError(f"{key}: expected {num_experts} experts in each of {num_layers} layers")
        value = torch.stack([torch.stack([pieces[(i, e)] for e in range(num_experts)]) for i in range(num_layers)])
        state[key] = LocalShard(value, tuple(value.shape), (0,) * value.dim())
        block, linear = key.split(".layers.", 1)[0] + ".layers", key.split(".layers.", 1)[1].rsplit(".", 1)[0]
        if key.endswith(".weight") and extra_state:
            for layer in range(num_layers):
                for e in range(num_experts):
                    state[dist_keys.expert_extra_state_key(block, linear, layer, e, num_layers, num_experts)] = [None]
    for key, pieces in unstacked_experts.items():
        num_experts = 1 + max(pieces)
        if sorted(pieces) != list(range(num_experts)):
            raise ConversionError(f"{key}: expected experts 0..{num_experts - 1}, found {sorted(pieces)}")
        value = torch.stack([pieces[e] for e in range(num_experts)])
        state[key] = LocalShard(value, tuple(value.shape), (0,) * value.dim())
        if key.endswith(".weight") and extra_state:
            for e in range(num_experts):
                state[dist_keys.unstacked_extra_state_key(key, e, num_experts)] = [None]
    return state


def _write(state, args, save_dir, tp, pp, iteration, release, common: Optional[dict] = None) -> None:
    """The shards, common.pt (args, version, iteration, and ``common``), metadata.json and the tracker file."""
    iter_dir = os.path.join(save_dir, "release" if release else "iter_{:07d}".format(iteration))
    os.makedirs(iter_dir, exist_ok=True)
    save_sharded(state, iter_dir, no_dist=True)
    out_args = safe_args(args)
    out_args.tensor_model_parallel_size, out_args.pipeline_model_parallel_size = tp, pp
    out_args.ckpt_format = "torch_dist"
    torch.save({"args": out_args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                "num_floating_point_operations_so_far": 0.0,
                "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
                **(common or {})}, os.path.join(iter_dir, "common.pt"))
    with open(os.path.join(iter_dir, "metadata.json"), "w") as f:
        json.dump(METADATA, f)
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release" if release else str(iteration))
