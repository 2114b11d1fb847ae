"""Rotary position embeddings (RoPE), in Megatron's "rotate half" layout or RoFormer's interleaved one.

``RotaryEmbedding(kv_channels, rotary_percent)`` rotates the first ``d = kv_channels * rotary_percent`` channels
of each head with angles ``pos * inv_freq[j]``, ``inv_freq[j] = base^(-2j/d)`` (j < d/2, fp32);
``seq_len_interpolation_factor`` divides the positions (linear position interpolation).

Layouts of the ``d`` channels: rotate-half (default, Llama) pairs channel ``j`` with ``j + d/2`` and the angle
vector is ``cat(f, f)``; interleaved (``rotary_interleaved``, RoFormer) pairs ``2j`` with ``2j+1`` and the
angle vector is ``[f0, f0, f1, f1, ...]``. Either way ``t' = t cos + rotate(t) sin``.

Context parallelism: a rank holds the positions of ``context_parallel_chunk_indices`` (chunks ``r`` and
``2 CP - 1 - r`` of ``2 CP``), so the angles are built for the full sequence and sliced the same way
(:func:`get_pos_emb_on_this_cp_rank`); the batch's ``position_ids`` are not used for RoPE, as in megatron-core.

``rope_scaling`` (Llama-3.x) rescales ``inv_freq`` with ``factor`` (8 by default), low/high frequency factors 1 and
4 and an original context of 8192 tokens: with wavelength ``w = 2 pi / f``, ``w < 8192/4`` keeps ``f``,
``w > 8192/1`` gives ``f / factor``, in between ``s = (8192 / w - 1) / (4 - 1)`` and ``f' = (1 - s) f / factor + s f``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core.fusions import fused_kernels
from megatron.core.utils import context_parallel_chunk_indices

LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float = 8.0) -> torch.Tensor:
    """Llama-3.x frequency scaling of ``inv_freq`` (see the module docstring for the formula)."""
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    wavelen = 2 * math.pi / inv_freq
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, smoothed)
    return torch.where(wavelen < high_wavelen, inv_freq, out)


class RotaryEmbedding(torch.nn.Module):
    """``RotaryEmbedding(kv_channels, rotary_percent, rotary_interleaved=False, seq_len_interpolation_factor=None,
    rotary_base=10000, rope_scaling=False, rope_scaling_factor=8.0)``; ``forward(max_seq_len)`` returns the
    angles ``[s, 1, 1, d]`` in the chosen layout."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0, **unused):
        super().__init__()
        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim % 2 != 0:
            raise ValueError(f"rotary dimension kv_channels*rotary_percent = {dim} must be even (--rotary-percent)")
        self.dim = dim
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if rope_scaling:
            inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
        # Not a parameter and not saved: it is a function of the configuration.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype) + offset
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = torch.outer(seq, self.inv_freq)
        if self.rotary_interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int = 0, cp_size: Optional[int] = None,
                                cp_rank: Optional[int] = None) -> torch.Tensor:
    """The rows of the full-sequence angles ``pos_emb`` that this context-parallel rank's tokens have (see the
    module docstring); the CP size and rank default to this process's."""
    if cp_size is None or cp_rank is None:
        from megatron.core import parallel_state

        cp_size = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
    if cp_size <= 1:
        return pos_emb
    index = context_parallel_chunk_indices(pos_emb.size(seq_dim), cp_size, cp_rank).to(pos_emb.device)
    return pos_emb.index_select(seq_dim, index)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, fused: bool = False,
                         interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` (``[s, b, np, hn]``); pass the rest through.

    ``fused`` (``config.apply_rope_fusion``, ``--no-rope-fusion`` turns it off) runs the torch.compile'd
    kernel where one can be used (see :mod:`megatron.core.fusions.fused_kernels`); the math is the same.
    ``interleaved`` (``config.rotary_interleaved``) selects RoFormer's pair layout.
    """
    op = fused_kernels.ROTARY_INTERLEAVED if interleaved else fused_kernels.ROTARY
    return op(t, freqs.to(t.device), fused=fused, flag_hint="--no-rope-fusion")
