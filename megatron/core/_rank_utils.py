"""This process's global rank without requiring torch.distributed, and logging on one rank only."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch


def safe_get_rank() -> int:
    """The global rank: torch.distributed's once initialised, else the ``RANK`` environment variable (set by
    torchrun), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        return int(os.environ.get("RANK", 0))
    except (TypeError, ValueError):
        return 0


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only (see :func:`safe_get_rank`)."""
    if safe_get_rank() == rank:
        logger.log(*args, **kwargs)
