"""Small shared pieces of the dataset package: the split enum, weight normalisation, blend parsing,
rank-aware logging."""
from __future__ import annotations

import logging
from enum import Enum
from typing import List, Optional, Tuple

import numpy

from megatron.core._rank_utils import log_single_rank  # noqa: F401  (the datasets' import path)

logger = logging.getLogger(__name__)


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def normalize(weights: List[float]) -> List[float]:
    """Scale ``weights`` so that they sum to one (float64, as megatron-core does)."""
    w = numpy.array(weights, dtype=numpy.float64)
    w_sum = numpy.sum(w)
    if not w_sum > 0:
        raise ValueError(f"dataset weights must sum to a positive number, got {list(weights)}")
    return (w / w_sum).tolist()


def get_blend_from_list(blend: Optional[List[str]]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """Turn ``--data-path`` style lists into megatron-core's ``(prefixes, weights)`` blend.

    ``["p1", "p2"]`` -> ``(["p1", "p2"], None)``; ``["0.3", "p1", "0.7", "p2"]`` -> ``(["p1", "p2"], [0.3, 0.7])``.
    A single string containing spaces is split first (as when the list comes from a file).
    """
    if blend is None:
        return None
    if len(blend) == 1 and isinstance(blend[0], str) and len(blend[0].split()) > 1:
        blend = blend[0].split()
    if len(blend) == 0:
        return None
    if len(blend) % 2 == 1:
        return [str(p).strip() for p in blend], None
    raw_weights, raw_prefixes = blend[0::2], blend[1::2]
    try:
        weights = [float(w) for w in raw_weights]
    except ValueError:
        # An even number of plain prefixes: no weights were given.
        return [str(p).strip() for p in blend], None
    return [str(p).strip() for p in raw_prefixes], weights


def compile_helpers() -> None:
    """Kept for callers of megatron-core's run-time compile step: here the helpers are compiled by
    ``pip install`` (or replaced by their NumPy twin), so this only reports which implementation is used."""
    from megatron.core.datasets import helpers

    log_single_rank(logger, logging.INFO, f"dataset index helpers: {helpers.IMPLEMENTATION} (built at install time)")
