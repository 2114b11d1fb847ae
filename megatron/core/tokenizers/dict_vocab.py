"""The vocabulary properties every dictionary-backed tokenizer shares."""
from __future__ import annotations

from typing import Dict


class DictVocab:
    """``vocab``/``encoder`` (token -> id) and ``inv_vocab``/``decoder`` (id -> token) from ``self._vocab`` and
    ``self._inv_vocab``, which the tokenizer sets in its constructor."""

    _vocab: Dict[str, int]
    _inv_vocab: Dict[int, str]

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def encoder(self) -> Dict[str, int]:
        return self._vocab

    @property
    def decoder(self) -> Dict[int, str]:
        return self._inv_vocab


__all__ = ["DictVocab"]
