"""Megatron's ``TikTokenizer``: byte-level BPE run by the ``tiktoken`` library, from a JSON vocabulary.

Vocabulary file (``--tokenizer-model``, must end in ``.json``): a JSON list; entry i is an object with exactly the
keys ``rank`` (== i), ``token_bytes`` (base64 of the token's bytes) and ``token_str`` (a display string); entries
0..255 are the single bytes 0..255. A lower rank merges first.

Id layout: ids ``0 .. S-1`` are the S = ``--tiktoken-num-special-tokens`` (default 1000) special tokens, BPE rank r
has id ``r + S``. The vocabulary holds ``V`` = ``--vocab-size`` (default 2**17 = 131072) ids, so the first V - S
entries of the file are used (the file must hold at least that many). Special tokens: ``--tiktoken-special-tokens``
(default ``<unk> <s> </s>``, which any custom list must contain) followed by ``<SPECIAL_{i}>`` fillers up to S;
unk = id of ``<unk>``, bos = ``<s>``, eos = eod = ``</s>`` (0, 1, 2 with the default list). Text is encoded with
``encode_ordinary``: a special token's string in the text is encoded as ordinary bytes, never as the special id.

Pre-tokenisation patterns (``--tiktoken-pattern``): v1 splits letters runs, single digits, punctuation runs and
whitespace; v2 (o200k-like) additionally separates upper-case-led and lower-case words and keeps ``/`` after
punctuation runs.
"""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional, Sequence

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
DEFAULT_VOCAB_SIZE = 2 ** 17
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def load_tiktoken_ranks(path: str, max_entries: int) -> Dict[bytes, int]:
    """The first ``max_entries`` entries of a TikTokenizer JSON vocabulary as ``{token bytes: rank}``."""
    def bad(why: str) -> ValueError:
        return ValueError(f"--tokenizer-model {path}: {why}")

    if not path.endswith(".json"):
        raise bad("TikTokenizer needs a JSON vocabulary file ending in .json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model {path} does not exist (TikTokenizer needs its .json vocabulary)")
    with open(path, encoding="utf-8") as f:
        try:
            entries = json.load(f)
        except json.JSONDecodeError as error:
            raise bad(f"not valid JSON ({error})") from None
    if not isinstance(entries, list):
        raise bad("expected a JSON list of {rank, token_bytes, token_str} objects")
    if len(entries) < max_entries:
        raise bad(f"holds {len(entries)} BPE entries, but the vocabulary needs {max_entries} "
                  "(--vocab-size minus --tiktoken-num-special-tokens): lower --vocab-size")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries[:max_entries]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            raise bad(f"entry {i} must have exactly the keys rank, token_bytes, token_str")
        if entry["rank"] != i:
            raise bad(f"entry {i} has rank {entry['rank']}; ranks must be 0, 1, 2, ... in order")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise bad(f"entry {i} must be the single byte {i} (entries 0..255 are the 256 bytes)")
        if token in ranks:
            raise bad(f"entry {i} repeats the bytes of entry {ranks[token]}")
        ranks[token] = i
    return ranks


class _TikTokenizer(MegatronTokenizer):
    """See the module docstring for the file format and the id layout."""

    def __init__(self, path: str, pattern: str, vocab_size: Optional[int] = None, num_special_tokens: int = 1000,
                 special_tokens: Optional[Sequence[str]] = None) -> None:
        super().__init__(path, pattern=pattern, vocab_size=vocab_size, num_special_tokens=num_special_tokens,
                         special_tokens=special_tokens)
        import tiktoken

        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
        self._vocab_size = int(vocab_size) if vocab_size is not None else DEFAULT_VOCAB_SIZE
        specials = list(special_tokens) if special_tokens is not None else list(REQUIRED_SPECIAL_TOKENS)
        if len(set(specials)) != len(specials):
            raise ValueError(f"--tiktoken-special-tokens must be unique, got {specials}")
        missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in specials]
        if missing:
            raise ValueError(f"--tiktoken-special-tokens must include {' '.join(REQUIRED_SPECIAL_TOKENS)} "
                             f"(missing {' '.join(missing)})")
        if not len(specials) <= num_special_tokens < self._vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens ({num_special_tokens}) must be at least the number of "
                             f"special tokens ({len(specials)}) and below the vocabulary size ({self._vocab_size})")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        self.num_special_tokens = num_special_tokens
        ranks = load_tiktoken_ranks(path, self._vocab_size - num_special_tokens)
        shifted = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._special_ids = {token: i for i, token in enumerate(specials)}
        self._model = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "tiktoken",
                                        pat_str=PATTERNS[pattern], mergeable_ranks=shifted,
                                        special_tokens=self._special_ids)
        self._token_to_id: Dict = dict(shifted)
        self._token_to_id.update(self._special_ids)
        self._id_to_token = {i: t for t, i in self._token_to_id.items()}

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> List[int]:
        ids = self._model.encode_ordinary(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._model.encode_ordinary_batch(list(texts))

    def detokenize(self, ids) -> str:
        return self._model.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict:
        return self._token_to_id

    @property
    def inv_vocab(self) -> Dict:
        return self._id_to_token

    @property
    def unk(self) -> int:
        return self._special_ids["<unk>"]

    @property
    def bos(self) -> int:
        return self._special_ids["<s>"]

    @property
    def eos(self) -> int:
        return self._special_ids["</s>"]

    @property
    def eod(self) -> int:
        return self.eos

    @property
    def pad(self) -> int:
        if "<pad>" in self._special_ids:
            return self._special_ids["<pad>"]
        raise NotImplementedError("TikTokenizer has no <pad> special token (add it with --tiktoken-special-tokens)")


__all__ = ["PATTERNS", "DEFAULT_VOCAB_SIZE", "REQUIRED_SPECIAL_TOKENS", "load_tiktoken_ranks", "_TikTokenizer"]
