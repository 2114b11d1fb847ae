"""The per-process half of tools/preprocess_data.py: JSON decoding, sentence splitting, tokenisation.

Blocks of raw input lines go in; per JSON key come out NumPy arrays ready for
``IndexedDatasetBuilder.add_document_batch``: all token ids, the length of every sequence (sentence, or
whole document without --split-sentences) and the number of sequences of every document.
"""
from __future__ import annotations

import gzip
import itertools
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy

logger = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20  # raw input per task: large enough to amortise IPC, small enough to bound memory
_MAX_CHARS_PER_SPLIT = 1000000  # texts are split into sentences in pieces of this size, as Megatron does


class EncodeFailure(RuntimeError):
    """A malformed input line; the message names the file and line."""


@dataclass
class LineFailure:
    line_number: int
    message: str


@dataclass
class BlockResult:
    arrays: Dict[str, Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]] = field(default_factory=dict)
    chars_per_doc: List[int] = field(default_factory=list)
    failure: Optional[LineFailure] = None


def open_input(path: str):
    """Open a JSON-lines file for binary reading; gzip is detected from the content, not the name."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


def read_line_blocks(fin, block_bytes: int):
    """Yield ``(number of the first line, bytes of whole lines)`` blocks of about ``block_bytes`` bytes.

    The parent only slices raw bytes; decoding and parsing happen in the workers.
    """
    line_number = 1
    while True:
        blob = fin.read(block_bytes)
        if not blob:
            return
        if not blob.endswith(b"\n"):
            blob += fin.readline()  # complete the last line
        yield line_number, blob
        line_number += blob.count(b"\n")


# ------------------------------------------------------------------------------------- sentence splitting


class _RuleSentenceSplitter:
    """Splits after ``.``, ``!`` or ``?`` (and closing quotes/brackets) followed by whitespace and a capital,
    digit or opening quote, and at blank lines; common abbreviations and initials do not end sentences.
    Used when NLTK's punkt model is not installed (it needs a download)."""

    _ABBREVIATIONS = {"e.g", "i.e", "etc", "vs", "mr", "mrs", "ms", "dr", "prof", "st", "no", "fig", "cf", "al",
                      "approx", "dept", "inc", "ltd", "jr", "sr"}
    _BOUNDARY = re.compile(r"""(?<=[.!?])["')\]]*(\s+)(?=["'(\[]?[A-Z0-9])|(\n[ \t]*\n\s*)""")

    def __init__(self, keep_newlines: bool) -> None:
        self.keep_newlines = keep_newlines

    def tokenize(self, text: str) -> List[str]:
        sentences, start = [], 0
        for match in self._BOUNDARY.finditer(text):
            gap_start = match.start(1) if match.group(1) is not None else match.start(2)
            if match.group(1) is not None:
                # Closing quotes/brackets belong to the sentence; whitespace starts at group 1.
                word = text[:gap_start].rsplit(None, 1)[-1] if text[:gap_start].strip() else ""
                stem = word.rstrip("\"')]").rstrip(".!?").lower()
                if stem in self._ABBREVIATIONS or (len(stem) == 1 and stem.isalpha()):
                    continue
            end = match.end() if self.keep_newlines else gap_start
            sentence = text[start:end]
            if sentence.strip():
                sentences.append(sentence)
            start = match.end()
        tail = text[start:]
        if tail.strip():
            sentences.append(tail if self.keep_newlines else tail.rstrip())
        return sentences


def build_sentence_splitter(lang: str, keep_newlines: bool):
    """NLTK's punkt splitter when NLTK and its model are installed, else the rule-based splitter."""
    try:
        import nltk

        splitter = nltk.load(f"tokenizers/punkt/{lang}.pickle")
        if keep_newlines:
            class _KeepNewlines(nltk.tokenize.punkt.PunktLanguageVars):
                _period_context_fmt = r"""
                    \S*                          # some word material
                    %(SentEndChars)s             # a potential sentence ending
                    \s*                       #  <-- THIS is what I changed
                    (?=(?P<after_tok>
                        %(NonWord)s              # either other punctuation
                        |
                        (?P<next_tok>\S+)     #  <-- Normally you would have \\s+ here
                    ))"""

            splitter = nltk.tokenize.punkt.PunktSentenceTokenizer(train_text=splitter._params,
                                                                   lang_vars=_KeepNewlines())
        return splitter, "NLTK punkt"
    except Exception:  # noqa: BLE001 - NLTK missing, or its model not downloaded
        return _RuleSentenceSplitter(keep_newlines), "rule-based (NLTK punkt not installed)"


# ------------------------------------------------------------------------------------------------ encoder


