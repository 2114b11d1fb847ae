"""``MegatronFSDP``: Megatron-FSDP's wrapper of any ``torch.nn.Module`` over a DeviceMesh (megatron-core's
``megatron_fsdp.megatron_fsdp``), built on this library's FSDP2 engine
(:class:`megatron.core.distributed.fsdp.sharded_module.FullyShardedModule`: one implementation).

The math (the engine's): with ``d`` ranks on the ``dp_shard_dim`` mesh, every parameter ``W`` is cut along dim 0
into ``torch.chunk`` row blocks and rank ``r`` keeps block ``r`` as a ``Shard(0)`` DTensor parameter: the main
weight the optimizer updates. Each FSDP unit (an instance of a class in ``fsdp_unit_modules``, outermost first;
the root holds the rest) all-gathers its blocks before its forward and, after its backward, reduce-scatters the
gradients divided by ``d`` (summed with ``calculate_per_token_loss``): rank ``r`` gets block ``r`` of the
data-parallel mean gradient, so an element-wise optimizer over ``model.parameters()`` gives the unsharded update.

* ``optim_grads_params`` (ZeRO-3): gathered weights are freed after each unit's forward and backward;
* ``optim_grads`` (ZeRO-2): gathered weights stay until the optimizer step, after which
  :meth:`MegatronFSDP.install_optimized_model_weights` gathers the updated blocks again;
* ``no_shard`` (DDP): a ``(d, 1)`` mesh whose first dimension FSDP2 replicates over: every rank keeps whole
  weights and optimizer state, and each unit's gradients are all-reduced and divided by ``d``;
* hybrid FSDP (``dp_outer_dim`` with ``outer_dp_sharding_strategy="no_shard"``): the ``(dp_outer, dp_shard)``
  mesh; blocks are cut over ``dp_shard`` and replicated over ``dp_outer``, gradients reduce-scattered over
  ``dp_shard``, all-reduced over ``dp_outer`` and divided by the product of the two sizes.

Low-precision modules (bf16 / fp16 parameters) keep fp32 main weights and compute (and return outputs) in their
dtype (``preserve_fp32_weights``, the default); otherwise the parameters' own dtype is kept. With
``init_model_with_meta_device`` the module is built on the meta device and each rank draws only its blocks, with the
values of an ordinary build from the present generator state (every parameter must belong to a module with
``reset_parameters()``).

Not here: ``optim`` (ZeRO-1: whole gradients with sharded optimizer state, which FSDP2 has no mode for; Megatron
models get it from ``megatron.core.distributed.fsdp.FullyShardedDataParallel``'s DDP buckets with the distributed
optimizer), hybrid FSDP that also shards over the outer dimension (``outer_dp_sharding_strategy="optim"``) or
with ``no_shard`` inside: refused with a message.
"""
from __future__ import annotations

import importlib
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto
from typing import List, Optional

import torch

from megatron.core import device as _device
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.meta_init import allocate_sharded, materialize
from megatron.core.distributed.fsdp.sharded_module import (FULLY_SHARDED_STRATEGIES, FullyShardedModule,
                                                           units_of_types)
from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import PrefetchOrder
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

logger = logging.getLogger(__name__)

__all__ = ["TrainingState", "MegatronFSDP", "RegisterFSDPBackwardFunction"]


class TrainingState(Enum):
    """Where a parameter group is in its sharding life cycle: ``FORWARD`` (gathered for the forward pass),
    ``PRE_BACKWARD`` (gathered for the backward pass), ``POST_BACKWARD`` (gradients being reduced), ``IDLE``."""

    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()
    IDLE = auto()


@dataclass(frozen=True)
class _ComputeSettings:
    """What the FSDP2 engine reads from a model config: the compute dtype and whether gradients are summed
    (per-token loss) rather than averaged over the data-parallel ranks."""

    params_dtype: torch.dtype
    calculate_per_token_loss: bool


def _compute_dtype(module: torch.nn.Module, preserve_fp32_weights: bool) -> torch.dtype:
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    low = dtypes & {torch.bfloat16, torch.float16}
    if preserve_fp32_weights and len(dtypes) == 1 and low:
        return low.pop()  # fp32 main weights, compute in the module's dtype
    return torch.float32  # no cast: the parameters' own dtypes are the main weights


def _import_class(path):
    if not isinstance(path, str):
        return path
    module_path, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module_path), name)


