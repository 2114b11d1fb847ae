"""Tensor splitting helpers for tensor parallelism."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.utils import all_gather_into_tensor, divide


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal chunks along its last dimension."""
    last_dim = tensor.dim() - 1
    last_dim_size = divide(tensor.size()[last_dim], num_partitions)
    tensor_list = torch.split(tensor, last_dim_size, dim=last_dim)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in tensor_list)
    return tensor_list


def _tp(tp_group):
    if tp_group is None:
        return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_group())
    return torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group), tp_group


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False, tp_group=None) -> torch.Tensor:
    """This TP rank's equal 1-D slice of ``tensor`` (used to distribute saved activations); ``tp_group`` defaults
    to parallel_state's."""
    tp_size, tp_rank, _ = _tp(tp_group)
    partition_size = torch.numel(tensor) // tp_size
    start_index = partition_size * tp_rank
    end_index = start_index + partition_size
    if new_buffer:
        data = torch.empty(partition_size, dtype=tensor.dtype, device=tensor.device, requires_grad=False)
        data.copy_(tensor.view(-1)[start_index:end_index])
        return data
    return tensor.view(-1)[start_index:end_index]


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the 1-D slices of the TP group."""
    tp_size, _, group = _tp(tp_group)
    numel_gathered = torch.numel(tensor) * tp_size
    gathered = torch.empty(numel_gathered, dtype=tensor.dtype, device=tensor.device, requires_grad=False)
    all_gather_into_tensor(gathered, tensor.contiguous(), group=group)
    return gathered


class VocabUtility:
    """The vocabulary range ``[first, last)`` owned by a TP rank; the vocab is split in equal contiguous parts."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        index_f = rank * per_partition_vocab_size
        return index_f, index_f + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Tuple[int, int]:
        per_partition_vocab_size = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition_vocab_size, rank, world_size)
