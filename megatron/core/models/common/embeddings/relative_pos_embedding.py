"""T5's relative position bias: a learned scalar per attention head and *bucket* of the key-minus-query offset,
added to the attention scores.

Buckets of an offset ``d = key_pos - query_pos`` with ``N`` buckets and maximum distance ``D``:
bidirectional attention gives half of the buckets to ``d > 0`` (offset ``N/2``) and the rest to ``d <= 0``, using
``|d|``; causal attention uses ``max(-d, 0)`` with all ``N``. Within the ``n`` buckets of one side, offsets below
``n/2`` get a bucket each; larger ones share ``n/2 + floor(log(|d| / (n/2)) / log(D / (n/2)) * (n - n/2))``
logarithmic buckets, capped at ``n - 1`` (every offset beyond ``D`` shares the last one).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = ["RelativePositionEmbedding"]


class RelativePositionEmbedding(torch.nn.Module):
    """``RelativePositionEmbedding(bidirectional, init_method, num_attention_heads,
    relative_attention_num_buckets=32, relative_attention_max_distance=128)``; ``forward(query_seq_length,
    key_seq_length)`` returns the bias ``[1, heads, query_seq_length, key_seq_length]``."""

    def __init__(self, bidirectional: bool, init_method: Callable, num_attention_heads: int,
                 relative_attention_num_buckets: int = 32, relative_attention_max_distance: int = 128) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.relative_attention_bias = torch.nn.Embedding(relative_attention_num_buckets, num_attention_heads)
        init_method(self.relative_attention_bias.weight)

    def _relative_position_bucket(self, relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        """The bucket (module docstring) of each offset in ``relative_position`` (key minus query position)."""
        bucket = torch.zeros_like(relative_position, dtype=torch.long)
        if bidirectional:
            num_buckets //= 2
            bucket += (relative_position > 0).long() * num_buckets
            distance = relative_position.abs()
        else:
            distance = (-relative_position).clamp(min=0)
        exact = num_buckets // 2
        log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
        far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
        return bucket + torch.where(distance < exact, distance, far)

    def _compute_bias(self, query_length: int, key_length: int) -> torch.Tensor:
        device = self.relative_attention_bias.weight.device
        offsets = (torch.arange(key_length, device=device)[None, :]
                   - torch.arange(query_length, device=device)[:, None])
        buckets = self._relative_position_bucket(offsets, self.bidirectional, self.relative_attention_num_buckets,
                                                 self.relative_attention_max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    @staticmethod
    def get_relative_seq_len(inference_context, transformer, transformer_input, transformer_config, *,
                             inference_params=None) -> int:
        """The full sequence length the bias must cover: the inference context's maximum, else the length of the
        block's input (its pipeline input when set) times the TP size under sequence parallelism."""
        inference_context = inference_context if inference_context is not None else inference_params
        if inference_context is not None:
            return inference_context.max_sequence_length
        source = transformer.input_tensor if getattr(transformer, "input_tensor", None) is not None \
            else transformer_input
        length = source.size(0)
        if transformer_config.sequence_parallel:
            length *= transformer_config.tensor_model_parallel_size
        return length

    def forward(self, query_seq_length: int, key_seq_length: int) -> torch.Tensor:
        return self._compute_bias(query_seq_length, key_seq_length)
