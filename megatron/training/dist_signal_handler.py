"""Catch a signal (SIGTERM by default) and let every rank learn whether any rank received it.

``--exit-signal-handler`` installs one for the whole run; the training loop asks
``get_signal_handler().signals_received()`` (a collective) and saves and exits when any rank got the signal.
"""
from __future__ import annotations

import signal

import torch

from megatron.core import device
from megatron.training.utils import distributed_is_initialized


def all_gather_item(item, dtype, group=None, async_op=False):
    """Every rank's value of the scalar ``item``, as a list indexed by rank."""
    if not distributed_is_initialized():
        return [torch.tensor(item, dtype=dtype).item()]
    world_size = torch.distributed.get_world_size(group=group)
    tensor = torch.tensor([item], device=device.current_device(), dtype=dtype)
    output = [torch.zeros_like(tensor) for _ in range(world_size)]
    torch.distributed.all_gather(output, tensor, group, async_op)
    return [elem.item() for elem in output]


class DistributedSignalHandler:
    def __init__(self, sig=signal.SIGTERM):
        self.sig = sig
        self._signal_received = False
        self.released = True
        self.original_handler = None

    def signals_received(self):
        """Per-rank flags (collective over the default group)."""
        return all_gather_item(self._signal_received, dtype=torch.int32)

    def __enter__(self):
        self._signal_received = False
        self.released = False
        self.original_handler = signal.getsignal(self.sig)

        def handler(signum, frame):
            self._signal_received = True

        signal.signal(self.sig, handler)
        return self

    def __exit__(self, type, value, tb):
        self.release()

    def release(self):
        if self.released:
            return False
        signal.signal(self.sig, self.original_handler)
        self.released = True
        return True
