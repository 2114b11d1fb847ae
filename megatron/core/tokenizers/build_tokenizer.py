"""``build_tokenizer(args)`` (the ``--tokenizer-type`` table) and the small tokenizers (Hugging Face, Null).
Everything works offline. ``megatron.tokenizer.tokenizer`` and ``megatron.training.tokenizer.tokenizer`` (the path of
Megatron-LM 0.16) re-export this module."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.dict_vocab import DictVocab
from megatron.core.tokenizers.bert_wordpiece import _BertWordPieceTokenizer
from megatron.core.tokenizers.gpt2_bpe import _GPT2BPETokenizer
from megatron.core.tokenizers.sentencepiece_tokenizers import (
    _GPTSentencePieceTokenizer,
    _Llama2Tokenizer,
    _SentencePieceTokenizer,
)
from megatron.core.tokenizers.tiktoken_tokenizer import _TikTokenizer
from megatron.core.tokenizers.vocab_padding import (null_tokenizer_vocab_size, resolve_padded_vocab_size,
                                                    vocab_size_with_padding)

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
                   "NullTokenizer")

# End-of-text pieces a bare tokenizer.json may use, in order of preference.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


def _require(args, name: str, tokenizer_type: str):
    value = getattr(args, name, None)
    if value is None:
        raise ValueError(f"--{name.replace('_', '-')} is required for --tokenizer-type {tokenizer_type}")
    return value


def build_tokenizer(args) -> MegatronTokenizer:
    """Build the tokenizer named by ``args.tokenizer_type``; set ``args.padded_vocab_size`` if unset.

    The padded size is the vocabulary rounded up to a multiple of
    ``make_vocab_size_divisible_by * tensor_model_parallel_size`` (Megatron's message is printed on rank 0).
    """
    tokenizer_type = getattr(args, "tokenizer_type", None)
    rank = getattr(args, "rank", 0) or 0
    if rank == 0:
        print(f"> building {tokenizer_type} tokenizer ...", flush=True)
    extra_ids = getattr(args, "vocab_extra_ids", 0) or 0
    if tokenizer_type == "BertWordPieceLowerCase":
        tokenizer = _BertWordPieceTokenizer(_require(args, "vocab_file", tokenizer_type), lower_case=True,
                                            vocab_extra_ids=extra_ids)
    elif tokenizer_type == "BertWordPieceCase":
        tokenizer = _BertWordPieceTokenizer(_require(args, "vocab_file", tokenizer_type), lower_case=False,
                                            vocab_extra_ids=extra_ids)
    elif tokenizer_type == "GPT2BPETokenizer":
        tokenizer = _GPT2BPETokenizer(_require(args, "vocab_file", tokenizer_type),
                                      _require(args, "merge_file", tokenizer_type))
    elif tokenizer_type == "SentencePieceTokenizer":
        tokenizer = _SentencePieceTokenizer(_require(args, "tokenizer_model", tokenizer_type), vocab_extra_ids=extra_ids)
    elif tokenizer_type == "GPTSentencePieceTokenizer":
        tokenizer = _GPTSentencePieceTokenizer(_require(args, "tokenizer_model", tokenizer_type))
    elif tokenizer_type == "HuggingFaceTokenizer":
        tokenizer = _HuggingFaceTokenizer(_require(args, "tokenizer_model", tokenizer_type),
                                          trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    elif tokenizer_type == "Llama2Tokenizer":
        tokenizer = _Llama2Tokenizer(_require(args, "tokenizer_model", tokenizer_type))
    elif tokenizer_type == "TikTokenizer":
        tokenizer = _TikTokenizer(_require(args, "tokenizer_model", tokenizer_type),
                                  _require(args, "tiktoken_pattern", tokenizer_type),
                                  vocab_size=getattr(args, "vocab_size", None),
                                  num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
                                  special_tokens=getattr(args, "tiktoken_special_tokens", None))
    elif tokenizer_type == "NullTokenizer":
        tokenizer = _NullTokenizer(_require(args, "vocab_size", tokenizer_type))
    else:
        raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    # --padded-vocab-size is used as given (checked to hold the vocabulary); else padded by
    # --make-vocab-size-divisible-by x TP (megatron.core.vocab_padding).
    args.padded_vocab_size = resolve_padded_vocab_size(
        tokenizer.vocab_size, getattr(args, "make_vocab_size_divisible_by", 128) or 128,
        getattr(args, "tensor_model_parallel_size", 1) or 1, getattr(args, "padded_vocab_size", None),
        getattr(args, "pad_vocab_size", True), rank=rank)
    return tokenizer


def _vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Megatron's private helper name, kept for callers that import it."""
    return vocab_size_with_padding(orig_vocab_size, args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size, rank=getattr(args, "rank", 0) or 0)


class _HuggingFaceTokenizer(DictVocab, MegatronTokenizer):
    """A Hugging Face tokenizer from a local directory or a ``tokenizer.json`` — never downloaded.

    A directory is loaded with ``transformers.AutoTokenizer`` (``local_files_only=True``), and tokenises
    like Megatron's wrapper (``tokenizer(text).input_ids``, special tokens included). A ``tokenizer.json``
    file is loaded with the ``tokenizers`` library directly.
    """

    def __init__(self, pretrained_model_name_or_path: str, trust_remote_code: bool = False) -> None:
        super().__init__(pretrained_model_name_or_path)
        path = pretrained_model_name_or_path
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"--tokenizer-model {path} is not a local directory or tokenizer.json: this library never downloads "
                f"tokenizers; save it first (e.g. AutoTokenizer.from_pretrained(...).save_pretrained(DIR)) and pass DIR")
        self._is_file = os.path.isfile(path)
        if self._is_file:
            from tokenizers import Tokenizer

            try:
                self._tokenizer = Tokenizer.from_file(path)
            except Exception as error:  # noqa: BLE001 - the Rust library raises plain Exceptions
                raise ValueError(f"--tokenizer-model {path} is not a valid tokenizer.json: {error}") from None
            self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            self._eod = next((self._vocab[t] for t in _EOS_CANDIDATES if t in self._vocab), None)
        else:
            try:
                import transformers
            except ImportError as error:
                raise ImportError("HuggingFaceTokenizer with a directory needs the transformers package") from error
            try:
                # --trust-remote-code: a directory whose tokenizer class is its own Python code may run it.
                self._tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                                             trust_remote_code=trust_remote_code)
            except (OSError, ValueError) as error:
                raise ValueError(f"--tokenizer-model {path} could not be loaded as a Hugging Face tokenizer "
                                 f"directory: {error}") from None
            self._vocab = self._tokenizer.get_vocab()
            self._eod = self._tokenizer.eos_token_id
        self._inv_vocab = {i: t for t, i in self._vocab.items()}

    @property
    def vocab_size(self) -> int:
        if self._is_file:
            return self._tokenizer.get_vocab_size(with_added_tokens=True)
        return len(self._tokenizer)

    def tokenize(self, text: str) -> List[int]:
        if self._is_file:
            return self._tokenizer.encode(text).ids
        return self._tokenizer(text).input_ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if self._is_file:
            return [e.ids for e in self._tokenizer.encode_batch(list(texts))]
        return self._tokenizer(list(texts)).input_ids

    def detokenize(self, token_ids) -> str:
        ids = [int(t) for t in token_ids]
        if self._is_file:
            return self._tokenizer.decode(ids, skip_special_tokens=False)
        return self._tokenizer.decode(ids)

    @property
    def eod(self) -> int:
        if self._eod is None:
            raise NotImplementedError(f"the Hugging Face tokenizer {self.unique_identifiers['tokenizer_path'][0]} "
                                      f"defines no end-of-text token")
        return self._eod


