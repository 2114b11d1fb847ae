"""``jit_fuser`` (megatron-core's ``megatron.core.jit``): the decorator of small element-wise functions. This library
compiles its fused kernels in :mod:`megatron.core.fusions` (``torch.compile`` on CUDA, eager on CPU, logged);
``jit_fuser`` runs the decorated function as written unless :func:`enable_jit_fuser` switches it to
``torch.compile``."""
from __future__ import annotations

import torch


def noop_decorator(func):
    return func


jit_fuser = noop_decorator


def enable_jit_fuser() -> None:
    """Decorate with ``torch.compile`` from now on (functions decorated earlier keep their form)."""
    global jit_fuser
    jit_fuser = torch.compile


def disable_jit_fuser() -> None:
    global jit_fuser
    jit_fuser = noop_decorator
