"""The standalone Megatron-FSDP API (megatron-core's ``megatron_fsdp.fully_shard``): shard any ``torch.nn.Module``
over a DeviceMesh and make a ``torch.optim`` optimizer drive it.

    model = fully_shard_model(model, device_mesh=mesh, dp_shard_dim="fsdp", tp_dim="tp",
                              fsdp_unit_modules=[Block], zero_dp_strategy=3)
    optimizer = fully_shard_optimizer(torch.optim.Adam(model.parameters()))
    # or both at once: model, optimizer = fully_shard(model, optimizer, ...)

``fully_shard_model`` builds the :class:`DistributedDataParallelConfig` and :class:`FSDPDistributedIndex` from its
arguments and wraps the module in :class:`MegatronFSDP` (its docstring has the math). Without a mesh it builds a
``(world_size, 1)`` mesh named ``("fsdp", "tp")`` on this process's device type. With
``preproc_state_dict_for_dcp_ckpt`` (and a sharded strategy) the model's ``state_dict()`` drops ``*_extra_state``
entries and carries the uneven-chunk metadata PyTorch DCP needs (``uneven_dtensor``; collective: every rank calls
it). ``fully_shard_optimizer`` extends ``step`` (keyword-only ``sync_grad_before_optimizer_step``,
``install_optimized_model_weights``, both True) and ``zero_grad`` (``zero_grad_buffer=True``) with the model's
synchronisation, in place.
"""
from __future__ import annotations

import logging
import types
from enum import IntEnum
from typing import Callable, Optional, Sequence, Type

import torch
from torch.distributed import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh

from megatron.core import device as _device
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import MegatronFSDP
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import (FSDPDistributedIndex,
                                                                     create_updated_function_signature)

logger = logging.getLogger(__name__)

__all__ = ["ShardingStrategy", "experimental_api", "fully_shard_model", "fully_shard_optimizer", "fully_shard"]


class ShardingStrategy(IntEnum):
    """Megatron-FSDP's strategies by number: 0 ``no_shard`` (DDP), 1 ``optim`` (ZeRO-1: optimizer state),
    2 ``optim_grads`` (ZeRO-2: and gradients), 3 ``optim_grads_params`` (ZeRO-3: and parameters)."""

    NO_SHARD = 0
    OPTIM = 1
    OPTIM_GRADS = 2
    OPTIM_GRADS_PARAMS = 3


_STRATEGY_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def experimental_api(func: Callable) -> Callable:
    """Mark ``func`` as an experimental API (sets ``func._experimental_api = True``); returns it."""
    func._experimental_api = True
    return func


def _strategy_name(value, allowed, what):
    if isinstance(value, str) and value in allowed:
        return value
    if not isinstance(value, str) and int(value) in range(len(allowed)):
        return allowed[int(value)]
    raise ValueError(f"Invalid {what}: {value!r}; valid: "
                     + ", ".join(f"{i} / {name!r}" for i, name in enumerate(allowed)))


