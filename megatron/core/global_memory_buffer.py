"""``GlobalMemoryBuffer``: reusable scratch tensors (megatron-core exposes it as ``megatron.core.utils.GlobalMemoryBuffer``;
it lives here, below both ``utils`` and ``parallel_state``, so that neither imports the other to reach it)."""
from __future__ import annotations

import operator
from functools import reduce

import torch

from megatron.core import device as _device


class GlobalMemoryBuffer:
    """Reusable scratch tensors keyed by (name, dtype), grown on demand.

    Used by sequence parallelism for the all-gather output so that every layer does not allocate a new
    full-sequence buffer.
    """

    def __init__(self):
        self.buffer: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype: torch.dtype, name: str) -> torch.Tensor:
        required = reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        buf = self.buffer.get(key)
        if buf is None or buf.numel() < required:
            buf = torch.empty(required, dtype=dtype, device=_device.current_device(), requires_grad=False)
            self.buffer[key] = buf
        return buf[0:required].view(*tensor_shape)
