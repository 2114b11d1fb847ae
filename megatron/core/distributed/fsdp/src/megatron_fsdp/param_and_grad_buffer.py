"""megatron-core's ``megatron_fsdp.param_and_grad_buffer``: the buffer pieces of :mod:`._data_parallel_buffer`
(re-exported), and the engine built from them: :class:`ParamAndGradBuffer` (a module's parameters grouped into
flat data-parallel buckets of model weights, main weights and gradients, sharded as the DDP config's
``data_parallel_sharding_strategy`` says), :class:`AllGatherPipeline` (gathers the ranks' weight shards into
temporary buckets and releases them) and :class:`GradReducePipeline` (reduce-scatters, or all-reduces for
``no_shard``, gradient buckets into the main-gradient shards).

This library trains with Megatron-FSDP on PyTorch FSDP2 (``megatron.core.distributed.fsdp``); these classes give
megatron-core's buffer API on plain ``torch.distributed`` (gloo or NCCL). Collectives run in order on the
caller's thread: the CUDA streams megatron-core overlaps them on, NCCL user-buffer registration and FP8
parameters are not here (no-ops, or NotImplementedError where the result would differ).
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from contextlib import nullcontext
from typing import List, Optional, Tuple

import torch

from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.src.megatron_fsdp._data_parallel_buffer import (  # noqa: F401 (re-exported)
    Bucket, BucketIndex, BucketingPolicy, BucketStatus, DataParallelBuffer, FixedPoolAllocator, ParameterGroup,
    PrefetchOrder, ResetParametersContext, RotaryBucketAllocator, ShardBucketIndex, StorageResizeBasedBucketAllocator,
    TemporaryBucketAllocator, TensorItemIndex, _resize_storage, build_data_parallel_buffer_index, check_gpu_memory,
    gradient_reduce_preprocessing, make_fsdp_dtensor, override_sharded_param_methods_with_safety_checks)
from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex
from megatron.core.utils import _ALL_GATHER_TENSOR_NAME, _REDUCE_SCATTER_TENSOR_NAME, to_local_if_dtensor

__all__ = ["BucketingPolicy", "Bucket", "BucketStatus", "PrefetchOrder", "build_data_parallel_buffer_index",
           "TemporaryBucketAllocator", "StorageResizeBasedBucketAllocator", "RotaryBucketAllocator",
           "FixedPoolAllocator", "DataParallelBuffer", "ParameterGroup", "gradient_reduce_preprocessing",
           "check_gpu_memory", "ResetParametersContext", "override_sharded_param_methods_with_safety_checks",
           "to_local_if_dtensor", "make_fsdp_dtensor", "ParamAndGradBuffer", "GradReducePipeline",
           "AllGatherPipeline"]

_COPIED_PARAM_ATTRS = ("requires_grad", "sequence_parallel", "shared", "tensor_model_parallel", "partition_dim",
                       "partition_stride", "is_embedding_or_output_parameter", "_mcore_tp", "_tp_duplicated",
                       "_tp_partition_dim")


_SHARDED = {"no_shard": (False, False, False), "optim": (False, True, False),
            "optim_grads": (False, True, True), "optim_grads_params": (True, True, True)}  # (weights, main, grads)


def _dist_fn(name_attr):
    return getattr(torch.distributed, name_attr)


def _get_parameter_groups(module: torch.nn.Module, policy: BucketingPolicy, meta_device_init_fp8_params: dict,
                          bucket_group_by_fsdp_unit: bool = True):
    """``(buckets, {param: bucket id}, {bucket id: the bucket ids reduced together})``. Parameters (in
    ``named_parameters`` order) are grouped by (dtype, expert (``.experts.`` in the name), requires_grad, outermost
    FSDP unit module); a group outside any unit is cut once it reaches ``suggested_bucket_size`` elements, and a
    ``shared_embedding`` parameter gets a bucket of its own when anything is sharded. Each bucket's parameters are
    ordered by row size (``numel / shape[0]``), largest first, and its ``chunk_size_factor`` is the least common
    multiple of the row sizes that do not already divide it (so every shard boundary falls on a row boundary). The
    buckets of one FSDP unit (per expert flag) are reduced together."""
    unit_of, n_units = {}, 0
    for m in module.modules():
        if policy.fsdp_unit_modules and isinstance(m, tuple(policy.fsdp_unit_modules)):
            new = [p for p in m.parameters() if p not in unit_of]
            unit_of.update({p: n_units for p in new})
            n_units += bool(new)
    groups = {}
    for name, p in module.named_parameters():
        key = (p.dtype, ".experts." in name, p.requires_grad, unit_of.get(p))
        groups.setdefault(key, []).append(p)
    buckets = []
    for (dtype, expert, requires_grad, unit), params in groups.items():
        attrs = dict(dtype=dtype, is_expert_param=expert, requires_grad=requires_grad, fsdp_unit_id=unit)
        current = []
        for p in params:
            if getattr(p, "shared_embedding", False) and policy.data_parallel_sharding_strategy != "no_shard":
                buckets += [(current, attrs)] if current else []
                buckets.append(([p], attrs))
                current = []
                continue
            current.append(p)
            if unit is None and policy.suggested_bucket_size and \
                    sum(to_local_if_dtensor(q).numel() for q in current) >= policy.suggested_bucket_size:
                buckets.append((current, attrs))
                current = []
        buckets += [(current, attrs)] if current else []
    parameter_groups = []
    for params, attrs in buckets:
        params = sorted(params, key=lambda q: to_local_if_dtensor(q).shape[1:].numel(), reverse=True)
        c = to_local_if_dtensor(params[0]).shape[1:].numel()
        for q in params:
            shape = to_local_if_dtensor(q).shape
            row = shape[1:].numel()
            if not (row == c or (c % row == 0 and shape.numel() % c == 0) or shape.numel() < c):
                c = math.lcm(c, row)
        parameter_groups.append(ParameterGroup(params, chunk_size_factor=c, **attrs))
    param_to_group = {p: i for i, g in enumerate(parameter_groups) for p in g.params}
    bucket_group = {i: [i] for i in range(len(parameter_groups))}
    if bucket_group_by_fsdp_unit:
        together = defaultdict(list)
        for i, g in enumerate(parameter_groups):
            if g.fsdp_unit_id is not None:
                together[(g.fsdp_unit_id, g.is_expert_param)].append(i)
        for ids in together.values():
            bucket_group.update({i: ids for i in ids})
    return parameter_groups, param_to_group, bucket_group


class ParamAndGradBuffer:
    """A module's parameters in :class:`ParameterGroup` buckets (:func:`_get_parameter_groups`), each with its
    :class:`DataParallelBuffer` s over the FSDP data-parallel group of ``dist_index``: the model weights (not with
    ``no_shard``; the parameters' ``.data`` become views of its bucket), fp32 main weights
    (``preserve_fp32_weights``) and the main gradients (fp32 with ``grad_reduce_in_fp32``). Which of them store only
    this rank's shard is ``ddp_config.data_parallel_sharding_strategy``'s: ``no_shard`` none, ``optim`` the main
    weights, ``optim_grads`` also the gradients, ``optim_grads_params`` also the model weights (then a parameter has
    no storage between all-gathers). ``optimizer_named_parameters`` are DTensors over the main weights' (else the
    model weights', else the parameter's) rows on this rank; :meth:`update_main_grads` gives them the matching rows
    of the reduced gradient.

    Not here: NCCL user-buffer registration (``nccl_ub``: the allocation context is a no-op), FP8 parameters and
    sharded hybrid FSDP (``outer_dp_sharding_strategy != "no_shard"``, NotImplementedError; this library's training
    runs hybrid FSDP on PyTorch FSDP2). A meta-device module is materialised on ``device`` (``reset_parameters`` of
    each module owning meta parameters) before the grouping."""

    def __init__(self, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 bucketing_policy: BucketingPolicy, dist_index: FSDPDistributedIndex,
                 preserve_fp32_weights: bool = True, grad_reduce_in_fp32: bool = True,
                 gradient_scaling_factor: Optional[float] = None,
                 expert_gradient_scaling_factor: Optional[float] = None, device: torch.device = torch.device("cuda"),
                 only_create_grad_buffer_and_main_weight_buffer_for_param_requires_grad: bool = True,
                 reset_parameters_for_meta_device_init_module: bool = False):
        bucketing_policy.data_parallel_sharding_strategy = ddp_config.data_parallel_sharding_strategy
        if ddp_config.data_parallel_sharding_strategy not in _SHARDED:
            raise ValueError(f"Invalid data_parallel_sharding_strategy: {ddp_config.data_parallel_sharding_strategy}")
        if dist_index.use_hybrid_fsdp and ddp_config.outer_dp_sharding_strategy != "no_shard":
            raise NotImplementedError("ParamAndGradBuffer: hybrid FSDP sharded over the outer DP group is not "
                                      "implemented here (use this library's FSDP2-based Megatron-FSDP)")
        self.ddp_config, self.module, self.bucketing_policy, self.dist_index = (ddp_config, module,
                                                                                bucketing_policy, dist_index)
        self.preserve_fp32_weights, self.grad_reduce_in_fp32 = preserve_fp32_weights, grad_reduce_in_fp32
        self.gradient_scaling_factor = gradient_scaling_factor
        self.expert_gradient_scaling_factor = expert_gradient_scaling_factor
        self.device = device
        self.only_create_grad_buffer_and_main_weight_buffer_for_param_requires_grad = \
            only_create_grad_buffer_and_main_weight_buffer_for_param_requires_grad
        self.reset_parameters_for_meta_device_init_module = reset_parameters_for_meta_device_init_module
        self.ubr_groups, self.already_registered = None, False
        self.mem_alloc_context = self.get_mem_alloc_context()
        if reset_parameters_for_meta_device_init_module:
            for m in module.modules():
                if any(p.is_meta for p in m.parameters(recurse=False)):
                    m.to_empty(device=device, recurse=False)
                    with ResetParametersContext(init_param_with_fp8=ddp_config.fp8_param_gather):
                        (m.reset_parameters if hasattr(m, "reset_parameters") else m._reset_parameters)()
        self.param_to_name = {p: name for name, p in module.named_parameters()}
        self.params = list(module.parameters())
        self.parameter_groups, self.param_to_param_group, self.bucket_to_bucket_group = _get_parameter_groups(
            module, bucketing_policy, {})
        self._init_each_parameter_group_buffers({})
        self._init_distributed_params()
        self.optimizer_named_parameters = self._init_optimizer_named_parameters()

    def get_mem_alloc_context(self, groups=None, symmetric=True):
        """The context buffers are allocated in: NCCL user-buffer registration is CUDA's, so always a no-op."""
        return nullcontext

    def manual_buffer_registration(self):
        """Register the buffers with NCCL (``fsdp_manual_registration``): a no-op without NCCL user buffers."""
        self.already_registered = True

    def _init_each_parameter_group_buffers(self, meta_device_init_fp8_params):
        """Create and fill each group's buffers (class docstring)."""
        cfg = self.ddp_config
        shard_w, shard_m, shard_g = _SHARDED[cfg.data_parallel_sharding_strategy]
        if cfg.fsdp_double_buffer and self.bucketing_policy.fsdp_unit_modules:
            self.weight_alloc = FixedPoolAllocator("fsdp_params", self.parameter_groups)
            self.transpose_weight_alloc = FixedPoolAllocator("fsdp_fp8_transpose_params", self.parameter_groups)
            self.main_grad_alloc = FixedPoolAllocator("fsdp_grads", self.parameter_groups)
            self.double_buf_units = self.weight_alloc.fsdp_double_buffer_units
        else:
            self.weight_alloc, self.transpose_weight_alloc = (StorageResizeBasedBucketAllocator(),
                                                              StorageResizeBasedBucketAllocator())
            self.main_grad_alloc, self.double_buf_units = None, []
        self.buffer_all_in_one = False
        for i, g in enumerate(self.parameter_groups):
            dp = self.dist_index.get_fsdp_group(is_expert_parallel=g.is_expert_param)
            ag = None if g.is_expert_param else self.dist_index.get_fsdp_group(independent_all_gather=True)
            kw = dict(device=self.device, bucket_id=i, chunk_size_factor=g.chunk_size_factor,
                      mem_alloc_context=self.mem_alloc_context)
            if cfg.data_parallel_sharding_strategy != "no_shard":
                wdp = ag if ag is not None else dp
                g.model_weight_buffer = DataParallelBuffer(cfg, g.params, shard_w and wdp.size() > 1, dtype=g.dtype,
                                                           data_parallel_group=wdp,
                                                           temporary_bucket_allocator=self.weight_alloc, **kw)
            if g.requires_grad or not self.only_create_grad_buffer_and_main_weight_buffer_for_param_requires_grad:
                if self.preserve_fp32_weights:
                    g.main_weight_buffer = DataParallelBuffer(cfg, g.params, shard_m and dp.size() > 1,
                                                              dtype=torch.float32, data_parallel_group=dp, **kw)
                scale = self.expert_gradient_scaling_factor if g.is_expert_param else self.gradient_scaling_factor
                g.main_grad_buffer = DataParallelBuffer(
                    cfg, g.params, shard_g and dp.size() > 1, data_parallel_group=dp,
                    dtype=torch.float32 if self.grad_reduce_in_fp32 else g.dtype, gradient_scaling_factor=scale,
                    temporary_bucket_allocator=self.main_grad_alloc, **kw)
            wbuf, mbuf, gbuf = g.model_weight_buffer, g.main_weight_buffer, g.main_grad_buffer
            for buf in (wbuf, mbuf, gbuf):
                if buf is not None:
                    buf.init_data(torch.zeros(buf.data_size, dtype=buf.dtype, device=self.device))
            bucket = wbuf.fetch_bucket() if wbuf else None
            with torch.no_grad():
                for item_id, p in enumerate(g.params):
                    local = to_local_if_dtensor(p)
                    if mbuf:
                        mbuf.set_item(item_id, local)
                    if wbuf:
                        wbuf.set_item(item_id, local)
                        view = wbuf.get_item_from_bucket(bucket, item_id).view(local.shape)
                        view.copy_(local)
                        local.data = view
                    if gbuf:
                        p._gbuf, p._item_id = gbuf, item_id
                        p.get_main_grad = (lambda q: q._gbuf.get_item_from_bucket(
                            q._gbuf.fetch_bucket(), q._item_id).view(to_local_if_dtensor(q).shape)).__get__(p)
            if wbuf and wbuf.is_data_distributed:
                wbuf.free_bucket_storage()

    def _init_distributed_params(self):
        """``dist_main_weight``: per parameter name, the DTensor the optimizer steps (class docstring)."""
        sharded = self.bucketing_policy.data_parallel_sharding_strategy != "no_shard"
        self.dist_main_weight, self.dist_main_grad = {}, {}
        for g in self.parameter_groups:
            buf = g.main_weight_buffer or g.model_weight_buffer
            for item_id, p in enumerate(g.params):
                local = buf.get_item(item_id, only_shard=sharded) if buf else p.data
                self.dist_main_weight[self.param_to_name[p]] = make_fsdp_dtensor(
                    local, p, self.dist_index, is_sharded_param=sharded and buf is not None,
                    is_expert_param=g.is_expert_param, run_check=True,
                    update_uneven_dtensor_chunk_meta=sharded and buf is not None, force_sync_tp_duplicated_param=True)

    def _init_optimizer_named_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        named = []
        for g in self.parameter_groups:
            for item_id, p in enumerate(g.params):
                name = self.param_to_name[p]
                dist_param = torch.nn.Parameter(self.dist_main_weight[name])

                def reset_attribute(_dist=dist_param, _orig=p):
                    for attr in _COPIED_PARAM_ATTRS:
                        if hasattr(_orig, attr):
                            setattr(_dist, attr, getattr(_orig, attr))

                dist_param.reset_attribute, dist_param.orig_param = reset_attribute, p
                dist_param.megatron_fsdp_dist_index = self.dist_index
                if g.model_weight_buffer:
                    dist_param.megatron_fsdp_slice = slice(*g.model_weight_buffer._get_item_slice_in_shard(item_id))
                reset_attribute()
                named.append((name, dist_param))
        return named

    def update_main_grads(self):
        """Give each optimizer parameter the gradient rows matching its own (a view of the main-gradient buffer,
        in the parameter's dtype; ``decoupled_grad`` for a precision-aware optimizer)."""
        sharded = self.bucketing_policy.data_parallel_sharding_strategy != "no_shard"
        for name, param in self.optimizer_named_parameters:
            orig = param.orig_param
            g = self.parameter_groups[self.param_to_param_group[orig]]
            if g.main_grad_buffer is None:
                continue
            local = g.main_grad_buffer.get_item(g.main_grad_buffer.param_idx[orig], only_shard=sharded)
            if g.main_weight_buffer is not None and not getattr(self, "use_precision_aware_optimizer", False):
                local = local.to(param.dtype)
            if name not in self.dist_main_grad:
                self.dist_main_grad[name] = make_fsdp_dtensor(local, orig, self.dist_index, is_sharded_param=sharded,
                                                              is_expert_param=g.is_expert_param)
            else:
                self.dist_main_grad[name]._local_tensor = local.view((-1,) + tuple(orig.shape[1:]))
            grad = self.dist_main_grad[name] if local.numel() else None
            if getattr(self, "use_precision_aware_optimizer", False):
                param.decoupled_grad = grad
            else:
                param.grad = grad.to(param.dtype) if grad is not None else None

    @property
    def num_buckets(self):
        return len(self.parameter_groups)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply the main gradients by ``scaling_factor`` (and refresh the optimizer's gradients)."""
        for g in self.parameter_groups:
            if g.main_grad_buffer is not None:
                g.main_grad_buffer.data *= scaling_factor
        self.update_main_grads()

    def zero_grad(self):
        """Zero the main-gradient buffers and drop the optimizer parameters' gradients."""
        for name, param in self.optimizer_named_parameters:
            param.grad = None
            if hasattr(param, "decoupled_grad"):
                param.decoupled_grad = None
            if name in self.dist_main_grad:
                self.dist_main_grad[name]._local_tensor = None
        for g in self.parameter_groups:
            for buf in (g.main_grad_buffer, g.hsdp_gbuf):
                if buf is not None:
                    buf.data.zero_()

    @torch.no_grad()
    def copy_main_weights_to_model_weights(self):
        """Model weights := main weights, element by element (this rank's shard when either buffer is sharded;
        :meth:`all_gather_parameters` then completes an unsharded model-weight buffer). FP8 is not here."""
        for g in self.parameter_groups:
            mbuf, wbuf = g.main_weight_buffer, g.model_weight_buffer
            if mbuf is None:
                continue
            for p in g.params:
                i = mbuf.param_idx[p]
                if wbuf is None:
                    to_local_if_dtensor(p).data.copy_(mbuf.get_item(i).view(to_local_if_dtensor(p).shape))
                else:
                    shard = wbuf.is_data_distributed or mbuf.is_data_distributed
                    wbuf.get_item(i, only_shard=shard).copy_(mbuf.get_item(i, only_shard=shard))

    @torch.no_grad()
    def copy_model_weights_to_main_weights(self):
        """Main weights := model weights (the shard when the main weights are sharded; the parameters themselves
        with ``no_shard``)."""
        for g in self.parameter_groups:
            mbuf, wbuf = g.main_weight_buffer, g.model_weight_buffer
            if mbuf is not None and wbuf is None:
                for p in g.params:
                    mbuf.set_item(mbuf.param_idx[p], to_local_if_dtensor(p))
            elif mbuf is not None:
                mbuf.data.copy_(wbuf.get_shard_from_local_buffer() if mbuf.is_data_distributed else wbuf.data)

    def _check_unsharded(self, kind, what):
        if any(b.is_data_distributed for b in (getattr(g, kind) for g in self.parameter_groups) if b):
            raise AssertionError(f"{what}() should only be called when its buffers are not sharded")

    def all_gather_parameters(self, async_op: bool = True):
        """Make every rank's unsharded model-weight buffer whole from the ranks' shards (``optim``)."""
        self._check_unsharded("model_weight_buffer", "all_gather_parameters")
        works = [_dist_fn(_ALL_GATHER_TENSOR_NAME)(b.data, b.get_shard_from_local_buffer().clone(),
                                                   group=b.data_parallel_group, async_op=async_op)
                 for g in self.parameter_groups for b in (g.model_weight_buffer, g.transpose_weight_buffer) if b]
        for w in works if async_op else ():
            w.wait()

    def _reduce_gradient_buffers(self, scatter: bool, async_op: bool):
        works = []
        for g in self.parameter_groups:
            b = g.main_grad_buffer
            if b is None:
                continue
            op = gradient_reduce_preprocessing(b.data, b.gradient_scaling_factor, self.ddp_config)
            works.append(_dist_fn(_REDUCE_SCATTER_TENSOR_NAME)(b.get_shard_from_local_buffer(), b.data.clone(),
                                                               op=op, group=b.data_parallel_group, async_op=async_op)
                         if scatter else torch.distributed.all_reduce(b.data, op=op, group=b.data_parallel_group,
                                                                      async_op=async_op))
        for w in works if async_op else ():
            w.wait()

    def reduce_scatter_gradients(self, async_op: bool = True):
        """Reduce the unsharded gradient buffers into this rank's shard of each (scaled as
        :func:`gradient_reduce_preprocessing` says)."""
        self._check_unsharded("main_grad_buffer", "reduce_scatter_gradients")
        self._reduce_gradient_buffers(True, async_op)

    def all_reduce_gradients(self, async_op: bool = False):
        """All-reduce the unsharded gradient buffers (scaled as :func:`gradient_reduce_preprocessing` says)."""
        self._check_unsharded("main_grad_buffer", "all_reduce_gradients")
        self._reduce_gradient_buffers(False, async_op)


class GradReducePipeline:
    """Reduces a bucket's gradients once all its parameters' gradients are in (and those of its bucket group).
    The gradients sit in each parameter's ``main_grad`` view of the bucket (``p.get_main_grad()``); the reduction
    (``gradient_reduce_preprocessing``: summed, averaged or scaled by the buffer's ``gradient_scaling_factor``) is
    an all-reduce of the bucket with ``no_shard``, else a reduce-scatter whose result is added to this rank's
    stored gradient shard (a sharded buffer accumulates over micro-batches) or, for an unsharded buffer (``optim``,
    where the bucket is the buffer), written into its shard. With ``outer_fsdp_group_grad_reduce`` (hybrid FSDP)
    the shard is then all-reduced over the outer DP group. Collectives run in order on the caller's thread:
    ``rs_stream`` (a CUDA stream) is kept but unused; queued reductions are completed, and their temporary buckets
    freed, by :meth:`wait_for_previous_grad_reduce`."""

    def __init__(self, param_and_grad_buffer: ParamAndGradBuffer, rs_stream: Optional["torch.cuda.Stream"] = None,
                 check_nans: bool = False) -> None:
        self.buffer = param_and_grad_buffer
        self.grad_reduce_queue = []
        self.bucket_status = {i: BucketStatus.EMPTY for i, g in enumerate(self.buffer.parameter_groups)
                              if g.main_grad_buffer}
        self.bucket_grad_ready_params = [set() for _ in range(self.buffer.num_buckets)]
        self.rs_stream, self.check_nans = rs_stream, check_nans
        self.outer_fsdp_group_grad_reduce = self.buffer.dist_index.use_hybrid_fsdp

    @property
    def num_buckets(self):
        return self.buffer.num_buckets

    def reset(self):
        """Finish every queued reduction and free the gradient buckets (no bucket may be half ready)."""
        self.wait_for_previous_grad_reduce(0)
        for bucket_id, ready in enumerate(self.bucket_grad_ready_params):
            if ready:
                raise AssertionError(f"bucket {bucket_id}: {len(ready)} parameters' gradients are ready but not "
                                     f"reduced while the pipeline is reset: "
                                     f"{[self.buffer.param_to_name[p] for p in ready]}")
        for bucket_id in self.bucket_status:
            self.get_fsdp_buffer(bucket_id).free_bucket_storage()
            self.bucket_status[bucket_id] = BucketStatus.EMPTY

    def reduce_gradients(self, params: List[torch.Tensor], suggested_queue_capacity: Optional[int] = None,
                         outer_fsdp_group_grad_reduce: bool = False):
        """Mark ``params``' gradients ready; reduce each bucket group that becomes complete."""
        for param in sorted(params, key=lambda p: self.buffer.param_to_param_group[p]):
            bucket_id = self.buffer.param_to_param_group[param]
            group = self.buffer.parameter_groups[bucket_id]
            if bool(param.requires_grad) != bool(group.requires_grad):
                raise AssertionError(f"{self.buffer.param_to_name[param]}: requires_grad={param.requires_grad} in "
                                     f"a parameter group with requires_grad={group.requires_grad}")
            if not param.requires_grad:
                continue
            self.bucket_grad_ready_params[bucket_id].add(param)
            bucket_group = self.get_ready_bucket_group_for_reduction(bucket_id)
            if bucket_group:
                self.wait_for_previous_grad_reduce(suggested_queue_capacity=suggested_queue_capacity)
                self._bucket_group_gradient_reduce(bucket_group, async_op=True,
                                                   outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce)

    def wait_for_previous_grad_reduce(self, suggested_queue_size: int = 1,
                                      suggested_queue_capacity: Optional[int] = None):
        """Complete the oldest queued reductions until at most ``suggested_queue_size`` buckets (capped at
        ``num_buckets - 1``), or at most ``suggested_queue_capacity`` bucket elements, remain queued."""
        def size(entry):
            return self.buffer.parameter_groups[entry[2]].main_grad_buffer.bucket_index.size

        limit = max(0, min(suggested_queue_size, self.num_buckets - 1))
        while self.grad_reduce_queue and (
                sum(map(size, self.grad_reduce_queue)) > suggested_queue_capacity
                if suggested_queue_capacity is not None else len(self.grad_reduce_queue) > limit):
            work, free_up, _ = self.grad_reduce_queue.pop(0)
            work.wait()
            free_up()

    def _enforce_double_buffer_limit(self, add_buckets):
        """With ``fsdp_double_buffer``, keep at most two double-buffered FSDP units' gradient buckets in use."""
        if not self.buffer.ddp_config.fsdp_double_buffer:
            return
        groups = self.buffer.parameter_groups
        units = {groups[b].fsdp_unit_id for b in add_buckets if groups[b].fsdp_unit_id in self.buffer.double_buf_units}
        if len(units) > 2:
            raise AssertionError(f"Double buffer limit exceeded. Current double_buf_units: {units}.")
        keep = len(self.grad_reduce_queue)
        for _, _, bucket_id in reversed(self.grad_reduce_queue):
            units.add(groups[bucket_id].fsdp_unit_id)
            keep -= len(units) > 2
        self.wait_for_previous_grad_reduce(keep)

    def get_ready_bucket_group_for_reduction(self, bucket_id: int) -> Optional[List[int]]:
        """The bucket group of ``bucket_id`` (those with a gradient buffer) when all their gradients are in."""
        group = [b for b in self.buffer.bucket_to_bucket_group[bucket_id]
                 if self.buffer.parameter_groups[b].main_grad_buffer]
        ready = all(len(self.bucket_grad_ready_params[b]) == len(self.buffer.parameter_groups[b].params)
                    for b in group)
        return group if ready else None

    def get_fsdp_buffer(self, bucket_id: int) -> DataParallelBuffer:
        group = self.buffer.parameter_groups[bucket_id]
        return group.hsdp_gbuf if self.buffer.ddp_config.outer_dp_sharding_strategy != "no_shard" \
            else group.main_grad_buffer

    def _bucket_group_gradient_reduce(self, bucket_group: List[int], async_op: bool = False,
                                      outer_fsdp_group_grad_reduce: bool = False) -> bool:
        """Reduce the buckets of ``bucket_group`` (class docstring); queued with ``async_op``."""
        cfg = self.buffer.ddp_config
        self._enforce_double_buffer_limit(bucket_group)
        for bucket_id in bucket_group:
            gbuf = self.get_fsdp_buffer(bucket_id)
            bucket = gbuf.fetch_bucket()
            if self.check_nans and not torch.isfinite(bucket.data).all():
                raise RuntimeError(f"NaN or Inf in the gradients of bucket {bucket_id} before their reduction")
            op = gradient_reduce_preprocessing(bucket.data, gbuf.gradient_scaling_factor, cfg)
            self.bucket_status[bucket_id] = BucketStatus.COMMUNICATING
            if cfg.data_parallel_sharding_strategy == "no_shard":
                torch.distributed.all_reduce(bucket.data, op=op, group=gbuf.data_parallel_group)
            else:
                reduced = torch.empty_like(gbuf.get_shard_from_bucket(bucket))
                _dist_fn(_REDUCE_SCATTER_TENSOR_NAME)(reduced, bucket.data, op=op, group=gbuf.data_parallel_group)
                local = gbuf.get_shard_from_local_buffer()
                local.add_(reduced) if gbuf.is_data_distributed else local.copy_(reduced)
            if outer_fsdp_group_grad_reduce:
                shard = gbuf.get_shard_from_local_buffer() if cfg.data_parallel_sharding_strategy != "no_shard" \
                    else bucket.data
                torch.distributed.all_reduce(shard, group=self.buffer.dist_index.get_outer_fsdp_group(),
                                             op=torch.distributed.ReduceOp.AVG if cfg.average_in_collective
                                             else torch.distributed.ReduceOp.SUM)

            def free_up(bucket_id=bucket_id, gbuf=gbuf):
                self.bucket_grad_ready_params[bucket_id] = set()
                if gbuf.is_data_distributed:
                    gbuf.free_bucket_storage()
                self.bucket_status[bucket_id] = BucketStatus.EMPTY

            if async_op:
                self.grad_reduce_queue.append((_DONE, free_up, bucket_id))
            else:
                free_up()
        return True


class _Done:
    """A finished collective (they run synchronously here): ``wait`` returns at once."""

    def wait(self):
        return True


_DONE = _Done()


class AllGatherPipeline:
    """All-gathers weight buckets: each bucket of ``param_and_grad_buffer`` (and, in the backward pass, its
    transpose buffer when it has one) is ``EMPTY``, ``COMMUNICATING`` or ``READY_TO_USE``. :meth:`all_gather_params`
    fetches the temporary bucket of every bucket holding one of ``params`` (plus, with ``prefetch``, the next
    buckets in ``prefetch_order`` up to ``suggested_AG_prefetch_size`` elements), points the parameters' ``.data``
    at it and gathers the ranks' shards into it; :meth:`wait_bucket_ready` completes a gather;
    :meth:`release_bucket` frees the bucket (``lazy``: at the next gather, :meth:`recycle_unused_buckets`). The
    gathers run in order on the caller's thread: ``ag_stream`` (a CUDA stream) is kept but unused."""

    def __init__(self, param_and_grad_buffer: ParamAndGradBuffer,
                 ag_stream: Optional["torch.cuda.Stream"] = None) -> None:
        self.buffer = param_and_grad_buffer
        self.ag_stream = ag_stream
        self.param_gather_event_map = {}
        keys = {self.get_bucket_key(i, bwd) for i in range(self.num_buckets) for bwd in (False, True)}
        self.bucket_status = {k: BucketStatus.EMPTY for k in keys}
        self.bucket_can_be_released = {k: False for k in keys}
        self.bucket_to_bucket_group = {}
        for group in self.buffer.bucket_to_bucket_group.values():
            if any(b not in self.bucket_to_bucket_group for b in group):
                gid = len(set(self.bucket_to_bucket_group.values())) + 1
                self.bucket_to_bucket_group.update({b: gid for b in group})

    def get_bucket_key(self, bucket_id, bwd):
        """``(bucket_id, uses the transpose buffer)``."""
        return (bucket_id, bwd and self.buffer.parameter_groups[bucket_id].transpose_weight_buffer is not None)

    @property
    def num_buckets(self):
        return self.buffer.num_buckets

    def reset(self):
        """Complete pending gathers (with a warning) and release every bucket."""
        if self.param_gather_event_map:
            warnings.warn(f"There are still pending all-gather tasks, process them. Bucket status: "
                          f"{self.bucket_status}.", UserWarning)
            for bucket_id, bwd in list(self.param_gather_event_map):
                self.wait_bucket_ready(bucket_id, bwd)
        for key in self.bucket_can_be_released:
            self.bucket_can_be_released[key] = True
        self.recycle_unused_buckets()
        if any(s is not BucketStatus.EMPTY for s in self.bucket_status.values()):
            raise AssertionError(f"There are still working buckets, it is not safe to reset: {self.bucket_status}")

    def all_gather_params(self, params: List[torch.Tensor], prefetch: bool = False,
                          prefetch_order: PrefetchOrder = PrefetchOrder.FORWARD_PASS_ORDER,
                          suggested_AG_prefetch_size: Optional[int] = None, async_param_gather: bool = True,
                          outer_fsdp_group_param_gather: bool = False, bwd: bool = False):
        """Gather the buckets of ``params`` (class docstring); with ``async_param_gather=False`` they are ready
        on return. ``outer_fsdp_group_param_gather`` (sharded hybrid FSDP) is not here."""
        if not params:
            return
        if outer_fsdp_group_param_gather:
            raise NotImplementedError("AllGatherPipeline: outer-DP parameter gathers (sharded hybrid FSDP)")
        groups = self.buffer.parameter_groups
        buckets = sorted({self.buffer.param_to_param_group[p] for p in params})
        if self.buffer.ddp_config.fsdp_double_buffer and len(
                {groups[b].fsdp_unit_id for b in buckets} & set(self.buffer.double_buf_units)) > 2:
            raise ValueError("more than 2 double-buffered FSDP units were requested: double buffers hold 2")
        for b in buckets:
            self.bucket_can_be_released[self.get_bucket_key(b, bwd)] = False
        if prefetch:
            limit = 500_000_000 if suggested_AG_prefetch_size is None else suggested_AG_prefetch_size
            size = lambda ids: sum(groups[i].model_weight_buffer.bucket_index.size for i in ids)  # noqa: E731
            base, step = size(buckets), 1 if prefetch_order == PrefetchOrder.FORWARD_PASS_ORDER else -1
            while size(buckets) - base < limit:
                nxt = (buckets[0] if step > 0 else buckets[-1]) + step  # the first bucket after a run
                while nxt in buckets:
                    nxt += step
                if not 0 <= nxt < self.num_buckets:
                    break
                buckets = sorted(set(buckets) | set(self.buffer.bucket_to_bucket_group[nxt]))
        for b in buckets:
            if self.bucket_status[self.get_bucket_key(b, bwd)] == BucketStatus.EMPTY:
                self.async_bucket_gather(b, bwd)
        if not async_param_gather:
            for b in buckets:
                self.wait_bucket_ready(b, bwd)

    def wait_bucket_ready(self, bucket_id, bwd, empty_ok=False):
        """Complete the bucket's gather (ValueError for an empty bucket unless ``empty_ok``)."""
        key = self.get_bucket_key(bucket_id, bwd)
        if self.bucket_status[key] == BucketStatus.EMPTY:
            if empty_ok:
                return
            raise ValueError(f"Bucket {bucket_id} is empty.")
        if self.bucket_status[key] == BucketStatus.COMMUNICATING:
            work = self.param_gather_event_map.pop(key)
            work.wait()
            self.bucket_status[key] = BucketStatus.READY_TO_USE

    @torch.no_grad()
    def release_bucket(self, bucket_id, bwd, lazy: bool = False):
        """Free the bucket's gathered weights (``lazy``: mark it for :meth:`recycle_unused_buckets`)."""
        key = self.get_bucket_key(bucket_id, bwd)
        if self.bucket_status[key] == BucketStatus.EMPTY:
            return
        if lazy:
            self.bucket_can_be_released[key] = True
            return
        self.wait_bucket_ready(bucket_id, bwd, empty_ok=True)
        self.get_fsdp_buffer(bucket_id, bwd).free_bucket_storage()
        self.bucket_status[key] = BucketStatus.EMPTY

    def recycle_unused_buckets(self):
        """Release the buckets marked for a lazy release."""
        for (bucket_id, transpose), release in list(self.bucket_can_be_released.items()):
            if release:
                self.release_bucket(bucket_id, transpose)
                self.bucket_can_be_released[(bucket_id, transpose)] = False

    def get_fsdp_buffer(self, bucket_id: int, bwd=False) -> DataParallelBuffer:
        group = self.buffer.parameter_groups[bucket_id]
        if bwd and group.transpose_weight_buffer is not None:
            return group.transpose_weight_buffer
        return group.model_weight_buffer

    @torch.no_grad()
    def async_bucket_gather(self, bucket_id, bwd) -> None:
        """Start gathering the bucket: fetch it, point its parameters at it, all-gather the shards into it."""
        key = self.get_bucket_key(bucket_id, bwd)
        self.bucket_can_be_released[key] = False
        if self.bucket_status[key] != BucketStatus.EMPTY:
            return
        self.bucket_status[key] = BucketStatus.COMMUNICATING
        wbuf = self.get_fsdp_buffer(bucket_id, bwd)
        self.recycle_unused_buckets()
        bucket = wbuf.fetch_bucket(set_param_data=True)
        self.param_gather_event_map[key] = _dist_fn(_ALL_GATHER_TENSOR_NAME)(
            bucket.data, wbuf.get_shard_from_local_buffer().clone() if not wbuf.is_data_distributed
            else wbuf.get_shard_from_local_buffer(), group=wbuf.data_parallel_group, async_op=True)
