"""Base of the masked-language-model datasets over WordPiece tokens (BERT): sample index and masking."""
from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)


@dataclass
class MaskedWordPieceDatasetConfig(BlendedMegatronDatasetConfig):
    """Masking options (megatron-core's names); BERT uses p=0.15, n-grams up to 3, whole words."""

    masking_probability: Optional[float] = None
    short_sequence_probability: Optional[float] = None
    masking_max_ngram: Optional[int] = None
    masking_do_full_word: Optional[bool] = None
    masking_do_permutation: Optional[bool] = None
    masking_use_longer_ngrams: Optional[bool] = None
    masking_use_geometric_distribution: Optional[bool] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a WordPiece tokenizer")
        for name in ("masking_probability", "short_sequence_probability", "masking_max_ngram",
                     "masking_do_full_word", "masking_do_permutation", "masking_use_longer_ngrams",
                     "masking_use_geometric_distribution"):
            if getattr(self, name) is None:
                raise ValueError(f"{type(self).__name__}.{name} must be set")
        if not 0 < self.masking_probability < 1:
            raise ValueError(f"--mask-prob must be in (0, 1), got {self.masking_probability}")
        if not 0 <= self.short_sequence_probability <= 1:
            raise ValueError(f"--short-seq-prob must be in [0, 1], got {self.short_sequence_probability}")
        if self.masking_max_ngram <= 0:
            raise ValueError("masking_max_ngram must be positive")
        if self.masking_do_permutation:
            raise NotImplementedError("masking_do_permutation is not supported (BERT does not use it)")


class MaskedWordPieceDataset(MegatronDataset):
    """Splits by document; samples are runs of whole sentences chosen by ``helpers.build_mapping``."""

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        return low_level_dataset.document_indices.shape[0] - 1

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: MaskedWordPieceDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + [
            "masking_probability", "short_sequence_probability", "masking_max_ngram", "masking_do_full_word",
            "masking_do_permutation", "masking_use_longer_ngrams", "masking_use_geometric_distribution"]

    def __len__(self) -> int:
        return self.sample_index.shape[0]

    def _build_sample_index(self, sequence_length: int, min_sentences_per_sample: int) -> numpy.ndarray:
        cache = self._index_cache(("sample_index.npy",), with_split=False)
        # With a sample count, epochs are unbounded and the count stops the mapping.
        num_epochs = numpy.iinfo(numpy.int32).max - 1 if self.num_samples is not None else 1
        max_num_samples = self.num_samples if self.num_samples is not None else numpy.iinfo(numpy.int64).max

        def build():
            log_single_rank(logger, logging.INFO,
                            f"Build and save the {type(self).__name__} {self.index_split.name} indices")
            from megatron.core.datasets import helpers

            if len(self.indices) == 0:
                return {"sample_index.npy": numpy.zeros((0, 3), dtype=numpy.uint32)}
            bounds = numpy.append(self.indices, self.indices[-1] + 1)  # + the upper bound of the last document
            sample_index = helpers.build_mapping(self.dataset.document_indices[bounds], self.dataset.sequence_lengths,
                                                 num_epochs, max_num_samples, sequence_length,
                                                 self.config.short_sequence_probability, self.config.random_seed,
                                                 False, min_sentences_per_sample)
            return {"sample_index.npy": sample_index}

        arrays, self.built_anew_on_cache_miss = cache.get_or_build(build)
        sample_index = arrays["sample_index.npy"]
        log_single_rank(logger, logging.INFO, f"> total number of samples: {sample_index.shape[0]}")
        return sample_index

    def _create_masked_lm_predictions(self, token_ids: List[int], target_sequence_length: int,
                                      numpy_random_state: numpy.random.RandomState
                                      ) -> Tuple[List[int], List[int], List[int], List[int], List]:
        """Mask n-grams of (whole-word) candidates until ``masking_probability`` of the tokens are masked.

        Returns the masked ids, the masked positions, their original ids, the word boundaries and the
        masked spans.
        """
        tokenizer = self.config.tokenizer
        inv_vocab = tokenizer.inv_vocab
        special = {tokenizer.cls, tokenizer.sep}
        boundaries, candidates = [], []
        for i, token_id in enumerate(token_ids):
            if token_id in special:
                boundaries.append(1)
            elif not inv_vocab[token_id].startswith("##"):
                boundaries.append(1)
                candidates.append([i])
            else:
                boundaries.append(0)
                if self.config.masking_do_full_word and candidates:
                    candidates[-1].append(i)
                else:
                    candidates.append([i])

        n_maskings = min(self.config.masking_probability * target_sequence_length,
                         max(1, int(round(len(token_ids) * self.config.masking_probability))))
        ngram_sizes = numpy.arange(self.config.masking_max_ngram, dtype=numpy.int64) + 1
        ngram_probs = 1.0 / ngram_sizes
        ngram_probs = ngram_probs / ngram_probs.sum(keepdims=True)
        if self.config.masking_use_longer_ngrams:
            ngram_probs = ngram_probs[::-1]

        # For each candidate start, the n-grams (lists of candidates) starting there, n = 1..max.
        candidate_ngrams = [[candidates[start:start + n] for n in ngram_sizes] for start in range(len(candidates))]
        numpy_random_state.shuffle(candidate_ngrams)

        masked_token_ids = list(token_ids)
        masked_positions_and_labels, masked_spans, masked_indices = [], [], set()
        for ngrams in candidate_ngrams:
            if len(masked_positions_and_labels) >= n_maskings:
                break
            if not ngrams:
                continue
            if self.config.masking_use_geometric_distribution:
                n = min(numpy_random_state.geometric(0.2), self.config.masking_max_ngram)
            else:
                probs = ngram_probs[:len(ngrams)] / ngram_probs[:len(ngrams)].sum(keepdims=True)
                n = numpy_random_state.choice(ngram_sizes[:len(ngrams)], p=probs)
            # Shrink the n-gram until it fits in the remaining masking budget.
            while True:
                ngram_indices = sum(ngrams[n - 1], [])
                n = n - 1
                if n_maskings >= len(masked_positions_and_labels) + len(ngram_indices):
                    skip = False
                    break
                if n == 0:
                    skip = True
                    break
            if skip or any(index in masked_indices for index in ngram_indices):
                continue
            for index in ngram_indices:
                masked_indices.add(index)
                replacement = self._get_token_mask(numpy_random_state)
                masked_token_ids[index] = token_ids[index] if replacement is None else replacement
                masked_positions_and_labels.append((index, token_ids[index]))
            masked_spans.append((ngram_indices, [token_ids[index] for index in ngram_indices]))

        numpy_random_state.shuffle(candidate_ngrams)  # kept: it advances the random state as megatron-core does

        masked_positions_and_labels.sort(key=lambda pair: pair[0])
        masked_positions = [position for position, _ in masked_positions_and_labels]
        masked_labels = [label for _, label in masked_positions_and_labels]
        masked_spans.sort(key=lambda span: span[0][0])
        return masked_token_ids, masked_positions, masked_labels, boundaries, masked_spans

    @abstractmethod
    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """The replacement id for a masked position, or None to keep the original."""
