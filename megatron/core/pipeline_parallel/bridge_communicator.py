"""Pipeline communication between two modules laid out on different grids (megatron-core's
``bridge_communicator``): e.g. a vision encoder on TP 2 feeding a language model on DP 2.

Both grids are :class:`~megatron.core.hyper_comm_grid.HyperCommGrid` s over disjoint rank ranges (CP must be 1).
Per data-parallel replica of a grid (the ranks that share its ``dp`` coordinate) one *leader* talks across the
bridge: the replica's last rank on the source grid (its last pipeline stage), its first rank on the destination
grid (its first stage). With ``S`` source and ``D`` destination leaders (one a multiple of the other):

* fan-out (``D >= S``): source leader ``i`` sends to destination leaders ``i k .. i k + k - 1`` (``k = D / S``),
  its activation cut into ``k`` equal parts along the batch dimension;
* fan-in (``S > D``): destination leader ``j`` receives from source leaders ``j k .. j k + k - 1`` (``k = S / D``)
  and concatenates their activations along the batch dimension.

Gradients travel back the same way (cut along the batch dimension, concatenated along dim 0). Before every
exchange the leaders exchange the 3-D shapes of what they send. A leader then broadcasts what it received to its
*broadcast group*: the TP x CP ranks of its replica at the boundary stage (last stage of the source, first of the
destination), which all get the same tensor. Roles: ``SENDER`` (source leader), ``RECEIVER`` (destination leader),
``MEMBER`` (everyone else). ``dim_mapping`` names the axes of ``s`` (sequence), ``b`` (batch), ``h`` (hidden);
default ``{'s': 1, 'b': 0, 'h': 2}``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.hyper_comm_grid import HyperCommGrid

logger = logging.getLogger(__name__)


class CommRole(Enum):
    """A rank's part in the bridge: a source leader (``SENDER``), a destination leader (``RECEIVER``), or a
    ``MEMBER`` that only takes part in its leader's broadcasts."""

    SENDER = "SENDER"
    RECEIVER = "RECEIVER"
    MEMBER = "MEMBER"


@dataclass
class RankCommInfo:
    """One rank's plan: its role and the global ranks it sends activations to / receives them from."""

    role: CommRole = CommRole.MEMBER
    send_to_ranks: List[int] = field(default_factory=list)
    recv_from_ranks: List[int] = field(default_factory=list)


def _axis(grid: HyperCommGrid, name: str) -> int:
    return grid.shape[grid.dim_names.index(name)]


