"""Pipeline-stage helpers over an explicit pipeline group (megatron-core's ``megatron.core.pipeline_parallel.utils``):
stage ``r`` of a group of ``p`` ranks is first when ``r == 0``, last when ``r == p - 1``; a virtual chunk
``v`` of ``vp_size`` is first / last when ``v == 0`` / ``v == vp_size - 1`` (always, without virtual stages)."""
from __future__ import annotations

from typing import Optional

import torch


def is_pp_first_stage(pp_group) -> bool:
    return torch.distributed.get_rank(pp_group) == 0


def is_pp_last_stage(pp_group) -> bool:
    return torch.distributed.get_rank(pp_group) == torch.distributed.get_world_size(pp_group) - 1


def is_vp_first_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == 0


def is_vp_last_stage(vp_stage: Optional[int], vp_size: Optional[int]) -> bool:
    if vp_size is None or vp_size <= 1:
        return True
    return vp_stage == vp_size - 1


def get_pp_first_rank(pp_group) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return torch.distributed.get_global_rank(pp_group, 0)


def get_pp_last_rank(pp_group) -> int:
    return torch.distributed.get_global_rank(pp_group, torch.distributed.get_world_size(pp_group) - 1)


def get_pp_next_rank(pp_group) -> Optional[int]:
    """Global rank of the next stage, None on the last stage."""
    if is_pp_last_stage(pp_group):
        return None
    return torch.distributed.get_global_rank(pp_group, torch.distributed.get_rank(pp_group) + 1)


def get_pp_prev_rank(pp_group) -> Optional[int]:
    """Global rank of the previous stage, None on the first stage."""
    if is_pp_first_stage(pp_group):
        return None
    return torch.distributed.get_global_rank(pp_group, torch.distributed.get_rank(pp_group) - 1)


def make_viewless(e):
    """A tensor that is not a view of another (its ``_base`` dropped), so a schedule can free it after sending."""
    from megatron.core.utils import make_viewless_tensor

    return make_viewless_tensor(e, requires_grad=e.requires_grad, keep_graph=True)
