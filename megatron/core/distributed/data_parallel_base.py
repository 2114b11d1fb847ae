"""``_BaseDataParallel``: what every data-parallel wrapper of a model offers (megatron-core's template).

The wrapper runs the wrapped module's forward and hands out its (sharded) state dicts; the gradient
synchronisation hooks (``no_sync``, ``start_grad_sync``, ``finish_grad_sync``, ``scale_gradients``,
``zero_grad_buffer``, ``broadcast_params``) do nothing here, which is right for a single data-parallel replica;
:class:`~megatron.core.distributed.DistributedDataParallel` overrides them with its bucketed reductions.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron.core.transformer.module import MegatronModule


class _BaseDataParallel(MegatronModule):
    """``_BaseDataParallel(config, module)``."""

    def __init__(self, config, module: torch.nn.Module):
        super().__init__(config=config)
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside skip the gradient synchronisation (nothing to skip here)."""
        yield

    def start_grad_sync(self, *unused):
        """Start reducing the gradients over the data-parallel ranks (nothing to reduce here)."""

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply the gradients by ``scaling_factor`` (they live in the parameters' ``.grad`` here)."""

    def finish_grad_sync(self):
        """Wait for the gradient reduction (nothing to wait for here)."""

    def zero_grad_buffer(self):
        """Zero the gradient buffers at the start of an iteration (none here)."""

    def broadcast_params(self):
        """Make the parameters equal across data-parallel ranks (one replica here)."""

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        inner = self.module
        if hasattr(inner, "state_dict_for_save_checkpoint"):
            return inner.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return inner.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", *args, **kwargs):
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
