"""Attention across a context-parallel (CP) group, in pure PyTorch (megatron-core leaves this to Transformer Engine).

Layout
------
With CP ranks each sequence of ``S`` tokens is cut into ``2 CP`` chunks of ``c = S / (2 CP)`` tokens and rank ``r``
holds chunks ``r`` and ``2 CP - 1 - r`` (:func:`megatron.core.utils.context_parallel_chunk_indices`), for the
queries as for the keys and values. Under a causal mask chunk ``x`` attends to the chunks ``y <= x`` (to itself
with the causal triangle), so every rank gets one early (cheap) and one late (expensive) chunk.

Blockwise softmax
-----------------
For a query row ``q`` and a block ``B`` of keys, ``l_B = log sum_{k in B} exp(s_k)`` with ``s_k = q.k / sqrt(d)``
and ``o_B = sum_{k in B} exp(s_k - l_B) v_k`` are the block's log-sum-exp and normalised output. Two disjoint
blocks merge exactly into the attention over their union::

    l = log(exp(l_A) + exp(l_B))                     (torch.logaddexp)
    o = exp(l_A - l) o_A + exp(l_B - l) o_B

so the output over all keys is built block by block without ever holding the ``S x S`` scores. Attention
dropout is applied to each block's normalised probabilities; since the merge weights ``exp(l_B - l)`` turn them
into the probabilities of the full softmax, this equals dropout on the full softmax.

``p2p`` (ring)
--------------
Keys and values go round the CP ring for ``CP`` steps: at step ``i`` rank ``r`` holds the KV of rank
``j = (r - i) mod CP`` (chunks ``j`` and ``2 CP - 1 - j``) and sends it on to rank ``r + 1``. Causal handling
per chunk pair:

* ``i = 0`` (own KV): ordinary causal attention over the local ``2c`` tokens (chunk ``r`` precedes chunk
  ``2 CP - 1 - r``, so the local order is the global order);
* ``j < r``: both local query chunks come after KV chunk ``j`` and before KV chunk ``2 CP - 1 - j``: all
  ``2c`` queries attend, without a mask, to the first KV chunk only;
* ``j > r``: query chunk ``r`` precedes both KV chunks (skipped); query chunk ``2 CP - 1 - r`` follows both:
  only the second half of the queries attends, without a mask, to the whole KV block and only its running
  statistics are merged.

Without a causal mask every step is full attention. The backward pass is autograd through the same blocks; the
ring shift is a differentiable op (:class:`_RingShift`: forward sends to ``r + 1`` and receives from ``r - 1``,
backward sends the gradient back to ``r - 1`` and receives from ``r + 1``), so dK/dV travel the ring in reverse.
Sends and receives use ``torch.distributed.batch_isend_irecv`` over the CP group (gloo and NCCL).

``all_gather``
--------------
K and V are all-gathered over the CP group (backward: reduce-scatter of dK/dV, :class:`_AllGatherCP`), put back
in natural order, and query chunk ``x`` attends to the keys ``[0, (x + 1) c)`` with the causal triangle on its
own chunk (key position ``<=`` query position).

``a2a`` (all-to-all, DeepSpeed-Ulysses)
--------------------------------------
The heads are cut into ``CP`` equal groups (query heads and key/value groups alike: both must divide by ``CP``) and
one all-to-all gives rank ``r`` head group ``r`` for every token of the sequence (:func:`_exchange_slots`; it is its
own transpose, so its backward is the same exchange). Put back in natural order, that is ordinary (causal)
attention over the whole sequence for ``1/CP`` of the heads; the reverse all-to-all returns every rank's tokens
with all heads. Grouped-query attention keeps working because query head group ``r`` uses exactly key/value group
``r``. Two all-to-alls of Q, K, V and one of the output replace the ring; the scores are ``S x S`` per head.

Scores and softmax statistics are computed in fp32 whatever the input dtype; the output has the queries' dtype.
"""
from __future__ import annotations

import contextlib
import math
from typing import List, Optional

import torch

from megatron.core.transformer.moe.moe_utils import all_to_all
from megatron.core.utils import all_gather_into_tensor, context_parallel_chunk_indices, reduce_scatter_tensor

CP_COMM_TYPES_IMPLEMENTED = ("p2p", "all_gather", "a2a")


# ------------------------------------------------------------------------------------------------ communication
def _ring_exchange(x: torch.Tensor, group, global_ranks: List[int], to_next: bool) -> torch.Tensor:
    """Send ``x`` to the next CP rank and receive the previous rank's tensor (reversed with ``to_next=False``)."""
    n = len(global_ranks)
    me = torch.distributed.get_rank(group=group)
    dst = global_ranks[(me + 1) % n] if to_next else global_ranks[(me - 1) % n]
    src = global_ranks[(me - 1) % n] if to_next else global_ranks[(me + 1) % n]
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [torch.distributed.P2POp(torch.distributed.isend, x, dst, group),
           torch.distributed.P2POp(torch.distributed.irecv, out, src, group)]
    for req in torch.distributed.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingShift(torch.autograd.Function):
    """``y`` on rank ``r`` is ``x`` of rank ``r - 1``; the gradient goes the other way round."""

    @staticmethod
    def forward(ctx, x, group, global_ranks):
        ctx.group, ctx.global_ranks = group, global_ranks
        return _ring_exchange(x, group, global_ranks, to_next=True)

    @staticmethod
    def backward(ctx, grad):
        return _ring_exchange(grad, ctx.group, ctx.global_ranks, to_next=False), None, None


