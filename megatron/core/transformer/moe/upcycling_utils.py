"""Upcycling: initialise a mixture-of-experts model from a dense one (Komatsuzaki et al.; fine-grained upcycling
of He et al., arXiv 2410.07524), at run time.

With the dense FFN width ``F``, the MoE's expert width ``f`` and ``E`` experts: granularity ``g = F / f`` (each
dense FFN is cut into ``g`` column blocks of fc1 / row blocks of fc2) and expansion rate ``x = E / g`` (the ``g``
blocks are repeated ``x`` times: expert ``e`` gets block ``e mod g``). Every expert weight is multiplied by
``a^(1/p)`` with ``p = 3`` for gated units and squared ReLU, else 2 (the activation is homogeneous of degree
``p - 1`` in fc1, linear in fc2), and ``a`` the activation scale: ``x g^2 / k`` with pre-softmax routing (top-k
of a softmax over all experts), else ``g``. For ``g = 1`` and softmax-after-top-k routing each expert is the dense
MLP and the MoE layer's output equals the dense layer's.

Per layer (state-dict keys ending in): the keys both models share are copied from the dense model; a fused
layer norm ``mlp.linear_fc1.layer_norm_{weight,bias}`` becomes ``pre_mlp_layernorm.{weight,bias}``; the MoE
model's own ``mlp.router.weight [E, h]`` is replaced by its first ``E / g`` rows, each repeated ``g`` times in a
row; ``mlp.linear_fc{1,2}.{weight,bias}`` become ``mlp.experts.local_experts.{i}.linear_fc{1,2}.{weight,bias}``
for this expert-parallel rank's local experts (fc2's bias is repeated unscaled; a gated fc1 ``[gate; up]`` is cut
per half so each block keeps its gate and up rows). Only ``SequentialMLP`` experts (and Transformer Engine's
grouped layout, in megatron-core) are supported; the models are unwrapped (no DDP / Float16Module).
"""
from __future__ import annotations

import copy
from enum import Enum

import torch

from megatron.core.transformer.moe.moe_layer import BaseMoELayer

ExpertsType = Enum("ExpertsType", ("SequentialMLP", "TEGroupedMLP"))
ActivationFuncName = Enum("ActivationFuncName", ("gelu", "silu", "squared_relu"))


def _find_submodule(model, name: str):
    for full_name, module in model.named_modules():
        if full_name == name or full_name.endswith("." + name):
            return module
    return None


def _activation_name(config) -> ActivationFuncName:
    name = "squared_relu" if getattr(config, "squared_relu", False) else config.activation_func.__name__
    if name not in ActivationFuncName.__members__:
        raise ValueError(f"The activation func is not supported by upcycling. Valid options are: "
                         f"{list(ActivationFuncName.__members__)} But got {name}")
    return ActivationFuncName[name]


