"""Offline conversion of whole training states (model, optimizer, scheduler, RNG, iteration) between the
``torch_dist``, ``fsdp_dtensor`` and ``torch_dcp`` formats, for tools/checkpoint/convert.py.

Every reader returns a :class:`FullState`: tensors under megatron-core module names (layers numbered, experts by
global index as SequentialMLP's ``local_experts.{e}``, a gated ``linear_fc1`` as one ``[gate; up]`` tensor, all
tensor-parallel merged), optimizer state per kind under the same names, and the common state. Model tensors are
the fp32 main weights when the source has them (torch_dist's ``fp32_param`` / ``param`` kinds; fsdp_dtensor and
torch_dcp store main weights as the model). Every writer takes one. So resuming after a conversion continues the
same training (the next losses equal those of the source run resumed in its own format).

Layouts written: torch_dist as tools/checkpoint/dist_io.py (plus ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}
.<key>``, the optimizer's common part, RNG objects ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``); fsdp_dtensor and
torch_dcp as megatron/training/checkpointing/{fsdp_dtensor,torch_dcp}.py. A param group's members, which only
fsdp_dtensor and torch_dcp record, come from Megatron's default rule when the source is torch_dist (no weight decay
for biases and 1-D tensors: group 1, others group 0, when the source has those two groups).
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp

from megatron.core.dist_checkpointing.sharded_io import LocalShard, load_full_state_dict, save_sharded
from megatron.core.transformer.fsdp_dtensor_checkpoint import (GATE_SUFFIX, MODEL_PREFIX, OPTIMIZER_STATE_PREFIX,
                                                               PARAM_GROUP_META_PREFIX, UP_SUFFIX,
                                                               grouped_to_sequential_name, is_gated_fc1,
                                                               sequential_to_grouped_name)
from tools.checkpoint.legacy_io import ConversionError, read_tracker

CHECKPOINT_VERSION = 3.0
_RNG_OBJECT = re.compile(r"^rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")
_COMMON = ("args", "iteration", "opt_param_scheduler", "num_floating_point_operations_so_far")


@dataclass
class FullState:
    model: Dict[str, torch.Tensor]
    optimizer: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)  # kind -> name -> tensor
    param_groups: Optional[List[dict]] = None  # hyper-parameters and "step", no params
    group_of: Dict[str, int] = field(default_factory=dict)  # name -> param group index
    common: dict = field(default_factory=dict)  # args, iteration, opt_param_scheduler, flops
    rng: Dict[str, list] = field(default_factory=dict)  # "(pp, tp)" -> Megatron's list of RNG state dicts


def iteration_dir(load_dir: str) -> str:
    iteration, release = read_tracker(load_dir)
    return os.path.join(load_dir, "release" if release else "iter_{:07d}".format(iteration))


def detect_dcp_format(iter_dir: str) -> Optional[str]:
    """fsdp_dtensor or torch_dcp for a DCP directory without torch_dist's metadata.json; None otherwise."""
    if os.path.isfile(os.path.join(iter_dir, "metadata.json")) or not os.path.isfile(os.path.join(iter_dir, ".metadata")):
        return None
    keys = dcp.FileSystemReader(iter_dir).read_metadata().state_dict_metadata
    return "fsdp_dtensor" if any(k.startswith(MODEL_PREFIX) for k in keys) else "torch_dcp"


def default_group_of(model: Dict[str, torch.Tensor], num_groups: int) -> Dict[str, int]:
    """Megatron's default param groups (decayed first, then biases and 1-D tensors without weight decay)."""
    no_wd = {name: name.endswith(".bias") or t.dim() == 1 for name, t in model.items()}
    if num_groups == 1:
        return {name: 0 for name in model}
    if num_groups != 2:
        raise ConversionError(f"the source optimizer has {num_groups} param groups; without a record of their members "
                              "(torch_dist) only Megatron's default two groups can be rebuilt")
    return {name: int(flag) for name, flag in no_wd.items()}


