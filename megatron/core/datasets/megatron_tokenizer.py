"""The abstract tokenizer that megatron-core's datasets consume (``config.tokenizer``)."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Dict, List

import numpy


class MegatronTokenizer(ABC):
    """Base class of every tokenizer.

    ``unique_identifiers`` describes the tokenizer (class, files, options); datasets fold it into the hash
    that names their index caches, so a different tokenizer never reuses another one's caches.
    """

    def __init__(self, *tokenizer_paths: str, **tokenizer_options: Any):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["tokenizer_path"] = list(tokenizer_paths)
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)
        super().__init__()

    @abstractmethod
    def tokenize(self, text: str) -> numpy.ndarray | List[int]:
        """Convert text to token ids."""

    def detokenize(self, ids) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no method 'detokenize'")

    def offsets(self, ids: List[int], text: str) -> List[int]:
        raise NotImplementedError(f"{type(self).__name__} has no method 'offsets'")

    @property
    @abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token text -> id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token text."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding)."""

    def _missing(self, name: str):
        raise NotImplementedError(f"{type(self).__name__} has no attribute '{name}'")

    @property
    def cls(self):
        self._missing("cls")

    @property
    def sep(self):
        self._missing("sep")

    @property
    def pad(self):
        self._missing("pad")

    @property
    def eod(self):
        self._missing("eod")

    @property
    def bos(self):
        self._missing("bos")

    @property
    def eos(self):
        self._missing("eos")

    @property
    def mask(self):
        self._missing("mask")


# megatron-core 0.16's name of this base class (MegatronTokenizer there is the new megatron.core.tokenizers one).
MegatronLegacyTokenizer = MegatronTokenizer
