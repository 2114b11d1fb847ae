"""Selecting and re-keying the sharded leaves of a sharded state dict (keys are changed in place); the identity of a
shard (:data:`_ShardId`: ``(key, global_offset, flattened range or None)``, equal on every rank holding a replica of
the block); scoped debug timing (:func:`logger_stack`, :func:`debug_time`, :func:`debug_msg`).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

from megatron.core.dist_checkpointing.dict_utils import (dict_list_map_inplace, extract_matching_values,
                                                         nested_values)
from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase, ShardedObject,
                                                      ShardedStateDict, ShardedTensor, ShardedTensorFactory,
                                                      StateDict)


# A shard's identity: the same block of the same global tensor has the same id on every rank that holds it.
_ShardId = Tuple[str, tuple, Optional[tuple]]


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """``(key, global_offset, (start, stop) of flattened_range or None)``."""
    rng = sharded_tensor.flattened_range
    return sharded_tensor.key, sharded_tensor.global_offset, None if rng is None else (rng.start, rng.stop)


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """``(key, global_offset, global_shape)`` of a sharded object piece."""
    return sharded_object.key, sharded_object.global_offset, sharded_object.global_shape


def is_float8tensor(tensor) -> bool:
    """True when ``tensor`` is Transformer Engine's ``Float8Tensor`` (always False without Transformer Engine)."""
    for module in ("transformer_engine.pytorch.tensor.float8_tensor", "transformer_engine.pytorch.float8_tensor"):
        try:
            float8 = __import__(module, fromlist=["Float8Tensor"]).Float8Tensor
        except (ImportError, AttributeError):
            continue
        return isinstance(tensor, float8)
    return False


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace, in place, the ``data`` of every leaf that holds a Transformer Engine FP8 tensor by its
    dequantized (high-precision) value; other leaves are left alone."""
    for leaf in nested_values(sharded_state_dict):
        data = getattr(leaf, "data", None)
        if data is not None and is_float8tensor(data):
            leaf.data = data.dequantize()


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


# ------------------------------------------------------------------------------------------------- debug timing
# The scope names and loggers of the enclosing logger_stack blocks, per thread (a background save has its own).
_fallback_logger = logging.getLogger(__name__)
_scopes = threading.local()


def _stacks() -> Tuple[List[str], List[logging.Logger]]:
    if not hasattr(_scopes, "names"):
        _scopes.names, _scopes.loggers = [], []
    return _scopes.names, _scopes.loggers


@contextmanager
def logger_stack(name: Optional[str] = None, current_logger: Optional[logging.Logger] = None):
    """Enter a named scope: yields ``(the enclosing scope names joined by '.', the logger)``, where the logger is
    ``current_logger``, else the innermost one given to an enclosing block, else this module's. Both stacks are
    restored on exit."""
    names, loggers = _stacks()
    if name:
        names.append(name)
    if current_logger:
        loggers.append(current_logger)
    active = current_logger or (loggers[-1] if loggers else _fallback_logger)
    try:
        yield ".".join(names), active
    finally:
        if name and names:
            names.pop()
        if current_logger and loggers:
            loggers.pop()


@contextmanager
def debug_time(name: str, logger: Optional[logging.Logger] = None, threshold: float = float("-inf"), level=None):
    """Time the block (or, as a decorator, the function) and log ``"<scopes>.<name> took <t>s"``: at DEBUG when no
    ``threshold`` is set, at WARNING (or ``level``) when the time reached ``threshold`` seconds; nothing when
    it did not."""
    with logger_stack(name, logger) as (scope, active):
        start = time.time()
        try:
            yield
        finally:
            elapsed = time.time() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                active.log(level, f"{scope} took {elapsed:.4f}s")


def debug_msg(msg: str) -> None:
    """Log ``"<enclosing scopes> <msg>"`` at DEBUG with the innermost logger of :func:`logger_stack`."""
    with logger_stack(None, None) as (scope, active):
        active.debug(f"{scope} {msg}")
