"""GPT (left-to-right) dataset with megatron-core's document, sample and shuffle indices.

For the same data, seed, split and sequence length the indices, and therefore the samples and their
order, are those of megatron-core:

* ``document_index``: the split's sequence ids repeated once per epoch, cast to int32 and shuffled with
  one ``numpy.random.RandomState(random_seed)`` — the final epoch shuffled separately when it would
  contribute fewer than 80 % of an epoch's samples;
* ``sample_index``: where each ``sequence_length + 1``-token sample starts (consecutive samples share
  one token), built by ``helpers.build_sample_idx``;
* ``shuffle_index``: a permutation of the samples from the same random state (the separated final
  epoch again shuffled on its own).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.utils import Split, log_single_rank

logger = logging.getLogger(__name__)

_PAD_TOKEN_ID = -1


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Configuration of GPTDataset / MockGPTDataset."""

    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (its eod id marks document ends)")
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            if getattr(self, name) is None:
                raise ValueError(f"GPTDatasetConfig.{name} must be set (True or False)")


class GPTDataset(MegatronDataset):
    """Samples of ``sequence_length`` tokens (plus the shifted label) from one split of an IndexedDataset."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str], indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss])
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask = self.cached_loss_mask = self.cached_position_ids = None
        try:
            self._pad_token_id = config.tokenizer.pad
        except Exception:  # noqa: BLE001 - tokenizers without a pad id raise NotImplementedError
            self._pad_token_id = _PAD_TOKEN_ID
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        """GPT splits by sequence count."""
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MegatronDataset._key_config_attributes() + ["add_extra_token_to_sequence"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """``idx=None`` gives a padding sample whose loss mask is all zeros."""
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if self.masks_and_position_ids_are_cacheable and self.masks_and_position_ids_are_cached:
            attention_mask = self.cached_attention_mask
            loss_mask = self.cached_loss_mask.clone()  # edited below for padded samples
            position_ids = self.cached_position_ids
        else:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens, self.config.tokenizer.eod, self.config.reset_position_ids, self.config.reset_attention_mask,
                self.config.eod_mask_loss, self.config.create_attention_mask)
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask = attention_mask
                self.cached_loss_mask = loss_mask.clone()
                self.cached_position_ids = position_ids
                self.masks_and_position_ids_are_cached = True

        # Padding (short final samples) is never learnt, and is mapped to an id the embedding accepts.
        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)

        sample = {"tokens": tokens, "labels": labels}
        if self.config.create_attention_mask:
            sample["attention_mask"] = attention_mask
        sample["loss_mask"] = loss_mask
        sample["position_ids"] = position_ids
        return sample

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The tokens of sample ``idx`` (int64) and the ids of the documents they come from."""
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = self.sample_index[idx]
        doc_end, offset_end = self.sample_index[idx + 1]
        extra = int(self.config.add_extra_token_to_sequence)
        document_ids, parts = [], []
        if doc_beg == doc_end:
            document_ids.append(self.document_index[doc_beg])
            parts.append(self.dataset.get(self.document_index[doc_beg], offset=int(offset_beg),
                                          length=int(offset_end - offset_beg) + extra))
        else:
            for i in range(doc_beg, doc_end + 1):
                document_ids.append(self.document_index[i])
                offset = 0 if i > doc_beg else int(offset_beg)
                length = None if i < doc_end else int(offset_end) + extra
                parts.append(self.dataset.get(self.document_index[i], offset=offset, length=length))
        wanted = self.config.sequence_length + extra
        have = sum(len(part) for part in parts)
        if have < wanted:
            parts.append(numpy.full(wanted - have, self._pad_token_id, dtype=numpy.int64))
        return (numpy.concatenate(parts, dtype=numpy.int64, casting="unsafe"),
                numpy.array(document_ids, dtype=numpy.int64))

    # ------------------------------------------------------------------------------------------- indices

    def _build_document_sample_shuffle_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        cache = self._index_cache(("document_index.npy", "sample_index.npy", "shuffle_index.npy"))
        if cache.is_complete():
            log_single_rank(logger, logging.INFO,
                            f"Load the {type(self).__name__} {self.index_split.name} indices")
        arrays, built = cache.get_or_build(self._build_indices)
        self.built_anew_on_cache_miss = built
        if not built:
            log_single_rank(logger, logging.INFO,
                            f"\tLoaded the indices from {cache.path_to('*.npy')}")
        log_single_rank(logger, logging.INFO,
                        f"> total number of samples: {arrays['sample_index.npy'].shape[0] - 1}")
        return arrays["document_index.npy"], arrays["sample_index.npy"], arrays["shuffle_index.npy"]

    def _build_indices(self) -> Dict[str, numpy.ndarray]:
        log_single_rank(logger, logging.INFO,
                        f"Build and save the {type(self).__name__} {self.index_split.name} indices")
        t_beg = time.time()
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)

        separate_final_epoch = False
        num_samples_sans_final_epoch = None
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            assert 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1
            separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)
        log_single_rank(logger, logging.DEBUG, f"> separate_final_epoch: {separate_final_epoch}")

        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        document_index = _build_document_index(self.indices, num_epochs, numpy_random_state, separate_final_epoch)

        drop_last_partial_sequence = True
        if self.index_split == Split.valid:
            drop_last_partial_sequence = self.config.drop_last_partial_validation_sequence

        from megatron.core.datasets import helpers

        sequence_lengths = numpy.asarray(self.dataset.sequence_lengths)
        if len(document_index) * 2 > len(sequence_lengths):
            sequence_lengths = sequence_lengths.copy()  # dense access: read the mmap once, sequentially
        sample_index = helpers.build_sample_idx(sequence_lengths, document_index, sequence_length, num_epochs,
                                                num_tokens_per_epoch, drop_last_partial_sequence, extra)
        if separate_final_epoch:
            shuffle_index = _build_shuffle_index(num_samples_sans_final_epoch, sample_index.shape[0] - 1,
                                                 numpy_random_state)
        else:
            shuffle_index = _build_shuffle_index(sample_index.shape[0] - 1, sample_index.shape[0] - 1,
                                                 numpy_random_state)
        log_single_rank(logger, logging.DEBUG, f"\t> time elapsed: {time.time() - t_beg:4f} seconds")
        log_single_rank(logger, logging.INFO, f"> total number of epochs: {num_epochs}")
        return {"document_index.npy": document_index, "sample_index.npy": sample_index,
                "shuffle_index.npy": shuffle_index}

    def _get_num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(numpy.asarray(self.dataset.sequence_lengths)[self.indices], dtype=numpy.int64))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        """Fewest epochs whose tokens cover ``num_samples * sequence_length`` (+ the extra token)."""
        if self.num_samples is None:
            return 1
        if num_tokens_per_epoch <= 0:
            raise ValueError(f"the {self.index_split.name} split of {self.dataset_path} has no tokens; "
                             f"check --split and the dataset")
        requested = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, -(-requested // num_tokens_per_epoch))


def _build_document_index(documents: numpy.ndarray, num_epochs: int, numpy_random_state: numpy.random.RandomState,
                          separate_final_epoch: bool) -> numpy.ndarray:
    """The documents of every epoch, int32, shuffled as a whole (final epoch apart if separated)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int,
                         numpy_random_state: numpy.random.RandomState) -> numpy.ndarray:
    """``arange(num_samples)`` shuffled, then ``arange(num_samples, total_size)`` shuffled on its own."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


def _get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                     reset_attention_mask: bool, eod_mask_loss: bool, create_attention_mask: bool):
    """Causal attention mask ``[1, s, s]`` (True = masked), loss mask and position ids of one sample.

    ``reset_position_ids`` restarts positions after every EOD; ``reset_attention_mask`` stops attention
    across EODs; ``eod_mask_loss`` excludes EOD tokens from the loss.
    """
    seq_length = data.numel()
    attention_mask = None
    if create_attention_mask:
        attention_mask = torch.tril(torch.ones((seq_length, seq_length), device=data.device)).unsqueeze(0)
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    if reset_position_ids or reset_attention_mask:
        eod_positions = position_ids[data == eod_token].tolist()
        prev_index = 0
        for i in eod_positions:
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, (i + 1):, :(i + 1)] = 0
            if reset_position_ids:
                position_ids[(i + 1):] -= i + 1 - prev_index
                prev_index = i + 1
    if attention_mask is not None:
        attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


class MockGPTLowLevelDataset:
    """Synthetic documents (``1, 2, ..., length-1, eod``) with lengths from ``default_rng(0)``, as megatron-core.

    With a vocabulary smaller than the longest document (tiny test models), the ids ``1, 2, ...`` wrap
    around within ``[1, vocab_size - 2]`` instead of indexing past the embedding; with real vocabularies
    the documents are megatron-core's.
    """

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: MegatronTokenizer) -> None:
        self.tokenizer = tokenizer
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32)
        self._wrap = None
        vocab_size = getattr(tokenizer, "vocab_size", None)
        if vocab_size is not None and vocab_size - 1 < self.max_sequence_length:
            self._wrap = max(1, vocab_size - 2)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        ids = numpy.arange(length - 1, dtype=numpy.int64)
        ids = ids % self._wrap + 1 if self._wrap is not None else ids + 1
        return numpy.concatenate([ids, numpy.array([self.tokenizer.eod], dtype=numpy.int64)])

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset:offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (``--mock-data``); indices are built in memory."""

    def __init__(self, dataset: MockGPTLowLevelDataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a mock config (no blend / --mock-data)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
