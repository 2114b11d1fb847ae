"""Open every dataset named on the command line before any process group exists.

``initialize_megatron`` calls :func:`check_data_files` on every rank right after the tokenizer is built, so a
damaged ``.idx``/``.bin`` pair (bad magic, wrong version or dtype code, truncated or mismatched files) or data
tokenised with another tokenizer (token ids beyond the vocabulary) fails at once with one line naming the file,
instead of a crash deep inside training or ranks waiting on one that died.
"""
from __future__ import annotations

import numpy

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexFormatError, get_bin_path
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training.errors import ConfigurationError

# Token ids of files up to this size are scanned completely; of larger ones, the first and last half of it.
MAX_SCAN_BYTES = 1 << 30

_DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def data_prefixes(args):
    """(flag, dataset prefix) for every dataset the data flags name (none with --mock-data)."""
    if getattr(args, "mock_data", False):
        return
    for dest in _DATA_FLAGS:
        blend = get_blend_from_list(getattr(args, dest, None))
        for prefix in (blend[0] if blend else []):
            yield "--" + dest.replace("_", "-"), prefix


def max_token_id(dataset: IndexedDataset, max_scan_bytes: int = MAX_SCAN_BYTES):
    """(largest token id, whether the whole file was scanned)."""
    tokens = numpy.memmap(get_bin_path(dataset.path_prefix), dtype=dataset.index.dtype, mode="r")
    if tokens.size == 0:
        return -1, True
    if tokens.nbytes <= max_scan_bytes:
        return int(tokens.max()), True
    half = max_scan_bytes // 2 // tokens.itemsize
    return int(max(tokens[:half].max(), tokens[-half:].max())), False


def check_data_files(args, vocab_size=None, max_scan_bytes: int = MAX_SCAN_BYTES) -> None:
    """Raise a one-line ConfigurationError naming the flag and file when a dataset cannot be used."""
    for flag, prefix in data_prefixes(args):
        try:
            dataset = IndexedDataset(prefix, mmap=True)
        except (IndexFormatError, OSError) as error:
            raise ConfigurationError(f"{flag} {prefix}: {error}") from error
        if vocab_size is None:
            continue
        largest, complete = max_token_id(dataset, max_scan_bytes)
        if largest >= vocab_size:
            raise ConfigurationError(
                f"{flag} {prefix}: {get_bin_path(prefix)} holds token id {largest} but the tokenizer "
                f"(--tokenizer-type {getattr(args, 'tokenizer_type', None)}) has only {vocab_size} ids: the data was "
                "preprocessed with another tokenizer; pass that tokenizer's files or re-run tools/preprocess_data.py"
                + ("" if complete else f" (checked the first and last {max_scan_bytes >> 21} MiB of the file)"))
