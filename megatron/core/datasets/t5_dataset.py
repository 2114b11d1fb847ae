"""T5 span-corruption samples (megatron-core's ``T5MaskedWordPieceDataset``) over a sentence-level IndexedDataset.

Each sample is a run of whole sentences of one document (``helpers.build_mapping`` with room for
``sequence_length - 2`` tokens, one sentence minimum), cut to its target length. With
``numpy.random.RandomState((seed + idx) % 2**32)``, whole-word n-grams are masked until the budget
``min(p * target, max(1, round(p * len)))`` tokens is reached (``p`` = ``--mask-prob``; n = min(Geometric(0.2), 10)
words, shrunk to fit; see ``MaskedWordPieceDataset._create_masked_lm_predictions``). Spans, in order, are replaced
by the sentinels ``<extra_id_0>, <extra_id_1>, ...`` (``tokenizer.additional_special_tokens_ids``):

    encoder  = t[:s0] <extra_id_0> t[e0:s1] <extra_id_1> ... tail              (padded with 0 to sequence_length)
    decoder  = [BOS] <extra_id_0> span0 <extra_id_1> span1 ...                  (padded with 0 to sequence_length_decoder)
    labels   = <extra_id_0> span0 <extra_id_1> span1 ... [EOS]                  (padded with -1)
    loss_mask = 1 on the first len(decoder) positions

``enc_mask`` / ``dec_mask`` are 1 on the real tokens; :meth:`T5MaskedWordPieceDataset.config_attention_mask` turns
them into the model's boolean masks (True = masked).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset, MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import Split


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """``sequence_length`` is the encoder length (``--encoder-seq-length``), ``sequence_length_decoder`` the
    decoder's (``--decoder-seq-length``)."""

    sequence_length_encoder: Optional[int] = None
    sequence_length_decoder: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sequence_length_encoder = self.sequence_length
        if self.sequence_length_decoder is None:
            raise ValueError("T5MaskedWordPieceDatasetConfig.sequence_length_decoder must be set (--decoder-seq-length)")
        if not list(getattr(self.tokenizer, "additional_special_tokens_ids", None) or []):
            raise ValueError("the T5 dataset needs sentinel tokens <extra_id_N>: pass --vocab-extra-ids 100 (the "
                             "tokenizer has no additional special tokens)")


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """T5 span corruption over a ``*_text_sentence`` (or ``*_text_document``) IndexedDataset."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: str, indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: T5MaskedWordPieceDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.sample_index = self._build_sample_index(self.config.sequence_length - 2, 1)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["sequence_length_decoder"]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        idx_beg, idx_end, target_sequence_length = (int(x) for x in self.sample_index[idx])
        sample = [self.dataset[i] for i in range(idx_beg, idx_end)]
        numpy_random_state = numpy.random.RandomState(seed=(self.config.random_seed + idx) % 2**32)
        assert target_sequence_length <= self.config.sequence_length

        tokens = [int(t) for sentence in sample for t in sentence]
        truncated = len(tokens) > target_sequence_length
        tokens = tokens[:target_sequence_length]
        _, _, _, _, masked_spans = self._create_masked_lm_predictions(tokens, target_sequence_length,
                                                                      numpy_random_state)
        sample = build_t5_sample(tokens, masked_spans, self.config.tokenizer, self.config.sequence_length,
                                 self.config.sequence_length_decoder)
        sample["truncated"] = int(truncated)
        return sample

    def _get_token_mask(self, numpy_random_state: numpy.random.RandomState) -> Optional[int]:
        """T5 style: every chosen position becomes [MASK] in the working copy (no random draw)."""
        return self.config.tokenizer.mask

    @staticmethod
    def config_attention_mask(encoder_tokens: torch.Tensor, decoder_tokens: torch.Tensor, encoder_mask: torch.Tensor,
                              decoder_mask: torch.Tensor, use_local: bool = True,
                              test_te_version=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Boolean masks (True = masked) from the ``[b, s]`` token masks (1 = token, or ``< 0.5`` booleans with
        True = padding): encoder ``[b,1,se,se]``, decoder ``[b,1,sd,sd]`` (padding x lower-triangular),
        encoder-decoder ``[b,1,sd,se]`` -- megatron-core's local layout (the only one built here)."""
        if encoder_mask.dtype == torch.bool:  # get_batch's `< 0.5`: True = padding
            enc_keep, dec_keep = ~encoder_mask, ~decoder_mask
        else:
            enc_keep, dec_keep = encoder_mask >= 0.5, decoder_mask >= 0.5
        sd = dec_keep.shape[1]
        causal = torch.tril(torch.ones(sd, sd, dtype=torch.bool, device=dec_keep.device))
        enc = ~(enc_keep[:, None, :] & enc_keep[:, :, None])
        dec = ~(dec_keep[:, None, :] & dec_keep[:, :, None] & causal)
        enc_dec = ~(dec_keep[:, :, None] & enc_keep[:, None, :])
        return enc.unsqueeze(1), dec.unsqueeze(1), enc_dec.unsqueeze(1)


def build_t5_sample(tokens: Sequence[int], masked_spans, tokenizer, max_seq_length: int,
                    max_seq_length_dec: int) -> Dict[str, Union[int, numpy.ndarray]]:
    """Assemble encoder input, decoder input, labels and masks from the tokens and the sorted masked spans
    ``[(indices, original ids), ...]`` (module docstring)."""
    sentinels = list(tokenizer.additional_special_tokens_ids)
    if len(masked_spans) > len(sentinels):
        raise ValueError(f"a sample has {len(masked_spans)} masked spans but the tokenizer has only {len(sentinels)} "
                         "sentinel tokens: raise --vocab-extra-ids")
    encoder, decoder_in, labels = [], [tokenizer.bos], []
    start = 0
    for sentinel, (indices, span_ids) in zip(sentinels, masked_spans):
        encoder += list(tokens[start:indices[0]]) + [sentinel]
        decoder_in += [sentinel] + [int(t) for t in span_ids]
        labels += [sentinel] + [int(t) for t in span_ids]
        start = indices[-1] + 1
    encoder += list(tokens[start:])
    labels.append(tokenizer.eos)
    if len(encoder) > max_seq_length or len(decoder_in) > max_seq_length_dec:
        raise ValueError(f"a T5 sample needs {len(encoder)} encoder / {len(decoder_in)} decoder positions, more than "
                         f"--encoder-seq-length {max_seq_length} / --decoder-seq-length {max_seq_length_dec}")

    def pad(values, length, value):
        return numpy.array(list(values) + [value] * (length - len(values)), dtype=numpy.int64)

    return {
        "text_enc": pad(encoder, max_seq_length, 0),
        "text_dec": pad(decoder_in, max_seq_length_dec, 0),
        "labels": pad(labels, max_seq_length_dec, -1),
        "loss_mask": pad([1] * len(decoder_in), max_seq_length_dec, 0),
        "enc_mask": pad([1] * len(encoder), max_seq_length, 0),
        "dec_mask": pad([1] * len(decoder_in), max_seq_length_dec, 0),
    }


# The name the legacy path and research code use.
T5Dataset = T5MaskedWordPieceDataset
