"""Megatron-LM's 2023 local DDP signature, ``DistributedDataParallel(module, accumulate_allreduce_grads_in_fp32,
use_contiguous_buffers)``, as a thin layer over :class:`megatron.core.distributed.DistributedDataParallel`.

The legacy import path (``megatron.model.distributed``) re-exports this class. Gradients always live in
contiguous buffers: ``use_contiguous_buffers=False`` selected per-parameter ``main_grad`` tensors in
Megatron, which is numerically identical, so it is accepted and noted once.
"""
from __future__ import annotations

import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel as _CoreDDP
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

_NOTED_NON_CONTIGUOUS = False


class DistributedDataParallel(_CoreDDP):
    def __init__(self, module: torch.nn.Module, accumulate_allreduce_grads_in_fp32: bool,
                 use_contiguous_buffers: bool = True):
        global _NOTED_NON_CONTIGUOUS
        if not use_contiguous_buffers and not _NOTED_NON_CONTIGUOUS:
            _NOTED_NON_CONTIGUOUS = True
            print("> local DDP: use_contiguous_buffers=False requested; gradients use contiguous buffers anyway",
                  flush=True)
        config = getattr(module, "config", None)
        if config is None:
            config = TransformerConfig(num_layers=1, hidden_size=1, num_attention_heads=1)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=accumulate_allreduce_grads_in_fp32)
        super().__init__(config, ddp_config, module)
        self.accumulate_allreduce_grads_in_fp32 = accumulate_allreduce_grads_in_fp32
        self.use_contiguous_buffers = use_contiguous_buffers

    def allreduce_gradients(self):
        """Average the gradients over the data-parallel group (the old name of start + finish)."""
        self.start_grad_sync()
        self.finish_grad_sync()
