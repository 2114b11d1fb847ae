"""Reduce-scatter of low-precision (bf16 / fp16) tensors summed in fp32.

An ordinary reduce-scatter adds the ranks' values in the tensor's own dtype. Here an all-to-all first gives every rank
the ``W`` copies of its own shard (``W`` = the group size; the input is viewed as ``W`` equal shards, shard ``r``
going to rank ``r``), then the rank adds them in fp32 and writes the sum, cast to the output's dtype, into
``output_tensor``: one rounding instead of ``W - 1``. Only ``ReduceOp.SUM`` is supported.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


class _ReduceScatterWithFP32AccumulationWorkHandle:
    """What an ``async_op=True`` call returns: :meth:`wait` finishes the all-to-all and does the fp32 sum."""

    def __init__(self, all_to_all_handle: Any, all_to_all_output_tensor: torch.Tensor, output_tensor: torch.Tensor,
                 world_size: int):
        self.all_to_all_handle = all_to_all_handle
        self.all_to_all_output_tensor = all_to_all_output_tensor
        self.output_tensor = output_tensor
        self.world_size = world_size

    def wait(self):
        if self.all_to_all_handle is not None:
            self.all_to_all_handle.wait()
        shards = self.all_to_all_output_tensor.view(self.world_size, -1)
        self.output_tensor.copy_(torch.sum(shards, dim=0, dtype=torch.float32).view_as(self.output_tensor))


def reduce_scatter_with_fp32_accumulation(output_tensor: torch.Tensor, input_tensor: torch.Tensor, op, group,
                                          async_op: bool) -> Optional[_ReduceScatterWithFP32AccumulationWorkHandle]:
    """``output_tensor`` (this rank's shard, ``input_tensor.numel() / W`` elements) = the fp32 sum over ``group``
    of every rank's shard ``rank`` of ``input_tensor``. With ``async_op`` a handle whose ``wait()`` completes it."""
    if op != torch.distributed.ReduceOp.SUM:
        raise ValueError("reduce_scatter_with_fp32_accumulation supports ReduceOp.SUM only")
    world_size = torch.distributed.get_world_size(group)
    if input_tensor.numel() % world_size != 0:
        raise ValueError(f"reduce_scatter_with_fp32_accumulation: {input_tensor.numel()} elements do not split into "
                         f"{world_size} equal shards")
    received = torch.empty_like(input_tensor)
    handle = torch.distributed.all_to_all_single(received, input_tensor, group=group, async_op=async_op)
    work = _ReduceScatterWithFP32AccumulationWorkHandle(handle, received, output_tensor, world_size)
    if async_op:
        return work
    work.wait()
    return None
