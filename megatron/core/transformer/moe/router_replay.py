"""Router replay: record the experts each token was routed to, and route later passes to the same experts.

One :class:`RouterReplay` per MoE router (created by ``TopKRouter`` when ``config.moe_enable_routing_replay``),
registered in ``RouterReplay.global_router_replay_instances`` in construction order (= layer order). The action
of an instance decides what its top-k selection does (:meth:`RouterReplay.get_replay_topk`):

* ``RECORD``: the normal top-k; the chosen indices ``[T, k]`` are kept (:meth:`get_recorded_indices`);
* ``REPLAY_FORWARD``: the indices given with :meth:`set_target_indices` are used instead of a top-k, and the
  values are the scores gathered at them;
* ``REPLAY_BACKWARD``: the same, with the indices taken first-in first-out from every ``set_target_indices`` call
  (activation recomputation during backward replays them in the order of the forwards);
* no action: the normal top-k.

Uses: reproducing a routing exactly (debugging, RL where a policy's routing must match the rollout's).
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, List, Optional, Tuple

import torch


class RouterReplayAction(Enum):
    """What a router's top-k selection does (module docstring)."""

    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"


class RouterReplay:
    """The recorded and target top-k indices of one router, and class-level controls over every instance."""

    global_router_replay_instances: List["RouterReplay"] = []

    def __init__(self):
        self.target_topk_idx: Optional[torch.Tensor] = None
        self.recorded_topk_idx: Optional[torch.Tensor] = None
        self.router_replay_action: Optional[RouterReplayAction] = None
        self.replay_backward_list: List[torch.Tensor] = []
        RouterReplay.global_router_replay_instances.append(self)

    # ------------------------------------------------------------------ every instance at once
    @staticmethod
    def set_replay_data(all_layers_topk_indices: List[torch.Tensor]):
        """Give instance ``i`` the indices ``all_layers_topk_indices[i]`` (one tensor per router, in order)."""
        instances = RouterReplay.global_router_replay_instances
        if len(all_layers_topk_indices) != len(instances):
            raise ValueError(f"The number of replay tensors ({len(all_layers_topk_indices)}) does not match "
                             f"instances ({len(instances)}).")
        for instance, indices in zip(instances, all_layers_topk_indices):
            instance.set_target_indices(indices)

    @staticmethod
    def get_recorded_data() -> List[Optional[torch.Tensor]]:
        """The recorded indices of every instance, in order (None where nothing was recorded)."""
        return [r.get_recorded_indices() for r in RouterReplay.global_router_replay_instances]

    @staticmethod
    def clear_global_indices():
        for r in RouterReplay.global_router_replay_instances:
            r.clear_indices()

    @staticmethod
    def set_global_router_replay_action(router_replay_action: RouterReplayAction):
        for r in RouterReplay.global_router_replay_instances:
            r.set_router_replay_action(router_replay_action)

    @staticmethod
    def clear_global_router_replay_action():
        for r in RouterReplay.global_router_replay_instances:
            r.clear_router_replay_action()

    @staticmethod
    def clear_global_router_replay_instances():
        """Forget every instance (a new model registers its own)."""
        RouterReplay.global_router_replay_instances.clear()

    # ------------------------------------------------------------------ this instance
    def set_target_indices(self, topk_indices: torch.Tensor):
        """The indices to replay in the forward, also queued for the backward's recomputation."""
        self.target_topk_idx = topk_indices
        self.replay_backward_list.append(topk_indices)

    def get_recorded_indices(self) -> Optional[torch.Tensor]:
        return self.recorded_topk_idx

    def record_indices(self, topk_indices: torch.Tensor):
        self.recorded_topk_idx = topk_indices

    def clear_indices(self):
        self.recorded_topk_idx = None
        self.target_topk_idx = None
        self.replay_backward_list = []

    def set_router_replay_action(self, router_replay_action: RouterReplayAction):
        self.router_replay_action = router_replay_action

    def clear_router_replay_action(self):
        self.router_replay_action = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: Callable[..., Tuple[torch.Tensor, torch.Tensor]] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(values [T, k], indices [T, k])`` of ``scores [T, E]`` per the action (module docstring);
        ``default_compute_topk(scores, topk, num_groups, group_topk)`` is the normal selection."""
        action = self.router_replay_action
        if action == RouterReplayAction.RECORD:
            values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.record_indices(indices)
            return values, indices
        if action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            if action == RouterReplayAction.REPLAY_FORWARD:
                indices = self.target_topk_idx
            else:
                indices = self.replay_backward_list.pop(0)
            if indices is None:
                raise ValueError(f"router replay ({action.value}): no target indices were set "
                                 "(RouterReplay.set_replay_data / set_target_indices)")
            indices = indices.to(scores.device)
            return scores.gather(1, indices), indices
        return default_compute_topk(scores, topk, num_groups, group_topk)
