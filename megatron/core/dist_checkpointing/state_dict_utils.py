"""The preparation of a sharded state dict before a save or a load."""
from __future__ import annotations

from typing import Callable, Optional

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron.core.dist_checkpointing.mapping import (CommonStateDict, ShardedStateDict, ShardedTensorFactory,
                                                      StateDict, apply_factories)
from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity


def save_preprocess(sharded_state_dict: ShardedStateDict, validate_access_integrity: bool = True,
                    preprocess_common_before_consistancy_check: Optional[Callable[[CommonStateDict],
                                                                                  StateDict]] = None):
    """(sharded part, common part) of a state dict to save: factories applied, non-persistent objects dropped;
    with ``validate_access_integrity`` (collective) the sharding of all ranks is checked and the common part
    compared with rank 0's (``preprocess_common_before_consistancy_check`` may drop what may differ)."""
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)
    if validate_access_integrity:
        compared = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            compared = preprocess_common_before_consistancy_check(common_state_dict)
        validate_sharding_integrity(determine_global_metadata(sharded_part)[1], common_state_dict=compared)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict):
    """(request with factories applied, non-persistent objects unwrapped, the factories) of a state dict to load;
    the argument is not modified (its containers are copied)."""
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    factories, _ = extract_matching_values(sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(sharded_state_dict)
    dict_list_map_inplace(ShardedTensorFactory.without_data, factories)
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda obj: obj.unwrap(), nonpersistent)
    return sharded_state_dict, nonpersistent, factories
