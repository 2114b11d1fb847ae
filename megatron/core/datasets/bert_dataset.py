"""BERT pretraining samples: ``[CLS] A [SEP] B [SEP]``, masked LM labels and the sentence-order target.

Each sample is a run of whole sentences from one document (``helpers.build_mapping``). With the binary
head, the run is cut into segments A and B, which are swapped with probability 0.5 (``is_random``: the
sentence-order objective); the longer segment is trimmed one token at a time from a random end until the
pair fits. 15 % of the tokens (whole words, n-grams up to 3) are chosen for prediction, of which 80 %
become ``[MASK]``, 10 % a random id and 10 % stay. Every random choice comes from
``numpy.random.RandomState((seed + idx) % 2**32)``, so a sample does not depend on iteration order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split


@dataclass
class BERTMaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """``classification_head``: build sentence pairs for the binary (sentence-order) head."""

    classification_head: Optional[bool] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.classification_head is None:
            raise ValueError("BERTMaskedWordPieceDatasetConfig.classification_head must be set (--bert-no-binary-head)")


class BERTMaskedWordPieceDataset(MaskedWordPieceDataset):
    """The BERT dataset over a sentence-level WordPiece IndexedDataset (``*_text_sentence``)."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: BERTMaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.token_lookup = list(self.config.tokenizer.inv_vocab.keys())
        # Room for one [CLS] and two [SEP].
        self.sample_index = self._build_sample_index(self.config.sequence_length - 3,
                                                     2 if self.config.classification_head else 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["classification_head"]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        idx_beg, idx_end, target_sequence_length = (int(x) for x in self.sample_index[idx])
        sample = [self.dataset[i] for i in range(idx_beg, idx_end)]
        numpy_random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        tokenizer = self.config.tokenizer
        assert target_sequence_length <= self.config.sequence_length

        # Segments A and B (B empty without the binary head), swapped half of the time.
        pivot = len(sample)
        is_next_random = False
        if self.config.classification_head:
            if len(sample) < 2:
                raise ValueError(f"BERT sample {idx} has {len(sample)} sentence(s); the binary head needs two")
            pivot = 1
            if len(sample) >= 3:
                pivot = numpy_random_state.randint(low=1, high=len(sample))
            is_next_random = numpy_random_state.random() < 0.5
        split_a = [int(t) for sentence in sample[:pivot] for t in sentence]
        split_b = [int(t) for sentence in sample[pivot:] for t in sentence]
        if is_next_random:
            split_a, split_b = split_b, split_a

        # Trim the longer segment from a random end until the pair fits.
        truncated = len(split_a) + len(split_b) > target_sequence_length
        while len(split_a) + len(split_b) > target_sequence_length:
            segment = split_a if len(split_a) > len(split_b) else split_b
            if numpy_random_state.random() < 0.5:
                del segment[0]
            else:
                del segment[-1]

        tokens = [tokenizer.cls, *split_a, tokenizer.sep]
        assignments = [0] * (len(split_a) + 2)
        if split_b:
            tokens += [*split_b, tokenizer.sep]
            assignments += [1] * (len(split_b) + 1)

        tokens, masked_positions, masked_labels, _, _ = self._create_masked_lm_predictions(
            tokens, target_sequence_length, numpy_random_state)

        num_tokens = len(tokens)
        num_pads = self.config.sequence_length - num_tokens
        assert num_pads >= 0
        pad = tokenizer.pad
        # Padding values follow megatron-core (pad id, which is 0 for BERT vocabularies).
        text = numpy.pad(numpy.array(tokens, dtype=numpy.int64), (0, num_pads), constant_values=pad)
        types = numpy.pad(numpy.array(assignments, dtype=numpy.int64), (0, num_pads), constant_values=pad)
        padding_mask = numpy.pad(numpy.ones(num_tokens, dtype=numpy.int64), (0, num_pads), constant_values=pad)
        labels = numpy.full(self.config.sequence_length, -1, dtype=numpy.int64)
        labels[masked_positions] = masked_labels
        loss_mask = numpy.zeros(self.config.sequence_length, dtype=numpy.int64)
        loss_mask[masked_positions] = 1
        return {"text": text, "types": types, "labels": labels, "is_random": int(is_next_random),
                "padding_mask": padding_mask, "loss_mask": loss_mask, "truncated": int(truncated)}

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """80 % [MASK]; otherwise half a random vocabulary id, half the original token (None)."""
        if numpy_random_state.random() < 0.8:
            return self.config.tokenizer.mask
        if numpy_random_state.random() >= 0.5:
            return self.token_lookup[numpy_random_state.randint(0, len(self.token_lookup))]
        return None


# The name research code and the legacy path use.
BertDataset = BERTMaskedWordPieceDataset
