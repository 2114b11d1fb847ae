"""The ``torch_dist`` state of a model and its optimizer, built on what the modules declare.

Model: each chunk's ``sharded_state_dict()`` (megatron.core: every module declares its tensors' checkpoint keys,
TP axes, stacked layer offsets, expert offsets and replicas), under ``model`` (``model0``, ``model1`` ... for
virtual-pipeline chunks, as Megatron-LM names them).

Optimizer state, per model tensor with the same sharding (the module's ShardedTensor or factory with another key
and the state tensor as data, megatron-core's ``make_sharded_optimizer_tensor``): ``optimizer.state.{exp_avg,
exp_avg_sq}.<key>`` (Adam; ``momentum_buffer`` for SGD) plus the fp32 master copy ``optimizer.state.fp32_param.<key>``
(mixed precision) for the plain optimizer; the distributed optimizer uses Megatron's ``fully_reshardable`` form
``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``: each parameter's pieces are gathered over the data-parallel
group (the ranges of all DP ranks are disjoint and summed by one all-reduce per kind). Without a master copy (fp32
training) the model weights are the master copy. The common state (``common.pt`` ``optimizer``) holds the param
groups without their params, ``state.common_step`` and the grad scaler.

``args`` in common.pt holds only values Megatron's ``weights_only`` loader accepts (:func:`safe_args`);
:func:`read_common` reads Megatron-LM's common.pt too (classes this package does not define become placeholders).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Optional

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingConfig, CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_items_iter
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                                      apply_factory_merges)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies.common import read_common_state_dict
from megatron.core.dist_checkpointing.strategies.torch import StorageRequest, to_storage
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params
from megatron.training.errors import FatalRunError

CHECKPOINT_VERSION = 3.0
METADATA = dataclasses.asdict(CheckpointingConfig("torch_dist", 1, "torch", 1))
_SAFE_SCALARS = (type(None), bool, int, float, str, torch.dtype)


class DistCheckpointError(FatalRunError):
    """A torch_dist checkpoint that cannot be used; the message names the directory or entry."""


# ------------------------------------------------------------------------------------------------ model
def model_sharded_state_dicts(model) -> Dict[str, dict]:
    """``{'model': chunk.sharded_state_dict()}``, or ``{'model0': ..., 'model1': ...}`` for virtual-pipeline chunks."""
    if len(model) == 1:
        return {"model": model[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(model)}


def model_sharded_state(model, args=None, for_load=False) -> Dict[str, object]:
    """The model part of the storage-level state (``{DCP key: [LocalShard] | [object]}``): main replicas to save;
    for loading, zero buffers of every block this rank needs (and the ``_extra_state`` objects)."""
    sharded, _, _ = load_preprocess(model_sharded_state_dicts(model))
    if for_load:
        return StorageRequest(sharded).items
    return to_storage(sharded)


def fill_request(sharded_state_dicts, items):
    """The nested state dict of ``sharded_state_dicts`` with every leaf replaced by what the storage request
    ``items`` read (entries whose key strictness dropped are left out), factories merged."""
    sharded, _, factories = load_preprocess(sharded_state_dicts)
    filled = StorageRequest(sharded).fill(sharded, items)
    _drop_unread(filled, factories)
    return apply_factory_merges(filled, factories)


def _drop_unread(filled, factories) -> None:
    """Remove the None values (keys strictness dropped, empty ``_extra_state`` objects) and the factories that lost
    a part."""
    for key in list(filled):
        sub = factories.get(key) if isinstance(factories, dict) else None
        if isinstance(sub, ShardedTensorFactory):
            parts = filled[key] if isinstance(filled[key], list) else [filled[key]]
            if any(p is None for p in parts):
                del filled[key], factories[key]
        elif filled[key] is None:
            del filled[key]
        elif isinstance(filled[key], dict):
            _drop_unread(filled[key], sub if isinstance(sub, dict) else {})


def apply_loaded_model(model, loaded, args=None, strict=True):
    """Copy the tensors read into ``loaded`` (the request of :func:`model_sharded_state` ``for_load``) into the
    model chunks."""
    state = fill_request(model_sharded_state_dicts(model), loaded)
    for i, chunk in enumerate(model):
        chunk.load_state_dict(state["model" if len(model) == 1 else f"model{i}"], strict=strict)


def safe_args(args) -> argparse.Namespace:
    """A copy of ``args`` with only values Megatron's ``torch.load(weights_only=True)`` accepts (None, bool, int,
    float, str, torch.dtype and lists/tuples/dicts of them); anything else (functions, classes) is left out."""
    def ok(v):
        if isinstance(v, _SAFE_SCALARS):
            return True
        if isinstance(v, (list, tuple)):
            return all(ok(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and ok(x) for k, x in v.items())
        return False
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if ok(v)})


def read_common(directory):
    """common.pt of a torch_dist checkpoint (ours or Megatron-LM's: unknown classes become placeholders)."""
    try:
        return read_common_state_dict(directory)
    except CheckpointingException as e:
        raise DistCheckpointError(str(e)) from e


# ------------------------------------------------------------------------------------------------ optimizer
def _state_keys(torch_optimizer) -> List[str]:
    name = type(torch_optimizer).__name__
    if "Adam" in name:
        return ["exp_avg", "exp_avg_sq"]
    if "SGD" in name:
        return ["momentum_buffer"]
    raise DistCheckpointError(f"--ckpt-format torch_dist does not know the state of the {name} optimizer")


def _main_params(optimizer):
    """{model param: (main tensor the torch optimizer updates, (start, end) in param.view(-1) or None)}."""
    if isinstance(optimizer, DistributedOptimizer):
        out = {}
        for param, (g, o) in optimizer.model_param_group_index_map.items():
            r = optimizer.param_ranges[param]
            out[param] = (optimizer.optimizer.param_groups[g]["params"][o], (r.param_start, r.param_end))
        return out
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        out = {}
        for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups):
            out.update({p: (m, None) for p, m in zip(model_group, main_group)})
        for group in optimizer.fp32_from_fp32_groups:
            out.update({p: (p, None) for p in group})
        return out
    if isinstance(optimizer, FP32Optimizer):
        return {p: (p, None) for group in optimizer.optimizer.param_groups for p in group["params"]}
    raise DistCheckpointError(f"--ckpt-format torch_dist cannot save a {type(optimizer).__name__}")


