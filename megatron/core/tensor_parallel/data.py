"""Broadcast a batch from TP rank 0 to the other ranks of its TP group (megatron.core.tensor_parallel.data).

Only TP rank 0 reads data; the others receive it. Sizes go first (a fixed-width int64 tensor per key) so
receivers can allocate, then one flattened tensor with every key's data. Under ``--fake-process-group`` nothing
arrives, so every rank reads its own batch and uses it as if it were the source's.
"""
from __future__ import annotations

import torch

from megatron.core import device
from megatron.core.fake_process_group import is_fake_process_group
from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
)

_MAX_DATA_DIM = 5


def _check_data_types(keys, data, target_dtype):
    for key in keys:
        if data[key].dtype != target_dtype:
            raise TypeError(f"{key} has data type {data[key].dtype} which is different than {target_dtype}")


def _is_source(data) -> bool:
    return get_tensor_model_parallel_rank() == 0 or (data is not None and is_fake_process_group())


def _build_key_size_numel_dictionaries(keys, data):
    sizes = [0] * (_MAX_DATA_DIM * len(keys))
    if _is_source(data):
        offset = 0
        for key in keys:
            if data[key].dim() >= _MAX_DATA_DIM:
                raise ValueError(f"you should increase _MAX_DATA_DIM: {key} has {data[key].dim()} dims")
            for i, s in enumerate(data[key].size()):
                sizes[i + offset] = s
            offset += _MAX_DATA_DIM

    if get_tensor_model_parallel_world_size() == 1:
        # Nothing to receive: skip the collective and, above all, the device-to-host copy of the sizes (a
        # host-device synchronisation on every batch on GPU).
        sizes_cpu = sizes
    else:
        sizes_t = torch.tensor(sizes, dtype=torch.long, device=device.current_device())
        torch.distributed.broadcast(sizes_t, get_tensor_model_parallel_src_rank(),
                                    group=get_tensor_model_parallel_group())
        sizes_cpu = sizes_t.cpu().tolist()

    key_size, key_numel, total_numel = {}, {}, 0
    offset = 0
    for key in keys:
        size, numel = [], 1
        i = 0
        while sizes_cpu[offset + i] > 0:
            size.append(sizes_cpu[offset + i])
            numel *= sizes_cpu[offset + i]
            i += 1
        key_size[key], key_numel[key] = size, numel
        total_numel += numel
        offset += _MAX_DATA_DIM
    return key_size, key_numel, total_numel


def broadcast_data(keys, data, datatype):
    """Broadcast ``data[key]`` for each key from the TP source rank; other ranks may pass ``data=None``.

    Returns a dict of tensors on this process's device (``megatron.core.device.current_device()``).
    """
    key_size, key_numel, total_numel = _build_key_size_numel_dictionaries(keys, data)
    dev = device.current_device()
    if _is_source(data):
        _check_data_types(keys, data, datatype)
        flatten_data = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0).to(dev)
    else:
        flatten_data = torch.empty(total_numel, device=dev, dtype=datatype)
    torch.distributed.broadcast(flatten_data, get_tensor_model_parallel_src_rank(), group=get_tensor_model_parallel_group())

    output, offset = {}, 0
    for key in keys:
        numel = key_numel[key]
        output[key] = flatten_data.narrow(0, offset, numel).view(key_size[key])
        offset += numel
    return output