def _merge_halves(flat: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """fsdp_dtensor's ``<name>_w`` / ``<name>_v`` pairs back into one ``[gate; up]`` tensor; grouped experts'
    ``mlp.experts.linear_fc1.weight{e}`` under SequentialMLP's ``mlp.experts.local_experts.{e}.linear_fc1.weight``."""
    out = {}
    for key, value in flat.items():
        if key.endswith(UP_SUFFIX) and key[:-2] + GATE_SUFFIX in flat and is_gated_fc1(key[:-2]):
            continue
        if key.endswith(GATE_SUFFIX) and is_gated_fc1(key[:-2]):
            out[grouped_to_sequential_name(key[:-2])] = torch.cat([value, flat[key[:-2] + UP_SUFFIX]])
        else:
            out[grouped_to_sequential_name(key)] = value
    return out


# ------------------------------------------------------------------------------------------------ readers
def read_torch_dist(iter_dir: str) -> FullState:
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint.dist_io import unstack

    ckpt = load_full_checkpoint(iter_dir)
    if ckpt.get("args") is None:
        raise ConversionError(f"{iter_dir}/common.pt holds no 'args': the converter needs the model's shape")
    kinds = {kind: unstack(tensors, ckpt["args"]) for kind, tensors in ckpt["optimizer_state"].items()}
    model = unstack(ckpt["model"], ckpt["args"])
    for main in ("fp32_param", "param"):  # the fp32 master weights are the model here
        if main in kinds:
            model.update({k: v.float() for k, v in kinds.pop(main).items()})
            break
    state = FullState(model=model, optimizer=kinds, common={k: ckpt[k] for k in _COMMON if k in ckpt})
    opt = ckpt.get("optimizer")
    if opt is not None:
        inner = opt["optimizer"] if "optimizer" in opt else opt
        step = int(inner.get("state", {}).get("common_step", 0) or 0)
        state.param_groups = [dict(g, step=step) for g in inner["param_groups"]]
        state.group_of = default_group_of(model, len(state.param_groups))
    for key, value in ckpt["rng_state"].items():
        m = _RNG_OBJECT.match(key)
        if m:
            state.rng[f"({m.group(1)}, {m.group(2)})"] = value[0]
    return state


def read_fsdp_dtensor(iter_dir: str) -> FullState:
    flat = load_full_state_dict(iter_dir)
    model = _merge_halves({k[len(MODEL_PREFIX):]: v for k, v in flat.items() if k.startswith(MODEL_PREFIX)})
    kinds: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith(OPTIMIZER_STATE_PREFIX):
            name, kind = key[len(OPTIMIZER_STATE_PREFIX):].rsplit(".", 1)
            kinds.setdefault(kind, {})[name] = value
    state = FullState(model=model, optimizer={k: _merge_halves(v) for k, v in kinds.items()},
                      param_groups=flat.get("optimizer.param_groups"),
                      common={k: flat[k] for k in _COMMON if k in flat}, rng=flat.get("rng_state") or {})
    state.group_of = {grouped_to_sequential_name(key[len(PARAM_GROUP_META_PREFIX):]): meta["group_index"]
                      for key, meta in flat.items() if key.startswith(PARAM_GROUP_META_PREFIX) and meta is not None}
    return state


def read_torch_dcp(iter_dir: str) -> FullState:
    flat = load_full_state_dict(iter_dir)
    model = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.") and torch.is_tensor(v)}
    kinds: Dict[str, Dict[str, torch.Tensor]] = {}
    steps = []
    for key, value in flat.items():
        if key.startswith("optimizer.state."):
            name, kind = key[len("optimizer.state."):].rsplit(".", 1)
            if kind == "step":
                steps.append(float(value))
            else:
                kinds.setdefault(kind, {})[name] = value
    groups: Dict[int, dict] = {}
    for key, value in flat.items():
        if key.startswith("optimizer.param_groups."):
            index, name = key[len("optimizer.param_groups."):].split(".", 1)
            groups.setdefault(int(index), {})[name] = value
    state = FullState(model=model, optimizer=kinds, common={k: flat[k] for k in _COMMON if k in flat})
    if groups:
        state.param_groups = []
        for index in sorted(groups):
            group = groups[index]
            for name in group.pop("params", []):
                state.group_of[name] = index
            state.param_groups.append(dict(group, step=int(max(steps)) if steps else 0))
    paths = dcp.FileSystemReader(iter_dir).read_metadata().planner_data or {}
    nested = _unflatten({k: v for k, v in flat.items() if k.startswith("rng_state.")}, paths)
    state.rng = nested.get("rng_state", {})
    return state


def _unflatten(flat: Dict[str, object], paths: Dict[str, tuple]) -> dict:
    """Nested dicts / lists back from DCP's flattened keys (``paths``: the save planner's key -> path tuples)."""
    root: dict = {}
    for key, value in flat.items():
        path = paths.get(key, tuple(key.split(".")))
        node = root
        for step, following in zip(path[:-1], path[1:]):
            empty = [] if isinstance(following, int) else {}
            if isinstance(node, list):
                while len(node) <= step:
                    node.append(None)
                node[step] = node[step] if node[step] is not None else empty
                node = node[step]
            else:
                node = node.setdefault(step, empty)
        if isinstance(node, list):
            while len(node) <= path[-1]:
                node.append(None)
        node[path[-1]] = value
    return root


READERS = {"torch_dist": read_torch_dist, "fsdp_dtensor": read_fsdp_dtensor, "torch_dcp": read_torch_dcp}


# ------------------------------------------------------------------------------------------------ writers
def _args_for(state: FullState, fmt: str):
    args = copy.deepcopy(state.common.get("args"))
    if args is None:
        raise ConversionError("the source checkpoint holds no 'args': the converter needs the model's shape")
    args.ckpt_format = fmt
    args.use_mcore_models = True
    return args


def _finish(save_dir: str, iteration: int):
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def write_torch_dist(state: FullState, save_dir: str):
    from tools.checkpoint.dist_io import save_dist

    args = _args_for(state, "torch_dist")
    optimizer = dict(state.optimizer)
    if state.optimizer:
        optimizer["fp32_param"] = {k: v.float() for k, v in state.model.items()}  # exact main weights in bf16 runs
    common = {k: v for k, v in state.common.items() if k != "args"}
    if state.param_groups is not None:
        step = max((int(g.get("step", 0)) for g in state.param_groups), default=0)
        common["optimizer"] = {"param_groups": [{k: v for k, v in g.items() if k != "step"} for g in state.param_groups],
                               "state": {"common_step": step}}
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    objects = {}
    for key, states in state.rng.items():
        p, t = (int(x) for x in key.strip("()").split(","))
        objects[f"rng_state/shard_{p}.{t}_{pp}.{tp}"] = [states]
    save_dist(state.model, args, save_dir, tp, pp, int(state.common.get("iteration", 0)), optimizer=optimizer,
              common=common, objects=objects)


def _split(name: str, tensor: torch.Tensor, gated: bool, grouped: bool) -> Dict[str, torch.Tensor]:
    if grouped:
        name = sequential_to_grouped_name(name)
    if gated and is_gated_fc1(name):
        gate, up = torch.chunk(tensor, 2)
        return {name + GATE_SUFFIX: gate, name + UP_SUFFIX: up}
    return {name: tensor}


def _whole(tensor: torch.Tensor) -> LocalShard:
    return LocalShard(tensor.contiguous(), tuple(tensor.shape), (0,) * tensor.dim())


def write_fsdp_dtensor(state: FullState, save_dir: str):
    args = _args_for(state, "fsdp_dtensor")
    args.use_megatron_fsdp = True
    gated = bool(getattr(args, "swiglu", False))
    grouped = bool(getattr(args, "moe_grouped_gemm", False))  # Megatron's grouped expert names (TEGroupedMLP's)
    iteration = int(state.common.get("iteration", 0))
    out: Dict[str, object] = {**{k: v for k, v in state.common.items()}, "args": args,
                              "checkpoint_version": CHECKPOINT_VERSION,
                              "content_metadata": {"distrib_optim_sharding_type": "fsdp_dtensor"}, "rng_state": state.rng}
    for name, tensor in state.model.items():
        out.update({MODEL_PREFIX + k: _whole(v.float()) for k, v in _split(name, tensor, gated, grouped).items()})
    for kind, tensors in state.optimizer.items():
        for name, tensor in tensors.items():
            out.update({f"{OPTIMIZER_STATE_PREFIX}{k}.{kind}": _whole(v)
                        for k, v in _split(name, tensor, gated, grouped).items()})
    if state.param_groups is not None:
        out["optimizer.param_groups"] = state.param_groups
        for name in state.model:
            group = state.param_groups[state.group_of[name]]
            key = sequential_to_grouped_name(name) if grouped else name
            out[PARAM_GROUP_META_PREFIX + key] = {"group_index": state.group_of[name],
                                                   **{k: group[k] for k in ("wd_mult", "lr_mult") if k in group}}
    directory = os.path.join(save_dir, "iter_{:07d}".format(iteration))
    os.makedirs(directory, exist_ok=True)
    save_sharded(out, directory, no_dist=True)
    _finish(save_dir, iteration)


def write_torch_dcp(state: FullState, save_dir: str):
    args = _args_for(state, "torch_dcp")
    if args.tensor_model_parallel_size != 1 or args.pipeline_model_parallel_size != 1:
        args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1  # torch_dcp loads at TP = PP = 1
    iteration = int(state.common.get("iteration", 0))
    out: Dict[str, object] = {**state.common, "args": args, "checkpoint_version": CHECKPOINT_VERSION,
                              "model": {k: v.float() for k, v in state.model.items()},
                              "rng_state": dict(state.rng)}
    if state.param_groups is not None:
        step = max((int(g.get("step", 0)) for g in state.param_groups), default=0)
        groups = []
        for index, group in enumerate(state.param_groups):
            groups.append({**{k: v for k, v in group.items() if k != "step"},
                           "params": [n for n in state.model if state.group_of.get(n) == index]})
        per_param = {name: {kind: tensors[name] for kind, tensors in state.optimizer.items() if name in tensors}
                     for name in state.model}
        for entry in per_param.values():
            entry["step"] = torch.tensor(float(step))
        out["optimizer"] = {"state": per_param, "param_groups": groups}
    directory = os.path.join(save_dir, "iter_{:07d}".format(iteration))
    os.makedirs(directory, exist_ok=True)
    dcp.save(out, storage_writer=dcp.FileSystemWriter(directory, thread_count=1), no_dist=True)
    _finish(save_dir, iteration)


WRITERS = {"torch_dist": write_torch_dist, "fsdp_dtensor": write_fsdp_dtensor, "torch_dcp": write_torch_dcp}


def convert_state(loader: str, saver: str, load_dir: str, save_dir: str) -> FullState:
    """Read the checkpoint the tracker of ``load_dir`` names in ``loader``'s format, write it in ``saver``'s."""
    directory = iteration_dir(load_dir)
    state = READERS[loader](directory)
    if not state.model:
        raise ConversionError(f"{directory} holds no model tensors of the {loader} format")
    WRITERS[saver](state, save_dir)
    return state
