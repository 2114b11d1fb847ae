"""The base class of the "mid-level" datasets (GPT, BERT): one split of one low-level dataset."""
from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Union

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.index_cache import IndexCache
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """One split of a low-level dataset, sampled ``num_samples`` times.

    Args:
        dataset: the low-level dataset (usually an ``IndexedDataset``).
        dataset_path: its path prefix (None for mock data), for bookkeeping and the default cache path.
        indices: the low-level element indices of this split.
        num_samples: how many samples to draw (None: one epoch).
        index_split: which split this is.
        config: the dataset config.
    """

    def __init__(self, dataset: LowLevelDataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: BlendedMegatronDatasetConfig) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8")).hexdigest()
        self.built_anew_on_cache_miss = False

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """Number of elements the split proportions apply to."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config fields that change the indices, hence the cache hash."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    def _index_cache(self, array_names, with_split: bool = True) -> IndexCache:
        """The cache of this dataset's index arrays: ``--data-cache-path`` or ``<prefix>/cache/<Class>_indices``."""
        directory = self.config.path_to_cache
        if directory is None and not self.config.mock and getattr(self.dataset, "path_prefix", None):
            directory = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        stem = f"{self.unique_description_hash}-{type(self).__name__}"
        if with_split:
            stem += f"-{self.index_split.name}"
        return IndexCache(directory, stem, array_names, self.unique_description)

    @abstractmethod
    def __len__(self) -> int:
        pass

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Union[torch.Tensor, numpy.ndarray, Any]]:
        pass
