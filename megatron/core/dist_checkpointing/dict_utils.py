"""Walking nested dicts and lists of a (sharded) state dict; any other value (tuples too) is a leaf."""
from __future__ import annotations

from typing import Any, Callable, Tuple, Union

import torch


def extract_matching_values(x: Union[dict, list], predicate: Callable[[Any], bool],
                            return_lists_as_dicts: bool = False) -> Tuple[Union[dict, list], Union[dict, list]]:
    """Split ``x`` into (the leaves ``predicate`` accepts, the others), both keeping the nesting. A container
    whose leaves all matched does not appear in the second part (an empty one stays there). With
    ``return_lists_as_dicts`` the matching part turns lists into ``{index: value}`` dicts, so that the
    positions can be restored."""
    if isinstance(x, dict):
        matching, other = {}, {}
        for key, value in x.items():
            if isinstance(value, (dict, list)):
                m, o = extract_matching_values(value, predicate, return_lists_as_dicts)
                if m:
                    matching[key] = m
                if o or not value:
                    other[key] = o
            elif predicate(value):
                matching[key] = value
            else:
                other[key] = value
        return matching, other
    if not isinstance(x, list):
        raise ValueError(f"a state dict must be a dict or a list at its top level, got {type(x).__name__}")
    matching = {} if return_lists_as_dicts else []
    other = {} if return_lists_as_dicts else []

    def put(target, index, value):
        if return_lists_as_dicts:
            target[index] = value
        else:
            target.append(value)

    for index, value in enumerate(x):
        if isinstance(value, (dict, list)) and value:
            m, o = extract_matching_values(value, predicate, return_lists_as_dicts)
            if m:
                put(matching, index, m)
            if o:
                put(other, index, o)
        else:
            put(matching if predicate(value) else other, index, value)
    return matching, other


def nested_values(x: Union[dict, list]):
    """Every leaf of ``x``, depth first."""
    for value in (x.values() if isinstance(x, dict) else x):
        if isinstance(value, (dict, list)):
            yield from nested_values(value)
        else:
            yield value


def nested_items_iter(x: Union[dict, list]):
    """(container, key, leaf) of every leaf of ``x``."""
    for key, value in (x.items() if isinstance(x, dict) else enumerate(x)):
        if isinstance(value, (dict, list)):
            yield from nested_items_iter(value)
        else:
            yield x, key, value


def dict_map(f: Callable, d: dict) -> None:
    """Apply ``f`` to every leaf of the nested dict ``d``, in place (lists are leaves)."""
    for key, value in d.items():
        if isinstance(value, dict):
            dict_map(f, value)
        else:
            d[key] = f(value)


def dict_map_with_key(f: Callable, d: dict) -> None:
    """As :func:`dict_map` with ``f(key, value)``."""
    for key, value in d.items():
        if isinstance(value, dict):
            dict_map_with_key(f, value)
        else:
            d[key] = f(key, value)


def dict_list_map_inplace(f: Callable, x):
    """Replace every leaf ``v`` of nested dicts/lists ``x`` by ``f(v)`` in place; returns ``x`` (or ``f(x)`` for a
    leaf)."""
    if isinstance(x, dict):
        for key, value in x.items():
            x[key] = dict_list_map_inplace(f, value)
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, value) for value in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable, x):
    """A new nesting of the same shape with ``f`` applied to every leaf."""
    if isinstance(x, dict):
        return {key: dict_list_map_outplace(f, value) for key, value in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, value) for value in x]
    return f(x)


def merge(x1: Union[dict, list], x2: Union[dict, list], key: Tuple = ()):
    """Merge ``x2`` into ``x1`` in place (dicts by key, lists by position) and return ``x1``; two leaves at the same
    place are an error."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"cannot merge lists of lengths {len(x1)} and {len(x2)} at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
        return x1
    raise ValueError(f"two values at the same place {key}: {type(x1).__name__} and {type(x2).__name__}")


def diff(x1: Any, x2: Any, prefix: Tuple = ()):
    """(paths only in ``x1``, paths only in ``x2``, paths of differing leaves) of two nested dicts/lists; tensors
    differ when their shapes or values differ."""
    only_left, only_right, mismatch = [], [], []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, diff_ = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += diff_
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (a, b) in enumerate(zip(x1, x2)):
            left, right, diff_ = diff(a, b, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += diff_
    else:
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            same = x1.shape == x2.shape and bool(torch.equal(x1, x2))
        elif isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
            same = False
        else:
            try:
                same = bool(x1 == x2)
            except Exception:  # noqa: BLE001 - values that cannot be compared count as different
                same = False
        if not same:
            mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def inspect_types(x, prefix: Tuple = (), indent: int = 4) -> None:
    """Print the nesting of ``x`` with each leaf's type (tensors with shape and dtype)."""
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        for key, value in x.items():
            if isinstance(value, (dict, list)):
                print(f"{pad}{key}:")
                inspect_types(value, prefix + (key,), indent)
            else:
                inspect_types(value, prefix + (key,), indent)
    elif isinstance(x, list):
        for i, value in enumerate(x):
            inspect_types(value, prefix + (i,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"{pad}{prefix[-1] if prefix else ''}: Tensor of shape {tuple(x.shape)} {x.dtype}")
    else:
        print(f"{pad}{prefix[-1] if prefix else ''}: {type(x).__name__}")


def map_reduce(xs, key_fn: Callable = lambda x: x, value_fn: Callable = lambda x: x,
               reduce_fn: Callable = lambda x: x) -> dict:
    """``{key_fn(x): reduce_fn([value_fn(x) for the xs with that key])}``."""
    groups = {}
    for x in xs:
        groups.setdefault(key_fn(x), []).append(value_fn(x))
    return {key: reduce_fn(values) for key, values in groups.items()}
