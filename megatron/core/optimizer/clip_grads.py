"""Global gradient norm, clipping and zero counting across tensor and pipeline parallel ranks.

Every rank holds a different piece of the model. The global L2 norm is ``sqrt(sum over pieces of
||g||^2)``, so each rank sums the squares of its pieces and an all-reduce over the model-parallel group
(TP x PP; the whole world for the distributed optimizer, whose pieces are also split over DP) adds them.
Pieces that exist on several ranks must be counted once: parameters replicated across TP ranks (norm
weights, row-parallel biases; ``param_is_not_tensor_parallel_duplicate`` keeps TP rank 0's copy) and the
copy of the tied word embedding on the last pipeline stage (``param.shared``).
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Union

import torch

from megatron.core.utils import log_once
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

_APEX_L2NORM = None


def _apex_l2norm():
    """(amp_C.multi_tensor_l2norm, multi_tensor_applier) when apex is installed, else None."""
    global _APEX_L2NORM
    if _APEX_L2NORM is None:
        try:
            import amp_C  # type: ignore
            from apex.multi_tensor_apply import multi_tensor_applier  # type: ignore

            _APEX_L2NORM = (amp_C.multi_tensor_l2norm, multi_tensor_applier)
        except ImportError:
            _APEX_L2NORM = False
    return _APEX_L2NORM or None


def param_is_not_shared(param) -> bool:
    return not getattr(param, "shared", False)


def _sum_of_squares(grads: List[torch.Tensor], dev: torch.device) -> torch.Tensor:
    if not grads:  # the same dtype as the other ranks' sums (they meet in one all-reduce)
        return torch.zeros((), dtype=torch.float32 if dev.type == "cuda" else torch.float64, device=dev)
    fused = _apex_l2norm() if grads[0].is_cuda else None
    if fused is not None:
        log_once("gradient norm=apex", "gradient norm: using apex amp_C.multi_tensor_l2norm")
        l2norm, applier = fused
        overflow = torch.zeros(1, dtype=torch.int, device=dev)
        norm, _ = applier(l2norm, overflow, [grads], False)
        return (norm.float() ** 2).reshape(())
    log_once("gradient norm=torch", "gradient norm: using torch._foreach_norm")
    if grads[0].is_cuda:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], 2)
        return torch.stack(norms).square().sum()
    # On CPU the fp32 reduction of a large tensor drifts (2e-5 relative for 1.6M elements, measured with torch
    # 2.13): accumulate in fp64, so that the norm does not depend on how the gradients are split over ranks.
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def get_grad_norm_fp32(grads_for_norm: Union[List[torch.Tensor], torch.Tensor], norm_type: Union[int, float] = 2,
                       model_parallel_group=None) -> float:
    """The global ``norm_type`` norm of ``grads_for_norm`` over ``model_parallel_group`` (None: world)."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    dev = grads_for_norm[0].device if grads_for_norm else _default_device()
    if math.isinf(norm_type):
        local = max((g.abs().max().float() for g in grads_for_norm), default=None)
        total = local.reshape(1) if local is not None else torch.zeros(1, dtype=torch.float32, device=dev)
        total = total.clone()
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=model_parallel_group)
        return total.item()
    if norm_type == 2.0:
        total = _sum_of_squares(list(grads_for_norm), dev).reshape(1)
    else:
        total = torch.zeros(1, dtype=torch.float32, device=dev)
        for g in grads_for_norm:
            total += torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=model_parallel_group)
    return total.item() ** (1.0 / norm_type)


def clip_grad_by_total_norm_fp32(parameters: Union[Iterable[torch.Tensor], torch.Tensor], max_norm: float,
                                 total_norm: float):
    """Scale every ``param.grad`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm_fp32(parameters, grads_for_norm, max_norm: float, norm_type: Union[int, float] = 2,
                        model_parallel_group=None) -> float:
    """Clip the gradients of ``parameters`` to a global norm of ``max_norm``; return the norm before clipping.

    ``grads_for_norm`` are the gradients that count towards the norm (duplicates already removed, see the
    module docstring); ``parameters`` are all those whose ``.grad`` gets scaled.
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    total_norm = get_grad_norm_fp32(grads_for_norm, norm_type, model_parallel_group)
    clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm)
    return total_norm


def count_zeros_fp32(parameters: Iterable[torch.Tensor], model_parallel_group=None, use_decoupled_grad: bool = False,
                     tp_group=None) -> int:
    """Number of zero gradient entries over the model-parallel group, counting each parameter once (a replicated
    parameter on rank 0 of ``tp_group``, parallel_state's TP group when None)."""
    if use_decoupled_grad:
        raise NotImplementedError("count_zeros_fp32(use_decoupled_grad=True): decoupled gradients (the "
                                  "precision-aware optimizer) are not implemented")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    dev: Optional[torch.device] = None
    total = None
    for param in parameters:
        if param.grad is None or not param_is_not_shared(param) or \
                not param_is_not_tensor_parallel_duplicate(param, tp_group):
            continue
        zeros = param.grad.numel() - torch.count_nonzero(param.grad)
        total = zeros if total is None else total + zeros
        dev = param.grad.device
    if total is None:
        total = torch.zeros((), dtype=torch.int64, device=dev or _default_device())
    total = total.reshape(1).to(torch.int64)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=model_parallel_group)
    return int(total.item())


def _default_device() -> torch.device:
    from megatron.core import device as _device

    return _device.current_device()
