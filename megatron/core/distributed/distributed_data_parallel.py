"""Megatron's local DistributedDataParallel (``--DDP-impl local``): contiguous gradient buffers.

Why not torch's DDP: the optimizer wants every gradient in one flat buffer per dtype (``param.main_grad``)
so that micro-batches accumulate in fp32 when asked, tensor-parallel layers can add their weight
gradients straight into it (gradient accumulation fusion), the distributed optimizer can reduce-scatter
and own contiguous shards, and the reduction runs once per iteration (not once per micro-batch).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List

import torch

from megatron.core import parallel_state
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.process_groups_config import group_of
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import unwrap_model_chunk
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer
from megatron.core.transformer.transformer_config import TransformerConfig


def shared_embedding_params(module) -> set:
    """Parameters kept identical across pipeline stages by an all-reduce of their gradients.

    The tied word embedding (``shared_embedding_or_output_weight()`` when
    ``share_embeddings_and_output_weights``) and any parameter marked ``shared_embedding = True``.
    """
    found = {p for p in module.parameters() if getattr(p, "shared_embedding", False)}
    inner = unwrap_model_chunk(module)
    if (getattr(inner, "share_embeddings_and_output_weights", False)
            and hasattr(inner, "shared_embedding_or_output_weight")):
        try:
            weight = inner.shared_embedding_or_output_weight()
        except (AttributeError, RuntimeError, AssertionError):
            weight = None  # a middle pipeline stage holds neither the embedding nor the output layer
        if isinstance(weight, torch.nn.Parameter):
            found.add(weight)
    return found


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


class DistributedDataParallel(_BaseDataParallel):
    """Wraps ``module``; gradients land in contiguous per-dtype buffers and are averaged over DP.

    Use::

        model = DistributedDataParallel(config, ddp_config, model)
        model.zero_grad_buffer()
        with model.no_sync():            # micro-batches 1..n-1: only accumulate
            loss(...).backward()
        loss(...).backward()             # last micro-batch: buckets reduce as they fill (overlap)
        model.finish_grad_sync()         # or finalize_model_grads([model])
    """

    def __init__(self, config: TransformerConfig, ddp_config: DistributedDataParallelConfig,
                 module: torch.nn.Module, disable_bucketing: bool = False, pg_collection=None):
        super().__init__(config, module)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        self.ddp_config = ddp_config
        self.bucket_size = ddp_config.effective_bucket_size(disable_bucketing)
        # megatron-core's pg_collection: ``dp_cp`` reduces the gradients, ``expt_dp`` the expert gradients
        # (None: parallel_state's groups).
        self.pg_collection = pg_collection

        # Gradients are reduced over DP x CP: the ranks of a context-parallel group hold different tokens of the
        # same samples, so for the weights they are data-parallel replicas.
        dp_cp = group_of(pg_collection, "dp_cp")
        self.data_parallel_group = dp_cp if dp_cp is not None else \
            parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp_size = torch.distributed.get_world_size(self.data_parallel_group)
        # Per-token loss: gradients are summed over DP x CP here and divided by the global token count in
        # finalize_model_grads; otherwise every rank pre-scales by 1/|DP x CP| before the SUM reduction.
        gradient_scaling_factor = 1.0 if config.calculate_per_token_loss else 1.0 / dp_size

        # Expert parameters (``allreduce = False``: expert parallelism) get their own buffers, reduced over the
        # expert data-parallel group. Their scaling is the dense one, 1/|DP|: an expert's gradient already holds
        # the contributions of the tokens that the dispatcher brought from the other EP ranks' batches.
        self.expert_data_parallel_group = None
        param_to_name: Dict[torch.nn.Parameter, str] = {}
        params_by_dtype: Dict[tuple, List[torch.nn.Parameter]] = {}
        for name, param in self.module.named_parameters():
            if not param.requires_grad:
                continue
            param_to_name[param] = name
            param.grad_added_to_main_grad = False
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param.dtype
            is_expert = not getattr(param, "allreduce", True)
            params_by_dtype.setdefault((param.dtype, grad_dtype, is_expert), []).append(param)
        if any(key[2] for key in params_by_dtype):
            self.expert_data_parallel_group = group_of(pg_collection, "expt_dp") or \
                parallel_state.get_expert_data_parallel_group()

        own_bucket = shared_embedding_params(self.module)
        self.param_and_grad_buffers: List[ParamAndGradBuffer] = []
        self.param_to_buffer: Dict[torch.nn.Parameter, ParamAndGradBuffer] = {}
        for (param_dtype, grad_dtype, is_expert), params in params_by_dtype.items():
            group = self.expert_data_parallel_group if is_expert else self.data_parallel_group
            buffer = ParamAndGradBuffer(ddp_config, param_dtype, grad_dtype, params, group,
                                        self.bucket_size, param_to_name, gradient_scaling_factor, own_bucket)
            self.param_and_grad_buffers.append(buffer)
            for p in params:
                self.param_to_buffer[p] = buffer

        # Fires after autograd accumulated the parameter's gradient (also when it accumulated nothing,
        # e.g. a tensor-parallel layer that added its weight gradient into main_grad itself).
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_param_hook(self.param_to_buffer[param]))
            for param in self.param_to_buffer
        ]

        # --overlap-param-gather: buckets chained in forward order (the reverse of their creation order, as
        # buckets are filled from the last parameters), and a forward pre-hook on every submodule.
        self.param_to_bucket = {p: b for buffer in self.param_and_grad_buffers for p, b in buffer.param_to_bucket.items()}
        self.forward_order_buckets = [b for buffer in self.param_and_grad_buffers for b in buffer.buckets][::-1]
        for bucket, following in zip(self.forward_order_buckets, self.forward_order_buckets[1:]):
            bucket.next_param_gather_bucket = following
        self.use_forward_hook = ddp_config.overlap_param_gather
        self._forward_pre_hook_handles = []
        if ddp_config.overlap_param_gather:
            for module in self.module.modules():
                self._forward_pre_hook_handles.append(module.register_forward_pre_hook(self._forward_pre_hook))

    @staticmethod
    def _make_param_hook(buffer: ParamAndGradBuffer):
        def hook(param: torch.nn.Parameter):
            grad = param.grad
            if grad is not None:
                # Skip when the gradient was already added to main_grad: by the layer itself
                # (grad_added_to_main_grad), or by autograd accumulating in place into a .grad that an
                # optimizer pointed at main_grad.
                if not getattr(param, "grad_added_to_main_grad", False) and not _aliases(grad, param.main_grad):
                    param.main_grad.add_(grad.data)
                param.grad = None
            buffer.register_grad_ready(param)

        return hook

    def _forward_pre_hook(self, module, *unused):
        """Wait for the all-gather of the buckets holding ``module``'s own parameters (dispatching the next)."""
        if not self.use_forward_hook:
            return
        for param in module.parameters(recurse=False):
            bucket = self.param_to_bucket.get(param)
            if bucket is not None and bucket.param_gather_pending:
                bucket.finish_param_sync(skip_next=self.ddp_config.align_param_gather)

    # ------------------------------------------------------------------------------ public API
    @contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into the buffers (no data-parallel communication)."""
        for buffer in self.param_and_grad_buffers:
            buffer.is_last_microbatch = False
        try:
            yield
        finally:
            for buffer in self.param_and_grad_buffers:
                buffer.is_last_microbatch = True

    def start_grad_sync(self, *unused):
        """Start the reduction of every bucket not started yet (asynchronous when overlapping)."""
        for buffer in self.param_and_grad_buffers:
            buffer.start_grad_sync()

    def finish_grad_sync(self):
        """Make every ``main_grad`` hold the DP-averaged gradient (own shards only with the distributed optimizer)."""
        for buffer in self.param_and_grad_buffers:
            buffer.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float):
        """Multiply every gradient buffer by ``scaling_factor`` (per-token loss normalisation)."""
        for buffer in self.param_and_grad_buffers:
            buffer.grad_data.mul_(scaling_factor)

    def zero_grad_buffer(self, zero_buffer: bool = True):
        """Reset for a new iteration: zero the buffers and the bookkeeping of which gradients are ready."""
        for param in self.param_to_buffer:
            param.grad_added_to_main_grad = False
        for buffer in self.param_and_grad_buffers:
            if zero_buffer:
                buffer.reset()
            else:
                for bucket in buffer.buckets:
                    bucket.reset()
                buffer.is_last_microbatch = True

    def broadcast_params(self):
        """Copy every parameter of DP x CP rank 0 to the other ranks of its DP x CP group."""
        src = torch.distributed.get_global_rank(self.data_parallel_group, 0)
        for param in self.module.parameters():
            if not getattr(param, "allreduce", True):
                group = self.expert_data_parallel_group
                expert_src = torch.distributed.get_global_rank(group, 0)
                torch.distributed.broadcast(param.data, src=expert_src, group=group)
                continue
            torch.distributed.broadcast(param.data, src=src, group=self.data_parallel_group)

    def all_gather_params(self):
        """Distributed optimizer: all-gather the parameter shards updated on each DP rank."""
        for buffer in self.param_and_grad_buffers:
            buffer.all_gather_params()

    def start_param_sync(self, *unused, force_sync: bool = False):
        """Dispatch the all-gather of every pending bucket (asynchronous unless ``force_sync``, which also waits);
        the interleaved schedule's ``config.param_sync_func`` with aligned parameter gathers."""
        for bucket in self.forward_order_buckets:
            bucket.start_param_sync(force_sync=force_sync)

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """Stop the forward pre-hooks (around evaluation and checkpointing); gather pending buckets now."""
        self.use_forward_hook = False
        if param_sync:
            self.start_param_sync(force_sync=True)

    def enable_forward_pre_hook(self):
        self.use_forward_hook = self.ddp_config.overlap_param_gather

    def _sync_pending_params(self):
        if self.ddp_config.overlap_param_gather:
            self.start_param_sync(force_sync=True)

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        self._sync_pending_params()  # --overlap-param-gather: a checkpoint holds whole parameters
        return super().state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        self._sync_pending_params()
        return super().state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs):
        """The wrapped module's sharded state (:class:`_BaseDataParallel`'s); whole parameters."""
        self._sync_pending_params()
        return super().sharded_state_dict(prefix, *args, **kwargs)
