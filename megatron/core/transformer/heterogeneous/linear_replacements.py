"""The linear layer that replaces a whole attention or MLP block in a heterogeneous transformer
(``replace_with_linear`` in the block config): ``y = x W^T (+ b)`` with ``W`` of ``[hidden, hidden]``.

It is a :class:`ColumnParallelLinear` (each tensor-parallel rank holds ``hidden / tp`` output rows) whose output is
gathered back to the full hidden size, because the residual add that follows needs it:

* without sequence parallelism, the ranks' ``[s, b, hidden / tp]`` outputs are all-gathered along the last
  dimension (``gather_from_tensor_model_parallel_region``);
* with sequence parallelism the column-parallel layer all-gathered the sequence, so its output is
  ``[s, b, hidden / tp]`` and the block must return ``[s / tp, b, hidden]``: each rank zero-pads its slice to
  ``hidden`` at columns ``[rank * hidden / tp, (rank + 1) * hidden / tp)`` and a reduce-scatter along the
  sequence (``reduce_scatter_to_sequence_parallel_region``) sums the padded slices (giving the full hidden size)
  and keeps the rank's sequence chunk.

megatron-core's Transformer Engine variant (``TELayerNormColumnParallelLinearGathered``) is not available here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, tp_size_and_rank
from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.utils import divide


def _gather_from_tensor_parallel_region(x: torch.Tensor, config, tp_group=None) -> torch.Tensor:
    """This rank's ``[..., hidden / tp]`` output made full-width (module docstring); the identity without TP."""
    world, rank = tp_size_and_rank(tp_group)
    if world == 1:
        return x
    if not config.sequence_parallel:
        return gather_from_tensor_model_parallel_region(x, tp_group)
    width = divide(config.hidden_size, world)
    before = rank * width
    x = F.pad(x, [before, config.hidden_size - before - width])
    return reduce_scatter_to_sequence_parallel_region(x, tp_group)


class ColumnParallelLinearGathered(ColumnParallelLinear):
    """``ColumnParallelLinearGathered(config, *args, **kwargs)``: the ``hidden -> hidden`` linear replacement
    (``config.init_method``, a bias with ``config.add_bias_linear``, the bias added inside). Other arguments a
    spec passes (``layer_number``, ``tp_comm_buffer_name`` ...) are accepted and unused, except that a
    ``pg_collection``'s ``tp`` group is the tensor-parallel group (parallel_state's without one).
    ``forward(input_, weight=None, runtime_gather_output=None, **kwargs) -> (output, None)``."""

    def __init__(self, config, *args, **kwargs):
        pg_collection = kwargs.get("pg_collection")
        super().__init__(config.hidden_size, config.hidden_size, config=config, init_method=config.init_method,
                         gather_output=False, bias=config.add_bias_linear, skip_bias_add=False, is_expert=False,
                         tp_group=None if pg_collection is None else pg_collection.tp)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None, **kwargs):
        """The layer's output over the full hidden size (and ``None``: the bias is already added); extra keywords
        (the attention mask, rotary embeddings ...) are ignored. ``runtime_gather_output`` is refused."""
        out, bias = super().forward(input_, weight)
        if runtime_gather_output or self.gather_output:
            raise ValueError("gathering TP outputs is not supported for linear replacement")
        return _gather_from_tensor_parallel_region(out, self.config, self.tp_group), bias
