"""Rotary position embeddings (RoPE) in Megatron's "rotate half" layout (the same as Hugging Face Llama).

``RotaryEmbedding(kv_channels, rotary_percent)`` rotates the first ``kv_channels * rotary_percent`` channels
of each head; ``seq_len_interpolation_factor`` divides the positions (linear position interpolation).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.core.fusions import fused_kernels  # module import: resolved lazily (import cycle)


class RotaryEmbedding(torch.nn.Module):
    """Angles ``pos * base^(-2i/d)``, returned as ``[s, 1, 1, d]`` (both halves) by ``forward(max_seq_len)``."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000):
        super().__init__()
        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim % 2 != 0:
            raise ValueError(f"rotary dimension kv_channels*rotary_percent = {dim} must be even (--rotary-percent)")
        self.dim = dim
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        # Not a parameter and not saved: it is a function of the configuration.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = torch.outer(seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` (``[s, b, np, hn]``); pass the rest through.

    ``fused`` (``config.apply_rope_fusion``, ``--no-rope-fusion`` turns it off) runs the torch.compile'd
    kernel where one can be used (see :mod:`megatron.core.fusions.fused_kernels`); the math is the same.
    """
    return fused_kernels.ROTARY(t, freqs.to(t.device), fused=fused, flag_hint="--no-rope-fusion")
