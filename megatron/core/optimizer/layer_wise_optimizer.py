"""LayerWiseDistributedOptimizer: shard whole parameters (not flat buffer ranges) over the data-parallel ranks.

Every rank keeps the full model and, after DDP's all-reduce, the full gradients. The parameters of all chained
optimizers are sorted by size (stable) and dealt to the ``d`` DP x CP ranks in ping-pong order
``0, 1, ..., d-1, d-1, ..., 1, 0, 0, 1, ...`` (so that sizes even out; expert-parallel groups are dealt over the
expert data-parallel ranks the same way); each rank's optimizers keep only the parameters dealt to it, so
optimizer state (and, with bf16, the fp32 main parameters) exists once over DP. A step computes the gradient norm
and the zero count over the whole world (each parameter counted by its owner), clips, updates the local
parameters, then all-gathers every rank's updated parameters. Unlike the distributed optimizer this works with
optimizers that need whole matrices (Muon's orthogonalisation).
"""
from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32
from megatron.core.optimizer.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_pg_rank, get_pg_size

logger = logging.getLogger(__name__)


def _ping_pong(size: int) -> List[int]:
    return list(range(size)) + list(range(size))[::-1]


class LayerWiseDistributedOptimizer(ChainedOptimizer):
    """Chained optimizers whose parameters are dealt over the DP ranks whole (module docstring).

    ``optimizers``: Megatron optimizers (FP32 ones, or bare torch optimizers) not yet stepped; with ``config.bf16``
    each is (re)wrapped in fp32 main parameters after sharding (an already fp16/bf16-wrapped one is refused).
    ``pg_collection`` gives ``dp_cp`` and ``expt_dp``; ``init_state_fn_list`` (one per optimizer) is accepted for
    megatron-core's signature; state is created lazily by the optimizers here.
    """

    def __init__(self, optimizers: List[MegatronOptimizer], config: OptimizerConfig,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 init_state_fn_list: Optional[List[Callable]] = None) -> None:
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        if init_state_fn_list and len(init_state_fn_list) != len(optimizers):
            raise ValueError("init_state_fn_list must be the same length as optimizers if provided")
        self.pg_collection = pg_collection
        self.shard_params(optimizers)
        if config.bf16:
            for i, optimizer in enumerate(optimizers):
                if isinstance(optimizer, Float16OptimizerWithFloat16Params):
                    raise TypeError("LayerWiseDistributedOptimizer received Float16 optimizer already.")
                inner = optimizer.optimizer if isinstance(optimizer, FP32Optimizer) else optimizer
                optimizers[i] = Float16OptimizerWithFloat16Params(inner, config, None)
                optimizers[i].pg_collection = pg_collection
        super().__init__(optimizers)
        self.config = config

    def shard_params(self, optimizers):
        """Deal the parameters over the ranks; ``dp_cp_params_list[r]`` / ``expt_dp_params_list[r]`` are rank r's
        (None when there is nothing to deal: one DP rank, or no expert parameter / one expert-DP rank)."""
        dp_size = get_pg_size(self.pg_collection.dp_cp)
        if dp_size == 1:
            self.dp_cp_params_list = None
            self.expt_dp_params_list = None
            return
        expt_size = get_pg_size(self.pg_collection.expt_dp)
        dp_rank, expt_rank = get_pg_rank(self.pg_collection.dp_cp), get_pg_rank(self.pg_collection.expt_dp)
        dp_loop, expt_loop = _ping_pong(dp_size), _ping_pong(expt_size)
        self.dp_cp_params_list = [[] for _ in range(dp_size)]
        self.expt_dp_params_list = [[] for _ in range(expt_size)]
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        entries = sorted(((p, g) for g, group in enumerate(groups) for p in group["params"]),
                         key=lambda entry: entry[0].numel())
        mine = [[] for _ in groups]
        dp_turn = expt_turn = 0
        for param, g in entries:
            if groups[g].get("is_expert_parallel", False):
                owner, expt_turn = expt_loop[expt_turn], (expt_turn + 1) % len(expt_loop)
                lists, rank = self.expt_dp_params_list, expt_rank
            else:
                owner, dp_turn = dp_loop[dp_turn], (dp_turn + 1) % len(dp_loop)
                lists, rank = self.dp_cp_params_list, dp_rank
            lists[owner].append(param)
            if owner == rank:
                mine[g].append(param)
        for group, params in zip(groups, mine):
            group["params"] = params
        if expt_size == 1 or not self.expt_dp_params_list[0]:
            self.expt_dp_params_list = None

    @torch.no_grad()
    def allgather_params(self) -> None:
        """Every rank's updated parameters to every rank: one all-gather per group of the flattened parameters
        (padded to the largest rank's size, so that it works with any backend)."""
        def gather(params_list, group):
            rank = get_pg_rank(group)
            sample = next(p for params in params_list for p in params)
            sizes = [sum(p.numel() for p in params) for params in params_list]
            local = (_flatten_dense_tensors([p.data for p in params_list[rank]]) if params_list[rank]
                     else torch.empty(0, dtype=sample.dtype, device=sample.device))
            padded = torch.zeros(max(sizes), dtype=sample.dtype, device=sample.device)
            padded[:local.numel()].copy_(local)
            gathered = [torch.empty_like(padded) for _ in params_list]
            torch.distributed.all_gather(gathered, padded, group=group)
            for owner, (flat, params) in enumerate(zip(gathered, params_list)):
                if owner == rank or not params:
                    continue
                for updated, param in zip(_unflatten_dense_tensors(flat[:sizes[owner]], params), params):
                    param.data.copy_(updated)

        if self.dp_cp_params_list:
            gather(self.dp_cp_params_list, self.pg_collection.dp_cp)
        if self.expt_dp_params_list:
            gather(self.expt_dp_params_list, self.pg_collection.expt_dp)

    @torch.no_grad()
    def broadcast_params(self):
        """The same result as :meth:`allgather_params` with one broadcast per parameter from its owner."""
        for params_list, group in ((self.dp_cp_params_list, self.pg_collection.dp_cp),
                                   (self.expt_dp_params_list, self.pg_collection.expt_dp)):
            for owner, params in enumerate(params_list or []):
                source = torch.distributed.get_global_rank(group, owner)
                for param in params:
                    torch.distributed.broadcast(param.data, source, group=group)

    @torch.no_grad()
    def get_grad_norm(self):
        """Over the whole world: every parameter's gradient is counted by its owner only."""
        return get_grad_norm_fp32(self.get_main_grads_for_grad_norm(), 2, None)

    @torch.no_grad()
    def count_zeros(self):
        return count_zeros_fp32(self.get_parameters(), model_parallel_group=None)

    @torch.no_grad()
    def step(self):
        """The chained step on the local parameters, then :meth:`allgather_params`."""
        update_successful, grad_norm, num_zeros = super().step()
        self.allgather_params()
        return update_successful, grad_norm, num_zeros

    def load_state_dict(self, state_dict):
        """Also accepts ``fp32_from_fp16_params`` stored as ``{index: group}`` (how sharded checkpoints keep the
        possibly empty per-group lists) and turns it back into a list."""
        wrapped = {1: state_dict} if len(self.chained_optimizers) == 1 else state_dict
        for sd in (wrapped.values() if isinstance(wrapped, dict) else wrapped):
            if isinstance(sd.get("fp32_from_fp16_params"), dict):
                sd["fp32_from_fp16_params"] = [v for _, v in sorted(sd["fp32_from_fp16_params"].items())]
        super().load_state_dict(state_dict)

    def save_state_dict_to_file(self, filename: str) -> None:
        """``torch.save`` of this rank's state (torch checkpoint format; each DP rank writes its own shard)."""
        torch.save(super().state_dict(), filename)

    def load_state_dict_from_file(self, filename: str) -> None:
        super().load_state_dict(torch.load(filename, weights_only=False))
