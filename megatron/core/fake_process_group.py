"""``--fake-process-group``: one process acts as rank ``r`` of a ``W``-rank job.

``init_fake_process_group(rank, world_size)`` initialises torch.distributed with PyTorch's "fake" backend
(``torch.testing._internal.distributed.fake_pg``, PyTorch >= 2.3): every collective and point-to-point call returns
at once without moving data. The rest of the library runs unchanged on top of it: ``parallel_state`` builds every
group of the rank grid (so rank ``r`` gets exactly the groups, coordinates and model shard it would have in the
real job), the model, DDP buffers and optimizer are built for that rank and its iterations run. Values that would
have come from other ranks are whatever the local buffer held (received activations, all-reduced gradients):
meaningless, while shapes, dtypes and therefore memory are real.

Where the library would wait for data from a peer that never arrives, the fake rank produces it itself: every
tensor-parallel rank reads its own copy of the batch (:func:`is_fake_process_group` in the data path).
"""
from __future__ import annotations

import torch


def init_fake_process_group(rank: int, world_size: int, timeout=None) -> None:
    """``init_process_group(backend="fake")`` for ``rank`` of ``world_size`` ranks (no rendezvous, no peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not 0 <= rank < world_size:
        raise ValueError(f"--fake-process-group: rank {rank} is not in a world of {world_size} ranks (RANK, "
                         "WORLD_SIZE)")
    kwargs = {} if timeout is None else {"timeout": timeout}
    torch.distributed.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=world_size,
                                         **kwargs)


def is_fake_process_group() -> bool:
    """True when torch.distributed runs on the fake backend."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_backend() == "fake")
