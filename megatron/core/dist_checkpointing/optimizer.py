"""Optimizer states with the sharding of their parameters (megatron-core's ``dist_checkpointing.optimizer``).

A state tensor of a parameter (Adam's ``exp_avg`` ...) has the parameter's shape, so it is saved with the
parameter's ShardedTensor / factory, under another key (``optimizer.state.exp_avg.<param key>``): the optimizer
state reshards on load exactly like the weights.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterable

import torch

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> Dict[int, int]:
    """``{id(param): index}`` in the order of the optimizer's parameters (the ids of its state dict)."""
    return {id(param): index for index, param in enumerate(optim_params_iter)}


def get_param_id_to_sharded_param_map(model_sharded_state_dict: ShardedStateDict,
                                      optim_params_iter: Iterable[torch.nn.Parameter]) -> Dict[int, object]:
    """``{optimizer param index: the model's ShardedTensor / factory of that param}``."""
    by_tensor = {id(leaf.data): leaf for leaf in nested_values(model_sharded_state_dict)
                 if isinstance(leaf, (ShardedTensor, ShardedTensorFactory))}
    out = {}
    for index, param in enumerate(optim_params_iter):
        if id(param) in by_tensor:
            out[index] = by_tensor[id(param)]
    return out


def make_sharded_optimizer_tensor(model_param, optim_param: torch.Tensor, prefix: str):
    """``model_param`` (a ShardedTensor or factory of a parameter) for a state tensor of the same shape: the same
    sharding, key ``prefix + key``."""
    if tuple(optim_param.shape) != tuple(model_param.data.shape):
        raise ValueError(f"optimizer state of shape {tuple(optim_param.shape)} for {model_param.key!r} of shape "
                         f"{tuple(model_param.data.shape)}")
    if isinstance(model_param, ShardedTensorFactory):
        return dataclasses.replace(model_param, key=f"{prefix}{model_param.key}", data=optim_param)
    return dataclasses.replace(model_param, key=f"{prefix}{model_param.key}", data=optim_param,
                               dtype=optim_param.dtype)


def optim_state_to_sharding_state(optim_state_dict: StateDict, id_to_sharded_param_map: Dict[int, object],
                                  exclude_keys=()) -> None:
    """Replace, in place, every per-parameter tensor of a torch optimizer's ``state_dict()`` (``state[i][name]``)
    by its sharded form (key ``optimizer.state.<name>.<param key>``); scalars and ``exclude_keys`` stay."""
    for param_id, param_state in optim_state_dict["state"].items():
        for name, value in list(param_state.items()):
            if name in exclude_keys or not torch.is_tensor(value) or value.dim() == 0:
                continue
            param_state[name] = make_sharded_optimizer_tensor(id_to_sharded_param_map[param_id], value,
                                                              f"optimizer.state.{name}.")
