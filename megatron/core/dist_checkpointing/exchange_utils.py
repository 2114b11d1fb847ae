"""Spreading the work of a save or a load over the ranks of a group, and exchanging what each rank loaded.

A *shard* is one block of a global tensor, named by its :data:`_ShardId` ``(key, global_offset, flattened range)``;
several ranks of a group may hold it (replicas). :func:`distribute_shards_to_ranks` assigns every shard to exactly
one of the ranks holding it, greedily balancing bytes: shards are taken in the order (shards needed from another
group last, fewest holders first, largest first, then by id) and each goes to the holder with the fewest bytes so
far (ties: the lowest rank). The order is a total order on data every rank has, so every rank computes the same
assignment without further communication.

On load, each rank reads its assigned shards only; the ``exchange_*`` functions then give every rank the shards
it needs but did not read, from the rank that read them: ``broadcast`` (one broadcast per shard needed by more
than one rank), ``gather_rounds`` (per dtype, all-gathers in rounds: round ``i`` carries the ``i``-th shard read by
each rank) or ``gather_object`` (one ``all_gather_object`` of the loaded dicts; simple, for debugging). Tensors
travel on the group's device (CUDA for NCCL, CPU otherwise) and come back on the device they were loaded on.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from itertools import zip_longest
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch

from megatron.core._rank_utils import log_single_rank
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from megatron.core.dist_checkpointing.utils import (_sharded_tensor_shard_id, _ShardId, debug_time,
                                                    is_float8tensor)

logger = logging.getLogger(__name__)

__all__ = ["ShardDistribution", "determine_main_replica_uniform_distribution", "distribute_shards_to_ranks",
           "exchange_by_distribution", "exchange_loaded_objects_gather_object", "exchange_loaded_tensors_broadcast",
           "exchange_loaded_tensors_gather_object", "exchange_loaded_tensors_gather_rounds", "is_float8tensor"]

T = TypeVar("T")


class ShardDistribution(NamedTuple):
    """Who does the work for each shard, within one (implicit) group.

    ``main_rank_for_shard``: the group rank that saves / loads each shard; ``shards_in_this_group``: the shards the
    group handles; ``shard_to_metadata``: each shard's :class:`ShardedTensor` (without data);
    ``all_ranks_for_shard``: the group ranks that hold (need) each shard.
    """

    main_rank_for_shard: Dict[_ShardId, int]
    shards_in_this_group: Set[_ShardId]
    shard_to_metadata: Dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: Dict[_ShardId, List[int]]


def _numel(sh_ten: ShardedTensor) -> int:
    numel = 1
    for size in sh_ten.local_shape:
        numel *= size
    return numel


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of the shard: local elements times the element size of its dtype."""
    return _numel(sh_ten) * torch.empty((), dtype=sh_ten.dtype).element_size()


def _world(group):
    return torch.distributed.group.WORLD if group is None else group


