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

Packed sequences (THD, ``cu_seqlens``: document ``i`` fills rows ``cu[i] .. cu[i+1]`` of the packed tensor): each
document's positions restart at 0, so its rows get the angles ``freqs[0 .. len_i)``
(:func:`packed_sequence_rotary_freqs`); with context parallelism a rank holds chunks ``r`` and ``2 CP - 1 - r`` of
each document (``len_i / CP`` rows). When ``freqs`` has one row per packed token (``cu[-1]`` rows) they are taken
at the document's own offset instead (positions chosen by the caller, e.g. multimodal RoPE).

``rope_scaling`` (Llama-3.x) rescales ``inv_freq`` with ``factor`` (8 by default), low/high frequency factors 1 and
4 and an original context of 8192 tokens: with wavelength ``w = 2 pi / f``, ``w < 8192/4`` keeps ``f``,
``w > 8192/1`` gives ``f / factor``, in between ``s = (8192 / w - 1) / (4 - 1)`` and ``f' = (1 - s) f / factor + s f``.

YaRN (``YarnRotaryEmbedding``; multi-latent attention and ``--position-embedding-type yarn``), with rotary dim ``d``,
base ``theta``, factor ``s``, original context ``L_o`` and ``beta_fast`` / ``beta_slow``:

* ``e_i = theta^(-2i/d)`` (extrapolation), ``p_i = e_i / s`` (interpolation), ``i < d/2``;
* ``c(r) = d ln(L_o / (2 pi r)) / (2 ln theta)``; ``lo = c(beta_fast)``, ``hi = c(beta_slow)`` (floored / ceiled when
  rounding to integers), clamped to ``[0, d-1]``; ``ramp_i = clamp((i - lo) / (hi - lo), 0, 1)`` (``hi += 0.001``
  when equal) and ``f_i = p_i ramp_i + e_i (1 - ramp_i)``: fast dimensions keep their frequency, slow ones are
  interpolated;
* cos and sin are multiplied by the concentration ``g(s, mscale) / g(s, mscale_all_dim)`` with
  ``g(s, m) = 1 + 0.1 m ln s`` for ``s > 1`` (else 1); multi-latent attention also scales its softmax by
  ``g(s, mscale_all_dim)^2`` (:func:`yarn_get_mscale`).
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
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0, use_cpu_initialization: bool = False,
                 cp_group=None):
        super().__init__()
        # The angles are computed on the fly (nothing to initialise); the model splits them by context-parallel rank.
        self.cp_group = cp_group
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


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's ``g(s, m) = 1 + 0.1 m ln s`` for ``s > 1``, else 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_concentration(scale: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor YaRN multiplies cos and sin by: ``g(s, mscale) / g(s, mscale_all_dim)``."""
    return yarn_get_mscale(scale, mscale) / yarn_get_mscale(scale, mscale_all_dim)


def yarn_inv_freq(dim: int, rotary_base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float, beta_slow: float, round_to_int: bool = True) -> torch.Tensor:
    """YaRN's per-pair frequencies ``f_i`` (module docstring), fp32 ``[dim / 2]``."""
    def correction_dim(rotations):
        ratio = original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(rotary_base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    interpolation = extrapolation / scaling_factor
    return interpolation * ramp + extrapolation * (1 - ramp)


class YarnRotaryEmbedding(RotaryEmbedding):
    """megatron-core's ``YarnRotaryEmbedding(kv_channels, rotary_percent=1.0, rotary_interleaved=False,
    seq_len_interpolation_factor=None, rotary_base=10000, scaling_factor=1.0, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0, correction_range_round_to_int=True)``;
    ``forward(max_seq_len, offset=0)`` returns ``(angles [s, 1, 1, d], concentration)`` (module docstring).
    ``rotary_percent`` is not applied to the YaRN frequencies (as in megatron-core)."""

    def __init__(self, kv_channels: int, rotary_percent: float = 1.0, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: float = 10000,
                 scaling_factor: float = 1.0, original_max_position_embeddings: int = 4096, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, mscale: float = 1.0, mscale_all_dim: float = 0.0,
                 correction_range_round_to_int: bool = True, use_cpu_initialization: bool = False, cp_group=None):
        if rotary_interleaved:
            raise ValueError("YaRN rotary embeddings do not support rotary_interleaved (--rotary-interleaved)")
        super().__init__(kv_channels, 1.0, False, seq_len_interpolation_factor, rotary_base, cp_group=cp_group)
        self.scaling_factor = scaling_factor
        self.mscale = yarn_concentration(scaling_factor, mscale, mscale_all_dim)
        self.inv_freq = yarn_inv_freq(kv_channels, rotary_base, scaling_factor, original_max_position_embeddings,
                                      beta_fast, beta_slow, correction_range_round_to_int)

    def forward(self, max_seq_len: int, offset: int = 0):
        return super().forward(max_seq_len, offset), self.mscale


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


def packed_sequence_rotary_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int = 1,
                                 cp_rank: int = 0) -> torch.Tensor:
    """The angles of a packed (THD) tensor's rows: for document ``i`` (``L = cu_seqlens[i+1] - cu_seqlens[i]``
    tokens, of which this rank holds ``L / cp_size``), the rows of ``freqs`` at its positions ``0 .. L-1``, or
    with ``cp_size > 1`` at chunks ``cp_rank`` and ``2 cp_size - 1 - cp_rank`` of its ``2 cp_size`` chunks;
    concatenated in document order (``[sum_i L_i / cp_size, ...]``). If ``freqs`` has exactly ``cu_seqlens[-1]``
    rows, document ``i`` reads them from offset ``cu_seqlens[i]`` instead of 0."""
    bounds = [int(x) for x in cu_seqlens.tolist()]
    per_token = freqs.size(0) == bounds[-1]
    index = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        length, offset = end - start, (start if per_token else 0)
        positions = (context_parallel_chunk_indices(length, cp_size, cp_rank) if cp_size > 1
                     else torch.arange(length))
        index.append(positions + offset)
    if not index:
        return freqs[:0]
    rows = torch.cat(index).to(freqs.device)
    if int(rows.max()) >= freqs.size(0):
        raise ValueError(f"packed sequence: a document of {int(rows.max()) + 1} positions but rotary angles for "
                         f"{freqs.size(0)} only (max_seqlen_q / max_seqlen_kv of PackedSeqParams too small?)")
    return freqs.index_select(0, rows)


