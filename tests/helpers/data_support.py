"""Shared helpers of the tests/data tests (not a test module)."""
from __future__ import annotations

import functools
import gzip
import json
import os
from types import SimpleNamespace

import numpy

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

DATA = os.path.join(REPO, "data")
CORPUS = os.path.join(DATA, "stdlib_prose.jsonl.gz")
GPT2_VOCAB = os.path.join(DATA, "tokenizers", "gpt2", "vocab.json")
GPT2_MERGES = os.path.join(DATA, "tokenizers", "gpt2", "merges.txt")
BERT_VOCAB = os.path.join(DATA, "tokenizers", "bert", "vocab.txt")
SPM_MODEL = os.path.join(DATA, "tokenizers", "sentencepiece", "spm.model")


@functools.lru_cache(maxsize=None)
def corpus_texts():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line)["text"] for line in f)


def sample_texts(n: int, max_chars: int = 4000, stride: int = 37):
    """``n`` corpus documents spread over the corpus, each cut to ``max_chars``."""
    texts = corpus_texts()
    return [texts[(i * stride) % len(texts)][:max_chars] for i in range(n)]


def write_jsonl(path: str, texts, key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({key: text}) + "\n")
    return path


def tokenizer_args(tokenizer_type: str, **overrides) -> SimpleNamespace:
    args = SimpleNamespace(tokenizer_type=tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None,
                           vocab_size=None, vocab_extra_ids=0, make_vocab_size_divisible_by=128,
                           tensor_model_parallel_size=1, rank=1)
    if tokenizer_type == "GPT2BPETokenizer":
        args.vocab_file, args.merge_file = GPT2_VOCAB, GPT2_MERGES
    elif tokenizer_type.startswith("BertWordPiece"):
        args.vocab_file = BERT_VOCAB
    elif "SentencePiece" in tokenizer_type:
        args.tokenizer_model = SPM_MODEL
    elif tokenizer_type == "NullTokenizer":
        args.vocab_size = 1000
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def tokenizer_flags(tokenizer_type: str, hf_path: str = None):
    flags = ["--tokenizer-type", tokenizer_type]
    if tokenizer_type == "GPT2BPETokenizer":
        flags += ["--vocab-file", GPT2_VOCAB, "--merge-file", GPT2_MERGES]
    elif tokenizer_type.startswith("BertWordPiece"):
        flags += ["--vocab-file", BERT_VOCAB]
    elif "SentencePiece" in tokenizer_type:
        flags += ["--tokenizer-model", SPM_MODEL]
    elif tokenizer_type == "HuggingFaceTokenizer":
        flags += ["--tokenizer-model", hf_path]
    elif tokenizer_type == "NullTokenizer":
        flags += ["--vocab-size", "1000"]
    return flags


def write_indexed(prefix: str, documents, dtype=numpy.uint16) -> None:
    """``documents``: list of documents, each a list of sequences (lists of ints)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(numpy.asarray(sequence))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def random_token_corpus(prefix: str, vocab: int, num_docs: int = 64, seed: int = 0) -> str:
    """``num_docs`` documents of 20-60 random token ids below ``vocab - 1``, each ended by ``vocab - 1``, written as
    an indexed dataset at ``prefix``: a training corpus whose sample index costs nothing (``--mock-data``'s holds
    millions of samples). Returns the prefix (for ``--data-path``)."""
    rng = numpy.random.default_rng(seed)
    write_indexed(prefix, [[rng.integers(0, vocab - 1, int(n)).tolist() + [vocab - 1]]
                           for n in rng.integers(20, 60, num_docs)])
    return prefix