def _exchange_device(group) -> torch.device:
    """Where tensors travel: the current CUDA device for an NCCL group, the CPU for gloo."""
    if torch.distributed.get_backend(_world(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distribute_shards_to_ranks(shard_to_ranks: Dict[T, List[int]], shard_to_size: Dict[T, int], num_ranks: int,
                               cross_parallelization_group_loads: Set[T]) -> Dict[T, int]:
    """``{shard: rank}``: each shard assigned to one of ``shard_to_ranks[shard]`` so that the bytes per rank are as
    even as the greedy order of the module docstring makes them. ``cross_parallelization_group_loads``: shards
    whose main replica lives in another group (placed last). Deterministic on every rank."""
    load = [0] * num_ranks

    def order(item):
        shard, ranks = item
        return int(shard in cross_parallelization_group_loads), len(ranks), -shard_to_size[shard], shard

    assignment = {}
    for shard, ranks in sorted(((s, tuple(r)) for s, r in shard_to_ranks.items()), key=order):
        chosen = min(ranks, key=lambda r: (load[r], r))
        assignment[shard] = chosen
        load[chosen] += shard_to_size[shard]
    logger.debug(f"distribute_shards_to_ranks: bytes per rank {load}")
    return assignment


def determine_main_replica_uniform_distribution(sharded_state_dict: ShardedStateDict, parallelization_group,
                                                ignore_groups: bool = False) -> Optional[ShardDistribution]:
    """Collective on ``parallelization_group`` (default: all ranks): gather every rank's ShardedTensor metadata and
    compute the :class:`ShardDistribution` of the shards whose main replica is in the group (with
    ``ignore_groups``, as on load, every shard a rank of the group holds). None for a group of one rank."""
    group = _world(parallelization_group)
    group_size = torch.distributed.get_world_size(group)
    if group_size <= 1:
        return None
    local = [leaf.without_data() for leaf in nested_values(sharded_state_dict) if isinstance(leaf, ShardedTensor)]
    gathered: List[Optional[list]] = [None] * group_size
    torch.distributed.all_gather_object(gathered, local, group=group)

    shard_to_ranks: Dict[_ShardId, List[int]] = defaultdict(list)
    shard_to_size: Dict[_ShardId, int] = {}
    shard_to_metadata: Dict[_ShardId, ShardedTensor] = {}
    with_main, with_other = set(), set()
    for rank, shards in enumerate(gathered):
        for sh_ten in shards:
            shard = _sharded_tensor_shard_id(sh_ten)
            shard_to_ranks[shard].append(rank)
            if shard not in shard_to_size:
                shard_to_size[shard] = _shard_size(sh_ten)
                shard_to_metadata[shard] = sh_ten
            (with_main if is_main_replica(sh_ten.replica_id) else with_other).add(shard)

    in_group = with_main | with_other if ignore_groups else set(with_main)
    cross_group = in_group - with_main
    shard_to_ranks = {shard: ranks for shard, ranks in shard_to_ranks.items() if shard in in_group}
    assignment = distribute_shards_to_ranks(shard_to_ranks, shard_to_size, group_size, cross_group)
    return ShardDistribution(assignment, in_group, shard_to_metadata, shard_to_ranks)


def _exchanged_shards(distribution: ShardDistribution):
    """(shard, loading rank) of the shards needed by more than one rank, in the distribution's order."""
    for shard, rank in distribution.main_rank_for_shard.items():
        holders = distribution.all_ranks_for_shard[shard]
        if len(holders) == 1:
            if holders[0] != rank:
                raise CheckpointingException(f"shard {shard} is needed only by rank {holders[0]} but assigned to "
                                             f"rank {rank}")
            continue
        yield shard, rank


def _nominal(tensor: torch.Tensor) -> torch.Tensor:
    """A Transformer Engine FP8 tensor travels as its high-precision value."""
    return tensor.dequantize() if is_float8tensor(tensor) else tensor


def _receive_buffer(shard: _ShardId, unloaded_shards: Dict[_ShardId, ShardedTensor],
                    shard_to_metadata: Dict[_ShardId, ShardedTensor], result: Dict[_ShardId, torch.Tensor],
                    device: torch.device) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """(a tensor to receive ``shard`` into on ``device``, the device to move it back to or None when this rank
    does not need it). A needed shard is received into its ShardedTensor's ``data`` when that already lives on
    ``device`` (allocated there when missing), and recorded in ``result``."""
    needed = unloaded_shards.get(shard)
    if needed is None:
        meta = shard_to_metadata[shard]
        return torch.empty(meta.local_shape, dtype=meta.dtype, device=device), None
    needed.init_data(device)
    home = needed.data.device
    buffer = needed.data if home == device and needed.data.is_contiguous() else torch.empty_like(
        needed.data, device=device, memory_format=torch.contiguous_format)
    result[shard] = buffer
    return buffer, home


@torch.no_grad()
@debug_time("exchange_loaded_tensors_gather_rounds", logger)
def exchange_loaded_tensors_gather_rounds(loaded_tensors: Dict[_ShardId, torch.Tensor],
                                          unloaded_shards: Dict[_ShardId, ShardedTensor],
                                          shard_distribution: ShardDistribution = None,
                                          parallelization_group=None) -> Dict[_ShardId, torch.Tensor]:
    """Collective: ``loaded_tensors`` plus every shard of ``unloaded_shards`` (read by another rank of the group),
    exchanged by all-gathers: per dtype (in order of its name), round ``i`` gathers the ``i``-th exchanged shard
    read by each rank, flattened and padded to the round's largest (nothing but padding from a rank that has no
    more)."""
    group = _world(parallelization_group)
    local_rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    device = _exchange_device(group)
    result = dict(loaded_tensors)
    metadata = shard_distribution.shard_to_metadata
    exchanged = list(_exchanged_shards(shard_distribution))
    for dtype in sorted({metadata[shard].dtype for shard, _ in exchanged}, key=str):
        per_rank: List[List[_ShardId]] = [[] for _ in range(size)]
        for shard, rank in exchanged:
            if metadata[shard].dtype == dtype:
                per_rank[rank].append(shard)
        for round_shards in zip_longest(*per_rank):
            # Every rank sends a flat buffer as long as the round's largest shard (gloo gathers equal sizes only).
            numels = [0 if shard is None else _numel(metadata[shard]) for shard in round_shards]
            send = torch.zeros(max(numels), dtype=dtype, device=device)
            mine = round_shards[local_rank]
            if mine is not None:
                if mine not in result:
                    raise CheckpointingException(f"rank {local_rank} was to load shard {mine} but did not")
                send[:numels[local_rank]] = _nominal(result[mine]).reshape(-1).to(device)
            received = [torch.empty_like(send) for _ in range(size)]
            torch.distributed.all_gather(received, send, group=group)
            for rank, shard in enumerate(round_shards):
                if shard is None or rank == local_rank or shard not in unloaded_shards:
                    continue
                buffer, home = _receive_buffer(shard, unloaded_shards, metadata, result, device)
                buffer.copy_(received[rank][:numels[rank]].view(buffer.shape))
                result[shard] = buffer.to(home)
    return result


def exchange_loaded_tensors_gather_object(loaded_tensors: Dict[_ShardId, torch.Tensor],
                                          unloaded_shards: Dict[_ShardId, ShardedTensor],
                                          shard_distribution: ShardDistribution,
                                          parallelization_group=None) -> Dict[_ShardId, torch.Tensor]:
    """Collective: the union of every rank's ``loaded_tensors`` (one ``all_gather_object``); a shard loaded by
    two ranks raises :class:`CheckpointingException`."""
    return _union_of_gathered(loaded_tensors, parallelization_group)


def exchange_loaded_objects_gather_object(loaded_objects: Dict[_ShardId, Any]) -> Dict[_ShardId, Any]:
    """Collective over all ranks: the union of every rank's ``loaded_objects`` (one ``all_gather_object``); an
    object loaded by two ranks raises :class:`CheckpointingException`."""
    return _union_of_gathered(loaded_objects, None)


def _union_of_gathered(local: Dict[_ShardId, Any], group) -> Dict[_ShardId, Any]:
    gathered: List[Optional[dict]] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, local, group=group)
    union: Dict[_ShardId, Any] = {}
    for part in gathered:
        union.update(part)
    if len(union) != sum(len(part) for part in gathered):
        log_single_rank(logger, logging.ERROR, "Duplicate shard ids loaded by different ranks. Shard ids by rank: "
                        f"{[sorted(part, key=str) for part in gathered]}")
        raise CheckpointingException("Duplicate shard ids loaded by different ranks")
    return union


@torch.no_grad()
@debug_time("exchange_loaded_tensors_broadcast", logger)
def exchange_loaded_tensors_broadcast(loaded_tensors: Dict[_ShardId, torch.Tensor],
                                      unloaded_shards: Dict[_ShardId, ShardedTensor],
                                      shard_distribution: ShardDistribution,
                                      parallelization_group=None) -> Dict[_ShardId, torch.Tensor]:
    """Collective: ``loaded_tensors`` plus every shard of ``unloaded_shards``, each exchanged shard broadcast from
    the rank that read it to the whole group (in the distribution's order)."""
    group = _world(parallelization_group)
    local_rank = torch.distributed.get_rank(group)
    device = _exchange_device(group)
    result = dict(loaded_tensors)
    for shard, rank in _exchanged_shards(shard_distribution):
        if rank == local_rank:
            if shard not in result:
                raise CheckpointingException(f"rank {rank} was to load shard {shard} but did not")
            home = result[shard].device
            tensor = _nominal(result[shard]).to(device)
            result[shard] = tensor
        else:
            tensor, home = _receive_buffer(shard, unloaded_shards, shard_distribution.shard_to_metadata, result,
                                           device)
        src = rank if parallelization_group is None else torch.distributed.get_global_rank(group, rank)
        torch.distributed.broadcast(tensor, src=src, group=group)
        if home is not None:
            result[shard] = tensor.to(home)
    return result


_EXCHANGES = {"gather_object": exchange_loaded_tensors_gather_object,
              "gather_rounds": exchange_loaded_tensors_gather_rounds,
              "broadcast": exchange_loaded_tensors_broadcast}


def exchange_by_distribution(loaded_tensors: Dict[_ShardId, torch.Tensor],
                             unloaded_shards: Dict[_ShardId, ShardedTensor],
                             shard_distribution: ShardDistribution, parallelization_group=None,
                             exchange_algo="broadcast") -> Dict[_ShardId, torch.Tensor]:
    """The exchange named by ``exchange_algo`` (``broadcast``, ``gather_rounds`` or ``gather_object``)."""
    if shard_distribution is None:
        raise CheckpointingException("exchange_by_distribution needs a shard distribution")
    if exchange_algo not in _EXCHANGES:
        raise NotImplementedError(f"Unrecognized gather algorithm: {exchange_algo} (known: {sorted(_EXCHANGES)})")
    return _EXCHANGES[exchange_algo](loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)
