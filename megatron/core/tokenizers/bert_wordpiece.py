"""BERT WordPiece (``vocab.txt``), lower-cased or cased, run by the Rust ``tokenizers`` library.

The pipeline is BERT's: clean control characters, space out CJK characters, lower-case and strip accents
(lower-case variant only), split on whitespace and punctuation, then greedy longest-match WordPiece with
``##`` continuations and ``[UNK]`` for words that cannot be matched (or are longer than 100 characters).
Like Megatron, the vocabulary gains ``[BOS]``/``[EOS]`` (and ``<extra_id_N>`` sentinels) when missing.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.dict_vocab import DictVocab

_REQUIRED = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def load_wordpiece_vocab(vocab_file: str) -> Dict[str, int]:
    if not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"--vocab-file {vocab_file} does not exist (BERT tokenizers need a vocab.txt)")
    # Megatron's rule: the id of a token is its line number (a repeated token keeps its last line).
    vocab: Dict[str, int] = {}
    try:
        with open(vocab_file, encoding="utf-8") as f:
            for line_number, line in enumerate(f):
                vocab[line.strip()] = line_number
    except UnicodeDecodeError as error:
        raise ValueError(f"--vocab-file {vocab_file} is not a UTF-8 vocab.txt: {error}") from None
    missing = [t for t in _REQUIRED if t not in vocab]
    if missing:
        raise ValueError(f"--vocab-file {vocab_file} is not a BERT vocab.txt: it lacks {', '.join(missing)}")
    return vocab


class _BertWordPieceTokenizer(DictVocab, MegatronTokenizer):
    """Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``."""

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0) -> None:
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

        self._vocab = load_wordpiece_vocab(vocab_file)
        self._tokenizer = Tokenizer(models.WordPiece(vocab=dict(self._vocab), unk_token="[UNK]",
                                                     max_input_chars_per_word=100))
        self._tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                                strip_accents=None, lowercase=lower_case)
        self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tokenizer.decoder = decoders.WordPiece(prefix="##")
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self.cls_id = self._vocab["[CLS]"]
        self.sep_id = self._vocab["[SEP]"]
        self.pad_id = self._vocab["[PAD]"]
        self.mask_id = self._vocab["[MASK]"]
        self._bos_token, self._eos_token = "[BOS]", "[EOS]"
        self.add_token(self._bos_token)
        self.add_token(self._eos_token)
        self._bos_token_id = self._vocab[self._bos_token]
        self._eos_token_id = self._vocab[self._eos_token]
        self._additional_special_tokens: List[str] = []
        self.add_additional_special_tokens([f"<extra_id_{i}>" for i in range(vocab_extra_ids)])

    def add_token(self, token: str) -> None:
        if token not in self._vocab:
            self._inv_vocab[len(self._vocab)] = token
            self._vocab[token] = len(self._vocab)

    def add_additional_special_tokens(self, tokens: List[str]) -> None:
        self._additional_special_tokens = list(tokens)
        for token in tokens:
            self.add_token(token)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def convert_ids_to_tokens(self, ids) -> List[str]:
        return [self._inv_vocab[int(i)] for i in ids]

    def decode(self, ids) -> str:
        """Tokens joined by spaces with ``##`` continuations glued back (BERT's convert_tokens_to_string)."""
        return " ".join(self.convert_ids_to_tokens(ids)).replace(" ##", "").strip()

    detokenize = decode

    def decode_token_ids(self, token_ids) -> str:
        """Like ``decode`` but without ``[PAD]``/``[CLS]`` and with a leading space per word (Megatron's)."""
        result = ""
        for token in self.convert_ids_to_tokens(token_ids):
            if token in ("[PAD]", "[CLS]"):
                continue
            result += token[2:] if token.startswith("##") else " " + token
        return result

    @property
    def cls(self) -> int:
        return self.cls_id

    @property
    def sep(self) -> int:
        return self.sep_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def mask(self) -> int:
        return self.mask_id

    @property
    def bos(self) -> int:
        return self._bos_token_id

    @property
    def eos(self) -> int:
        return self._eos_token_id

    @property
    def eod(self) -> int:
        """As in Megatron: the [EOS] id (what ``--append-eod`` appends with a BERT tokenizer)."""
        return self.eos

    @property
    def bos_token(self) -> str:
        return self._bos_token

    @property
    def eos_token(self) -> str:
        return self._eos_token

    @property
    def additional_special_tokens(self) -> List[str]:
        return self._additional_special_tokens

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self._additional_special_tokens]


__all__ = ["_REQUIRED", "load_wordpiece_vocab", "_BertWordPieceTokenizer"]
