"""Checks around a save or load: the sharding of all ranks is complete and not overlapping, the common part is the
same on every rank, and ``strict`` handling of keys requested but absent from the checkpoint (*unexpected*) or
present but requested by no rank (*missing*).

============================ ==================================== ==========================================
``strict``                   unexpected keys                      missing keys
============================ ==================================== ==========================================
``assume_ok_unexpected``     not checked (the read fails on one)  not checked
``log_unexpected``           warned, dropped from the request     not checked
``log_all``                  warned, dropped                      warned
``raise_unexpected``         error before reading                 not checked
``raise_all``                error before reading                 error before reading
``return_unexpected``        dropped, returned by ``load``        not checked
``return_all``               dropped, returned                    returned
``ignore_all``               dropped silently                     ignored
============================ ==================================== ==========================================

Missing keys need every rank's request (one ``all_gather_object``), so they are the same on all ranks; unexpected
keys are per rank.
"""
from __future__ import annotations

import enum
import logging
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Set, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import diff, extract_matching_values, nested_values
from megatron.core.dist_checkpointing.mapping import (CommonStateDict, ShardedBase, ShardedObject, ShardedStateDict,
                                                      ShardedTensor, is_main_replica)

logger = logging.getLogger(__name__)

LocalMetadata = List[ShardedBase]
GlobalMetadata = List[LocalMetadata]