class _NullTokenizer(MegatronTokenizer):
    """Text is space-separated ids; with ``--vocab-size N`` the end-of-document id is N and the vocabulary holds
    N + 1 ids (megatron-core 0.16.1's rule, ``null_tokenizer_vocab_size``)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)
        self._eod_id = self._vocab_size_without_eod

    def tokenize(self, text: str) -> List[int]:
        if not text:
            return []
        try:
            return [int(x) for x in text.split(" ")]
        except ValueError:
            raise ValueError(f"NullTokenizer expects space-separated integers, got {text[:60]!r}") from None

    def detokenize(self, ids) -> str:
        return " ".join(str(int(x)) for x in ids)

    @property
    def vocab_size(self) -> int:
        return null_tokenizer_vocab_size(self._vocab_size_without_eod)

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocabulary")

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
        return self._eod_id

    @property
    def additional_special_tokens_ids(self):
        return None


# Public aliases (megatron.training.tokenizer names these the same way in recent Megatron).
GPT2BPETokenizer = _GPT2BPETokenizer
BertWordPieceTokenizer = _BertWordPieceTokenizer
SentencePieceTokenizer = _SentencePieceTokenizer
GPTSentencePieceTokenizer = _GPTSentencePieceTokenizer
HuggingFaceTokenizer = _HuggingFaceTokenizer
Llama2Tokenizer = _Llama2Tokenizer
TikTokenizer = _TikTokenizer
NullTokenizer = _NullTokenizer

__all__ = ["TOKENIZER_TYPES", "build_tokenizer", "_vocab_size_with_padding", "MegatronTokenizer", "DictVocab",
           "_BertWordPieceTokenizer", "_GPT2BPETokenizer", "_SentencePieceTokenizer", "_GPTSentencePieceTokenizer",
           "_HuggingFaceTokenizer", "_Llama2Tokenizer", "_TikTokenizer", "_NullTokenizer", "GPT2BPETokenizer",
           "BertWordPieceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
           "Llama2Tokenizer", "TikTokenizer", "NullTokenizer"]
