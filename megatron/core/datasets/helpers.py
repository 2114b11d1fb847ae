"""The dataset index builders: the compiled ``helpers_cpp`` module when installed, else the NumPy twin.

``helpers_cpp`` is built from helpers.cpp by ``pip install`` (setup.py); nothing is compiled at run
time. Which implementation is in use is logged once, on first use.
"""
from __future__ import annotations

import logging

import numpy

logger = logging.getLogger(__name__)

try:
    from megatron.core.datasets import helpers_cpp as _impl

    IMPLEMENTATION = "C++ (megatron.core.datasets.helpers_cpp)"
    _IMPORT_ERROR = None
except ImportError as error:  # not built: no compiler at install time, or an in-place checkout
    from megatron.core.datasets import helpers_numpy as _impl

    IMPLEMENTATION = "NumPy (megatron.core.datasets.helpers_numpy)"
    _IMPORT_ERROR = error

_announced = False


def _announce() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    if _IMPORT_ERROR is None:
        logger.info("dataset index helpers: using %s", IMPLEMENTATION)
    else:
        logger.warning("dataset index helpers: the compiled module is not installed (%s); using the %s "
                       "fallback, which gives identical indices but builds them more slowly. Reinstall with "
                       "a C++ compiler available to build it.", _IMPORT_ERROR, IMPLEMENTATION)


def build_sample_idx(sizes: numpy.ndarray, document_indices: numpy.ndarray, sequence_length: int, num_epochs: int,
                     tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                     add_extra_token_to_sequence: bool = True) -> numpy.ndarray:
    """GPT sample index, int32 when every value fits, else int64 (megatron-core's choice)."""
    _announce()
    if sizes.dtype != numpy.int32 or document_indices.dtype != numpy.int32:
        raise TypeError(f"build_sample_idx expects int32 sizes and document indices, got {sizes.dtype} and "
                        f"{document_indices.dtype}")
    largest = max(document_indices.shape[0], int(sizes.max()) if sizes.size else 0)
    builder = _impl.build_sample_idx_int32 if largest <= numpy.iinfo(numpy.int32).max else _impl.build_sample_idx_int64
    return builder(sizes, document_indices, int(sequence_length), int(num_epochs), int(tokens_per_epoch),
                   bool(drop_last_partial_sequence), int(add_extra_token_to_sequence))


def build_sample_idx_int32(*args, **kwargs) -> numpy.ndarray:
    _announce()
    return _impl.build_sample_idx_int32(*args, **kwargs)


def build_sample_idx_int64(*args, **kwargs) -> numpy.ndarray:
    _announce()
    return _impl.build_sample_idx_int64(*args, **kwargs)


def build_blending_indices(dataset_index, dataset_sample_index, weights, num_datasets, size, verbose) -> None:
    _announce()
    _impl.build_blending_indices(dataset_index, dataset_sample_index, numpy.asarray(weights, dtype=numpy.float64),
                                 int(num_datasets), int(size), bool(verbose))


def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets) -> None:
    _announce()
    _impl.build_exhaustive_blending_indices(dataset_index, dataset_sample_index,
                                            numpy.asarray(sizes, dtype=numpy.int64), int(num_datasets))


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, verbose,
                  min_num_sent) -> numpy.ndarray:
    _announce()
    return _impl.build_mapping(numpy.asarray(docs, dtype=numpy.int64), numpy.asarray(sizes, dtype=numpy.int32),
                               int(num_epochs), int(max_num_samples), int(max_seq_length), float(short_seq_prob),
                               int(seed), bool(verbose), int(min_num_sent))


def build_blocks_mapping(docs, sizes, titles_sizes, num_epochs, max_num_samples, max_seq_length, seed, verbose,
                         use_one_sent_blocks) -> numpy.ndarray:
    _announce()
    return _impl.build_blocks_mapping(numpy.asarray(docs, dtype=numpy.int64), numpy.asarray(sizes, dtype=numpy.int32),
                                      numpy.asarray(titles_sizes, dtype=numpy.int32), int(num_epochs),
                                      int(max_num_samples), int(max_seq_length), int(seed), bool(verbose),
                                      bool(use_one_sent_blocks))
