"""SentencePiece tokenizers: Megatron's ``SentencePieceTokenizer`` and ``GPTSentencePieceTokenizer``."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.dict_vocab import DictVocab


def load_sentencepiece(model_file: str):
    if model_file is None or not os.path.isfile(model_file):
        raise FileNotFoundError(f"--tokenizer-model {model_file} does not exist (SentencePiece tokenizers need a "
                                f".model file)")
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (RuntimeError, OSError) as error:
        raise ValueError(f"--tokenizer-model {model_file} is not a valid SentencePiece model: {error}") from None


class _SentencePieceTokenizer(DictVocab, MegatronTokenizer):
    """SentencePiece with Megatron's special tokens.

    ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>`` (and the model's pad/bos/eos pieces, or ``<PAD>``,
    ``<BOS>``, ``<EOS>`` when the model has none) are added after the model's pieces when missing, plus
    ``vocab_extra_ids`` sentinels ``<extra_id_N>``. Special-token strings in the text are encoded as
    those tokens.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0) -> None:
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        self.tokenizer = load_sentencepiece(model_file)
        self._initalize(vocab_extra_ids)

    def _populate_vocab(self) -> None:
        self._vocab: Dict[str, int] = {}
        self._inv_vocab: Dict[int, str] = {}
        for i in range(len(self.tokenizer)):
            piece = self.tokenizer.id_to_piece(i)
            self._inv_vocab[i] = piece
            self._vocab[piece] = i

    def _piece_or(self, piece_id: int, fallback: str) -> str:
        if 0 <= piece_id < len(self.tokenizer):
            return self.tokenizer.id_to_piece(piece_id)
        return fallback  # the model disables this special piece (id -1)

    def _initalize(self, vocab_extra_ids: int) -> None:  # (sic) Megatron's method name
        self._populate_vocab()
        self._special_tokens: Dict[str, int] = {}
        self._inv_special_tokens: Dict[int, str] = {}
        self._t5_tokens: List[str] = []

        def add_special(token: str) -> int:
            if token not in self._vocab:
                next_id = len(self._vocab)
                self._vocab[token] = next_id
                self._inv_vocab[next_id] = token
            self._special_tokens[token] = self._vocab[token]
            self._inv_special_tokens[self._vocab[token]] = token
            return self._vocab[token]

        self._cls_id = add_special("<CLS>")
        self._sep_id = add_special("<SEP>")
        self._eod_id = add_special("<EOD>")
        self._mask_id = add_special("<MASK>")
        self._pad_id = add_special(self._piece_or(self.tokenizer.pad_id(), "<PAD>"))
        self._bos_id = add_special(self._piece_or(self.tokenizer.bos_id(), "<BOS>"))
        self._eos_id = add_special(self._piece_or(self.tokenizer.eos_id(), "<EOS>"))
        for i in range(vocab_extra_ids):
            token = f"<extra_id_{i}>"
            add_special(token)
            self._t5_tokens.append(token)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize(self, text: str) -> List[int]:
        """Encode, turning occurrences of special-token strings into their ids."""
        ids: List[int] = []
        idx = 0
        while True:
            found = {token: text.find(token, idx) for token in self._special_tokens}
            found = {token: at for token, at in found.items() if at >= 0}
            if not found:
                break
            token = min(found, key=found.get)
            at = found[token]
            ids.extend(self.tokenizer.encode_as_ids(text[idx:at]))
            ids.append(self._special_tokens[token])
            idx = at + len(token)
        ids.extend(self.tokenizer.encode_as_ids(text[idx:]))
        return ids

    def detokenize(self, ids) -> str:
        ids = [int(i) for i in ids]
        text, last = "", 0
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self.tokenizer.decode_ids(ids[last:i]) + " "
                text += self._inv_special_tokens[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self._t5_tokens]


class _GPTSentencePieceTokenizer(_SentencePieceTokenizer):
    """Plain SentencePiece for GPT: no added tokens; eod is the model's eos."""

    def __init__(self, model_file: str) -> None:
        super().__init__(model_file, vocab_extra_ids=0)

    def _initalize(self, vocab_extra_ids: int) -> None:
        self._populate_vocab()
        self._pad_id = self.tokenizer.pad_id()
        self._bos_id = self.tokenizer.bos_id()
        self._eos_id = self.tokenizer.eos_id()
        self._special_tokens, self._inv_special_tokens, self._t5_tokens = {}, {}, []

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode_as_ids(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.tokenizer.encode_as_ids(list(texts))

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

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
    def eod(self) -> int:
        return self._eos_id

    @property
    def additional_special_tokens_ids(self):
        return None


class _Llama2Tokenizer(_GPTSentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: a SentencePiece model used as is (``vocab_size`` = the model's pieces),
    ``tokenize`` prepends the model's BOS id (``bos=True, eos=False`` by default); ``eod`` is the model's EOS id;
    cls/sep/mask are -1."""

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        ids = self.tokenizer.encode_as_ids(text)
        return ([self._bos_id] if bos else []) + ids + ([self._eos_id] if eos else [])

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [[self._bos_id] + ids for ids in self.tokenizer.encode_as_ids(list(texts))]


__all__ = ["load_sentencepiece", "_SentencePieceTokenizer", "_GPTSentencePieceTokenizer", "_Llama2Tokenizer"]