def _upcycling_layout(moe_model, dense_model) -> dict:
    from megatron.core.transformer.moe.experts import SequentialMLP

    mlp = _find_submodule(moe_model, "mlp")
    if not isinstance(mlp, BaseMoELayer):
        raise TypeError(f"upcycling needs an MoE model whose mlp is a BaseMoELayer, got {type(mlp).__name__}")
    config = mlp.config
    experts = _find_submodule(mlp, "experts")
    if not isinstance(experts, SequentialMLP):
        raise TypeError(f"The experts type {type(experts).__name__} is not supported by upcycling. Valid options "
                        f"are: {list(ExpertsType.__members__)} (TEGroupedMLP needs Transformer Engine)")
    dense_mlp = _find_submodule(dense_model, "mlp")
    if dense_mlp is None:
        raise ValueError("upcycling: the dense model has no mlp layer")
    dense_ffn, expert_ffn = dense_mlp.config.ffn_hidden_size, config.moe_ffn_hidden_size
    if dense_ffn % expert_ffn:
        raise ValueError(f"The ffn hidden size of dense model ({dense_ffn}) must be divisible by ffn hidden size of "
                         f"moe model ({expert_ffn}).")
    granularity = dense_ffn // expert_ffn
    if config.num_moe_experts % granularity:
        raise ValueError(f"The number of experts ({config.num_moe_experts}) must be divisible by granularity "
                         f"({granularity}) for upcycling")
    return dict(num_local_experts=mlp.num_local_experts, topk=config.moe_router_topk, granularity=granularity,
                expansion=config.num_moe_experts // granularity, gated=config.gated_linear_unit,
                activation=_activation_name(config), pre_softmax=config.moe_router_pre_softmax,
                ep_rank=mlp.local_expert_indices[0] // mlp.num_local_experts)


def _weight_scale(layout: dict) -> float:
    """``a^(1/p)`` of the module docstring."""
    g, x = layout["granularity"], layout["expansion"]
    activation_scale = x * g * g / layout["topk"] if layout["pre_softmax"] else g
    degree = 3 if layout["gated"] or layout["activation"] == ActivationFuncName.squared_relu else 2
    return activation_scale ** (1 / degree)


def _convert_to_moe_state_dict(moe_model, dense_model) -> dict:
    """The MoE model's state dict, initialised from the dense model's (module docstring)."""
    layout = _upcycling_layout(moe_model, dense_model)
    g, x = layout["granularity"], layout["expansion"]
    scale = _weight_scale(layout)
    gated_split = layout["gated"] and layout["activation"] == ActivationFuncName.silu

    def fc1_blocks(param):
        param = param * scale
        if gated_split:
            gate, up = torch.chunk(param, 2, dim=0)
            blocks = [torch.cat((a, b), dim=0) for a, b in zip(torch.tensor_split(gate, g), torch.tensor_split(up, g))]
        else:
            blocks = list(torch.tensor_split(param, g, dim=0))
        return blocks * x

    def fc2_weight_blocks(param):
        return list(torch.tensor_split(param * scale, g, dim=1)) * x

    def fc2_bias_blocks(param):
        return [param.clone() for _ in range(g * x)]

    def router_weight(value):
        rows = torch.tensor_split(value.detach().clone(), g, dim=0)[0]
        return rows.repeat_interleave(g, dim=0)

    dense = copy.deepcopy(dense_model.state_dict())
    moe = copy.deepcopy(moe_model.state_dict())
    for key in dense.keys() & moe.keys():
        moe[key] = dense[key]
    for old, new in (("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
                     ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias")):
        for key in [k for k in dense if k.endswith(old)]:
            moe[key.replace(old, new)] = dense[key].clone()
    for key in [k for k in moe if k.endswith("mlp.router.weight")]:
        moe[key] = router_weight(moe[key])
    first = layout["ep_rank"] * layout["num_local_experts"]
    for old, blocks_of in (("mlp.linear_fc1.weight", fc1_blocks), ("mlp.linear_fc1.bias", fc1_blocks),
                           ("mlp.linear_fc2.weight", fc2_weight_blocks), ("mlp.linear_fc2.bias", fc2_bias_blocks)):
        new = "mlp.experts.local_experts.{}." + old[len("mlp."):]
        for key in [k for k in dense if k.endswith(old)]:
            blocks = blocks_of(dense[key])
            for i in range(layout["num_local_experts"]):
                moe[key.replace(old, new.format(i))] = blocks[first + i]
    return moe


def upcycle_state_dict(moe_model, dense_model) -> dict:
    """``{'model': state dict}`` (one model chunk) or ``{'model0': ..., 'model1': ...}`` (virtual pipeline chunks):
    the MoE model chunks' state dicts initialised from the dense chunks' (module docstring). Both arguments are
    lists of unwrapped model chunks of equal length."""
    if len(moe_model) != len(dense_model):
        raise ValueError(f"upcycling: {len(moe_model)} MoE model chunks but {len(dense_model)} dense ones")
    if len(moe_model) == 1:
        return {"model": _convert_to_moe_state_dict(moe_model[0], dense_model[0])}
    return {f"model{i}": _convert_to_moe_state_dict(m, d) for i, (m, d) in enumerate(zip(moe_model, dense_model))}


def load_and_upcycle_model(load_dense_ckpt_func, moe_model, dense_model, strict=True, load_args=(), load_kwargs={}):
    """Load the dense checkpoint with ``load_dense_ckpt_func(*load_args, **load_kwargs)`` (it fills ``dense_model``
    and returns ``(iteration, num_floating_point_operations_so_far)``), upcycle it into ``moe_model``
    (:func:`upcycle_state_dict`, loaded with ``strict``) and return that pair."""
    iteration, flops = load_dense_ckpt_func(*load_args, **load_kwargs)
    state_dict = upcycle_state_dict(moe_model, dense_model)
    if len(moe_model) == 1:
        moe_model[0].load_state_dict(state_dict["model"], strict=strict)
    else:
        for i, chunk in enumerate(moe_model):
            chunk.load_state_dict(state_dict[f"model{i}"], strict=strict)
    return iteration, flops
