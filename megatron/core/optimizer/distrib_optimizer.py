"""The distributed optimizer (``--use-distributed-optimizer``, ZeRO stage 1).

Every bucket of every DDP gradient buffer is split into ``d`` equal contiguous shards (``d`` = DP size,
buckets are padded to a multiple of ``d``). DP rank ``r`` owns shard ``r`` of each bucket: it keeps fp32
main parameters and the optimizer state only for the elements of that shard. One step:

1. DDP reduce-scatters the gradients, so rank ``r``'s shard of ``main_grad`` holds the DP-averaged values;
2. the shard of each parameter's ``main_grad`` becomes the gradient of its shard main parameter;
3. unscale / overflow check / clip / count zeros over the whole world (shards are disjoint over DP,
   pieces over TP/PP as usual);
4. the torch optimizer updates the shard main parameters; they are copied into the parameter buffer
   (fp16/bf16; fp32 shards are views of it already) and every bucket's parameters are all-gathered, or,
   with ``overlap_param_gather``, marked pending so that the next forward pass gathers them bucket by bucket
   (``overlap_param_gather_with_optimizer_step``: the first chunk's first bucket is dispatched right away).

A parameter that straddles a shard boundary is split between ranks: each rank optimizes its piece.
Element-wise optimizers (Adam, SGD) therefore give exactly the unsharded result.

Checkpoint layout (``get_parameter_state``, saved as ``distrib_optim.pt``), following Megatron's
"buckets_coalesced" format::

    {"buckets_coalesced": True,
     gbuf_idx: {(param_dtype, grad_dtype): {"param": fp32[numel_unpadded], "exp_avg": ..., "exp_avg_sq": ...,
                                            "numel_unpadded": int}}}

``gbuf_idx`` counts the buffers of all model chunks in order; each tensor is the buffer's elements in
buffer order with the bucket padding removed, so the file does not depend on the DP size.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
from megatron.core.distributed.param_and_grad_buffer import ParamAndGradBuffer, shard_buffer
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    _zero_grad_group_helper,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes


class Range:
    """The half-open index interval ``[start, end)`` of a shard inside a flat tensor; ``size = end - start``
    (also ``len()``). Printed as ``"start,end [size]"``."""

    def __init__(self, start: int, end: int):
        self.start = start
        self.end = end
        self.size = end - start

    def normalize(self, start: int = 0) -> "Range":
        """The same-sized interval moved to begin at ``start``."""
        return Range(start, start + self.size)

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start},{self.end} [{self.size}]"

    __repr__ = __str__


class ShardRange:
    """Where a parameter's piece owned by this rank lies: in the parameter, the buffer and the bucket shard."""

    def __init__(self, param_start: int, param_end: int, buffer_start: int, shard_start: int):
        self.param_start, self.param_end = param_start, param_end  # within param.view(-1)
        self.buffer_start = buffer_start  # within the whole buffer
        self.shard_start = shard_start  # within this rank's shard of the bucket

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def _state_keys(optimizer: torch.optim.Optimizer) -> List[str]:
    """Per-element optimizer state tensors saved in distrib_optim.pt."""
    name = type(optimizer).__name__
    if "Adam" in name:
        return ["exp_avg", "exp_avg_sq"]
    if "SGD" in name:
        return ["momentum_buffer"]
    raise TypeError(f"the distributed optimizer does not know the state of {name}")


def _gloo_twin(group, with_context_parallel: bool = False, expert: bool = False):
    """The gloo group with ``group``'s ranks for the CPU gathers of checkpointing: parallel_state's gloo twin when
    ``group`` is parallel_state's DP (x CP) / expert-DP group, else ``group`` itself (a group passed in through a
    pg_collection; on a gloo world it is a gloo group)."""
    try:
        if expert and group is parallel_state.get_expert_data_parallel_group(check_initialized=False):
            return parallel_state.get_expert_data_parallel_group_gloo()
        if not expert and group is parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel):
            return parallel_state.get_data_parallel_group_gloo(with_context_parallel=with_context_parallel)
    except AssertionError:
        pass
    return group


