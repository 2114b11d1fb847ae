"""Megatron's memory-mapped indexed dataset: ``IndexedDataset`` (a torch ``Dataset`` over a ``.bin``/``.idx``
pair; ``len`` and indexing are over sequences) and, re-exported, the format it reads and writes (layout, index
reader and writer, ``IndexedDatasetBuilder``), which lives in ``megatron.core.datasets.indexed_format``."""
from __future__ import annotations

import os
from itertools import accumulate
from typing import Optional, Union

import numpy
import torch

from megatron.core.datasets.indexed_format import (
    DType, FileBinReader, IndexedDatasetBuilder, IndexFormatError, IndexReader, MMapBinReader, get_bin_path,
    get_idx_path)

# megatron-core's name of the index reader.
_IndexReader = IndexReader

__all__ = ["DType", "FileBinReader", "IndexedDataset", "IndexedDatasetBuilder", "IndexFormatError", "IndexReader",
           "MMapBinReader", "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "get_bin_path", "get_idx_path"]


class IndexedDataset(torch.utils.data.Dataset):
    """Reader of a ``.bin``/``.idx`` pair; ``len`` and indexing are over *sequences*.

    Args:
        path_prefix: the path without ``.bin``/``.idx``.
        multimodal: whether the index carries per-sequence modes.
        mmap: memory-map the ``.bin`` (default) or read it with file reads.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.index = IndexReader(get_idx_path(path_prefix), multimodal)
        bin_path = get_bin_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"data file {bin_path} does not exist (its index {get_idx_path(path_prefix)} does)")
        needed, have = self.index.bin_bytes_required(), os.path.getsize(bin_path)
        if have < needed:
            raise IndexFormatError(
                f"{bin_path} is shorter than its index claims: {get_idx_path(path_prefix)} needs {needed} bytes "
                f"of {numpy.dtype(self.index.dtype).name} tokens but the file has {have}")
        if self.index.sequence_count:
            # Every sequence must lie inside the .bin (one vectorised pass over the index): a corrupt pointer
            # would otherwise surface as a numpy error, or garbage tokens, at some later sample.
            lengths = self.index.sequence_lengths.astype(numpy.int64)
            starts = self.index.sequence_pointers
            ends = starts + lengths * self.index.dtype_size
            bad = numpy.flatnonzero((lengths < 0) | (starts < 0) | (ends > have))
            if bad.size:
                i = int(bad[0])
                raise IndexFormatError(
                    f"{get_idx_path(path_prefix)} points beyond {bin_path}: sequence {i} spans bytes "
                    f"[{int(starts[i])}, {int(ends[i])}) but the file has {have} bytes ({bad.size} such sequences)")
        if have > needed:
            raise IndexFormatError(
                f"{bin_path} does not match its index: {get_idx_path(path_prefix)} describes {needed} bytes of "
                f"{numpy.dtype(self.index.dtype).name} tokens but the file has {have} (are the .idx and .bin from "
                f"different preprocessing runs? Re-run tools/preprocess_data.py)")
        self.bin_reader = MMapBinReader(bin_path) if mmap else FileBinReader(bin_path)

    def __getstate__(self):
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state):
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx: Union[int, numpy.integer, slice]):
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            sequence = self.bin_reader.read(self.index.dtype, int(length), int(pointer))
            return (sequence, mode) if mode is not None else sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into IndexedDataset must be contiguous (step 1), got step {step}")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                return []
            offsets = list(accumulate(int(x) for x in lengths))
            flat = self.bin_reader.read(self.index.dtype, offsets[-1], int(self.index.sequence_pointers[start]))
            sequences = numpy.split(flat, offsets[:-1])
            if self.index.sequence_modes is not None:
                return sequences, self.index.sequence_modes[start:stop]
            return sequences
        raise TypeError(f"unexpected index type {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """``length`` tokens of sequence ``idx`` starting at token ``offset`` (to its end if None)."""
        pointer, seq_length, mode = self.index[idx]
        if length is None:
            length = int(seq_length) - offset
        sequence = self.bin_reader.read(self.index.dtype, int(length), int(pointer) + offset * self.index.dtype_size)
        return (sequence, mode) if mode is not None else sequence

    @property
    def dtype(self):
        return self.index.dtype

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        return self.index.sequence_modes

    # Names of the 2023 MMapIndexedDataset.
    sizes = sequence_lengths
    doc_idx = document_indices
    get_doc_idx = get_document_indices
    set_doc_idx = set_document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


# Older megatron-core names.
MMapIndexedDataset = IndexedDataset
MMapIndexedDatasetBuilder = IndexedDatasetBuilder
