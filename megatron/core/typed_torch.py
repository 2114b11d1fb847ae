"""Type-hinting helpers for torch interfaces (megatron-core's ``megatron.core.typed_torch``)."""
from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch

T = TypeVar("T")


def apply_module(m, *, check_subclass: bool = True) -> Callable:
    """``m`` unchanged (a ``torch.nn.Module``, called like its ``forward``); refuses a non-module when
    ``check_subclass``."""
    if check_subclass and not isinstance(m, torch.nn.Module):
        raise TypeError(f"{type(m)} is not a subclass of torch.nn.Module")
    return m


def not_none(value: Optional[T]) -> T:
    """``value``, which must not be None."""
    if value is None:
        raise ValueError("Expected value to be not None")
    return value
