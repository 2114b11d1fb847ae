"""The configuration shared by every megatron-core dataset, and the ``--split`` arithmetic."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

Blend = Tuple[List[str], Optional[List[float]]]


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration of the dataset builder.

    ``blend`` is ``(prefixes, weights or None)`` for splits carved from the same data by ``split``
    (e.g. ``"969,30,1"``); ``blend_per_split`` gives one blend per train/valid/test split instead. With
    neither, the datasets are mock datasets.
    """

    random_seed: int
    sequence_length: int
    blend: Optional[Blend] = None
    blend_per_split: Optional[List[Optional[Blend]]] = None
    split: Optional[str] = None
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = False
    tokenizer: Optional[MegatronTokenizer] = None
    mid_level_dataset_surplus: float = 0.005

    def __post_init__(self) -> None:
        if self.blend is None and not (self.blend_per_split and any(self.blend_per_split)):
            self.mock = True
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError("--data-path (blend) and --train/valid/test-data-path (blend_per_split) "
                                 "cannot be used together")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"blend_per_split needs {len(Split)} entries (train, valid, test), "
                                 f"got {len(self.blend_per_split)}")
            for split in Split:
                blend = self.blend_per_split[split.value]
                if blend is None:
                    log_single_rank(logger, logging.INFO, f"blend not provided for {split.name} split")
                else:
                    _check_blend(blend, f"--{split.name}-data-path")
            if self.split is not None:
                log_single_rank(logger, logging.WARNING,
                                f"--split {self.split!r} is ignored with per-split data paths")
                self.split = None
        else:
            if self.blend is not None:
                _check_blend(self.blend, "--data-path")
            if self.split is None:
                if not self.mock:
                    raise ValueError("--split is required with --data-path (e.g. --split 969,30,1)")
                self.split = "969,30,1"
            split_vector = parse_and_normalize_split(self.split)
            self.split_matrix = convert_split_vector_to_split_matrix(split_vector)
            log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def _check_blend(blend: Blend, flag: str) -> None:
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{flag} names no dataset prefix")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(f"{flag}: {len(weights)} weights for {len(prefixes)} dataset prefixes")
        if any(w < 0 for w in weights) or not sum(weights) > 0:
            raise ValueError(f"{flag}: weights must be non-negative and not all zero, got {weights}")


def parse_and_normalize_split(split: str) -> List[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, ``"99"``) -> three proportions summing to one."""
    values = list(map(float, re.findall(r"[.0-9]+", split)))
    if not values or len(values) > len(Split):
        raise ValueError(f"--split {split!r} must have one to three numbers such as 969,30,1")
    values = values + [0.0] * (len(Split) - len(values))
    return normalize(values)


def convert_split_vector_to_split_matrix(vector_a: List[float],
                                         vector_b: Optional[List[float]] = None) -> List[Optional[Tuple[float, float]]]:
    """Book-end each split: ``[.9, .09, .01]`` -> ``[(0, .9), (.9, .99), (.99, 1)]``.

    With ``vector_b``, each range is the overlap of the two vectors' ranges (None where they do not
    overlap). Sums are accumulated left to right so the rounding matches megatron-core's.
    """
    if vector_b is None:
        vector_b = vector_a

    def bookends(vector):
        edges = [0]
        for value in vector:
            edges.append(edges[-1] + value)
        return list(zip(edges[:-1], edges[1:]))

    matrix = []
    for (a_beg, a_end), (b_beg, b_end) in zip(bookends(vector_a), bookends(vector_b)):
        if min(a_end, b_end) <= max(a_beg, b_beg):
            matrix.append(None)
        else:
            matrix.append((max(a_beg, b_beg), min(a_end, b_end)))
    return matrix
