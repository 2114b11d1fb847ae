"""``GlobalMemoryBuffer``: reusable scratch tensors (megatron-core exposes it as ``megatron.core.utils.GlobalMemoryBuffer``;
it lives here, below both ``utils`` and ``parallel_state``, so that neither imports the other to reach it)."""
from __future__ import annotations

import contextlib
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

    def get_tensor(self, tensor_shape, dtype: torch.dtype, name: str, mem_alloc_context=None) -> torch.Tensor:
        """A ``tensor_shape`` view of the (name, dtype) buffer, grown when too small; a growth allocates inside
        ``mem_alloc_context()`` when given (e.g. a memory pool)."""
        required = reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        buf = self.buffer.get(key)
        if buf is None or buf.numel() < required:
            with (mem_alloc_context() if mem_alloc_context is not None else contextlib.nullcontext()):
                buf = torch.empty(required, dtype=dtype, device=_device.current_device(), requires_grad=False)
            self.buffer[key] = buf
        return buf[0:required].view(*tensor_shape)
