"""Collectives of the generation loop.

Tokens and flags travel from the last pipeline stage (which owns the logits and samples) to the other stages by
broadcast over the pipeline group; activations travel stage to stage with point-to-point send/recv; the request
itself (prompts, sampling settings) is broadcast from global rank 0 to every rank.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core import device, parallel_state


def _device():
    return device.current_device()


def broadcast_from_last_pipeline_stage(size, dtype, tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank of the pipeline group gets the last stage's ``tensor`` (``size`` elements or a shape)."""
    if parallel_state.is_pipeline_last_stage():
        tensor = tensor.to(device=_device(), dtype=dtype).contiguous()
    else:
        tensor = torch.empty(size, dtype=dtype, device=_device())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.broadcast(tensor, parallel_state.get_pipeline_model_parallel_last_rank(),
                                    group=parallel_state.get_pipeline_model_parallel_group())
    return tensor


def broadcast_within_tensor_parallel_group(tensor: torch.Tensor) -> torch.Tensor:
    """TP rank 0's ``tensor`` on every TP rank (keeps sampled tokens identical whatever each rank's RNG did)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(tensor, parallel_state.get_tensor_model_parallel_src_rank(),
                                    group=parallel_state.get_tensor_model_parallel_group())
    return tensor


def send_to_next_pipeline_stage(tensor: torch.Tensor) -> None:
    if not parallel_state.is_pipeline_last_stage():
        torch.distributed.send(tensor.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())


def recv_from_prev_pipeline_stage(shape, dtype) -> Optional[torch.Tensor]:
    if parallel_state.is_pipeline_first_stage():
        return None
    tensor = torch.empty(shape, dtype=dtype, device=_device())
    torch.distributed.recv(tensor, parallel_state.get_pipeline_model_parallel_prev_rank())
    return tensor


def broadcast_tensor(size, dtype, tensor: Optional[torch.Tensor] = None, rank: int = 0) -> torch.Tensor:
    """Broadcast from global ``rank`` to the whole world (the request, driven by the HTTP rank)."""
    if torch.distributed.get_rank() == rank:
        tensor = tensor.to(device=_device(), dtype=dtype).contiguous()
    else:
        tensor = torch.empty(size, dtype=dtype, device=_device())
    torch.distributed.broadcast(tensor, rank)
    return tensor


def broadcast_list(size: int, dtype, values: Optional[List] = None, rank: int = 0) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype) if torch.distributed.get_rank() == rank else None
    return broadcast_tensor(size, dtype, tensor, rank)


def broadcast_int_list(size: int, int_list: Optional[List[int]] = None, rank: int = 0) -> torch.Tensor:
    return broadcast_list(size, torch.int64, int_list, rank)


def broadcast_float_list(size: int, float_list: Optional[List[float]] = None, rank: int = 0) -> torch.Tensor:
    return broadcast_list(size, torch.float64, float_list, rank)