class DistributedOptimizer(MixedPrecisionOptimizer):
    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: Optional[MegatronGradScaler], model_chunks: List[torch.nn.Module]):
        super().__init__(optimizer, config, grad_scaler)
        if has_config_logger_enabled(config):
            log_config_to_disk(config, locals(), prefix=type(self).__name__)
        self.model_chunks = model_chunks
        self.buffers: List[ParamAndGradBuffer] = []
        for chunk in model_chunks:
            buffers = getattr(chunk, "param_and_grad_buffers", None)
            if buffers is None or not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
                raise ValueError("--use-distributed-optimizer needs every model chunk wrapped in megatron's "
                                 "DistributedDataParallel (--DDP-impl local) with "
                                 "DistributedDataParallelConfig(use_distributed_optimizer=True)")
            self.buffers.extend(buffers)
        # Shards over DP x CP: the group the gradients are reduced over (CP ranks are data-parallel replicas), the
        # DDP chunks' own (their pg_collection's dp_cp, else parallel_state's).
        self.data_parallel_group = model_chunks[0].data_parallel_group
        self.data_parallel_group_gloo = _gloo_twin(self.data_parallel_group, with_context_parallel=True)
        self.dp_size = torch.distributed.get_world_size(group=self.data_parallel_group)
        self.dp_rank = torch.distributed.get_rank(group=self.data_parallel_group)

        self.overlap_param_gather = any(chunk.ddp_config.overlap_param_gather for chunk in model_chunks)
        self.param_ranges: Dict[torch.nn.Parameter, ShardRange] = self._build_shard_ranges()
        self._build_shard_param_groups()

    # ------------------------------------------------------------------------------ sharding
    def _build_shard_ranges(self) -> Dict[torch.nn.Parameter, ShardRange]:
        ranges = {}
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                # Expert buffers are sharded over the expert data-parallel group (the bucket's own group).
                shard_size = bucket.grad_data.numel() // bucket.data_parallel_world_size
                shard_lo = bucket.offset + bucket.data_parallel_rank * shard_size
                shard_hi = shard_lo + shard_size
                for param in bucket.params_list:
                    start, end, _ = buffer.param_index_map[param]
                    lo, hi = max(start, shard_lo), min(end, shard_hi)
                    if lo < hi:
                        ranges[param] = ShardRange(lo - start, hi - start, lo, lo - shard_lo)
        return ranges

    def _build_shard_param_groups(self):
        """Replace the model params in the torch optimizer's groups by this rank's fp32 shards."""
        self.model_float16_groups, self.shard_fp32_from_float16_groups = [], []
        self.model_fp32_groups, self.shard_fp32_groups = [], []
        self.model_param_group_index_map: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        for group_index, group in enumerate(self.optimizer.param_groups):
            model16, shard16, model32, shard32, shard_params = [], [], [], [], []
            for param in group["params"]:
                if not param.requires_grad or param not in self.param_ranges:
                    continue
                r = self.param_ranges[param]
                shard_model = param.detach().view(-1)[r.param_start:r.param_end]
                if param.dtype in (torch.float16, torch.bfloat16):
                    shard_main = shard_model.clone().float()
                    model16.append(param)
                    shard16.append(shard_main)
                elif param.dtype == torch.float32:
                    shard_main = shard_model  # a view of the DDP parameter buffer: updated in place
                    model32.append(param)
                    shard32.append(shard_main)
                else:
                    raise TypeError(f"wrapped parameters must be float32, float16 or bfloat16, got {param.dtype}")
                copy_tensor_model_parallel_attributes(shard_main, param)
                if hasattr(param, "shared"):
                    shard_main.shared = param.shared
                self.model_param_group_index_map[param] = (group_index, len(shard_params))
                shard_params.append(shard_main)
            group["params"] = shard_params
            self.model_float16_groups.append(model16)
            self.shard_fp32_from_float16_groups.append(shard16)
            self.model_fp32_groups.append(model32)
            self.shard_fp32_groups.append(shard32)

    def _model_and_shard_pairs(self):
        for model_group, shard_group in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            yield from zip(model_group, shard_group)
        for model_group, shard_group in zip(self.model_fp32_groups, self.shard_fp32_groups):
            yield from zip(model_group, shard_group)

    def get_model_parallel_group(self):
        # Main grads are sharded over DP as well: norms, zero counts and overflow flags sum over every rank of the
        # model (pg_collection.intra_dist_opt; None = the world).
        return None if self.pg_collection is None else self.pg_collection.intra_dist_opt

    # ------------------------------------------------------------------------------ step pieces
    def zero_grad(self, set_to_none: bool = True):
        for groups in (self.model_float16_groups, self.shard_fp32_from_float16_groups, self.model_fp32_groups,
                       self.shard_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _collect_main_grad_data_for_unscaling(self):
        return [shard.grad.data for _, shard in self._model_and_shard_pairs() if shard.grad is not None]

    def _copy_model_grads_to_main_grads(self):
        for model_param, shard_main in self._model_and_shard_pairs():
            r = self.param_ranges[model_param]
            shard_grad = model_param.main_grad.view(-1)[r.param_start:r.param_end]
            shard_main.grad = shard_grad.float()

    def _copy_main_params_to_model_params(self, sync_gather: bool = False):
        model, main = [], []
        for model_group, shard_group in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            for model_param, shard_main in zip(model_group, shard_group):
                r = self.param_ranges[model_param]
                model.append(model_param.data.view(-1)[r.param_start:r.param_end])
                main.append(shard_main)
        if model:
            torch._foreach_copy_(model, main)
        if self.overlap_param_gather and not sync_gather:
            for buffer in self.buffers:
                buffer.mark_param_gather_pending()
            if self.config.overlap_param_gather_with_optimizer_step:
                self.model_chunks[0].forward_order_buckets[0].start_param_sync()
            return
        with self._timed("params-all-gather"):
            for buffer in self.buffers:
                buffer.all_gather_params()

    def reload_model_params(self):
        for model_group, shard_group in zip(self.model_float16_groups, self.shard_fp32_from_float16_groups):
            for model_param, shard_main in zip(model_group, shard_group):
                r = self.param_ranges[model_param]
                shard_main.data.copy_(model_param.data.view(-1)[r.param_start:r.param_end])

    # ------------------------------------------------------------------------------ state
    def _ensure_state(self):
        """Create zero optimizer state for shards that have none yet (before the first step)."""
        keys = _state_keys(self.optimizer)
        torch_adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW))
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                state = self.optimizer.state[shard]
                for key in keys:
                    if key not in state:
                        state[key] = torch.zeros_like(shard, memory_format=torch.preserve_format)
                if torch_adam and "step" not in state:
                    on_device = group.get("fused") or group.get("capturable")
                    state["step"] = torch.tensor(float(self._inner_steps), dtype=torch.float32,
                                                 device=shard.device if on_device else "cpu")

    def state_dict(self) -> dict:
        """Param-group hyper-parameters and the scaler; the sharded tensors go to get_parameter_state()."""
        inner = self._inner_state_dict()
        groups = []
        for group in inner["param_groups"]:
            groups.append({k: v for k, v in group.items() if k != "params"})
        state_dict = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: dict):
        saved_groups = state_dict["optimizer"]["param_groups"]
        current = self.optimizer.state_dict()
        if len(saved_groups) != len(current["param_groups"]):
            raise ValueError(f"optimizer checkpoint has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(current['param_groups'])}: the model or the weight-decay rules differ")
        param_groups = [{**saved, "params": list(cur["params"])}
                        for saved, cur in zip(saved_groups, current["param_groups"])]
        # Zero placeholders for the state; the values come with load_parameter_state().
        keys = _state_keys(self.optimizer)
        state = {}
        for group_index, group in enumerate(self.optimizer.param_groups):
            for order, shard in enumerate(group["params"]):
                index = current["param_groups"][group_index]["params"][order]
                state[index] = {key: torch.zeros_like(shard) for key in keys}
        self._load_inner_state_dict({"state": state, "param_groups": param_groups})

        self._load_grad_scaler(state_dict)

    def _shard_tensors(self, bucket, key: Optional[str]) -> torch.Tensor:
        """This rank's shard of one bucket as an fp32 CPU tensor: main params (key None) or a state tensor."""
        shard_size = bucket.grad_data.numel() // bucket.data_parallel_world_size  # DP, or expert DP
        local = torch.zeros(shard_size, dtype=torch.float32)
        for param in bucket.params_list:
            if param not in self.model_param_group_index_map:
                continue  # no piece of it on this rank
            r = self.param_ranges[param]
            group_index, order = self.model_param_group_index_map[param]
            shard_main = self.optimizer.param_groups[group_index]["params"][order]
            source = shard_main if key is None else self.optimizer.state[shard_main][key]
            local[r.shard_start:r.shard_start + r.numel].copy_(source.detach().view(-1))
        return local

    def _write_shard(self, bucket, key: Optional[str], local: torch.Tensor):
        for param in bucket.params_list:
            if param not in self.model_param_group_index_map:
                continue
            r = self.param_ranges[param]
            group_index, order = self.model_param_group_index_map[param]
            shard_main = self.optimizer.param_groups[group_index]["params"][order]
            target = shard_main if key is None else self.optimizer.state[shard_main][key]
            target.data.view(-1).copy_(local[r.shard_start:r.shard_start + r.numel])

    def _buffer_comm(self, buffer):
        """(gloo group, its rank 0 as a global rank, whether this rank is it, group size) of a buffer's sharding
        group: data parallel, or expert data parallel for expert-parallel buffers."""
        if buffer.data_parallel_group is self.data_parallel_group:
            return (self.data_parallel_group_gloo, torch.distributed.get_global_rank(self.data_parallel_group, 0),
                    self.dp_rank == 0, self.dp_size)
        group = _gloo_twin(buffer.data_parallel_group, expert=True)
        return (group, torch.distributed.get_global_rank(group, 0), torch.distributed.get_rank(group=group) == 0,
                torch.distributed.get_world_size(group=group))

    def is_parameter_state_root(self) -> bool:
        """Whether this rank gathers (and saves / reads) the state of at least one gradient buffer."""
        return any(self._buffer_comm(b)[2] for b in self.buffers) or (not self.buffers and self.dp_rank == 0)

    def get_parameter_state(self) -> Optional[dict]:
        """Gather the main params and optimizer state of every buffer on rank 0 of its sharding group (DP, or
        expert DP for expert buffers; gloo); the buffers this rank gathered, or None."""
        self._ensure_state()
        keys = ["param"] + _state_keys(self.optimizer)
        state = {"buckets_coalesced": True} if self.is_parameter_state_root() else None
        for gbuf_idx, buffer in enumerate(self.buffers):
            group, src, is_root, size = self._buffer_comm(buffer)
            world = {key: [] for key in keys}
            for bucket in buffer.buckets:
                for key in keys:
                    local = self._shard_tensors(bucket, None if key == "param" else key)
                    gathered = [torch.empty_like(local) for _ in range(size)] if is_root else None
                    torch.distributed.gather(local, gathered, dst=src, group=group)
                    if is_root:
                        world[key].append(torch.cat(gathered)[:bucket.numel_unpadded])
            if is_root:
                entry = {key: torch.cat(parts) for key, parts in world.items()}
                entry["numel_unpadded"] = buffer.numel_unpadded
                state[gbuf_idx] = {(buffer.param_dtype, buffer.grad_dtype): entry}
        return state

    def save_parameter_state(self, filename: str):
        """Write ``get_parameter_state()`` to ``filename`` (distrib_optim.pt) from the gathering ranks."""
        state = self.get_parameter_state()
        if state is not None:
            torch.save(state, filename)

    def load_parameter_state(self, state):
        """Scatter a ``get_parameter_state()`` result back into the shards. Collective over the world.

        ``state`` (the dict, or the path of a distrib_optim.pt file) is only read on the gathering ranks
        (``is_parameter_state_root``); other ranks may pass None.
        """
        root = self.is_parameter_state_root()
        if root and isinstance(state, (str, os.PathLike)):
            state = torch.load(state, map_location="cpu", weights_only=False)
        self._ensure_state()
        keys = ["param"] + _state_keys(self.optimizer)
        roles = [self._buffer_comm(b) for b in self.buffers]
        error = self._check_parameter_state(state, keys, [r[2] for r in roles]) if root else ""
        errors = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(errors, error)
        first = next((e for e in errors if e), "")
        if first:
            raise ValueError(first)
        for gbuf_idx, (buffer, (group, src, is_root, size)) in enumerate(zip(self.buffers, roles)):
            entry = state[gbuf_idx][(buffer.param_dtype, buffer.grad_dtype)] if is_root else None
            offset = 0
            for bucket in buffer.buckets:
                shard_size = bucket.grad_data.numel() // size
                for key in keys:
                    local = torch.empty(shard_size, dtype=torch.float32)
                    pieces = None
                    if is_root:
                        padded = torch.zeros(bucket.grad_data.numel(), dtype=torch.float32)
                        padded[:bucket.numel_unpadded].copy_(entry[key][offset:offset + bucket.numel_unpadded])
                        pieces = list(shard_buffer(padded, size))
                    torch.distributed.scatter(local, pieces, src=src, group=group)
                    self._write_shard(bucket, None if key == "param" else key, local)
                offset += bucket.numel_unpadded
        # The shard main params changed: refresh the model parameters of every rank.
        with torch.no_grad():
            self._copy_main_params_to_model_params(sync_gather=True)

    def _check_parameter_state(self, state, keys, mine=None) -> str:
        if not isinstance(state, dict):
            return "load_parameter_state: DP rank 0 needs the dict saved by get_parameter_state() (distrib_optim.pt)"
        if not state.get("buckets_coalesced", False):
            return ("distrib_optim.pt uses the pre-2024 padded layout (no 'buckets_coalesced' key), which depends on "
                    "the saving run's DP size and bucket padding; re-save it with this version or load with "
                    "--no-load-optim")
        for gbuf_idx, buffer in enumerate(self.buffers):
            if mine is not None and not mine[gbuf_idx]:
                continue  # another rank gathers this (expert) buffer
            dtype_key = (buffer.param_dtype, buffer.grad_dtype)
            entry = state.get(gbuf_idx, {}).get(dtype_key)
            if entry is None:
                return (f"distrib_optim.pt has no state for gradient buffer {gbuf_idx} {dtype_key}: the checkpoint "
                        f"was saved with other parameter dtypes or --accumulate-allreduce-grads-in-fp32 setting")
            if entry.get("numel_unpadded") != buffer.numel_unpadded:
                return (f"distrib_optim.pt buffer {gbuf_idx} holds {entry.get('numel_unpadded')} elements, this "
                        f"model's buffer has {buffer.numel_unpadded}: the model shape or TP/PP layout differs")
            missing = [k for k in keys if k not in entry]
            if missing:
                return f"distrib_optim.pt buffer {gbuf_idx} lacks optimizer state {missing} (another optimizer type?)"
        return ""