class StrictHandling(enum.Enum):
    """What ``load`` does when the request and the checkpoint disagree (see the module table)."""

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL,
                       StrictHandling.LOG_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, bool, StrictHandling]) -> StrictHandling:
    """A :class:`StrictHandling` from its value string (``True`` = assume_ok_unexpected, ``False`` = log_unexpected,
    as in torch's ``strict=`` convention)."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError) as e:
        choices = ", ".join(s.value for s in StrictHandling)
        raise ValueError(f"invalid strict flag {strict!r}: use one of {choices}") from e


def determine_global_metadata(sharded_state_dict: ShardedStateDict) -> Tuple[LocalMetadata, GlobalMetadata]:
    """(this rank's sharded leaves without data, every rank's), exchanged with one ``all_gather_object``."""
    local = [leaf.without_data() for leaf in nested_values(sharded_state_dict) if isinstance(leaf, ShardedBase)]
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local, [local]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, local)
    return local, everyone


def _check_tensor_key(shardings: List[Tuple[int, ShardedTensor]]) -> None:
    first = shardings[0][1]
    for rank, sh in shardings:
        if sh.global_shape != first.global_shape or sh.dtype != first.dtype:
            raise CheckpointingException(
                f"{sh.key!r}: rank {rank} declares global shape {sh.global_shape} {sh.dtype}, rank "
                f"{shardings[0][0]} {first.global_shape} {first.dtype}")
        if sh.has_regular_grid != first.has_regular_grid:
            raise CheckpointingException(f"{sh.key!r}: regular and irregular shardings are mixed")
        if sh.has_regular_grid and sh.axis_fragmentations != first.axis_fragmentations:
            raise CheckpointingException(f"{sh.key!r}: ranks cut it into different grids "
                                         f"({sh.axis_fragmentations} vs {first.axis_fragmentations})")
    if not first.has_regular_grid:
        return  # irregular shards: the storage layer checks overlaps
    count = torch.zeros(first.axis_fragmentations, dtype=torch.int32)
    for _, sh in shardings:
        if is_main_replica(sh.replica_id):
            count[sh.local_chunk_offset_in_global()] += 1
    if not bool(torch.all(count == 1)):
        holes, doubles = int((count == 0).sum()), int((count > 1).sum())
        raise CheckpointingException(
            f"invalid sharding of {first.key!r} (global shape {first.global_shape}, grid "
            f"{first.axis_fragmentations}): {holes} block(s) have no main replica, {doubles} have more than one "
            "(check the replica_id and offsets of its ShardedTensors)")


def _check_object_key(shardings: List[Tuple[int, ShardedObject]]) -> None:
    keys = [sh.unique_key for _, sh in shardings if is_main_replica(sh.replica_id)]
    duplicates = sorted(k for k, n in Counter(keys).items() if n > 1)
    if duplicates:
        raise CheckpointingException(f"ShardedObject pieces with more than one main replica: {duplicates}")
    expected = 1
    for size in shardings[0][1].global_shape:
        expected *= size
    if len(keys) != expected:
        raise CheckpointingException(f"ShardedObject {shardings[0][1].key!r}: {len(keys)} of its {expected} pieces "
                                     "have a main replica")


def validate_sharding_integrity(global_metadata: GlobalMetadata,
                                common_state_dict: Optional[CommonStateDict] = None) -> None:
    """Every global tensor is covered exactly once by main replicas of one regular grid; every object piece has
    exactly one main replica; the common part equals rank 0's (a difference is logged). Every rank checks the
    gathered metadata, so every rank raises the same error."""
    if common_state_dict is not None:
        _validate_common_state_dict(common_state_dict)
    by_key: Dict[str, list] = defaultdict(list)
    for rank, leaves in enumerate(global_metadata):
        for leaf in leaves:
            by_key[leaf.key].append((rank, leaf))
    for shardings in by_key.values():
        if isinstance(shardings[0][1], ShardedObject):
            _check_object_key(shardings)
        else:
            _check_tensor_key(shardings)


def _validate_common_state_dict(common_state_dict: CommonStateDict) -> None:
    """Only rank 0 writes the common part: warn when another rank's differs."""
    if not torch.distributed.is_initialized():
        return
    holder = [common_state_dict if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    if torch.distributed.get_rank() > 0:
        only_rank0, only_here, mismatch = diff(holder[0], common_state_dict)
        if only_rank0 or only_here or mismatch:
            logger.warning(f"rank {torch.distributed.get_rank()}'s common state dict differs from rank 0's (which is "
                           f"saved): only on rank 0 {only_rank0}, only here {only_here}, different {mismatch}")


def determine_missing_and_unexpected_keys(ckpt_sharded_metadata: Dict[str, ShardedBase], local_metadata: LocalMetadata,
                                          global_metadata: Optional[GlobalMetadata] = None) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected) keys: unexpected from this rank's request, missing from every rank's (empty when
    ``global_metadata`` is None)."""
    ckpt_keys = {leaf.key for leaf in ckpt_sharded_metadata.values()}
    unexpected = {leaf.key for leaf in local_metadata} - ckpt_keys
    missing = set()
    if global_metadata is not None:
        missing = ckpt_keys - {leaf.key for leaves in global_metadata for leaf in leaves}
    return missing, unexpected


def maybe_report_missing_and_unexpected_keys(missing_keys: Set[str], unexpected_keys: Set[str],
                                             raise_error: bool = True) -> None:
    """Raise (or warn) naming the keys, when there are any."""
    if not missing_keys and not unexpected_keys:
        return
    parts = []
    if missing_keys:
        parts.append(f"keys in the checkpoint that no rank requested (missing): {sorted(missing_keys)}")
    if unexpected_keys:
        parts.append(f"keys requested here that the checkpoint lacks (unexpected): {sorted(unexpected_keys)}")
    message = "; ".join(parts)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict, keys_to_remove: Set[str]) -> ShardedStateDict:
    """The request without the sharded leaves whose key is in ``keys_to_remove``."""
    _, kept = extract_matching_values(sharded_state_dict, lambda x: isinstance(x, ShardedBase)
                                      and x.key in keys_to_remove)
    return kept


def validate_integrity_and_strict_load(sharded_state_dict: ShardedStateDict, strict: StrictHandling,
                                       validate_access_integrity: bool, local_metadata: Optional[LocalMetadata] = None,
                                       global_metadata: Optional[GlobalMetadata] = None,
                                       ckpt_sharded_metadata: Optional[Dict[str, ShardedBase]] = None):
    """(request to read, missing keys, unexpected keys) after the ``strict`` handling of the module table and, with
    ``validate_access_integrity``, the sharding check of the request."""
    missing, unexpected = set(), set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException(f"strict={strict.value} needs the checkpoint's metadata")
        if local_metadata is None:
            local_metadata = [leaf.without_data() for leaf in nested_values(sharded_state_dict)]
        only_unexpected = strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.RAISE_UNEXPECTED,
                                     StrictHandling.RETURN_UNEXPECTED)
        missing, unexpected = determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata, None if only_unexpected else global_metadata)
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("validate_access_integrity needs every rank's metadata")
        validate_sharding_integrity(global_metadata)
    return sharded_state_dict, missing, unexpected


def validate_sharded_objects_handling(sharded_strategy, common_strategy) -> None:
    """One of the two strategies must store ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise CheckpointingException(f"neither {sharded_strategy} nor {common_strategy} can store ShardedObjects")


def verify_checkpoint_and_load_strategy(checkpoint_dir: str, sharded_strategy=None, common_strategy=None):
    """(sharded, common) load strategies for ``checkpoint_dir`` (see ``serialization``)."""
    from megatron.core.dist_checkpointing.serialization import verify_checkpoint_and_load_strategy as verify

    return verify(checkpoint_dir, sharded_strategy, common_strategy)
