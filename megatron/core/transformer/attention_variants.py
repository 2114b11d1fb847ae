"""The attention variants of today's model families (gpt-oss, Llama 4), in plain PyTorch.

* **Sliding window** (``window_size = (l, r)``, -1 = unbounded): query ``i`` may see key ``j`` iff
  ``i - l <= j <= i + r``; with ``sq`` queries after ``skv - sq`` cached keys (inference), query ``i`` sits at
  position ``i + skv - sq``. gpt-oss: ``(127, 0)`` = the current token and the 127 before it (Hugging Face
  ``sliding_window = 128``) on every other layer (``window_attn_skip_freq = 2``: layers 1, 3, 5 ... counted from 1).
* **Attention sinks** (``softmax_type``): a per-head logit ``s_h`` joins the softmax as an extra key column that is
  dropped after it, ``p_ij = exp(a_ij) / (sum_k exp(a_ik) + exp(s_h))``, so a row may give less than all of its weight
  to the keys. ``off-by-one``: ``s_h = 0``; ``learnable``: ``s_h`` is the parameter ``softmax_offset`` (``[heads]``,
  split over the TP ranks like the heads).
* **QK L2 norm** (Llama 4, ``qk_l2_norm``): ``x / sqrt(mean(x^2) + eps)`` over each head's channels of the queries
  and keys, in fp32, without a weight.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def window_mask(sq: int, skv: int, window: Tuple[int, int], device=None) -> torch.Tensor:
    """``[sq, skv]`` boolean, True where the sliding window hides key j from query i (module docstring)."""
    left, right = window
    q_pos = torch.arange(sq, device=device).unsqueeze(1) + (skv - sq)
    k_pos = torch.arange(skv, device=device).unsqueeze(0)
    hidden = torch.zeros(sq, skv, dtype=torch.bool, device=device)
    if left >= 0:
        hidden |= k_pos < q_pos - left
    if right >= 0:
        hidden |= k_pos > q_pos + right
    return hidden


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: Optional[torch.Tensor],
                         sinks: torch.Tensor, dropout=None) -> torch.Tensor:
    """softmax over the keys and one sink column per head: ``q`` ``[b, np, sq, hn]``, ``k``/``v`` ``[b, np, skv,
    hn]`` (as many heads as ``q``), ``hidden`` a boolean mask broadcastable to ``[b, np, sq, skv]`` (True = masked),
    ``sinks`` ``[np]``; returns ``[b, np, sq, hn]``. The scores and the softmax are computed in fp32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs.to(v.dtype), v)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension in fp32, returned in ``x``'s dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