class _AllGatherCP(torch.autograd.Function):
    """``[n, ...]`` stack of every CP rank's ``x`` (rank order); backward: the sum over ranks of the gradient
    of this rank's slot (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = torch.distributed.get_world_size(group=group)
        x = x.contiguous()
        out = torch.empty((n * x.size(0),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_into_tensor(out, x, group=group)
        return out.view((n,) + tuple(x.shape))

    @staticmethod
    def backward(ctx, grad):
        n = grad.size(0)
        grad = grad.contiguous().view((n * grad.size(1),) + tuple(grad.shape[2:]))
        out = torch.empty((grad.size(0) // n,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


def _exchange_slots(x: torch.Tensor, group) -> torch.Tensor:
    """``x [n, rows, ...]``: slot ``j`` goes to CP rank ``j``; slot ``i`` of the result came from rank ``i``. The
    MoE layer's autograd-aware all-to-all with equal splits (its backward is the same exchange)."""
    n, rows = x.size(0), x.size(1)
    return all_to_all(group, x.reshape((n * rows,) + tuple(x.shape[2:])), [rows] * n, [rows] * n).view(x.shape)


# ------------------------------------------------------------------------------------------------------- math
def block_attention(q, k, v, scale: float, causal_offset: Optional[int] = None, dropout=None):
    """Attention of queries ``q [b, h, sq, d]`` over one key block ``k, v [b, h, sk, d]`` (fp32).

    Returns ``(o, lse)``: the block-normalised output ``[b, h, sq, d]`` and the log-sum-exp ``[b, h, sq, 1]`` of
    the scores (module docstring). ``causal_offset`` ``t`` masks key ``k_idx > q_idx + t`` (``t = 0``: the
    diagonal block; ``t = sk - sq``: queries at the end of the keys); ``None`` is no mask.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal_offset is not None:
        sq, sk = scores.shape[-2], scores.shape[-1]
        masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1 + causal_offset)
        scores = scores.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse)
    if dropout is not None:
        probs = dropout(probs)
    return torch.matmul(probs, v), lse


def merge_partial(out, lse, out_b, lse_b):
    """Exact merge of two partial attentions over disjoint key sets (module docstring)."""
    new = torch.logaddexp(lse, lse_b)
    return torch.exp(lse - new) * out + torch.exp(lse_b - new) * out_b, new


def _heads_first(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """``[s, b, g, d]`` -> ``[b, g * repeat, s, d]`` in fp32 (grouped-query heads repeated to the query heads)."""
    x = x.permute(1, 2, 0, 3).float()
    return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x


def _p2p_attention(q, kv, scale, causal, group, global_ranks, dropout, repeat):
    cp = len(global_ranks)
    r = torch.distributed.get_rank(group=group)
    half = q.size(2) // 2
    out = lse = None
    for step in range(cp):
        # Pass the block on before using it (the last step's block needs no further trip).
        next_kv = _RingShift.apply(kv, group, global_ranks) if step < cp - 1 else None
        k, v = _heads_first(kv[0], repeat), _heads_first(kv[1], repeat)
        j = (r - step) % cp
        if not causal:
            o, l = block_attention(q, k, v, scale, None, dropout)
            out, lse = (o, l) if out is None else merge_partial(out, lse, o, l)
        elif step == 0:
            out, lse = block_attention(q, k, v, scale, 0, dropout)
        elif j < r:   # all local queries after KV chunk j, before chunk 2CP-1-j
            o, l = block_attention(q, k[:, :, :half], v[:, :, :half], scale, None, dropout)
            out, lse = merge_partial(out, lse, o, l)
        else:         # j > r: only query chunk 2CP-1-r sees this block, all of it
            o, l = block_attention(q[:, :, half:], k, v, scale, None, dropout)
            o2, l2 = merge_partial(out[:, :, half:], lse[:, :, half:], o, l)
            out = torch.cat([out[:, :, :half], o2], dim=2)
            lse = torch.cat([lse[:, :, :half], l2], dim=2)
        kv = next_kv
    return out


def _all_gather_attention(q, kv, scale, causal, group, dropout, repeat):
    cp = torch.distributed.get_world_size(group=group)
    r = torch.distributed.get_rank(group=group)
    gathered = _AllGatherCP.apply(kv, group)                      # [cp, 2, s_local, b, g, d]
    s_local = kv.size(1)
    seq = cp * s_local
    _, natural = _natural_order(seq, cp, kv.device)
    full = gathered.permute(1, 0, 2, 3, 4, 5).reshape((2, seq) + tuple(kv.shape[2:])).index_select(1, natural)
    k, v = _heads_first(full[0], repeat), _heads_first(full[1], repeat)
    if not causal:
        return block_attention(q, k, v, scale, None, dropout)[0]
    c = s_local // 2
    outs = []
    for half, chunk in enumerate((r, 2 * cp - 1 - r)):
        end = (chunk + 1) * c
        qc = q[:, :, half * c:(half + 1) * c]
        outs.append(block_attention(qc, k[:, :, :end], v[:, :, :end], scale, end - c, dropout)[0])
    return torch.cat(outs, dim=2)


def _natural_order(seq: int, cp: int, device) -> "tuple[torch.Tensor, torch.Tensor]":
    """(held, natural): ``held[p]`` is the sequence position of row ``p`` of the rank-major gathered order;
    ``gathered.index_select(0, natural)`` is the natural order, ``natural_rows.index_select(0, held)`` goes back."""
    held = torch.cat([context_parallel_chunk_indices(seq, cp, j) for j in range(cp)]).to(device)
    natural = torch.empty_like(held)
    natural[held] = torch.arange(seq, device=device)
    return held, natural


def _a2a_attention(query, key, value, scale, causal, group, dropout):
    """Ulysses attention (module docstring); ``query [s, b, np, hn]`` etc. -> ``[s, b, np, hn]`` in fp32."""
    cp = torch.distributed.get_world_size(group=group)
    s, b, np_, hn = query.shape
    ng = key.size(2)
    if np_ % cp or ng % cp:
        raise ValueError(f"--cp-comm-type a2a splits the heads over the {cp} context-parallel ranks: the attention "
                         f"heads ({np_}) and query groups ({ng}) of a tensor-parallel rank must be divisible by {cp}")
    held, natural = _natural_order(cp * s, cp, query.device)

    def heads_to_sequence(x):  # [s, b, h, d] -> [S, b, h / cp, d] in natural order
        h = x.size(2)
        slots = x.reshape(s, b, cp, h // cp, hn).permute(2, 0, 1, 3, 4)
        return _exchange_slots(slots, group).reshape(cp * s, b, h // cp, hn).index_select(0, natural)

    q = heads_to_sequence(query).permute(1, 2, 0, 3).float()
    k, v = (_heads_first(heads_to_sequence(x), np_ // ng) for x in (key, value))
    out = block_attention(q, k, v, scale, 0 if causal else None, dropout)[0]      # [b, np / cp, S, hn]
    rows = out.permute(2, 0, 1, 3).index_select(0, held).reshape(cp, s, b, np_ // cp, hn)
    return _exchange_slots(rows, group).permute(1, 2, 0, 3, 4).reshape(s, b, np_, hn)


def context_parallel_attention(query, key, value, *, group, global_ranks: List[int], comm_type: str = "p2p",
                               causal: bool = True, softmax_scale: Optional[float] = None, dropout=None,
                               dropout_rng=None):
    """Attention of this CP rank's queries over the keys and values of the whole CP group.

    ``query [s, b, np, hn]``, ``key [s, b, ng, hn]``, ``value [s, b, ng, hv]`` hold this rank's ``s = S / CP`` tokens
    in the order of :func:`megatron.core.utils.context_parallel_chunk_indices`; ``np`` must be a multiple of ``ng``
    (grouped-query attention: K and V travel un-repeated). Returns ``[s, b, np * hv]`` in the queries' dtype.
    ``dropout`` is applied to the block probabilities (under ``dropout_rng``, a context manager, if given).
    """
    if comm_type not in CP_COMM_TYPES_IMPLEMENTED:
        raise NotImplementedError(f"--cp-comm-type {comm_type} is not implemented in this library: use "
                                  f"{' or '.join(CP_COMM_TYPES_IMPLEMENTED)}")
    s, b, np_, hn = query.shape
    if s % 2 != 0:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {s} local tokens")
    if key.shape[:-1] != value.shape[:-1] or key.size(-1) != hn or np_ % key.size(2) != 0:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit query {tuple(query.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    hv = value.size(-1)
    if hv != hn:
        # Multi-latent attention: value heads of another width. Zero padding to a common width leaves q.k and the
        # weighted sum of the values unchanged; the extra output channels are dropped below.
        width = max(hn, hv)
        query, key, value = (torch.nn.functional.pad(x, (0, width - x.size(-1))) for x in (query, key, value))
    repeat = np_ // key.size(2)
    with dropout_rng if dropout_rng is not None else contextlib.nullcontext():
        if comm_type == "a2a":
            out = _a2a_attention(query, key, value, scale, causal, group, dropout)
            return out[..., :hv].to(query.dtype).reshape(s, b, np_ * hv)
        q = query.permute(1, 2, 0, 3).float()
        kv = torch.stack([key, value])
        if comm_type == "p2p":
            out = _p2p_attention(q, kv, scale, causal, group, global_ranks, dropout, repeat)
        else:
            out = _all_gather_attention(q, kv, scale, causal, group, dropout, repeat)
    return out[..., :hv].to(query.dtype).permute(2, 0, 1, 3).reshape(s, b, np_ * hv)
