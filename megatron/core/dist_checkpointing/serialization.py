"""megatron-core's entry points: ``save`` and ``load`` of sharded state dicts, and the readers of a checkpoint's
parts (common state, tensor metadata, plain tensors, content metadata).

A checkpoint directory holds ``common.pt`` (rank 0: everything that is not sharded), the DCP files of the sharded
tensors and objects (``.metadata``, ``__<rank>_0.distcp``) and, written last, ``metadata.json``. ``save`` is
collective: (1) factories applied, non-persistent objects dropped, (2) optionally the sharding of every rank
validated (each block has exactly one main replica), (3) ``common.pt``, (4) the shards, (5) ``metadata.json`` on
rank 0, then a barrier. With ``async_sharded_save`` steps 4-5 are returned as an :class:`AsyncRequest` for the
caller to run. ``load`` is collective too and returns the state dict with every sharded leaf replaced by its
value, factories merged back, the common part merged in.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Set, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import (CheckpointingConfig, CheckpointingException,
                                                   check_is_distributed_checkpoint, maybe_load_config, save_config)
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import (CommonStateDict, ShardedStateDict, StateDict,
                                                      apply_factory_merges)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (AsyncSaveShardedStrategy, LoadCommonStrategy,
                                                              LoadShardedStrategy, SaveCommonStrategy,
                                                              SaveShardedStrategy, StrategyAction,
                                                              get_default_strategy)
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.dist_checkpointing.validation import (StrictHandling, determine_global_metadata,
                                                         parse_strict_flag, validate_integrity_and_strict_load)

logger = logging.getLogger(__name__)

_CONTENT_METADATA_KEY = "content_metadata"

__all__ = ["check_is_distributed_checkpoint", "get_default_load_sharded_strategy",
           "get_default_save_common_strategy", "get_default_save_sharded_strategy", "load", "load_common_state_dict",
           "load_content_metadata", "load_plain_tensors", "load_sharded_metadata", "load_tensors_metadata",
           "remove_sharded_tensors", "save"]


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier(group=None) -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier(group=group)


def verify_checkpoint_and_load_strategy(checkpoint_dir: str, sharded_strategy=None, common_strategy=None):
    """(sharded, common) load strategies for ``checkpoint_dir``; one error when it is not a distributed
    checkpoint or its backend is unknown."""
    if not check_is_distributed_checkpoint(checkpoint_dir):
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint (no valid metadata.json)")
    config = maybe_load_config(checkpoint_dir)
    if sharded_strategy is None:
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, config.sharded_backend,
                                                config.sharded_backend_version)
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, config.common_backend,
                                               config.common_backend_version)
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.LOAD_COMMON, *common_strategy)
    sharded_strategy.check_backend_compatibility(config.sharded_backend)
    sharded_strategy.check_version_compatibility(config.sharded_backend_version)
    return sharded_strategy, common_strategy


def load(sharded_state_dict: ShardedStateDict, checkpoint_dir: str,
         sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
         common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
         validate_access_integrity: bool = True,
         strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
         verify_integrity: bool = False, process_group=None
         ) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Collective: the state dict of ``sharded_state_dict``'s shape with every sharded leaf loaded (resharded from
    whatever layout saved it), factories merged, non-persistent objects given back, the common part merged in.
    With ``strict`` ``return_unexpected`` / ``return_all``: ``(state_dict, missing_keys, unexpected_keys)``.

    ``validate_access_integrity`` checks (one all-gather) that the ranks' requests cover every block once as main
    replica. ``verify_integrity`` (megatron-core HEAD) also checks that every shard file is complete before the
    read. ``process_group`` (HEAD): the group of the collective read (default: all ranks)."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy,
                                                                            common_strategy)
    if process_group is not None and hasattr(sharded_strategy, "process_group"):
        sharded_strategy.process_group = process_group
    common_state_dict = common_strategy.load_common(checkpoint_dir)
    sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
    merge(common_state_dict, nonpersistent)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)

    strict = parse_strict_flag(strict)
    ckpt_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_metadata = load_sharded_metadata(checkpoint_dir, sharded_strategy, common_strategy)
    local_metadata = global_metadata = None
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, missing, unexpected = validate_integrity_and_strict_load(
        sharded_state_dict, strict, validate_access_integrity, local_metadata, global_metadata, ckpt_metadata)
    if verify_integrity:
        from megatron.core.dist_checkpointing.sharded_io import shard_file_problem

        problem = shard_file_problem(checkpoint_dir)
        if problem:
            raise CheckpointingException(f"torch_dist checkpoint {checkpoint_dir}: {problem}")

    loaded = sharded_strategy.load(sharded_state_dict, checkpoint_dir)
    merge(common_state_dict, loaded)
    apply_factory_merges(common_state_dict, factories)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing, unexpected
    return common_state_dict


def load_common_state_dict(checkpoint_dir: str) -> StateDict:
    """The common (non-sharded) part of the checkpoint (``common.pt``)."""
    _, common_strategy = verify_checkpoint_and_load_strategy(str(checkpoint_dir))
    return common_strategy.load_common(str(checkpoint_dir))


def load_tensors_metadata(checkpoint_dir: str, sharded_strategy: Optional[LoadShardedStrategy] = None):
    """``{key: ShardedTensor without data}`` of every stored tensor: its global shape and dtype, one block."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(str(checkpoint_dir), sharded_strategy)
    return sharded_strategy.load_tensors_metadata(str(checkpoint_dir))


