"""The rerun state machine's part of a checkpoint (megatron/core/rerun_state_machine.py).

Every rank's ``state_dict()`` (mode, state, iteration, and while a re-run from the checkpoint is pending: the
failed validation call, its first result, the suspicious node and device) is gathered into one list indexed by
global rank and stored with the checkpoint's common entries under ``rerun_state_machine``: in ``common.pt`` of every
torch_dist checkpoint (as Megatron writes it unless the mode is disabled), in every ``model_optim_rng.pt`` of a torch
checkpoint only while a re-run is pending (the files keep Megatron's keys otherwise). On load each rank takes its
own entry. Nothing is stored with ``--rerun-mode disabled``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.training.utils import print_rank_0

KEY = "rerun_state_machine"


def gather_rerun_state() -> Optional[List[dict]]:
    """Collective over the world: every rank's machine state, or None when the machine is disabled."""
    state = get_rerun_state_machine().state_dict()
    if state is None:
        return None
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [state]
    states: List[Optional[dict]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return states


def pending(states: Optional[List[dict]]) -> bool:
    """True when the gathered states wait for a re-run from the checkpoint (every rank agrees on it)."""
    return bool(states) and any(s and s.get("state") == "WILL_RERUN_FROM_CHECKPOINT" for s in states)


def restore_rerun_state(states: Optional[List[dict]], where: str) -> None:
    """Give this rank's entry of a loaded checkpoint's list to the machine."""
    if not states:
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank >= len(states):
        print_rank_0(f"  {where} holds the rerun state machine of {len(states)} ranks, this job has more: a pending "
                     "re-run is not resumed")
        return
    get_rerun_state_machine().load_state_dict(states[rank])
