"""GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``; merges run by the Rust ``tokenizers`` library.

The pipeline is GPT-2's: text is split with GPT-2's pre-tokenisation regex (the ``regex`` module, as in
OpenAI's reference encoder), each piece's UTF-8 bytes are mapped to printable characters and the merges
are applied by rank — so ids equal those of the reference encoder (and of Megatron's copy of it).
BPE results are cached per piece: natural text repeats a small set of words, so after warm-up encoding is
a regex scan plus dictionary lookups. The scan uses the standard library's ``re`` (about twice as fast)
with a pattern equivalent to GPT-2's for every character whose classes (space, letter, number, other)
both engines agree on; a text containing any other character is split with ``regex`` itself, so the
pieces, hence the ids, are always GPT-2's.
``<|endoftext|>`` is an ordinary vocabulary entry: text containing that string is encoded as plain text,
as GPT-2 does; its id is the end-of-document token.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from typing import Dict, List, Sequence, Tuple

import regex

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.dict_vocab import DictVocab

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenisation: contractions, letter runs, digit runs, other symbols, whitespace.
GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same with ``re`` classes: letters = word characters minus digits and "_", numbers = decimal digits.
_FAST_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
_CLASS_PAIRS = [(regex.compile(r"\s"), re.compile(r"\s")), (regex.compile(r"\p{L}"), re.compile(r"[^\W\d_]")),
                (regex.compile(r"\p{N}"), re.compile(r"\d")),
                (regex.compile(r"[^\s\p{L}\p{N}]"), re.compile(r"[^\s\w]|_"))]


class _Splitter:
    """GPT-2's pre-tokenisation: the fast ``re`` pattern when every character of the text is known to be
    classified identically by both engines, else the ``regex`` pattern."""

    def __init__(self) -> None:
        self._exact = regex.compile(GPT2_SPLIT_PATTERN)
        self._fast = re.compile(_FAST_SPLIT_PATTERN)
        self._agreeing = set()
        self._disagreeing = set()

    def _agrees(self, char: str) -> bool:
        return all(bool(exact.match(char)) == bool(fast.match(char)) for exact, fast in _CLASS_PAIRS)

    def findall(self, text: str) -> List[str]:
        new = set(text) - self._agreeing
        if new:
            if new & self._disagreeing:
                return self._exact.findall(text)
            for char in new:
                if self._agrees(char):
                    self._agreeing.add(char)
                else:
                    self._disagreeing.add(char)
            if new & self._disagreeing:
                return self._exact.findall(text)
        return self._fast.findall(text)


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable Latin-1 bytes map to themselves)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


class _PieceCache(dict):
    """piece -> tuple of ids; a miss runs the BPE model (Rust) on the piece's byte-mapped characters."""

    def __init__(self, model, byte_encoder: Dict[int, str], max_entries: int = 1 << 20) -> None:
        super().__init__()
        self._model = model
        self._byte_encoder = byte_encoder
        self._max_entries = max_entries

    def __missing__(self, piece: str) -> Tuple[int, ...]:
        mapped = "".join(self._byte_encoder[b] for b in piece.encode("utf-8"))
        ids = tuple(token.id for token in self._model.tokenize(mapped))
        if len(self) >= self._max_entries:  # bound memory on pathological inputs
            self.clear()
        self[piece] = ids
        return ids


def load_gpt2_vocab(vocab_file: str) -> Dict[str, int]:
    if not os.path.isfile(vocab_file):
        raise FileNotFoundError(f"--vocab-file {vocab_file} does not exist (GPT2BPETokenizer needs a GPT-2 vocab.json)")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"--vocab-file {vocab_file} is not a GPT-2 vocab.json (a JSON object of token -> id): "
                         f"{error}") from None
    if not isinstance(vocab, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()):
        raise ValueError(f"--vocab-file {vocab_file} is not a GPT-2 vocab.json: expected a JSON object mapping "
                         f"token strings to integer ids")
    if EOD_TOKEN not in vocab:
        raise ValueError(f"--vocab-file {vocab_file} has no {EOD_TOKEN} entry, which GPT2BPETokenizer uses as eod")
    return vocab


def load_gpt2_merges(merge_file: str) -> List[Tuple[str, str]]:
    if not os.path.isfile(merge_file):
        raise FileNotFoundError(f"--merge-file {merge_file} does not exist (GPT2BPETokenizer needs a merges.txt)")
    merges = []
    with open(merge_file, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            line = line.rstrip("\n")
            if not line or (line_number == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ValueError(f"--merge-file {merge_file} line {line_number} is not a merge ('left right'): "
                                 f"{line[:80]!r}")
            merges.append((parts[0], parts[1]))
    return merges


def build_byte_level_bpe(vocab: Dict[str, int], merges: List[Tuple[str, str]]):
    """A ``tokenizers.Tokenizer`` implementing GPT-2's BPE for these files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class _GPT2BPETokenizer(DictVocab, MegatronTokenizer):
    """Megatron's ``GPT2BPETokenizer``."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(vocab_file, merge_file)
        self._vocab = load_gpt2_vocab(vocab_file)
        merges = load_gpt2_merges(merge_file)
        unknown = {piece for merge in merges for piece in merge if piece not in self._vocab}
        if unknown:
            raise ValueError(f"--merge-file {merge_file} merges pieces that --vocab-file {vocab_file} lacks, e.g. "
                             f"{sorted(unknown)[:3]}: the two files do not belong together")
        self._inv_vocab = {v: k for k, v in self._vocab.items()}
        self._tokenizer = build_byte_level_bpe(self._vocab, merges)
        self._split = _Splitter()
        self._pieces = _PieceCache(self._tokenizer.model, bytes_to_unicode())
        self.eod_id = self._vocab[EOD_TOKEN]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize(self, text: str) -> List[int]:
        pieces = self._pieces
        return list(itertools.chain.from_iterable([pieces[p] for p in self._split.findall(text)]))

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(text) for text in texts]

    def detokenize(self, token_ids) -> str:
        return self._tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self.eod_id


__all__ = ["EOD_TOKEN", "GPT2_SPLIT_PATTERN", "_FAST_SPLIT_PATTERN", "_CLASS_PAIRS", "_Splitter", "bytes_to_unicode",
           "_PieceCache", "load_gpt2_vocab", "load_gpt2_merges", "build_byte_level_bpe", "_GPT2BPETokenizer"]