def load_sharded_metadata(checkpoint_dir: str, sharded_strategy: Optional[LoadShardedStrategy] = None,
                          common_strategy: Optional[LoadCommonStrategy] = None):
    """As :func:`load_tensors_metadata`, plus ``{unique_key: ShardedObject without data}`` of the stored objects."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(str(checkpoint_dir), sharded_strategy, common_strategy)
    return sharded_strategy.load_sharded_metadata(str(checkpoint_dir))


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """``{key: full tensor}`` of every stored tensor (the common part is not included). Collective when
    torch.distributed is initialized, else read in this process alone."""
    request = load_tensors_metadata(checkpoint_dir)
    loaded = load(dict(request), checkpoint_dir, validate_access_integrity=False)
    return {key: loaded[key] for key in request}


def load_content_metadata(checkpoint_dir: Optional[str] = None, *,
                          preloaded_state_dict: Optional[StateDict] = None) -> Optional[dict]:
    """The ``content_metadata`` given to :func:`save` (None if there was none)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


def remove_sharded_tensors(checkpoint_dir: str, key_prefix: str) -> None:
    """Remove from the checkpoint the sharded data stored under ``key_prefix`` (delegated to the checkpoint's
    sharded load strategy; torch_dist removes the data files named with that prefix and their metadata
    entries)."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(str(checkpoint_dir))
    sharded_strategy.remove_sharded_tensors(str(checkpoint_dir), key_prefix)


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: str) -> LoadShardedStrategy:
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def save(sharded_state_dict: ShardedStateDict, checkpoint_dir: str,
         sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
         common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
         validate_access_integrity: bool = True, async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check: Optional[Callable[[CommonStateDict], StateDict]] = None,
         content_metadata: Optional[dict] = None, async_strategy: Optional[str] = None,
         verify_integrity: bool = False) -> Optional[AsyncRequest]:
    """Collective: save ``sharded_state_dict`` under ``checkpoint_dir`` (see the module docstring); returns None,
    or with ``async_sharded_save`` the :class:`AsyncRequest` that writes the shards and ``metadata.json`` (run it
    with ``execute_sync()`` or an ``AsyncCallsQueue``). ``content_metadata`` is stored in the common part
    (``load_content_metadata`` reads it). ``async_strategy`` (megatron-core HEAD) names the background engine:
    any value runs the write in a background thread of this process."""
    checkpoint_dir = str(checkpoint_dir)
    if _rank() == 0:
        if os.path.isdir(checkpoint_dir) and os.listdir(checkpoint_dir):
            logger.warning(f"{checkpoint_dir} is not empty: overwriting an old incomplete or corrupted checkpoint")
        os.makedirs(checkpoint_dir, exist_ok=True)
    _barrier()
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    if common_strategy is None:
        common_strategy = get_default_save_common_strategy()
    elif isinstance(common_strategy, tuple):
        common_strategy = get_default_strategy(StrategyAction.SAVE_COMMON, *common_strategy)
    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    sharded_part, common_state_dict = save_preprocess(sharded_state_dict, validate_access_integrity,
                                                      preprocess_common_before_consistancy_check)
    common_strategy.save_common(common_state_dict, checkpoint_dir)
    if not sharded_strategy.can_handle_sharded_objects:
        raise CheckpointingException(f"{sharded_strategy} cannot store ShardedObjects")
    config = CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version, common_strategy.backend,
                                 common_strategy.version)

    def write_metadata():
        if _rank() == 0:
            save_config(config, checkpoint_dir)
        _barrier()

    if not async_sharded_save:
        sharded_strategy.save(sharded_part, checkpoint_dir)
        write_metadata()
        return None
    if not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(f"{sharded_strategy} cannot save asynchronously")
    request = sharded_strategy.async_save(sharded_part, checkpoint_dir)
    request.finalize_fns.append(write_metadata)
    return request
