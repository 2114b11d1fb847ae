"""megatron-core's path of the rotary helpers (defined in :mod:`megatron.core.transformer.rotary`)."""
import torch

from megatron.core.transformer import rotary
from megatron.core.transformer.rotary import apply_rotary_pos_emb, apply_rotary_pos_emb_with_cos_sin  # noqa: F401


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """megatron-core's form: the rows of the full-sequence angles that this rank of ``cp_group`` holds (chunks
    ``r`` and ``2 CP - 1 - r`` of ``2 CP`` along ``seq_dim``; see :func:`megatron.core.transformer.rotary.
    get_pos_emb_on_this_cp_rank`)."""
    if cp_group is None:
        raise ValueError("get_pos_emb_on_this_cp_rank: cp_group must be given (the context-parallel group)")
    return rotary.get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, torch.distributed.get_world_size(cp_group),
                                              torch.distributed.get_rank(cp_group))
