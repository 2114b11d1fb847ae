"""The Mamba-2 selective scan (state-space duality, "SSD") in pure PyTorch, and its causal depthwise convolution.

Per batch element and head ``h`` (head dim ``P``, state dim ``N``; head ``h`` reads group ``g = h // (H / G)`` of
``B`` and ``C``), with ``a_t = Δ_t A_h <= 0``::

    S_t = exp(a_t) S_{t-1} + Δ_t x_t B_tᵀ        (S ∈ R^{P×N}, S_{-1} = initial state or 0)
    y_t = S_t C_t + D_h x_t

:func:`ssd_recurrence` is that loop, one step at a time (the test oracle). :func:`ssd_chunked_scan` computes the
same values with matrix products over chunks of ``Q`` steps (the tail is padded with identity steps, Δ = 0):

1. ``λ_i = Σ_{r<=i} a_r`` inside the chunk; ``L[i, j] = exp(Σ_{j<r<=i} a_r)`` for ``j <= i`` and 0 above the
   diagonal, built from segment sums (a masked cumulative sum, -inf above the diagonal; exponentials are never
   divided);
2. diagonal block ``y_i = Σ_{j<=i} (C_i · B_j) L[i, j] Δ_j x_j``;
3. chunk state ``s_c = Σ_j exp(λ_{Q-1} - λ_j) Δ_j x_j B_jᵀ``, carried across chunks as
   ``S^(c) = exp(λ_{Q-1}) S^(c-1) + s_c``;
4. ``y_i += exp(λ_i) S^(c-1) C_i``, then ``y += D x``.

Everything runs in float32 (float64 inputs stay float64). Cost ``O(T Q (P + N) + T P N)`` per head.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


def causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``out[b, c, t] = bias[c] + Σ_{j<K} weight[c, 0, j] · x[b, c, t - K + 1 + j]`` (zeros before the start).

    ``x [b, C, T]``, ``weight [C, 1, K]`` (``nn.Conv1d``'s depthwise layout), ``bias [C]`` or None.
    """
    kernel = weight.shape[-1]
    return F.conv1d(x, weight, bias, padding=kernel - 1, groups=x.shape[1])[..., : x.shape[-1]]


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """``a [..., Q]`` -> ``[..., Q, Q]`` with entry ``[i, j] = Σ_{j<r<=i} a_r`` for ``j <= i`` and -inf above."""
    q = a.shape[-1]
    expanded = a.unsqueeze(-1).expand(*a.shape, q)  # [..., r, j] = a_r
    strictly_below = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(expanded.masked_fill(~strictly_below, 0), dim=-2)  # [..., i, j] = Σ_{j<r<=i} a_r
    lower = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~lower, float("-inf"))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ssd_chunked_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: Optional[torch.Tensor] = None, chunk_size: int = 128,
                     initial_state: Optional[torch.Tensor] = None,
                     return_final_state: bool = False, state_dtype: Optional[torch.dtype] = None):
    """The scan of the module docstring, chunked.

    ``x [b, T, H, P]``, ``dt [b, T, H]`` (Δ, after softplus), ``A [H]`` (negative), ``B``/``C [b, T, G, N]``,
    ``D [H]`` or None, ``initial_state [b, H, P, N]`` or None; ``state_dtype`` rounds the states carried between
    chunks to that dtype (``--mamba-training-ssm-states-dtype bf16``). Returns ``y [b, T, H, P]`` in ``x``'s dtype
    (and the final state ``[b, H, P, N]`` in the compute dtype with ``return_final_state``).
    """
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    if heads % groups:
        raise ValueError(f"the number of heads ({heads}) must be a multiple of the number of groups ({groups})")
    per_group = heads // groups
    dtype = _compute_dtype(x)
    q = min(chunk_size, length)  # a sequence shorter than a chunk is one chunk (no identity padding to compute)
    pad = (-length) % q
    xf, dtf, Bf, Cf = (t.to(dtype) for t in (x, dt, B, C))
    if pad:  # identity steps: Δ = 0 keeps the state and adds nothing
        xf = F.pad(xf, (0, 0, 0, 0, 0, pad))
        dtf = F.pad(dtf, (0, 0, 0, pad))
        Bf = F.pad(Bf, (0, 0, 0, 0, 0, pad))
        Cf = F.pad(Cf, (0, 0, 0, 0, 0, pad))
    chunks = (length + pad) // q
    # [b, c, l, g, j, ...]: head h = g * per_group + j
    xdt = (xf * dtf.unsqueeze(-1)).view(batch, chunks, q, groups, per_group, head_dim)
    a = (dtf * A.to(dtype)).view(batch, chunks, q, groups, per_group).permute(0, 1, 3, 4, 2)  # [b, c, g, j, l]
    Bc = Bf.view(batch, chunks, q, groups, state)
    Cc = Cf.view(batch, chunks, q, groups, state)

    lam = torch.cumsum(a, dim=-1)                                    # λ_i, [b, c, g, j, l]
    decay = torch.exp(_segment_sums(a))                              # L[i, s], [b, c, g, j, l, s]
    scores = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)              # C_i · B_s per group
    y = torch.einsum("bcgjls,bcsgjp->bclgjp", scores.unsqueeze(3) * decay, xdt)

    to_end = torch.exp(lam[..., -1:] - lam)                          # exp(λ_{Q-1} - λ_s), [b, c, g, j, s]
    chunk_states = torch.einsum("bcsgn,bcgjs,bcsgjp->bcgjpn", Bc, to_end, xdt)
    chunk_decay = torch.exp(lam[..., -1])                            # [b, c, g, j]

    carried = (torch.zeros(batch, groups, per_group, head_dim, state, dtype=dtype, device=x.device)
               if initial_state is None else initial_state.to(dtype).view(batch, groups, per_group, head_dim, state))
    starts = []
    for c in range(chunks):  # S^(c) = exp(λ_{Q-1}) S^(c-1) + s_c
        starts.append(carried)
        carried = chunk_decay[:, c, :, :, None, None] * carried + chunk_states[:, c]
        if state_dtype is not None:
            carried = carried.to(state_dtype).to(dtype)
    starts = torch.stack(starts, dim=1)                              # state entering each chunk, [b, c, g, j, p, n]
    y = y + torch.einsum("bclgn,bcgjpn,bcgjl->bclgjp", Cc, starts, torch.exp(lam))

    y = y.reshape(batch, chunks * q, heads, head_dim)[:, :length]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x.to(dtype)
    y = y.to(x.dtype)
    if return_final_state:
        return y, carried.reshape(batch, heads, head_dim, state)
    return y


def ssd_recurrence(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring, one step at a time: ``(y [b, T, H, P], final state [b, H, P, N])``."""
    batch, length, heads, head_dim = x.shape
    groups, state = B.shape[2], B.shape[3]
    Bh = B.repeat_interleave(heads // groups, dim=2)
    Ch = C.repeat_interleave(heads // groups, dim=2)
    S = (torch.zeros(batch, heads, head_dim, state, dtype=x.dtype, device=x.device)
         if initial_state is None else initial_state.to(x.dtype))
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        S = decay * S + (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * Bh[:, t].unsqueeze(-2)
        y = torch.einsum("bhpn,bhn->bhp", S, Ch[:, t])
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
    return torch.stack(ys, dim=1), S