def _main_kind(optimizer) -> Optional[str]:
    """Megatron's name of the fp32 master copy: ``param`` (distributed optimizer), ``fp32_param`` (mixed
    precision), None (fp32 training: the model weights are the master copy)."""
    if isinstance(optimizer, DistributedOptimizer):
        return "param"
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        return "fp32_param"
    return None


def _optimizer_kinds(optimizer) -> List[str]:
    main = _main_kind(optimizer)
    return ([main] if main else []) + _state_keys(optimizer.optimizer)


def model_params(sharded_state_dicts) -> List[torch.nn.Parameter]:
    """The parameters behind the model's sharded leaves, each once, in the (rank-independent) order of the leaves."""
    seen, out = set(), []
    for _, _, leaf in nested_items_iter(sharded_state_dicts):
        data = getattr(leaf, "data", None)
        if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and isinstance(data, torch.nn.Parameter) \
                and id(data) not in seen:
            seen.add(id(data))
            out.append(data)
    return out


def optimizer_tensors(optimizer, params) -> Dict[str, Dict[int, torch.Tensor]]:
    """{kind: {id(param): fp32 tensor of the param's local (TP) shape}} of the optimizer state of ``params``.

    The distributed optimizer holds only a range of each parameter: the ranges of all DP ranks are summed (they
    are disjoint) with one all-reduce per kind.
    """
    mains = _main_params(optimizer)
    sharded = isinstance(optimizer, DistributedOptimizer)
    # The same list on every DP rank (the all-reduce below needs it): with the distributed optimizer a rank may
    # own no piece of some parameter, and contributes zeros for it.
    params = [p for p in params if p in mains or sharded and p.requires_grad]
    out = {}
    for kind in _optimizer_kinds(optimizer):
        pieces = []
        for param in params:
            main, rng = mains.get(param, (None, None))
            if main is None:
                src = None
            else:
                src = main if kind == _main_kind(optimizer) else optimizer.optimizer.state.get(main, {}).get(kind)
            full = torch.zeros(param.numel(), dtype=torch.float32)
            if src is not None:
                lo, hi = rng if rng is not None else (0, param.numel())
                full[lo:hi] = src.detach().float().view(-1)
            pieces.append(full)
        if sharded and pieces:
            # Expert parameters are sharded over the expert data-parallel group, the rest over DP.
            for expert in (False, True):
                index = [i for i, p in enumerate(params) if (not getattr(p, "allreduce", True)) == expert]
                if not index:
                    continue
                group = (parallel_state.get_expert_data_parallel_group() if expert
                         else parallel_state.get_data_parallel_group(with_context_parallel=True))
                flat = torch.cat([pieces[i] for i in index])
                torch.distributed.all_reduce(flat, group=group)
                for i, part in zip(index, torch.split(flat, [params[i].numel() for i in index])):
                    pieces[i] = part
        out[kind] = {id(p): full.view(p.shape) for p, full in zip(params, pieces)}
    return out


def optimizer_sharded_state(sharded_state_dicts, tensors: Dict[str, Dict[int, torch.Tensor]]):
    """``{kind: {path: leaf}}``: for every model leaf whose parameter has a ``kind`` tensor, that tensor under the
    key ``optimizer.state.{kind}.<model key>`` with the model leaf's sharding; ``path`` is the leaf's place in the
    model's sharded state dicts (``model/decoder.layers.0.mlp.linear_fc1.weight``)."""
    out = {}
    for kind, by_param in tensors.items():
        leaves = {}
        for chunk, sd in sharded_state_dicts.items():
            for name, leaf in sd.items():
                data = getattr(leaf, "data", None)
                if isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) and id(data) in by_param:
                    leaves[f"{chunk}/{name}"] = make_sharded_optimizer_tensor(leaf, by_param[id(data)],
                                                                              f"optimizer.state.{kind}.")
        out[kind] = leaves
    return out


