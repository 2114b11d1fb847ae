"""megatron-core HEAD's ``null-text`` tokenizer: text is space-separated ids.

``NullTokenizer(vocab_size, eod_id=None, pad_id=-1)``: the vocabulary is ``vocab_size`` ids and the end-of-document
id is ``vocab_size - 1`` unless given (``--null-tokenizer-eod-id``, ``--null-tokenizer-pad-id``); cls, sep and mask
are -1. (Megatron-LM 0.16's ``_NullTokenizer`` — megatron.core.tokenizers.build_tokenizer, library ``null`` — instead
adds the end-of-document id N to N ids.)
"""
from __future__ import annotations

from typing import List, Optional

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer as MegatronTokenizerBase


class NullTokenizer(MegatronTokenizerBase):
    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1) -> None:
        super().__init__(None, vocab_size=vocab_size, eod_id=eod_id, pad_id=pad_id, library="null-text")
        if int(vocab_size) < 1:
            raise ValueError(f"the null-text tokenizer needs vocab_size >= 1, got {vocab_size}")
        self._vocab_size = int(vocab_size)
        self._eod_id = self._vocab_size - 1 if eod_id is None else int(eod_id)
        self._pad_id = int(pad_id)

    def tokenize(self, text: str) -> List[int]:
        if not text:
            return []
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"the null-text tokenizer expects space-separated integers, got {text[:60]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in ids)

    text_to_ids = tokenize
    ids_to_text = detokenize

    def offsets(self, ids: List[int], text: str) -> List[int]:
        out, start = [], 0
        for token in ids:
            out.append(start)
            start += len(str(token)) + 1
        return out

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self):
        raise NotImplementedError("the null-text tokenizer has no vocabulary")

    @property
    def inv_vocab(self):
        raise NotImplementedError("the null-text tokenizer has no vocabulary")

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1

    @property
    def additional_special_tokens_ids(self):
        return None
