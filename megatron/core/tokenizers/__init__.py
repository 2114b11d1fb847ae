"""Tokenizers (megatron-core's ``megatron.core.tokenizers``): the one home of this library's tokenizers.

``MegatronTokenizer.from_pretrained(tokenizer_path=None, metadata_path=None, **kwargs)`` builds a tokenizer from
its metadata — a dict or a JSON file (default ``<tokenizer dir>/tokenizer_metadata.json``, written by
``MegatronTokenizer.write_metadata``) whose ``library`` says which:

==================  ==========================================================================================
``null-text``       :class:`text.libraries.null_tokenizer.NullTokenizer` (``vocab_size=N``: N ids, eod N - 1)
``null``            megatron-core 0.16's null tokenizer (``vocab_size=N``: N + 1 ids, eod N)
``huggingface``     a ``tokenizer.json`` / Hugging Face directory at ``tokenizer_path``
``sentencepiece``   the SentencePiece model at ``tokenizer_path``
``tiktoken``        the tiktoken vocabulary at ``tokenizer_path`` (``pattern=``, ``vocab_size=`` ...)
``megatron``        Megatron's own: ``tokenizer_path`` = ``GPT2BPETokenizer`` (``vocab_file=``, ``merges_file=``),
                    ``BertWordPieceLowerCase`` / ``BertWordPieceCase`` (``vocab_file=``)
==================  ==========================================================================================

No path is needed for ``null-text`` / ``null``. ``build_tokenizer(args)`` (``--tokenizer-type``) is in
:mod:`.build_tokenizer`; ``megatron.tokenizer`` and ``megatron.training.tokenizer`` re-export these modules.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Union

from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer as MegatronTokenizerBase

METADATA_FILENAME = "tokenizer_metadata.json"
LIBRARIES = ("null-text", "null", "huggingface", "sentencepiece", "tiktoken", "megatron")
_NOT_HERE = ("byte-level", "sft", "null-multimodal")


def _metadata_path(tokenizer_path: Optional[str]) -> Optional[str]:
    if tokenizer_path is None:
        return None
    folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(tokenizer_path)
    return os.path.join(folder, METADATA_FILENAME)


class MegatronTokenizer:
    """megatron-core's tokenizer factory (see the module docstring); the tokenizers it returns derive from
    :class:`MegatronTokenizerBase`."""

    @staticmethod
    def from_pretrained(tokenizer_path: Optional[str] = None, metadata_path: Optional[Union[str, dict]] = None,
                        **kwargs) -> MegatronTokenizerBase:
        if metadata_path is None:
            metadata_path = _metadata_path(tokenizer_path)
            if metadata_path is None:
                raise ValueError("MegatronTokenizer.from_pretrained needs tokenizer_path or metadata_path (a dict "
                                 "such as {'library': 'null-text'} or a JSON file)")
        if isinstance(metadata_path, dict):
            metadata = dict(metadata_path)
        elif isinstance(metadata_path, str):
            if not os.path.isfile(metadata_path):
                raise FileNotFoundError(f"tokenizer metadata {metadata_path} does not exist: write it with "
                                        "MegatronTokenizer.write_metadata(tokenizer_path, library)")
            with open(metadata_path) as f:
                metadata = json.load(f)
        else:
            raise TypeError(f"metadata_path must be a path or a dict, got {type(metadata_path).__name__}")
        library = metadata.get("library")
        if library in _NOT_HERE:
            raise NotImplementedError(f"tokenizer library {library!r} is not implemented in this library; use one of "
                                      f"{', '.join(LIBRARIES)}")
        if library not in LIBRARIES:
            raise ValueError(f"tokenizer metadata needs 'library' among {', '.join(LIBRARIES)}, got {library!r}")
        if library not in ("null-text", "null") and not tokenizer_path:
            raise ValueError(f"the {library} tokenizer needs tokenizer_path")
        return _build(library, tokenizer_path, kwargs)

    @staticmethod
    def write_metadata(tokenizer_path: str, tokenizer_library: str, tokenizer_class=None,
                       chat_template: Optional[str] = None, overwrite: bool = False,
                       metadata_path: Optional[str] = None, model_type: Optional[str] = None) -> str:
        """Write ``{library, class_name, class_path, chat_template}`` next to the tokenizer (or to
        ``metadata_path``); returns the file's path. An existing file is kept unless ``overwrite``."""
        path = metadata_path or _metadata_path(tokenizer_path)
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"{path} exists: pass overwrite=True to replace it")
        metadata = {"library": tokenizer_library,
                    "class_name": tokenizer_class.__name__ if tokenizer_class is not None else None,
                    "class_path": tokenizer_class.__module__ if tokenizer_class is not None else None,
                    "chat_template": chat_template}
        if model_type is not None:
            metadata["model_type"] = model_type
        with open(path, "w") as f:
            json.dump(metadata, f)
        return path


def _build(library: str, path: Optional[str], kwargs: dict) -> MegatronTokenizerBase:
    from megatron.core.tokenizers import build_tokenizer as lib

    if library == "null-text":
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        return NullTokenizer(kwargs["vocab_size"], kwargs.get("eod_id"), kwargs.get("pad_id", -1))
    if library == "null":
        return lib._NullTokenizer(kwargs["vocab_size"])
    if library == "huggingface":
        return lib._HuggingFaceTokenizer(path)
    if library == "sentencepiece":
        return lib._SentencePieceTokenizer(path, vocab_extra_ids=kwargs.get("vocab_extra_ids", 0))
    if library == "tiktoken":
        return lib._TikTokenizer(path, kwargs.get("pattern", "v2"), vocab_size=kwargs.get("vocab_size"),
                                 num_special_tokens=kwargs.get("num_special_tokens", 1000),
                                 special_tokens=kwargs.get("special_tokens"))
    if path == "GPT2BPETokenizer":
        return lib._GPT2BPETokenizer(kwargs["vocab_file"], kwargs.get("merges_file", kwargs.get("merge_file")))
    if path in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return lib._BertWordPieceTokenizer(kwargs["vocab_file"], lower_case=path == "BertWordPieceLowerCase")
    raise ValueError(f"the megatron tokenizer library has GPT2BPETokenizer, BertWordPieceLowerCase and "
                     f"BertWordPieceCase; got tokenizer_path {path!r}")


__all__ = ["MegatronTokenizer", "MegatronTokenizerBase"]
