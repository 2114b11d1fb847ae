"""Selecting and re-keying the sharded leaves of a sharded state dict (keys are changed in place)."""
from __future__ import annotations

from typing import Dict, Tuple

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase, ShardedObject,
                                                      ShardedStateDict, ShardedTensor, ShardedTensorFactory,
                                                      StateDict)


def zip_strict(*args):
    """``zip`` that refuses iterables of different lengths."""
    lengths = {len(a) for a in args}
    if len(lengths) > 1:
        raise ValueError(f"zip_strict: lengths {sorted(lengths)} differ")
    return zip(*args)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(the ShardedTensor leaves, the rest), both nested as the input."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict):
    """(the ShardedTensor and ShardedTensorFactory leaves, the rest)."""
    return extract_matching_values(sharded_state_dict,
                                   lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory)))


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict):
    """(the ShardedTensor, factory and LocalNonpersistentObject leaves, the rest)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(
        v, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)))


def extract_sharded_base(sharded_state_dict: ShardedStateDict):
    """(every sharded leaf — tensors, objects, factories —, the plain rest: the common state dict)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict):
    """(the LocalNonpersistentObject leaves, the rest)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def _rekey(sharded_state_dict: ShardedStateDict, rename) -> None:
    def visit(x):
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            x.key = rename(x.key)
        return x

    dict_list_map_inplace(visit, sharded_state_dict)


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded leaf."""
    _rekey(sharded_state_dict, lambda key: prefix + key)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in the key of every sharded leaf; a key without it is an error."""
    def rename(key):
        if not key.startswith(old_prefix):
            raise ValueError(f"sharded key {key!r} does not begin with {old_prefix!r}")
        return new_prefix + key[len(old_prefix):]

    _rekey(sharded_state_dict, rename)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename the keys that begin with a prefix of ``prefix_map`` (the first matching prefix); others stay."""
    def rename(key):
        for old, new in prefix_map.items():
            if key.startswith(old):
                return new + key[len(old):]
        return key

    _rekey(sharded_state_dict, rename)
