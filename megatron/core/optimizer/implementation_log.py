"""Log once per process which implementation of an optional fast path is in use (apex vs PyTorch)."""
from __future__ import annotations

import torch

_LOGGED = set()


def log_implementation_once(what: str, implementation: str) -> None:
    """Print ``> {what}: using {implementation}`` the first time this pair is seen (on global rank 0)."""
    key = (what, implementation)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    print(f"> {what}: using {implementation}", flush=True)
