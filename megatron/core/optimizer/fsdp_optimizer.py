"""The optimizer of fully sharded models (FSDP2 engine: ``--use-torch-fsdp2``, Megatron-FSDP ``optim_grads`` /
``optim_grads_params``).

The torch optimizer works on the DTensor parameters themselves: each is this rank's block of the fp32 main weight,
its ``.grad`` the matching block of the DP-averaged gradient (FSDP2 reduce-scattered it), and Adam's state is
created with the same sharding. So one step is the unsharded step, block by block (element-wise optimizers).

Global gradient norm: ``||g||^2 = sum over ranks of the squares of the local blocks``, one all-reduce over the
world. Every block exists once over the DP x CP ranks (dense) or the expert-DP ranks (experts); tensor-parallel
duplicates (replicated norm weights, row-parallel biases) count on TP rank 0 only, and pipeline parallelism is not
allowed with FSDP. Clipping multiplies every local block by ``max_norm / (norm + 1e-6)`` when that is below 1;
zeros are counted the same way. No loss scaling: FSDP trains in fp32 or bf16 (fp16 is refused).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from megatron.core import device as _device
from megatron.core.distributed.fsdp.sharded_module import local_tensor
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32, param_is_not_shared
from megatron.core.optimizer.optimizer import FP32Optimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate


def _counted_once(param) -> bool:
    """Whether this rank's block of ``param`` counts in world-wide sums (experts: always; others: TP rank 0 of a
    TP-replicated parameter)."""
    if not getattr(param, "allreduce", True):
        return True
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param)


class FullyShardedOptimizer(FP32Optimizer):
    """``FullyShardedOptimizer(torch_optimizer, config, model_chunks)`` over the chunks' DTensor parameters: the
    fp32 optimizer's state handling (the parameters are the main weights), with norms over the shards."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, model_chunks: List[torch.nn.Module]):
        super().__init__(optimizer, config)
        if config.fp16:
            raise ValueError("fully sharded data parallelism trains in fp32 or bf16: --fp16 is not supported")
        self.model_chunks = model_chunks

    def state_kinds(self) -> List[str]:
        """The per-parameter state tensors of the torch optimizer (Adam's moments, SGD's momentum buffer)."""
        return ["exp_avg", "exp_avg_sq"] if "Adam" in type(self.optimizer).__name__ else ["momentum_buffer"]

    def state_blocks(self, params, create: bool) -> Dict[str, Dict[int, torch.Tensor]]:
        """``{kind: {id(param): this rank's block of the parameter's state}}`` (checkpointing). Before the first step
        there is no state: zeros, which ``create`` (a load, that then fills them) puts into the optimizer with the
        step count."""
        kinds = self.state_kinds()
        out = {k: {} for k in kinds}
        for param in params:
            state = self.optimizer.state[param]
            for kind in kinds:
                value = state.get(kind)
                if value is None:
                    value = torch.zeros_like(param)
                    if create:
                        state[kind] = value
                out[kind][id(param)] = local_tensor(value)
            if create and kinds[0] == "exp_avg":
                state["step"] = torch.tensor(float(self._inner_steps), dtype=torch.float32)
        return out

    def get_model_parallel_group(self):
        return None  # blocks are disjoint over DP as well: sums run over the world

    def _local_grads(self, counted_only: bool) -> List[torch.Tensor]:
        return [local_tensor(p.grad).detach() for p in self.get_parameters()
                if p.grad is not None and (not counted_only or _counted_once(p))]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return self._local_grads(counted_only=True)

    def get_grad_norm(self) -> float:
        return get_grad_norm_fp32(self.get_main_grads_for_grad_norm(), 2, None)

    def clip_grad_by_total_norm(self, clip_grad: float, total_norm: float):
        coefficient = clip_grad / (total_norm + 1.0e-6)
        grads = self._local_grads(counted_only=False)
        if coefficient < 1.0 and grads:
            torch._foreach_mul_(grads, coefficient)

    def count_zeros(self) -> int:
        grads = self.get_main_grads_for_grad_norm()
        total = sum((g.numel() - torch.count_nonzero(g) for g in grads),
                    torch.zeros((), dtype=torch.int64, device=_device.current_device()))
        total = total.reshape(1).to(torch.int64)
        torch.distributed.all_reduce(total)
        return int(total.item())

    def prepare_grads(self) -> bool:
        return False  # the sharded gradients are the parameters' own .grad blocks already

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        with self._timed("optimizer-inner-step"):
            self._inner_step()
        with self._timed("params-all-gather"):
            for chunk in self.model_chunks:
                chunk.start_param_sync(force_sync=True)  # optim_grads: the updated blocks, gathered whole
        return True
