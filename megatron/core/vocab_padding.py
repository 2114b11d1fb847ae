"""Vocabulary padding, shared by the tokenizer builder and argument validation.

Megatron's rules for the rows ``P`` of the embedding and output layer, from the tokenizer's vocabulary ``V``:

* ``--padded-vocab-size P`` is used as given; ``--make-vocab-size-divisible-by`` is then not applied;
* otherwise, with padding on (the default; ``--no-pad-vocab-size`` turns it off), ``P = ceil(V / (m * t)) * (m * t)``
  with ``m = --make-vocab-size-divisible-by`` and ``t = --tensor-model-parallel-size``; with padding off ``P = V``;
* every TP rank holds ``P / t`` rows of the vocabulary-parallel embedding and output layer, so ``P % t == 0``,
  and the vocabulary must fit: ``V <= P``.
"""
from __future__ import annotations

from typing import Optional


def vocab_size_with_padding(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128,
                            tensor_model_parallel_size: int = 1, rank: int = 0, log: bool = True) -> int:
    """Round ``orig_vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * tp``.

    Every TP rank then holds an equal slice of the embedding table and the slices stay aligned for fast
    GEMMs. Prints Megatron's message on rank 0.
    """
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    if multiple <= 0:
        raise ValueError(f"--make-vocab-size-divisible-by x --tensor-model-parallel-size must be > 0, got {multiple}")
    after = ((orig_vocab_size + multiple - 1) // multiple) * multiple
    if log and rank == 0:
        print(" > padded vocab (size: {}) with {} dummy tokens (new size: {})".format(
            orig_vocab_size, after - orig_vocab_size, after), flush=True)
    return after


def resolve_padded_vocab_size(orig_vocab_size: Optional[int], make_vocab_size_divisible_by: int = 128,
                              tensor_model_parallel_size: int = 1, padded_vocab_size: Optional[int] = None,
                              pad_vocab_size: bool = True, rank: int = 0, log: bool = True) -> Optional[int]:
    """``P`` by the module's rules; ValueError naming the flag when ``P`` does not hold the vocabulary or does not
    split over the TP ranks. ``orig_vocab_size`` None (a tokenizer not built yet) only checks a given ``P``."""
    tp = tensor_model_parallel_size
    if padded_vocab_size is not None:
        if padded_vocab_size <= 0:
            raise ValueError(f"--padded-vocab-size must be > 0, got {padded_vocab_size}")
        if padded_vocab_size % tp:
            raise ValueError(f"--padded-vocab-size ({padded_vocab_size}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp}): each TP rank holds an equal slice of the "
                             "vocabulary")
        if orig_vocab_size is not None and orig_vocab_size > padded_vocab_size:
            raise ValueError(f"--padded-vocab-size ({padded_vocab_size}) is smaller than the tokenizer's vocabulary "
                             f"({orig_vocab_size}): pass at least {orig_vocab_size}, or drop --padded-vocab-size to "
                             "pad by --make-vocab-size-divisible-by")
        return padded_vocab_size
    if orig_vocab_size is None:
        return None
    if pad_vocab_size:
        return vocab_size_with_padding(orig_vocab_size, make_vocab_size_divisible_by, tp, rank=rank, log=log)
    if orig_vocab_size % tp:
        raise ValueError(f"--no-pad-vocab-size: the vocabulary ({orig_vocab_size}) must be divisible by "
                         f"--tensor-model-parallel-size ({tp}); drop --no-pad-vocab-size or pass --padded-vocab-size")
    return orig_vocab_size
