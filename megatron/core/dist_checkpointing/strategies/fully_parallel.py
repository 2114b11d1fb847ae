"""Fully parallel save and load: wrappers around any sharded strategy that spread the work over a group.

Save: only metadata is exchanged. Every shard whose main replica is in the group is assigned to one rank holding it
(:func:`~megatron.core.dist_checkpointing.exchange_utils.determine_main_replica_uniform_distribution`, byte
balanced), which then writes it: its ``replica_id`` becomes 0 there and 1 on every other rank. With data-parallel
replicas the write is spread over the DP ranks instead of all falling on DP rank 0.

Load: the same assignment (over every shard a rank of the group needs) decides which rank reads each shard; each
rank reads its own, then the ranks exchange the tensors (``exchange_algo``) and the objects (one
``all_gather_object``), so the checkpoint is read once per group instead of once per replica. The result equals
what the wrapped strategy alone would load.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import (dict_list_map_inplace, extract_matching_values, merge,
                                                         nested_values)
from megatron.core.dist_checkpointing.exchange_utils import (ShardDistribution,
                                                             determine_main_replica_uniform_distribution,
                                                             exchange_by_distribution,
                                                             exchange_loaded_objects_gather_object)
from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedStateDict, ShardedTensor, StateDict,
                                                      is_main_replica)
from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy, LoadShardedStrategy,
                                                              SaveShardedStrategy)
from megatron.core.dist_checkpointing.utils import (_sharded_object_id, _sharded_tensor_shard_id, _ShardId,
                                                    debug_time)
from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

logger = logging.getLogger(__name__)

__all__ = ["FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper",
           "distribute_main_replicas_with_precomputed_distribution"]


def _group_size(group) -> int:
    return torch.distributed.get_world_size(torch.distributed.group.WORLD if group is None else group)


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Saves with ``strategy`` after spreading the main replicas over ``parallelization_group`` (default: all
    ranks). ``do_cache_distribution``: reuse the first distribution for later saves (only when the state dict's
    structure never changes)."""

    def __init__(self, strategy: SaveShardedStrategy, parallelization_group=None,
                 do_cache_distribution: bool = False):
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = (torch.distributed.group.WORLD if parallelization_group is None
                                      else parallelization_group)
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[ShardDistribution] = None

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir):
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"Cannot apply async_save to non-async base strategy {self.base_strategy}")
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir):
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Collective (unless cached): compute the distribution and set the replica ids of
        ``sharded_state_dict`` accordingly; the first time, check that every block keeps exactly one main
        replica."""
        start = time.time()
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict,
                                                                       self.parallelization_group)
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group,
                                                               distribution)
        if self.cached_distribution is None:
            validate_sharding_integrity(determine_global_metadata(sharded_state_dict)[1])
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        logger.debug(f"parallel save sharding, time: {time.time() - start}")

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Loads with ``strategy``, each shard read by one rank of ``parallelization_group`` (default: all ranks;
    usually the DP group) and exchanged with ``exchange_algo`` (``broadcast``, ``gather_rounds``,
    ``gather_object``). ``do_cache_distribution``: reuse the first load distribution (never a save's)."""

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group=None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast"):
        super().__init__()
        self.base_strategy = strategy
        self.parallelization_group = (torch.distributed.group.WORLD if parallelization_group is None
                                      else parallelization_group)
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: Optional[ShardDistribution] = None
        self.cached_global_metadata = None

    @debug_time("FullyParallelLoadStrategyWrapper.load", logger)
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir) -> StateDict:
        """Collective: (1) exchange the request metadata and (2) assign each shard to a reading rank, (3) read this
        rank's shards (objects, then tensors) with the wrapped strategy, (4) exchange tensors and objects, then
        put every value in its place. Returns the loaded state dict (the sharded leaves only)."""
        if _group_size(self.parallelization_group) <= 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        distribution = self.apply_loading_parallelization(sharded_state_dict)
        if distribution is None:
            raise CheckpointingException("no load distribution for a group of more than one rank")

        tensors, rest, to_load_tensors, unloaded_tensors = self._defer_loading_sharded_tensors(sharded_state_dict)
        objects, rest, to_load_objects, unloaded_objects = self._defer_loading_sharded_objects(rest)
        if rest:
            raise CheckpointingException(f"cannot load these leaves fully in parallel (not ShardedTensor / "
                                         f"ShardedObject): {rest}")
        loaded_objects = self.base_strategy.load(to_load_objects, checkpoint_dir)
        loaded_tensors = self.base_strategy.load(to_load_tensors, checkpoint_dir)

        all_tensors = exchange_by_distribution(loaded_tensors, unloaded_tensors, distribution,
                                               self.parallelization_group, self.exchange_algo)
        missing = set(unloaded_tensors) - set(all_tensors)
        if missing:
            raise CheckpointingException(f"Missing shards after fully parallel loading: {missing}")
        all_objects = exchange_loaded_objects_gather_object(loaded_objects)
        missing = set(unloaded_objects) - set(all_objects)
        if missing:
            raise CheckpointingException(f"Missing object shards after fully parallel loading: {missing}")

        self.fill_in_deferred_sharded_tensors(tensors, all_tensors)
        self.fill_in_deferred_sharded_objects(objects, all_objects)
        loaded: StateDict = {}
        merge(loaded, objects)
        merge(loaded, tensors)
        if hasattr(self.base_strategy, "cached_global_metadata"):
            self.cached_global_metadata = self.base_strategy.cached_global_metadata
        return loaded

    @staticmethod
    def _defer_loading_sharded_objects(sharded_state_dict: ShardedStateDict):
        return _defer_loading_sharded_items(sharded_state_dict, ShardedObject, _sharded_object_id)

    @staticmethod
    def _defer_loading_sharded_tensors(sharded_state_dict: ShardedStateDict):
        return _defer_loading_sharded_items(sharded_state_dict, ShardedTensor, _sharded_tensor_shard_id)

    @staticmethod
    def fill_in_deferred_sharded_objects(sharded_state_dict: ShardedStateDict,
                                         loaded_objects: Dict[_ShardId, Any]) -> None:
        """Replace every ShardedObject of ``sharded_state_dict`` (in place) by ``loaded_objects[its id]``."""
        _fill_in_deferred_sharded_items(sharded_state_dict, loaded_objects, ShardedObject, _sharded_object_id)

    @staticmethod
    def fill_in_deferred_sharded_tensors(sharded_state_dict: ShardedStateDict,
                                         loaded_tensors: Dict[_ShardId, torch.Tensor]) -> None:
        """Replace every ShardedTensor of ``sharded_state_dict`` (in place) by ``loaded_tensors[its id]``."""
        _fill_in_deferred_sharded_items(sharded_state_dict, loaded_tensors, ShardedTensor, _sharded_tensor_shard_id)

    def apply_loading_parallelization(self, sharded_state_dict: ShardedStateDict) -> Optional[ShardDistribution]:
        """Collective (unless cached): the load distribution over every shard the group needs; the shards this rank
        reads get ``replica_id`` 0, the others 1."""
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict,
                                                                       self.parallelization_group, True)
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group,
                                                               distribution)
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        return distribution

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def load_tensors_metadata(self, checkpoint_dir):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir):
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_version):
        return self.base_strategy.check_backend_compatibility(loaded_version)

    def check_version_compatibility(self, loaded_version):
        return self.base_strategy.check_version_compatibility(loaded_version)