def deinterleave_rotary_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...]`` along the last dim: multi-latent attention's pair
    layout, which then rotates in the rotate-half layout (DeepSeek's interleaved RoPE; the output stays reordered)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, fused: bool = False,
                         interleaved: bool = False, mscale: float = 1.0) -> torch.Tensor:
    """Rotate the first ``freqs.shape[-1]`` channels of ``t`` (``[s, b, np, hn]``); pass the rest through.

    ``fused`` (``config.apply_rope_fusion``, ``--no-rope-fusion`` turns it off) runs the torch.compile'd
    kernel where one can be used (see :mod:`megatron.core.fusions.fused_kernels`); the math is the same.
    ``interleaved`` (``config.rotary_interleaved``) selects RoFormer's pair layout; ``mscale`` (YaRN's
    concentration) multiplies cos and sin.
    """
    op = fused_kernels.ROTARY_INTERLEAVED if interleaved else fused_kernels.ROTARY
    if mscale == 1.0:
        return op(t, freqs.to(t.device), fused=fused, flag_hint="--no-rope-fusion")
    return op(t, freqs.to(t.device), mscale, fused=fused, flag_hint="--no-rope-fusion")


def apply_rotary_pos_emb_with_cos_sin(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                      rotary_interleaved: bool = False) -> torch.Tensor:
    """Rotate ``t [s, b, np, hn]`` with precomputed ``cos`` / ``sin`` of shape ``[s, r/2]`` (cast to ``t``'s dtype):
    the first ``r`` channels are rotated, the rest pass through. Rotate-half pairs ``(x_j, x_{j+r/2})``, interleaved
    pairs ``(x_{2j}, x_{2j+1})``; each pair ``(a, b)`` becomes ``(a cos_j - b sin_j, a sin_j + b cos_j)``
    (flash-attn's ``apply_rotary_emb`` contract, which megatron-core calls here)."""
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    while cos.dim() < t.dim():  # [s, r/2] -> [s, 1, 1, r/2]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = cos.shape[-1]
    x, rest = t[..., :2 * half], t[..., 2 * half:]
    if rotary_interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = x[..., :half], x[..., half:]
        rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


class MultimodalRotaryEmbedding(torch.nn.Module):
    """M-RoPE (Qwen2-VL): ``MultimodalRotaryEmbedding(kv_channels, rotary_percent, rotary_interleaved=False,
    seq_len_interpolation_factor=None, rotary_base=10000, cp_group=None)``.

    ``forward(position_ids [3, b, s], mrope_section, cp_group=None)`` returns angles ``[s, b, 1, d]``
    (``d = kv_channels * rotary_percent``). Each frequency index ``j < d/2`` (``inv_freq`` as in
    :class:`RotaryEmbedding`) takes its position from one of the three position rows (temporal, height, width):
    the ``d/2`` frequencies are cut into consecutive sections of ``mrope_section`` (which sums to ``d/2``) and
    section ``i`` uses row ``i % 3``. The angles are laid out as for :class:`RotaryEmbedding` (rotate-half:
    ``cat(f, f)``; interleaved: each angle twice). Positions are divided by ``seq_len_interpolation_factor`` when
    set; with a context-parallel group of size > 1, the rows of this rank's tokens are kept
    (:func:`get_pos_emb_on_this_cp_rank`)."""

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: Optional[float] = None, rotary_base: int = 10000, cp_group=None):
        super().__init__()
        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.register_buffer("inv_freq", 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)),
                             persistent=False)
        if cp_group is None:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
        if sum(mrope_section) != self.inv_freq.numel():
            raise ValueError(f"mrope_section {list(mrope_section)} must sum to the rotary dimension / 2 "
                             f"({self.inv_freq.numel()})")
        pos = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            pos = pos / self.seq_len_interpolation_factor
        freqs = pos[..., None] * self.inv_freq  # [3, b, s, d/2]
        row = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
        row = row.to(freqs.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
        freqs = freqs.gather(0, row)[0]  # [b, s, d/2]: frequency j from row (section of j) % 3
        emb = freqs.repeat_interleave(2, dim=-1) if self.rotary_interleaved else torch.cat((freqs, freqs), dim=-1)
        emb = emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, d]
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and torch.distributed.get_world_size(group) > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, torch.distributed.get_world_size(group),
                                              torch.distributed.get_rank(group))
        return emb
