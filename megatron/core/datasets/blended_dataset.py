"""A dataset that interleaves several datasets in proportion to weights, deterministically.

Position ``s`` is taken from the dataset whose share lags furthest behind its weight
(``argmax_d weights[d] * max(s, 1) - taken[d]``, ties to the lowest index) — no random sampling; the
component datasets are already shuffled. With ``size=None`` and integer weights every component is used
exactly ``weights[d]`` times.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import log_single_rank, normalize

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """Args:
        datasets: the component (mid-level) datasets, all of one class and one split.
        weights: their weights (normalised here when ``size`` is given).
        size: number of samples, or None to use every component sample exactly once (integer weights).
        config: the builder config (``path_to_cache`` decides whether the indices are cached).
    """

    def __init__(self, datasets: List[MegatronDataset], weights: List[Union[int, float]], size: Optional[int],
                 config: BlendedMegatronDatasetConfig) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:
            raise ValueError("BlendedDataset supports at most 32766 datasets (int16 dataset index)")
        if any(type(d) is not type(datasets[0]) for d in datasets):
            raise TypeError("BlendedDataset components must all be of the same class")
        if any(d.index_split != datasets[0].index_split for d in datasets):
            raise ValueError("BlendedDataset components must all belong to the same split")
        if any(w < 0 for w in weights) or not sum(weights) > 0:
            raise ValueError(f"BlendedDataset weights must be non-negative and not all zero, got {weights}")
        if size is None and any(w != int(w) for w in weights):
            raise ValueError("BlendedDataset with size=None needs integer weights (component sample counts)")
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")
        if size is not None:
            weights = normalize(weights)

        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_description = json.dumps(unique_identifiers, indent=4, default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self.built_anew_on_cache_miss = False

        self.dataset_index, self.dataset_sample_index = self._build_indices()
        self._check_bounds()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray, torch.Tensor]]:
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _build_indices(self):
        # Blended indices are cached only in an explicit cache directory, as megatron-core does.
        cache = IndexCache(self.config.path_to_cache, f"{self.unique_description_hash}-{type(self).__name__}-"
                           f"{self.split.name}", ("dataset_index.npy", "dataset_sample_index.npy"),
                           self.unique_description)
        arrays, self.built_anew_on_cache_miss = cache.get_or_build(self._compute_indices)
        return arrays["dataset_index.npy"], arrays["dataset_sample_index.npy"]

    def _compute_indices(self) -> Dict[str, numpy.ndarray]:
        log_single_rank(logger, logging.INFO,
                        f"Build and save the {type(self).__name__} indices")
        t_beg = time.time()
        from megatron.core.datasets import helpers

        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            helpers.build_blending_indices(dataset_index, dataset_sample_index, self.weights, len(self.datasets),
                                           self.size, False)
        else:
            total = int(sum(self.weights))
            dataset_index = numpy.zeros(total, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(total, dtype=numpy.int64)
            helpers.build_exhaustive_blending_indices(dataset_index, dataset_sample_index,
                                                      numpy.asarray(self.weights, dtype=numpy.int64),
                                                      len(self.datasets))
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        return {"dataset_index.npy": dataset_index, "dataset_sample_index.npy": dataset_sample_index}

    def _check_bounds(self) -> None:
        """Every component must hold the samples the blend asks of it (extreme weights can overrun one)."""
        counts = numpy.bincount(numpy.asarray(self.dataset_index, dtype=numpy.int64), minlength=len(self.datasets))
        for d, (dataset, wanted) in enumerate(zip(self.datasets, counts)):
            if wanted > len(dataset):
                raise ValueError(
                    f"BlendedDataset ({self.split.name}): dataset {d} ({dataset.dataset_path}) has {len(dataset)} "
                    f"samples but the blend with weights {self.weights} and size {self.size} needs {int(wanted)}; "
                    f"request more samples of it (mid_level_dataset_surplus) or lower its weight")
        log_single_rank(logger, logging.INFO, f"> {type(self).__name__} length: {len(self)}")
