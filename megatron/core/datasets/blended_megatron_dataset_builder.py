"""Builds the train/valid/test datasets (plain or blended) described by a BlendedMegatronDatasetConfig.

Unlike megatron-core, no rank waits on another here: datasets are built on every rank for which
``is_built_on_rank()`` is true (all of them without torch.distributed), and their index caches
coordinate through lock files (see index_cache.py), so a cache is built once per cache directory by
whichever rank gets there first. Ranks that do not build data return None and take part in no
collective.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, List, Optional, Type, Union

import numpy
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron.core.datasets.utils import Split, log_single_rank, normalize

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset
TopLevelDataset = Union[BlendedDataset, MidLevelDataset]
DistributedDataset = Union[TopLevelDataset, MidLevelDataset, LowLevelDataset, torch.utils.data.Dataset]


class BlendedMegatronDatasetBuilder:
    """Args:
        cls: the mid-level dataset class (GPTDataset, MockGPTDataset, BERTMaskedWordPieceDataset, ...).
        sizes: samples wanted per split (None: one pass over the data).
        is_built_on_rank: whether this rank builds datasets (consulted only under torch.distributed).
        config: the dataset config.
    """

    def __init__(self, cls: Type[MidLevelDataset], sizes: List[Optional[int]], is_built_on_rank: Callable[[], bool],
                 config: BlendedMegatronDatasetConfig) -> None:
        self.cls = cls
        self.sizes = list(sizes)
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        log_single_rank(logger, logging.INFO,
                        f"Building {cls.__name__} splits with sizes={self.sizes} and config={self.config}")
        if len(self.sizes) != len(Split):
            raise ValueError(f"sizes needs {len(Split)} entries (train, valid, test), got {self.sizes}")
        if not self.config.mock:
            for split in Split:
                if self.config.blend_per_split is None:
                    weights = self.config.blend[1]
                else:
                    if self.config.blend_per_split[split.value] is None:
                        continue
                    weights = self.config.blend_per_split[split.value][1]
                if self.sizes[split.value] is None and weights is not None:
                    raise ValueError(f"the {split.name} split has dataset weights but no requested size: weights "
                                     f"need a sample count")

    def build(self) -> List[Optional[TopLevelDataset]]:
        """One dataset (or None) per split."""
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if dataset is not None and len(dataset) > 0:
                if isinstance(dataset, BlendedDataset):
                    assert dataset.size is None or dataset.size == len(dataset)
                elif isinstance(dataset, MegatronDataset):
                    assert dataset.num_samples is None or dataset.num_samples <= len(dataset)
        return datasets

    def _build_blended_dataset_splits(self) -> List[Optional[TopLevelDataset]]:
        if self.config.mock:
            try:
                return self._build_megatron_dataset_splits(None, self.config.split_matrix, self.sizes)
            except Exception as error:
                raise Exception(f"{self.cls.__name__} failed to build as a mock data generator") from error

        if self.config.blend:
            prefixes, weights = self.config.blend
            if weights is not None:
                weights = normalize(weights)
            split = self.config.split_matrix
            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], split, self.sizes)
            return self._blend(prefixes, weights, split, self.sizes, range(len(Split)))

        blended = [None] * len(Split)
        for i in range(len(Split)):
            blend = self.config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            prefixes, weights = blend
            if weights is not None:
                weights = normalize(weights)
            if len(prefixes) == 1:
                blended[i] = self._build_megatron_dataset_splits(prefixes[0], split_spoof, sizes_spoof)[i]
            else:
                blended[i] = self._blend(prefixes, weights, split_spoof, sizes_spoof, [i])[i]
        return blended

    def _blend(self, prefixes, weights, split, sizes, split_ids) -> List[Optional[TopLevelDataset]]:
        """Mid-level datasets per prefix, then one BlendedDataset per split in ``split_ids``."""
        if weights is None:
            buffer_sizes = [[None] * len(Split) for _ in prefixes]  # one pass over each dataset
        else:
            target_sizes = _get_size_per_split_per_dataset(weights, sizes)
            buffer_sizes = _get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        per_split = self._build_megatron_datasets_parallel(prefixes, split, buffer_sizes)
        blended = [None] * len(Split)
        for i in split_ids:
            if split[i] is None:
                continue
            if weights is not None and sizes[i] is not None:
                weights_i = weights
                size_i = sum(target[i] for target in target_sizes)
            elif weights is None:
                try:
                    weights_i = [len(dataset) for dataset in per_split[i]]
                except TypeError:  # not built on this rank
                    weights_i = [0 for _ in prefixes]
                size_i = min(sizes[i], sum(weights_i)) if sizes[i] is not None else None
            else:
                raise ValueError("dataset weights need a requested sample count for every split")
            blended[i] = self.build_generic_dataset(BlendedDataset, self.is_built_on_rank, True, per_split[i],
                                                    weights_i, size_i, self.config)
        return blended

    def _build_megatron_datasets_parallel(self, prefixes: List[str], split, sizes_per_dataset
                                          ) -> List[List[Optional[MegatronDataset]]]:
        """For each split, the list of mid-level datasets (one per prefix, in prefix order)."""
        jobs = [(prefix, split, sizes_per_dataset[i], False) for i, prefix in enumerate(prefixes)]
        workers = max(1, int(self.config.num_dataset_builder_threads))
        if workers == 1:
            results = [self._build_megatron_dataset_splits(*job) for job in jobs]
        else:
            with ThreadPoolExecutor(max_workers=workers) as executor:
                results = list(executor.map(lambda job: self._build_megatron_dataset_splits(*job), jobs))
        return [[result[i] for result in results] for i in range(len(Split))]

    def _build_megatron_dataset_splits(self, dataset_path: Optional[str], split, sizes,
                                       synchronize_ranks: bool = True) -> List[Optional[MidLevelDataset]]:
        """Each split of one low-level dataset; ``synchronize_ranks`` is accepted for API compatibility."""
        if torch.distributed.is_initialized() and not self.is_built_on_rank():
            return [None] * len(Split)
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets = []
        for i, index_split in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            beg = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32)
            datasets.append(self.build_generic_dataset(self.cls, self.is_built_on_rank, synchronize_ranks,
                                                       low_level_dataset, dataset_path, indices, sizes[i],
                                                       index_split, self.config))
        return datasets

    @staticmethod
    def build_generic_dataset(cls: Union[Type[DistributedDataset], Callable], is_built_on_rank: Callable,
                              synchronize_ranks: bool, *args: Any) -> Optional[DistributedDataset]:
        """``cls(*args)`` on ranks that build data; None on the others (only under torch.distributed)."""
        if torch.distributed.is_initialized() and not is_built_on_rank():
            return None
        try:
            return cls(*args)
        except OSError as error:
            raise OSError(
                f"failed to read the dataset or write its index cache ({error}); if the cache directory is not "
                f"writable, pass a writable --data-cache-path (config.path_to_cache)") from error


def _get_size_per_split_per_dataset(normalized_weights: List[float], target_size_per_split: List[Optional[int]],
                                    surplus: float = 0.0) -> List[List[Optional[int]]]:
    """Samples to request from each dataset per split: ``ceil(ceil(size * weight) * (1 + surplus))``."""
    if not numpy.isclose(sum(normalized_weights), 1.0):
        raise ValueError(f"weights must be normalised, got {normalized_weights}")
    return [[None if target is None else int(math.ceil(math.ceil(target * weight) * (1 + surplus)))
             for target in target_size_per_split]
            for weight in normalized_weights]