def distribute_main_replicas_with_precomputed_distribution(sharded_state_dict: ShardedStateDict,
                                                           parallelization_group,
                                                           precomputed_distribution: Optional[ShardDistribution]):
    """Apply a distribution: every ShardedTensor of ``sharded_state_dict`` assigned to this rank (within
    ``parallelization_group``) gets ``replica_id`` 0, every other one 1. Nothing happens in a group of one rank;
    a larger group needs a distribution (ValueError)."""
    group = torch.distributed.group.WORLD if parallelization_group is None else parallelization_group
    if torch.distributed.get_world_size(group) <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError("precomputed_distribution must be not None for non-trivial parallelization group")
    me = torch.distributed.get_rank(group)
    for leaf in nested_values(sharded_state_dict):
        if isinstance(leaf, ShardedTensor):
            shard = _sharded_tensor_shard_id(leaf)
            mine = (shard in precomputed_distribution.shards_in_this_group
                    and precomputed_distribution.main_rank_for_shard[shard] == me)
            leaf.replica_id = 0 if mine else 1


def _defer_loading_sharded_items(sharded_state_dict: ShardedStateDict, item_type: type,
                                 shard_id_func: Callable) -> Tuple[ShardedStateDict, ShardedStateDict, dict, dict]:
    """(the ``item_type`` leaves, nested; the other leaves; ``{id: leaf}`` of the main replicas this rank reads;
    ``{id: leaf}`` of those other ranks read)."""
    items, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, item_type))
    mine, others = {}, {}
    for leaf in nested_values(items):
        (mine if is_main_replica(leaf.replica_id) else others)[shard_id_func(leaf)] = leaf
    return items, rest, mine, others


def _fill_in_deferred_sharded_items(sharded_state_dict: ShardedStateDict, loaded_items: Dict[_ShardId, Any],
                                    item_type: type, shard_id_func: Callable) -> None:
    def fill(x):
        if not isinstance(x, item_type):
            return x
        try:
            return loaded_items[shard_id_func(x)]
        except KeyError as e:
            raise CheckpointingException(f"Missing loaded item shard: {shard_id_func(x)}") from e

    dict_list_map_inplace(fill, sharded_state_dict)