class BridgeCommunicator:
    """Activations from ``src_grid`` to ``dest_grid`` and gradients back (module docstring). Constructing it is
    collective over the world (it creates the broadcast groups) and ends with a barrier."""

    def __init__(self, src_grid: HyperCommGrid, dest_grid: HyperCommGrid, dim_mapping: Optional[Dict[str, int]] = None,
                 comm_dtype: Optional[torch.dtype] = None, src_module_name: Optional[str] = None,
                 dest_module_name: Optional[str] = None):
        self.src_grid, self.dest_grid = src_grid, dest_grid
        self.src_module_name, self.dest_module_name = src_module_name, dest_module_name
        self.comm_dtype = comm_dtype
        for which, grid in (("Source", src_grid), ("Destination", dest_grid)):
            if "cp" in grid.dim_names and _axis(grid, "cp") != 1:
                raise AssertionError(f"{which} grid CP size must be 1, got {_axis(grid, 'cp')}")
        self.current_rank = dist.get_rank()
        self.comm_map: Dict[int, RankCommInfo] = {}
        if dim_mapping is None:
            dim_mapping = {"s": 1, "b": 0, "h": 2}
        if set(dim_mapping) != {"s", "b", "h"}:
            raise AssertionError(f"dim_mapping must have keys 's', 'b', 'h', got {set(dim_mapping)}")
        if not all(v in (0, 1, 2) for v in dim_mapping.values()):
            raise AssertionError(f"dim_mapping values must be 0, 1, or 2, got {list(dim_mapping.values())}")
        self.dim_mapping = dim_mapping

        self.src_grid_broadcast_pg, self.src_grid_broadcast_ranks = self._broadcast_group(src_grid, is_src=True)
        self.dest_grid_broadcast_pg, self.dest_grid_broadcast_ranks = self._broadcast_group(dest_grid, is_src=False)
        self.src_tp_leaders, self.src_local_leader_rank = self.get_leader_rank(src_grid, is_src=True)
        self.dest_tp_leaders, self.dest_local_leader_rank = self.get_leader_rank(dest_grid, is_src=False)
        logger.info(f"[Rank {self.current_rank}] srcLeader={self.src_local_leader_rank} "
                    f"destLeader={self.dest_local_leader_rank} srcBroadcastGrpRanks={self.src_grid_broadcast_ranks} "
                    f"destBroadcastGrpRanks={self.dest_grid_broadcast_ranks}")
        self.build_comm_map(self.src_tp_leaders, self.dest_tp_leaders)
        dist.barrier()

    # ------------------------------------------------------------------------------------------------ the plan
    def _broadcast_group(self, grid: HyperCommGrid, is_src: bool):
        """Create every broadcast group of ``grid`` (collective); return this rank's (group, ranks)."""
        groups = self.get_boundary_pp_stage_ranks(grid, is_src)
        if not groups:
            return None, []
        group, _ = dist.new_subgroups_by_enumeration(groups)
        return group, next((ranks for ranks in groups if self.current_rank in ranks), [])

    def get_leader_rank(self, grid: HyperCommGrid, is_src: bool) -> List[int]:
        """``(the leader of every DP replica of grid, the leader of this rank's replica or None)``: a replica's
        last rank on the source grid, its first on the destination grid."""
        leaders, mine = [], None
        for replica in grid._gen_rank_enum([d for d in grid.dim_names if d != "dp"]):
            leader = replica[-1] if is_src else replica[0]
            if self.current_rank in replica:
                if mine is not None:
                    raise AssertionError("only one local leader rank is allowed per dp replica")
                mine = leader
            leaders.append(leader)
        return leaders, mine

    def get_boundary_pp_stage_ranks(self, grid: HyperCommGrid, is_src: bool):
        """The TP x CP rank lists of ``grid`` on its boundary pipeline stage (last for the source, first for the
        destination), in the grid's enumeration order."""
        boundary = _axis(grid, "pp") - 1 if is_src else 0
        pp_stride = 1
        for name, size in zip(grid.dim_names, grid.shape):
            if name == "pp":
                break
            pp_stride *= size
        return [ranks for ranks in grid._gen_rank_enum(["tp", "cp"])
                if ranks and ((ranks[0] - grid.rank_offset) // pp_stride) % _axis(grid, "pp") == boundary]

    def is_current_rank_in_grid(self, grid: HyperCommGrid) -> bool:
        return grid.rank_offset <= self.current_rank < grid.rank_offset + grid.size

    def build_comm_map(self, src_tp_leaders: List[int], dest_tp_leaders: List[int]):
        """Fill ``comm_map`` for every rank of both grids: fan-in or fan-out between the leaders (module
        docstring), ``MEMBER`` for the rest."""
        src_count, dest_count = len(src_tp_leaders), len(dest_tp_leaders)
        if src_count % dest_count != 0 and dest_count % src_count != 0:
            raise ValueError(f"Source TP leaders count ({src_count}) and destination TP leaders count ({dest_count}) "
                             "must be evenly divisible. One must be a multiple of the other.")
        for grid in (self.src_grid, self.dest_grid):
            for rank in range(grid.rank_offset, grid.rank_offset + grid.size):
                self.comm_map[rank] = RankCommInfo(role=CommRole.MEMBER)
        if src_count > dest_count:
            k = src_count // dest_count
            for i, dest in enumerate(dest_tp_leaders):
                sources = src_tp_leaders[i * k:(i + 1) * k]
                for src in sources:
                    self.comm_map[src] = RankCommInfo(role=CommRole.SENDER, send_to_ranks=[dest])
                self.comm_map[dest] = RankCommInfo(role=CommRole.RECEIVER, recv_from_ranks=sources)
        else:
            k = dest_count // src_count
            for i, src in enumerate(src_tp_leaders):
                dests = dest_tp_leaders[i * k:(i + 1) * k]
                self.comm_map[src] = RankCommInfo(role=CommRole.SENDER, send_to_ranks=dests)
                for dest in dests:
                    self.comm_map[dest] = RankCommInfo(role=CommRole.RECEIVER, recv_from_ranks=[src])

    # ------------------------------------------------------------------------------------------------ helpers
    def _info(self, grid: HyperCommGrid, grid_name: str, what: str) -> RankCommInfo:
        if not self.is_current_rank_in_grid(grid):
            raise ValueError(f"[Bridge Communicator] [{what}] Rank {self.current_rank} is not in the {grid_name} grid.")
        info = self.comm_map.get(self.current_rank)
        if info is None:
            raise AssertionError(f"Rank {self.current_rank} is not in the comm map")
        return info

    def _check_leader(self, leader):
        if self.current_rank != leader:
            raise AssertionError(f"Rank {self.current_rank} is not the leader rank")

    def _exchange(self, peers: List[int], sends: Optional[List[torch.Tensor]], recv_shapes: Optional[List[tuple]],
                  requires_grad: bool = False) -> List[torch.Tensor]:
        """One batch of point-to-point operations with ``peers``: send ``sends[i]`` to / receive a tensor of
        ``recv_shapes[i]`` from ``peers[i]``; return the received tensors."""
        received, ops = [], []
        for i, peer in enumerate(peers):
            if sends is not None:
                ops.append(dist.P2POp(dist.isend, sends[i], peer))
            if recv_shapes is not None:
                buffer = torch.empty(recv_shapes[i], dtype=self.comm_dtype, device=device.current_device(),
                                     requires_grad=requires_grad)
                received.append(buffer)
                ops.append(dist.P2POp(dist.irecv, buffer, peer))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return received

    def _broadcast(self, tensor: Optional[torch.Tensor], leader: int, group, requires_grad: bool = False):
        """The leader sends ``tensor``'s 3-D shape, then ``tensor``, to its broadcast group; others receive both."""
        dev = device.current_device()
        if tensor is not None:
            dist.broadcast(torch.tensor(tensor.shape, dtype=torch.int64, device=dev), src=leader, group=group)
            dist.broadcast(tensor, src=leader, group=group)
            return tensor
        shape = torch.empty(3, dtype=torch.int64, device=dev)
        dist.broadcast(shape, src=leader, group=group)
        tensor = torch.empty(tuple(shape.tolist()), dtype=self.comm_dtype, device=dev, requires_grad=requires_grad)
        dist.broadcast(tensor, src=leader, group=group)
        return tensor

    def _forward_member(self) -> bool:
        return self.current_rank in self.dest_grid_broadcast_ranks

    def _backward_member(self) -> bool:
        return self.current_rank in self.src_grid_broadcast_ranks

    # ------------------------------------------------------------------------------------------- public calls
    def send_forward(self, tensor_to_send: torch.Tensor):
        """Source grid: a sender cuts its activation along the batch dimension and sends one part to each of its
        destinations (after their shapes); members do nothing."""
        info = self._info(self.src_grid, "source", "send_forward")
        if info.role == CommRole.SENDER and info.send_to_ranks:
            parts = self._split_tensor_at_batch_dim(tensor_to_send, len(info.send_to_ranks))
            self._communicate_shapes(tensor_to_send_next=parts[0])
            self._exchange(info.send_to_ranks, parts, None)

    def recv_forward(self) -> torch.Tensor:
        """Destination grid: a receiver takes its sources' parts, concatenates them along the batch dimension and
        broadcasts the result to its group; members of a broadcast group receive it; other ranks get None."""
        info = self._info(self.dest_grid, "destination", "receive_forward")
        if info.role == CommRole.RECEIVER:
            self._check_leader(self.dest_local_leader_rank)
            shapes, _ = self._communicate_shapes(recv_prev=True)
            parts = self._exchange(info.recv_from_ranks, None, shapes, requires_grad=True)
            joined = torch.cat(parts, dim=self.dim_mapping["b"])
            return self._broadcast(joined, self.current_rank, self.dest_grid_broadcast_pg)
        if info.role == CommRole.MEMBER and self._forward_member():
            return self._broadcast(None, self.dest_local_leader_rank, self.dest_grid_broadcast_pg, requires_grad=True)
        return None

    def send_backward(self, grad_tensor: torch.Tensor):
        """Destination grid: a receiver cuts the gradient along the batch dimension and sends each part back to
        the source it came from; members do nothing."""
        info = self._info(self.dest_grid, "destination", "send_backward")
        if info.role == CommRole.RECEIVER:
            self._check_leader(self.dest_local_leader_rank)
            parts = self._split_tensor_at_batch_dim(grad_tensor, len(info.recv_from_ranks))
            self._communicate_shapes(tensor_to_send_prev=parts[0])
            self._exchange(info.recv_from_ranks, parts, None)

    def recv_backward(self) -> torch.Tensor:
        """Source grid: a sender takes the gradients of its destinations, concatenates them along dim 0 and
        broadcasts the result to its group; members of a broadcast group receive it; other ranks get None."""
        info = self._info(self.src_grid, "source", "receive_backward")
        if info.role == CommRole.SENDER:
            self._check_leader(self.src_local_leader_rank)
            _, shapes = self._communicate_shapes(recv_next=True)
            parts = self._exchange(info.send_to_ranks, None, shapes)
            return self._broadcast(torch.cat(parts, dim=0), self.current_rank, self.src_grid_broadcast_pg)
        if info.role == CommRole.MEMBER and self._backward_member():
            return self._broadcast(None, self.src_local_leader_rank, self.src_grid_broadcast_pg)
        return None

    def send_forward_recv_backward(self, input_tensor: torch.Tensor,
                                   grad_shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        """Source grid, in one exchange: :meth:`send_forward` of ``input_tensor`` and :meth:`recv_backward` of the
        previous micro-batch's gradient (``grad_shape`` is not needed: shapes are exchanged)."""
        info = self._info(self.src_grid, "source", "send_forward_recv_backward")
        if info.role == CommRole.SENDER:
            self._check_leader(self.src_local_leader_rank)
            parts = self._split_tensor_at_batch_dim(input_tensor, len(info.send_to_ranks))
            _, shapes = self._communicate_shapes(tensor_to_send_next=parts[0], recv_next=True)
            grads = self._exchange(info.send_to_ranks, parts, shapes)
            return self._broadcast(torch.cat(grads, dim=0), self.current_rank, self.src_grid_broadcast_pg)
        if info.role == CommRole.MEMBER and self._backward_member():
            return self._broadcast(None, self.src_local_leader_rank, self.src_grid_broadcast_pg)
        return None

    def send_backward_recv_forward(self, grad_tensor: torch.Tensor,
                                   forward_shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        """Destination grid, in one exchange: :meth:`send_backward` of ``grad_tensor`` and :meth:`recv_forward` of
        the next micro-batch's activation (concatenated along dim 0)."""
        info = self._info(self.dest_grid, "destination", "send_backward_recv_forward")
        if info.role == CommRole.RECEIVER:
            self._check_leader(self.dest_local_leader_rank)
            parts = self._split_tensor_at_batch_dim(grad_tensor, len(info.recv_from_ranks))
            shapes, _ = self._communicate_shapes(tensor_to_send_prev=parts[0], recv_prev=True)
            acts = self._exchange(info.recv_from_ranks, parts, shapes, requires_grad=True)
            return self._broadcast(torch.cat(acts, dim=0), self.current_rank, self.dest_grid_broadcast_pg)
        if info.role == CommRole.MEMBER and self._forward_member():
            return self._broadcast(None, self.dest_local_leader_rank, self.dest_grid_broadcast_pg, requires_grad=True)
        return None

    def _communicate_shapes(self, tensor_to_send_next: Optional[torch.Tensor] = None, recv_next: bool = False,
                            recv_prev: bool = False, tensor_to_send_prev: Optional[torch.Tensor] = None,
                            ) -> Tuple[List[Tuple[int, ...]], List[Tuple[int, ...]]]:
        """Leaders exchange 3-D shapes in one batch: a sender sends ``tensor_to_send_next``'s shape to its
        destinations and, with ``recv_next``, receives their gradient shapes; a receiver, with ``recv_prev``,
        receives its sources' activation shapes and sends ``tensor_to_send_prev``'s shape back. Returns
        ``(activation shapes received, gradient shapes received)``; members get ``([], [])``."""
        info = self.comm_map.get(self.current_rank)
        if not info or info.role == CommRole.MEMBER:
            return [], []
        dev = device.current_device()
        sender = info.role == CommRole.SENDER
        peers = info.send_to_ranks if sender else info.recv_from_ranks
        outgoing = tensor_to_send_next if sender else tensor_to_send_prev
        receiving = recv_next if sender else recv_prev
        ops, buffers = [], []
        for peer in peers:
            if outgoing is not None:
                ops.append(dist.P2POp(dist.isend, torch.tensor(outgoing.shape, dtype=torch.int64, device=dev), peer))
        for peer in peers:
            if receiving:
                buffers.append(torch.empty(3, dtype=torch.int64, device=dev))
                ops.append(dist.P2POp(dist.irecv, buffers[-1], peer))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        shapes = [tuple(b.tolist()) for b in buffers]
        return ([], shapes) if sender else (shapes, [])

    def _split_tensor_at_batch_dim(self, aggregated_tensor: torch.Tensor, num_splits: int) -> List[torch.Tensor]:
        """``num_splits`` contiguous parts of ``aggregated_tensor`` along the batch axis (``torch.tensor_split``)."""
        if num_splits <= 0:
            raise ValueError(f"num_splits must be positive, got {num_splits}")
        return [part.contiguous() for part in torch.tensor_split(aggregated_tensor, num_splits,
                                                                  dim=self.dim_mapping["b"])]