class Encoder:
    """Holds the tokenizer of one process (a class attribute, set by ``initializer``, as in Megatron)."""

    tokenizer = None
    splitter = None
    active = None
    token_dtype = None

    def __init__(self, args) -> None:
        self.args = args

    def initializer(self) -> None:
        from megatron.tokenizer import build_tokenizer

        from megatron.core.datasets.indexed_format import DType

        if Encoder.active is not None and Encoder.active.args is self.args:
            return  # a forked worker inherits the parent's tokenizer (and its warm caches)
        Encoder.tokenizer = build_tokenizer(self.args)
        Encoder.token_dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)
        if self.args.split_sentences:
            Encoder.splitter, name = build_sentence_splitter(self.args.lang, self.args.keep_newlines)
            logger.info("sentence splitting: %s", name)
        Encoder.active = self

    @staticmethod
    def encode_block_in_worker(first_line: int, blob: bytes) -> BlockResult:
        return Encoder.active.encode_block(first_line, blob)

    def _sentences(self, text) -> List[str]:
        if isinstance(text, list):
            return [str(t) for t in text]  # already split into sentences
        if not self.args.split_sentences:
            return [text]
        pieces = []
        for begin in range(0, len(text), _MAX_CHARS_PER_SPLIT):
            pieces.extend(Encoder.splitter.tokenize(text[begin:begin + _MAX_CHARS_PER_SPLIT]))
        return pieces

    def encode_block(self, first_line: int, blob: bytes) -> BlockResult:
        tokenizer = Encoder.tokenizer
        keys = self.args.json_keys
        result = BlockResult()
        bad_encoding = None
        try:
            text = blob.decode("utf-8")
        except UnicodeDecodeError as error:
            # Keep the lines before the undecodable one; report that one.
            line_start = blob.rfind(b"\n", 0, error.start) + 1
            text = blob[:line_start].decode("utf-8")
            bad_encoding = LineFailure(first_line + blob.count(b"\n", 0, line_start),
                                       f"not valid UTF-8 ({error.reason} at byte {error.start - line_start})")
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        # Decode and split every line first, then tokenise all sentences in one batch per key.
        sentences_per_key: Dict[str, List[List[str]]] = {key: [] for key in keys}
        for offset, line in enumerate(lines):
            if not line.strip():
                continue  # blank lines carry no document
            try:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
                values = []
                for key in keys:
                    if key not in record:
                        raise ValueError(f"no key {key!r} (--json-keys)")
                    value = record[key]
                    if not isinstance(value, (str, list)):
                        raise ValueError(f"key {key!r} holds {type(value).__name__}, not text")
                    values.append(self._sentences(value))
            except (json.JSONDecodeError, ValueError) as error:
                message = f"malformed JSON line ({error.msg})" if isinstance(error, json.JSONDecodeError) \
                    else f"bad JSON record: {error}"
                result.failure = LineFailure(first_line + offset, message)
                break
            for key, sentences in zip(keys, values):
                sentences_per_key[key].append(sentences)
            result.chars_per_doc.append(len(line) + 1)  # Megatron counts the line with its newline
        if result.failure is None:
            result.failure = bad_encoding
        for key in keys:
            result.arrays[key] = self._tokenize_documents(tokenizer, sentences_per_key[key])
        return result

    def _tokenize_documents(self, tokenizer, documents: List[List[str]]):
        flat = [sentence for sentences in documents for sentence in sentences]
        batch = getattr(tokenizer, "tokenize_batch", None)
        ids = batch(flat) if batch is not None else [tokenizer.tokenize(s) for s in flat]
        eod = tokenizer.eod if self.args.append_eod else None
        tokens, lengths, per_doc = [], [], []
        position = 0
        for sentences in documents:
            count = 0
            doc_tokens = 0
            for sentence_ids in ids[position:position + len(sentences)]:
                if len(sentence_ids) > 0:  # empty sentences are dropped
                    tokens.append(sentence_ids)
                    lengths.append(len(sentence_ids))
                    doc_tokens += len(sentence_ids)
                    count += 1
            position += len(sentences)
            if eod is not None and doc_tokens > 0:
                tokens.append([eod])  # the EOD counts in the last sequence of the document
                lengths[-1] += 1
            per_doc.append(count)
        flat_tokens = numpy.fromiter(itertools.chain.from_iterable(tokens), dtype=numpy.int64, count=sum(lengths))
        if flat_tokens.size:
            low, high = int(flat_tokens.min()), int(flat_tokens.max())
            info = numpy.iinfo(Encoder.token_dtype)
            if low < info.min or high > info.max:
                raise ValueError(f"token ids in [{low}, {high}] exceed the {numpy.dtype(Encoder.token_dtype).name} "
                                 f"range chosen from the vocabulary size {tokenizer.vocab_size}")
        flat_tokens = flat_tokens.astype(Encoder.token_dtype)
        return flat_tokens, numpy.asarray(lengths, dtype=numpy.int32), numpy.asarray(per_doc, dtype=numpy.int64)
