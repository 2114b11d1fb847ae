"""megatron-core's path of the rotary helpers (defined in :mod:`megatron.core.transformer.rotary`)."""
import torch

from megatron.core.transformer import rotary
from megatron.core.transformer.rotary import apply_rotary_pos_emb_with_cos_sin  # noqa: F401


def _cp_size_rank(cp_group):
    """(size, rank) of ``cp_group``; without one, parallel_state's context-parallel group, or (1, 0) before
    parallel_state is initialised."""
    if cp_group is not None:
        return torch.distributed.get_world_size(cp_group), torch.distributed.get_rank(cp_group)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, mscale: float = 1.0,
                         cp_group=None) -> torch.Tensor:
    """megatron-core's form: rotate ``t`` with the angles ``freqs`` (``[s, 1, 1, d]``) as ``config`` says
    (``rotary_interleaved``, ``apply_rope_fusion``; ``multi_latent_attention`` first de-interleaves the rotated
    channels, DeepSeek's layout); ``mscale`` multiplies cos and sin.

    Without ``cu_seqlens``, ``t`` is ``[s, b, np, hn]`` and row ``i`` gets ``freqs[i]``. With ``cu_seqlens``, ``t``
    is packed (THD, ``[t, np, hn]``): each document's positions restart at 0 (this CP rank's chunks of each
    document with context parallelism over ``cp_group``, default parallel_state's), see
    :func:`megatron.core.transformer.rotary.packed_sequence_rotary_freqs`."""
    packed = cu_seqlens is not None
    if packed:
        cp_size, cp_rank = _cp_size_rank(cp_group)
        freqs = rotary.packed_sequence_rotary_freqs(freqs, cu_seqlens, cp_size, cp_rank)
        t = t.unsqueeze(1)
    if getattr(config, "multi_latent_attention", False):
        d = freqs.shape[-1]
        t = torch.cat((rotary.deinterleave_rotary_pairs(t[..., :d]), t[..., d:]), dim=-1)
    out = rotary.apply_rotary_pos_emb(t, freqs, fused=config.apply_rope_fusion, interleaved=config.rotary_interleaved,
                                      mscale=mscale)
    return out.squeeze(1) if packed else out


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's form: the rows of the full-sequence angles that this rank of ``cp_group`` holds (chunks
    ``r`` and ``2 CP - 1 - r`` of ``2 CP`` along ``seq_dim``; see :func:`megatron.core.transformer.rotary.
    get_pos_emb_on_this_cp_rank`)."""
    if cp_group is None:
        raise ValueError("get_pos_emb_on_this_cp_rank: cp_group must be given (the context-parallel group)")
    return rotary.get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, torch.distributed.get_world_size(cp_group),
                                              torch.distributed.get_rank(cp_group))
