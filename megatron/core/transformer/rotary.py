"""Rotary position embeddings (RoPE) in Megatron's "rotate half" layout (the same as Hugging Face Llama).

``RotaryEmbedding(kv_channels, rotary_percent)`` rotates the first ``kv_channels * rotary_percent`` channels
of each head; ``seq_len_interpolation_factor`` divides the positions (linear position interpolation).
"""
from __future__ import annotations

from typing import Optional

import torch


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` (``[s, b, np, hn]``); pass the rest through."""
    rot_dim = freqs.shape[-1]
    freqs = freqs.to(t.device)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos = torch.cos(freqs).to(t.dtype)
    sin = torch.sin(freqs).to(t.dtype)
    t_rot = (t_rot * cos) + (_rotate_half(t_rot) * sin)
    return torch.cat((t_rot, t_pass), dim=-1)
