"""``--DDP-impl torch``: PyTorch's DistributedDataParallel on the data-parallel group.

It gives the same interface as our local DDP so that schedules, ``finalize_model_grads`` and the
optimizers do not care which one is in use: after ``finish_grad_sync()`` every parameter's ``main_grad``
is its (already DP-averaged) ``.grad``. Gradients are reduced by torch's reducer during every backward
pass outside ``no_sync()``; the accumulation dtype is the parameter dtype (no fp32 accumulation, no
gradient accumulation fusion (switched off here, with a log line), no distributed optimizer: those need
``--DDP-impl local``).
"""
from __future__ import annotations

import torch

from megatron.core import parallel_state
from megatron.core.utils import log_once


def _disable_gradient_accumulation_fusion(module: torch.nn.Module) -> bool:
    """Switch fusion off in the configs and layers of ``module``; True if it was on anywhere."""
    found = False
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "gradient_accumulation_fusion", False):
            config.gradient_accumulation_fusion = False
            found = True
        if getattr(m, "gradient_accumulation_fusion", False):
            m.gradient_accumulation_fusion = False
            found = True
    return found


class TorchDistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module: torch.nn.Module, process_group=None, **kwargs):
        # Gradient accumulation fusion adds weight gradients into param.main_grad buffers that only the local
        # DDP allocates, and would bypass torch's reducer: torch DDP needs the gradients in .grad.
        if _disable_gradient_accumulation_fusion(module):
            log_once("torch-ddp-no-fusion", "--DDP-impl torch: gradient accumulation fusion turned off (it needs the "
                                            "main_grad buffers of --DDP-impl local)")
        if process_group is None:
            process_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        super().__init__(module, process_group=process_group, **kwargs)

    def start_grad_sync(self, *unused):
        """Nothing to start: torch's reducer already ran during backward."""

    def finish_grad_sync(self):
        for param in self.module.parameters():
            if param.requires_grad:
                param.main_grad = param.grad

    def zero_grad_buffer(self, zero_buffer: bool = True):
        for param in self.module.parameters():
            param.grad = None
            if hasattr(param, "main_grad"):
                del param.main_grad

    def broadcast_params(self):
        src = torch.distributed.get_global_rank(self.process_group, 0)
        for param in self.module.parameters():
            torch.distributed.broadcast(param.data, src=src, group=self.process_group)

    def state_dict(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        if hasattr(self.module, "state_dict_for_save_checkpoint"):
            return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