@experimental_api
def fully_shard_model(module: torch.nn.Module, device_mesh: Optional[DeviceMesh] = None,
                      dp_shard_dim: Optional[str] = None, dp_outer_dim: Optional[str] = None,
                      tp_dim: Optional[str] = None, hybrid_fsdp_group: Optional[torch.distributed.ProcessGroup] = None,
                      expt_device_mesh: Optional[DeviceMesh] = None,
                      fsdp_unit_modules: Optional[Sequence[Type[torch.nn.Module]] | Sequence[str]] = None,
                      zero_dp_strategy: str | int = 3, outer_dp_sharding_strategy: str | int = 0,
                      device: Optional[torch.device] = None, init_model_with_meta_device: bool = False,
                      grad_reduce_in_fp32: bool = False, preserve_fp32_weights: bool = True,
                      overlap_grad_reduce: bool = True, overlap_param_gather: bool = True,
                      sync_model_each_microbatch: bool = True, preproc_state_dict_for_dcp_ckpt: bool = True,
                      check_for_nan_in_grad: bool = True, average_in_collective: bool = False,
                      disable_bucketing: bool = False, calculate_per_token_loss: bool = False,
                      keep_fp8_transpose_cache: bool = False, nccl_ub: bool = False, fsdp_double_buffer: bool = False,
                      disable_symmetric_registration: bool = False,
                      enable_fine_grained_param_gather: bool = False) -> torch.nn.Module:
    """Wrap ``module`` in :class:`MegatronFSDP` sharded over ``device_mesh[dp_shard_dim]`` with
    ``zero_dp_strategy`` (a name or :class:`ShardingStrategy` number); module docstring. Returns the wrapper
    (the module is ``.module``)."""
    if device_mesh is None:
        dp_shard_dim = dp_shard_dim or "fsdp"
        tp_dim = tp_dim or "tp"
        dp_outer_dim, hybrid_fsdp_group, outer_dp_sharding_strategy = None, None, ShardingStrategy.NO_SHARD
        device_mesh = init_device_mesh(_device.current_device().type,
                                       (torch.distributed.get_world_size(), 1), mesh_dim_names=(dp_shard_dim, tp_dim))
    zero_dp_strategy = _strategy_name(zero_dp_strategy, _STRATEGY_NAMES, "FSDP / inner DP sharding strategy")
    outer_dp_sharding_strategy = _strategy_name(outer_dp_sharding_strategy, _STRATEGY_NAMES[:2],
                                                "hybrid DP-outer sharding strategy")
    if outer_dp_sharding_strategy == "optim" and zero_dp_strategy != "optim_grads_params":
        raise ValueError("sharding the optimizer over the outer DP dimension (HSDP) needs zero_dp_strategy="
                         "'optim_grads_params' (3): outer sharding builds on inner sharding")
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        raise ValueError(f"dp_outer_dim={dp_outer_dim} and hybrid_fsdp_group={hybrid_fsdp_group} go together for "
                         "hybrid FSDP (HSDP), or are both None")
    if init_model_with_meta_device and zero_dp_strategy == "no_shard":
        raise ValueError("init_model_with_meta_device=True is neither supported nor needed with zero_dp_strategy="
                         "'no_shard' (0)")
    ddp_config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=zero_dp_strategy, outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        grad_reduce_in_fp32=grad_reduce_in_fp32, preserve_fp32_weights=preserve_fp32_weights,
        overlap_grad_reduce=overlap_grad_reduce,
        # no_shard gathers no parameters (whole on every rank): there is nothing to overlap.
        overlap_param_gather=overlap_param_gather and zero_dp_strategy != "no_shard",
        average_in_collective=average_in_collective, keep_fp8_transpose_cache=keep_fp8_transpose_cache,
        nccl_ub=nccl_ub, fsdp_double_buffer=fsdp_double_buffer or nccl_ub,
        disable_symmetric_registration=disable_symmetric_registration, check_for_nan_in_grad=check_for_nan_in_grad)
    dist_index = FSDPDistributedIndex(device_mesh=device_mesh, dp_shard_dim=dp_shard_dim, dp_outer_dim=dp_outer_dim,
                                      tp_dim=tp_dim, hybrid_fsdp_group=hybrid_fsdp_group,
                                      hsdp_outer_dp_shard=outer_dp_sharding_strategy == "optim",
                                      expt_device_mesh=expt_device_mesh)
    model = MegatronFSDP(module=module, dist_index=dist_index, ddp_config=ddp_config,
                         fsdp_unit_modules=fsdp_unit_modules, disable_bucketing=disable_bucketing, device=device,
                         calculate_per_token_loss=calculate_per_token_loss,
                         init_model_with_meta_device=init_model_with_meta_device,
                         sync_model_each_microbatch=sync_model_each_microbatch,
                         enable_fine_grained_param_gather_hook=enable_fine_grained_param_gather)
    if preproc_state_dict_for_dcp_ckpt and zero_dp_strategy != "no_shard":
        def for_dcp(module, state_dict, prefix, local_metadata):
            for key in [k for k in state_dict if k.endswith("_extra_state")]:
                del state_dict[key]
            preprocess_state_dict_for_uneven_dtensor(state_dict)

        model._register_state_dict_hook(for_dcp)
    return model