def param_of_paths(sharded_state_dicts) -> Dict[str, torch.nn.Parameter]:
    """{path (as in :func:`optimizer_sharded_state`): parameter}."""
    return {f"{chunk}/{name}": leaf.data for chunk, sd in sharded_state_dicts.items() for name, leaf in sd.items()
            if isinstance(getattr(leaf, "data", None), torch.nn.Parameter)}


def optimizer_common(optimizer):
    """The optimizer's non-tensor state in common.pt, shaped as Megatron's class of the same kind writes it: the
    plain fp32 optimizer (``FP32Optimizer``) stores the torch optimizer's dict itself, ``{'state': {'common_step'},
    'param_groups'}``; the mixed-precision and distributed optimizers nest it, ``{'optimizer': {...}, 'grad_scaler'}``
    (plus ``param_state_sharding_type`` for the distributed one)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    inner = {"param_groups": groups, "state": {"common_step": int(getattr(optimizer, "_inner_steps", 0))}}
    if isinstance(optimizer, FP32Optimizer):
        return inner
    scaler = getattr(optimizer, "grad_scaler", None)
    common = {"optimizer": inner, "grad_scaler": scaler.state_dict() if scaler is not None else None}
    if isinstance(optimizer, DistributedOptimizer):
        common["param_state_sharding_type"] = "fully_reshardable"
    return common


def optimizer_load_kinds(optimizer, stored, directory):
    """(kinds to read, the master copy's kind in the checkpoint or None); one clear error for formats we cannot
    read. A checkpoint of the other optimizer flavour names the master copy differently (``param`` /
    ``fp32_param``); without one the master copy comes from the loaded weights."""
    if any(k.startswith("optimizer.distributed.") for k in stored):
        raise DistCheckpointError(
            f"{directory} holds the distributed optimizer in Megatron's dp_reshardable layout (keys "
            "optimizer.distributed.*), which this loader does not read: pass --no-load-optim (the optimizer "
            "starts fresh, the weights load), or re-save it in Megatron with --dist-ckpt-optim-fully-reshardable")
    kinds = _state_keys(optimizer.optimizer)
    main = None
    if _main_kind(optimizer) is not None:
        alt = [m for m in ("param", "fp32_param") if any(k.startswith(f"optimizer.state.{m}.") for k in stored)]
        main = alt[0] if alt else None
    return ([main] if main else []) + kinds, main


def optimizer_request_tensors(optimizer, params, kinds) -> Dict[str, Dict[int, torch.Tensor]]:
    """{kind: {id(param): fp32 zeros}} for the trainable parameters: what a load fills."""
    trainable = [p for p in params if p.requires_grad]
    return {kind: {id(p): torch.zeros(p.shape, dtype=torch.float32) for p in trainable} for kind in kinds}


def restore_optimizer_common(optimizer, common) -> int:
    """The param groups' hyper-parameters, the step count and the grad scaler from the common part (either
    nesting, :func:`optimizer_common`); returns the step."""
    inner = common["optimizer"] if "optimizer" in common else common  # nested (mixed precision, DO) or FP32Optimizer's
    saved_groups = inner["param_groups"]
    if len(saved_groups) != len(optimizer.optimizer.param_groups):
        raise DistCheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one has "
                                  f"{len(optimizer.optimizer.param_groups)}: pass --no-load-optim")
    for group, saved in zip(optimizer.optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    step = int(inner.get("state", {}).get("common_step", 0) or 0)
    optimizer._inner_steps = step
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is not None and common.get("grad_scaler") is not None:
        scaler.load_state_dict(common["grad_scaler"])
    return step


def load_optimizer_state(optimizer, loaded: Dict[str, Dict[str, torch.Tensor]], params_by_path, common, main_kind):
    """Restore ``optimizer`` from ``loaded`` (``{kind: {path: tensor of the param's shape}}``, as read for
    :func:`optimizer_sharded_state`) and the common part."""
    step = restore_optimizer_common(optimizer, common)
    mains = _main_params(optimizer)
    own_main = _main_kind(optimizer)
    adam = "Adam" in type(optimizer.optimizer).__name__
    first_path = {}
    for path, param in params_by_path.items():
        if param in mains:
            first_path.setdefault(id(param), (path, param))
    with torch.no_grad():
        for path, param in first_path.values():
            main, rng = mains[param]
            lo, hi = rng if rng is not None else (0, param.numel())
            state = optimizer.optimizer.state[main]

            def value(kind):
                try:
                    full = loaded[kind][path]
                except KeyError:
                    raise DistCheckpointError(f"the checkpoint holds no optimizer.state.{kind} for {path!r}: pass "
                                              "--no-load-optim") from None
                return full.reshape(-1)[lo:hi].view(main.shape)

            if own_main is not None:
                source = value(main_kind) if main_kind else param.detach().reshape(-1)[lo:hi].view(main.shape)
                main.copy_(source.to(main.dtype))
            for kind in _state_keys(optimizer.optimizer):
                state[kind] = value(kind).to(main.dtype).clone()
            if adam:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer._copy_main_params_to_model_params()  # all-gathers the shards into the model params