class MegatronFSDP(FullyShardedModule):
    """Shards ``module`` over ``dist_index``'s ``dp_shard_dim`` mesh (module docstring); ``self.module`` is the
    module, its parameters (``self.parameters()``) the sharded DTensors for the optimizer.

    ``ddp_config``: its ``data_parallel_sharding_strategy`` (``no_shard`` / ``optim_grads`` /
    ``optim_grads_params``) and ``preserve_fp32_weights`` are used; None gives megatron-core's default
    (``optim_grads_params``, gradients reduced in fp32). ``fsdp_unit_modules``: classes or their import paths.
    ``device``: the module is moved there first (not with ``init_model_with_meta_device``).
    ``keep_fp8_transpose_cache``, ``nccl_ub``, ``fsdp_double_buffer``, ``disable_symmetric_registration``,
    ``enable_fine_grained_param_gather_hook``, ``disable_bucketing``: GPU scheduling of the same collectives,
    accepted without effect.
    """

    def __init__(self, module: torch.nn.Module, dist_index: FSDPDistributedIndex,
                 ddp_config: DistributedDataParallelConfig = None, fsdp_unit_modules: Optional[List] = None,
                 disable_bucketing: bool = False, device: Optional[torch.device] = None,
                 calculate_per_token_loss: bool = False, init_model_with_meta_device: bool = False,
                 sync_model_each_microbatch: bool = False, keep_fp8_transpose_cache: bool = False,
                 nccl_ub: bool = False, fsdp_double_buffer: bool = False,
                 disable_symmetric_registration: bool = False, enable_fine_grained_param_gather_hook: bool = False):
        if ddp_config is None:
            ddp_config = DistributedDataParallelConfig(
                check_for_nan_in_grad=True, data_parallel_sharding_strategy="optim_grads_params",
                grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True,
                keep_fp8_transpose_cache=keep_fp8_transpose_cache, nccl_ub=nccl_ub,
                fsdp_double_buffer=fsdp_double_buffer or nccl_ub,
                disable_symmetric_registration=disable_symmetric_registration)
        strategy = ddp_config.data_parallel_sharding_strategy
        if strategy not in FULLY_SHARDED_STRATEGIES + ("no_shard",):
            raise ValueError(f"MegatronFSDP: data_parallel_sharding_strategy={strategy!r} is not available in the "
                             f"standalone Megatron-FSDP here ({FULLY_SHARDED_STRATEGIES + ('no_shard',)}); for "
                             "'optim' (ZeRO-1) wrap a Megatron model in "
                             "megatron.core.distributed.fsdp.FullyShardedDataParallel")
        if dist_index.use_hybrid_fsdp and (strategy == "no_shard" or dist_index.hsdp_outer_dp_shard):
            raise ValueError("MegatronFSDP: hybrid FSDP (dp_outer_dim) here replicates over dp_outer_dim and shards "
                             "over dp_shard_dim: it needs zero_dp_strategy 'optim_grads' / 'optim_grads_params' and "
                             "outer_dp_sharding_strategy 'no_shard'")
        target_device = device if device is not None else _device.current_device()
        if device is not None and not init_model_with_meta_device:
            module = module.to(device)
        init_dtypes = {n: p.dtype for n, p in module.named_parameters(remove_duplicate=False)}
        unit_classes = tuple(_import_class(c) for c in (fsdp_unit_modules or ()))
        units = units_of_types(module, unit_classes) if unit_classes else []
        settings = _ComputeSettings(_compute_dtype(module, ddp_config.preserve_fp32_weights), calculate_per_token_loss)
        shard_dim = dist_index.dp_shard_dim
        expert_mesh = dist_index.expt_device_mesh[shard_dim] if any(
            not getattr(p, "allreduce", True) for p in module.parameters()) else None
        if dist_index.use_hybrid_fsdp:  # replicate over the outer dimension, shard over the inner one
            mesh = dist_index.device_mesh[(dist_index.dp_outer_dim, shard_dim)]
        else:
            mesh = dist_index.device_mesh[shard_dim]
            if strategy == "no_shard":  # FSDP2's replicate dimension over the same ranks (module docstring)
                mesh = mesh._unflatten(0, (mesh.size(), 1), ("dp_replicate", "dp_unsharded"))
        super().__init__(settings, ddp_config, module, units, strategy=strategy, fsdp_mesh=mesh,
                         dp_cp_group=dist_index.get_dp_group(), expert_mesh=expert_mesh, fp32_outputs=False)
        if init_model_with_meta_device:
            allocate_sharded(self.module, target_device)
            materialize(self.module, None, init_dtypes, target_device)
        self.device = target_device
        self.dist_index = dist_index
        self.fsdp_unit_modules = list(unit_classes)
        self.calculate_per_token_loss = calculate_per_token_loss
        self.init_model_with_meta_device = init_model_with_meta_device
        self.enable_fine_grained_param_gather_hook = enable_fine_grained_param_gather_hook
        self.bucket_size = None if disable_bucketing else ddp_config.bucket_size
        self.microbatch_count = 0
        self.is_last_microbatch = True
        self.set_model_auto_sync(sync_model_each_microbatch)
        self.is_param_fsdp_distributed = True
        for param in self.parameters():
            param._megatron_fsdp_model = self

    @property
    def data_parallel_sharding_strategy(self) -> str:
        return self.ddp_config.data_parallel_sharding_strategy

    # ------------------------------------------------------------------ synchronisation (FSDP2 does it in backward)
    @contextmanager
    def no_sync(self):
        """Marks the micro-batches inside as not the last; gradients are still reduce-scattered at each one
        (sharded gradients: nothing whole to defer), so the accumulated result is the same."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    @contextmanager
    def sync(self):
        """Synchronise every micro-batch inside the block (``model_auto_sync`` on, then off)."""
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(False)

    def set_model_auto_sync(self, sync_model: bool = True):
        """Set ``model_auto_sync``: whether the model synchronises at every micro-batch (here reductions always
        complete within the backward pass, so it only decides whether ``optimizer.step`` calls
        :meth:`finish_grad_sync`)."""
        self.model_auto_sync = sync_model

    def get_distributed_index(self) -> FSDPDistributedIndex:
        return self.dist_index

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False):
        """Gather the updated weights: ``optim_grads`` gathers every unit now (kept whole until the next step);
        ``optim_grads_params`` gathers each unit just before its forward, so nothing happens here."""
        super().start_param_sync(force_sync=force_sync)
        self.is_param_fsdp_distributed = self.sharding_strategy != "optim_grads"

    def all_gather_and_wait_parameters_ready(self, params, prefetch=True,
                                             prefetch_order=PrefetchOrder.FORWARD_PASS_ORDER,
                                             wait_bucket_ready=True, bwd=False):
        """Gather the units that own ``params`` (whole weights in the module until they are resharded)."""
        wanted = {id(p) for p in params}
        for unit in self.units:
            if any(id(p) in wanted for p in unit.parameters()):
                unit.unshard()

    def synchronize_param_gather(self):
        """Nothing pending: FSDP2 waits for its all-gathers before the unit runs."""

    def synchronize_gradient_reduce(self):
        """Nothing pending: FSDP2 waits for its reduce-scatters when the backward pass ends."""

    def attach_grad_to_optimizer_state(self):
        """Nothing to copy: the reduced gradient block is already the sharded parameter's ``.grad``."""

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
        """Before ``optimizer.step()``: the gradients are complete (see :meth:`synchronize_gradient_reduce`); the
        module's parameters are made the sharded ones and the micro-batch count restarts."""
        self._replace_param_with_distributed_if_needed()
        self.microbatch_count = 0

    def _replace_param_with_distributed_if_needed(self):
        """The module's parameters become the sharded DTensors (``optim_grads`` drops its whole weights)."""
        if not self.is_param_fsdp_distributed:
            self._reshard()
            self.is_param_fsdp_distributed = True

    def _replace_param_with_raw_if_needed(self):
        """The module holds whole weights again (``optim_grads``); ZeRO-3 gathers per unit in forward."""
        if self.is_param_fsdp_distributed and self.sharding_strategy == "optim_grads":
            self.start_param_sync()

    def zero_grad_buffer(self):
        """Drop the gradients (the sharded parameters' ``.grad``) before the next step's backward passes."""
        super().zero_grad_buffer()

    def install_optimized_model_weights(self):
        """After ``optimizer.step()``: the updated blocks are the parameters themselves; ``optim_grads`` gathers
        the whole weights again."""
        if self.sharding_strategy == "optim_grads":
            self.start_param_sync()

    # ------------------------------------------------------------------ state dict: torch's, keys ``module.<name>``
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """``torch.nn.Module.state_dict`` of the wrapper (keys ``module.<name>``), parameters as sharded DTensors."""
        with self._sharded():
            return torch.nn.Module.state_dict(self, *args, destination=destination, prefix=prefix,
                                              keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``torch.nn.Module.load_state_dict`` into the sharded DTensors (values: DTensors of the same sharding)."""
        with self._sharded():
            return torch.nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)


class RegisterFSDPBackwardFunction(torch.autograd.Function):
    """Identity on ``inputs`` whose backward first calls ``post_backward()`` (a hook run when the gradients of
    the outputs reach this point), then passes the gradients through unchanged."""

    @staticmethod
    def forward(ctx, post_backward, *inputs: torch.Tensor):
        ctx.post_backward = post_backward
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.post_backward()
        return (None,) + grads