@experimental_api
def fully_shard_optimizer(optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Make ``optimizer`` (built on a :class:`MegatronFSDP` model's ``parameters()``) drive the model, in place:
    ``step()`` first completes the gradient reduction when the model does not synchronise each micro-batch, then
    steps, then installs the updated weights; ``zero_grad()`` also clears the model's gradients. With
    ``preproc_state_dict_for_dcp_ckpt`` its ``state_dict()`` carries the uneven-chunk metadata (collective)."""
    if not optimizer.param_groups or not optimizer.param_groups[0]["params"]:
        raise ValueError(f"fully_shard_optimizer: the optimizer has no parameters: {optimizer}")
    first = optimizer.param_groups[0]["params"][0]
    model = getattr(first, "_megatron_fsdp_model", None)
    if model is None:
        raise ValueError("fully_shard_optimizer: the optimizer's first parameter does not belong to a MegatronFSDP "
                         "model; build the optimizer on fully_shard_model(...).parameters()")
    base_step, base_zero_grad = type(optimizer).step, type(optimizer).zero_grad

    def step(self, *args, sync_grad_before_optimizer_step=True, install_optimized_model_weights=True, **kwargs):
        if sync_grad_before_optimizer_step and not model.model_auto_sync:
            model.finish_grad_sync()
        out = base_step(self, *args, **kwargs)
        if install_optimized_model_weights:
            model.install_optimized_model_weights()
        return out

    def zero_grad(self, *args, zero_grad_buffer=True, **kwargs):
        base_zero_grad(self, *args, **kwargs)
        if zero_grad_buffer:
            model.zero_grad_buffer()

    step.__signature__ = create_updated_function_signature(
        base_step, sync_grad_before_optimizer_step=True, install_optimized_model_weights=True)
    zero_grad.__signature__ = create_updated_function_signature(base_zero_grad, zero_grad_buffer=True)
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(zero_grad, optimizer)
    if preproc_state_dict_for_dcp_ckpt:
        optimizer.register_state_dict_post_hook(lambda opt, state_dict: preprocess_state_dict_for_uneven_dtensor(
            state_dict))
    return optimizer


def fully_shard(module: torch.nn.Module, optimizer: torch.optim.Optimizer, device_mesh: Optional[DeviceMesh] = None,
                dp_shard_dim: Optional[str] = None, dp_outer_dim: Optional[str] = None, tp_dim: Optional[str] = None,
                hybrid_fsdp_group: Optional[torch.distributed.ProcessGroup] = None,
                expt_device_mesh: Optional[DeviceMesh] = None,
                fsdp_unit_modules: Optional[Sequence[Type[torch.nn.Module]] | Sequence[str]] = None,
                zero_dp_strategy: str | int = 3, outer_dp_sharding_strategy: str | int = 0,
                device: Optional[torch.device] = None, init_model_with_meta_device: bool = False,
                grad_reduce_in_fp32: bool = False, preserve_fp32_weights: bool = True,
                overlap_grad_reduce: bool = True, overlap_param_gather: bool = True,
                sync_model_each_microbatch: bool = True, preproc_state_dict_for_dcp_ckpt: bool = True,
                check_for_nan_in_grad: bool = True, average_in_collective: bool = False,
                disable_bucketing: bool = False, calculate_per_token_loss: bool = False,
                keep_fp8_transpose_cache: bool = False, nccl_ub: bool = False, fsdp_double_buffer: bool = False,
                disable_symmetric_registration: bool = False,
                enable_fine_grained_param_gather: bool = False) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """:func:`fully_shard_model` then :func:`fully_shard_optimizer`: ``optimizer``'s parameter list and state are
    replaced by one group of the sharded model's parameters (its defaults: lr, betas, ...). Returns
    ``(model, optimizer)``."""
    arguments = dict(locals())  # every argument of fully_shard_model, plus the optimizer
    optimizer = arguments.pop("optimizer")
    model = fully_shard_model(**arguments)
    model._replace_param_with_distributed_if_needed()
    optimizer.param_groups.clear()
    optimizer.state.clear()
    optimizer.add_param_group({"params": list(model.parameters())})
    fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc_state_dict_for_dcp_ckpt)
    return model, optimizer
