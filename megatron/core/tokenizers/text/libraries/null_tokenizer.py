"""megatron-core HEAD's ``null-text`` tokenizer: text is space-separated ids.

``NullTokenizer(vocab_size, eod_id=None, pad_id=-1)``: the vocabulary is ``vocab_size`` ids and the end-of-document
id is ``vocab_size - 1`` unless given (``--null-tokenizer-eod-id``, ``--null-tokenizer-pad-id``); cls, sep and mask
are -1. Megatron-LM 0.16's ``_NullTokenizer`` (megatron.core.tokenizers.build_tokenizer, library ``null``), which
this class extends, instead adds the end-of-document id N to N ids.
"""
from __future__ import annotations

import json

from typing import List, Optional

from megatron.core.tokenizers.build_tokenizer import _NullTokenizer


class NullTokenizer(_NullTokenizer):
    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1) -> None:
        if int(vocab_size) < 1:
            raise ValueError(f"the null-text tokenizer needs vocab_size >= 1, got {vocab_size}")
        super().__init__(vocab_size)
        self.unique_identifiers.update(eod_id=str(eod_id), pad_id=str(pad_id), library="null-text")
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)  # the datasets' cache-name hash
        self._eod_id = int(vocab_size) - 1 if eod_id is None else int(eod_id)
        self._pad_id = int(pad_id)

    def text_to_ids(self, text: str) -> List[int]:
        return self.tokenize(text)

    def ids_to_text(self, ids) -> str:
        return self.detokenize(ids)

    def offsets(self, ids: List[int], text: str) -> List[int]:
        out, start = [], 0
        for token in ids:
            out.append(start)
            start += len(str(token)) + 1
        return out

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod

    @property
    def pad(self) -> int:
        return self._pad_id
