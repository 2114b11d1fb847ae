"""Rank-aware printing helpers of the training framework (more utilities join later)."""
from __future__ import annotations

import torch


def distributed_is_initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_rank_0() -> bool:
    """True on global rank 0, and in a process without torch.distributed."""
    return not distributed_is_initialized() or torch.distributed.get_rank() == 0


def is_last_rank() -> bool:
    """True on the last global rank (where Megatron prints training logs), and without torch.distributed."""
    return not distributed_is_initialized() or torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_0(message):
    """Print on rank 0 only (or always, without torch.distributed)."""
    if is_rank_0():
        print(message, flush=True)


def print_rank_last(message):
    """Print on the last rank only (or always, without torch.distributed)."""
    if is_last_rank():
        print(message, flush=True)
