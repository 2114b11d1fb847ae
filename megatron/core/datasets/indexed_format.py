"""Megatron's indexed-dataset file format: a headerless ``.bin`` of tokens plus an ``.idx`` (MMIDIDX v1).

``.idx`` layout (little-endian, unaligned):

    9 bytes  magic b"MMIDIDX\\x00\\x00"
    <Q       version (always 1)
    <B       dtype code of the .bin tokens (DType)
    <Q       N = number of sequences
    <Q       D = number of document_indices entries (documents + 1)
    int32[N] sequence_lengths (tokens)
    int64[N] sequence_pointers (byte offsets into .bin)
    int64[D] document_indices (sequence index boundaries, starting at 0)
    int8[N]  sequence_modes (only for multimodal datasets; not flagged in the file)

The builder keeps at most a bounded number of index entries in memory and spills the rest to temporary
files next to the ``.bin``, so building an index for billions of documents needs little RAM.

This module is the format alone (NumPy, no torch): the index reader and writer, the ``.bin`` readers and the
builder, so that ``tools/preprocess_data.py`` runs without importing torch.
The torch ``Dataset`` over a pair is ``megatron.core.datasets.indexed_dataset.IndexedDataset``.
"""
from __future__ import annotations

import logging
import os
import struct
import tempfile
import time
from enum import Enum
from typing import List, Optional, Tuple, Type, Union

import numpy

logger = logging.getLogger(__name__)

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_LEGACY_INDEX_HEADER = b"TNTIDX\x00\x00"
_HEADER_BYTES = 34  # magic(9) + version(8) + dtype(1) + N(8) + D(8)


class DType(Enum):
    """The NumPy dtype codes stored in the ``.idx`` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 when every id fits comfortably (vocab < 65500), else int32 — Megatron's rule."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class IndexFormatError(ValueError):
    """An ``.idx``/``.bin`` pair that does not follow the MMIDIDX format; the message names the file."""


# ----------------------------------------------------------------------------------------------- reading


class IndexReader:
    """Parses and validates an ``.idx`` file and exposes its arrays as zero-copy views of a memory map."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        self.idx_path = idx_path
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(
                f"index file {idx_path} does not exist: --data-path takes the prefix of a .bin/.idx pair "
                f"written by tools/preprocess_data.py, without the extension")
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if file_size < len(_INDEX_HEADER):
            raise IndexFormatError(f"{idx_path} is truncated: it has {file_size} bytes, fewer than the "
                                   f"{_HEADER_BYTES}-byte MMIDIDX header")
        if header[:len(_LEGACY_INDEX_HEADER)] == _LEGACY_INDEX_HEADER:
            raise IndexFormatError(
                f"{idx_path} is a legacy 'lazy'/'cached' (TNTIDX) index, which is not supported: re-run "
                f"tools/preprocess_data.py to write the mmap (MMIDIDX) format")
        if header[:9] != _INDEX_HEADER:
            raise IndexFormatError(
                f"{idx_path} is not a Megatron MMIDIDX index: it starts with {header[:9]!r} instead of "
                f"{_INDEX_HEADER!r}")
        if len(header) < _HEADER_BYTES:
            raise IndexFormatError(
                f"{idx_path} is truncated: the header needs {_HEADER_BYTES} bytes but the file has {file_size}")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != 1:
            raise IndexFormatError(f"{idx_path} has index version {version}; only version 1 is defined")
        (dtype_code,) = struct.unpack("<B", header[17:18])
        try:
            self.dtype = DType.dtype_from_code(dtype_code)
        except ValueError:
            raise IndexFormatError(
                f"{idx_path} has unknown token dtype code {dtype_code} (known codes: "
                f"{', '.join(f'{d.value}={d.name}' for d in DType)})") from None
        self.dtype_size = DType.size(self.dtype)
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        n, d = self.sequence_count, self.document_count
        expected = _HEADER_BYTES + 12 * n + 8 * d + (n if multimodal else 0)
        if file_size < expected:
            raise IndexFormatError(
                f"{idx_path} is truncated: its header declares {n} sequences and {d} document indices, "
                f"which need {expected} bytes, but the file has {file_size}")
        if file_size > expected and not (not multimodal and file_size == expected + n):
            raise IndexFormatError(
                f"{idx_path} has {file_size - expected} bytes more than its header declares "
                f"({n} sequences, {d} document indices); the file is corrupt or not an MMIDIDX index")
        if d < 1:
            raise IndexFormatError(f"{idx_path} has no document indices (it needs at least the leading 0)")

        self._mmap = numpy.memmap(idx_path, mode="r", order="C")
        self._buffer = self._mmap
        offset = _HEADER_BYTES
        self.sequence_lengths = numpy.frombuffer(self._buffer, dtype=numpy.int32, count=n, offset=offset)
        offset += 4 * n
        self.sequence_pointers = numpy.frombuffer(self._buffer, dtype=numpy.int64, count=n, offset=offset)
        offset += 8 * n
        self.document_indices = numpy.frombuffer(self._buffer, dtype=numpy.int64, count=d, offset=offset)
        offset += 8 * d
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = numpy.frombuffer(self._buffer, dtype=numpy.int8, count=n, offset=offset)
        if self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise IndexFormatError(
                f"{idx_path} is inconsistent: document_indices must run from 0 to the sequence count {n}, "
                f"but run from {self.document_indices[0]} to {self.document_indices[-1]}")

    def bin_bytes_required(self) -> int:
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> Tuple[numpy.int64, numpy.int32, Optional[numpy.int8]]:
        return (self.sequence_pointers[idx], self.sequence_lengths[idx],
                self.sequence_modes[idx] if self.sequence_modes is not None else None)


class MMapBinReader:
    def __init__(self, bin_path: str) -> None:
        # numpy cannot memory-map an empty file; an empty dataset reads from an empty buffer instead.
        self._buffer = numpy.memmap(bin_path, mode="r", order="C") if os.path.getsize(bin_path) else b""

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class FileBinReader:
    """Plain file reads (``--no-mmap-bin-files``), for filesystems where mmap is slow or limited: every read opens
    the ``.bin``, seeks and reads into a fresh array. A read that fails with an OSError (a flaky network
    filesystem) is retried after 10, 20 and 40 seconds, as Megatron-LM does, then the error is raised."""

    RETRY_DELAYS_S = (10, 20, 40)

    def __init__(self, bin_path: str) -> None:
        self._bin_path = bin_path

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        for delay in self.RETRY_DELAYS_S:
            try:
                return self._read_once(dtype, count, offset)
            except OSError as error:
                logger.warning("reading %s at offset %d failed (%s); retrying in %d s", self._bin_path, offset,
                               error, delay)
                time.sleep(delay)
        return self._read_once(dtype, count, offset)

    def _read_once(self, dtype, count: int, offset: int) -> numpy.ndarray:
        out = numpy.empty(count, dtype=dtype)
        with open(self._bin_path, mode="rb", buffering=0) as f:
            f.seek(offset)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise IndexFormatError(f"{self._bin_path}: short read of {got} bytes at offset {offset}, "
                                   f"expected {out.nbytes}")
        return out




# ----------------------------------------------------------------------------------------------- writing


class _SpillingArray:
    """An append-only integer array that keeps at most ``chunk`` entries in RAM and spills to a temp file."""

    def __init__(self, dtype, directory: str, chunk: int = 1 << 22) -> None:
        self.dtype = numpy.dtype(dtype)
        self._directory = directory
        self._chunk = chunk
        self._buffer = numpy.empty(min(chunk, 1024), dtype=self.dtype)
        self._used = 0
        self._spill = None
        self._spilled = 0

    def __len__(self) -> int:
        return self._spilled + self._used

    def append(self, value: int) -> None:
        if self._used == len(self._buffer):
            self._grow_or_flush(1)
        self._buffer[self._used] = value
        self._used += 1

    def extend(self, values) -> None:
        values = numpy.asarray(values, dtype=self.dtype).reshape(-1)
        start = 0
        while start < len(values):
            if self._used == len(self._buffer):
                self._grow_or_flush(len(values) - start)
            take = min(len(values) - start, len(self._buffer) - self._used)
            self._buffer[self._used:self._used + take] = values[start:start + take]
            self._used += take
            start += take

    def _grow_or_flush(self, wanted: int) -> None:
        if len(self._buffer) < self._chunk:
            new_size = min(self._chunk, max(2 * len(self._buffer), self._used + wanted))
            grown = numpy.empty(new_size, dtype=self.dtype)
            grown[:self._used] = self._buffer[:self._used]
            self._buffer = grown
            return
        if self._spill is None:
            self._spill = tempfile.TemporaryFile(dir=self._directory, prefix=".index-spill-")
        self._spill.write(self._buffer[:self._used].tobytes())
        self._spilled += self._used
        self._used = 0

    def chunks(self):
        """Yield the contents in order as NumPy arrays of at most ``chunk`` entries."""
        if self._spill is not None:
            self._spill.flush()
            self._spill.seek(0)
            remaining = self._spilled
            while remaining:
                count = min(remaining, self._chunk)
                yield numpy.frombuffer(self._spill.read(count * self.dtype.itemsize), dtype=self.dtype)
                remaining -= count
        if self._used:
            yield self._buffer[:self._used]

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None


class _IndexWriter:
    """Writes an ``.idx`` from chunked sequence lengths, document indices and modes."""

    def __init__(self, idx_path: str, dtype: Type[numpy.number]) -> None:
        self.idx_path = idx_path
        self.dtype = dtype

    def __enter__(self) -> "_IndexWriter":
        self.idx_writer = open(self.idx_path, "wb")
        self.idx_writer.write(_INDEX_HEADER)
        self.idx_writer.write(struct.pack("<Q", 1))
        self.idx_writer.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.idx_writer.close()

    def write(self, sequence_lengths, sequence_modes, document_indices) -> None:
        """Each argument is a list/array or a ``_SpillingArray`` (streamed chunk by chunk)."""
        lengths = sequence_lengths if isinstance(sequence_lengths, _SpillingArray) else _as_chunked(sequence_lengths, numpy.int32)
        docs = document_indices if isinstance(document_indices, _SpillingArray) else _as_chunked(document_indices, numpy.int64)
        self.idx_writer.write(struct.pack("<Q", len(lengths)))
        self.idx_writer.write(struct.pack("<Q", len(docs)))
        for chunk in lengths.chunks():
            self.idx_writer.write(numpy.asarray(chunk, dtype=numpy.int32).tobytes(order="C"))
        # Pointers are byte offsets computed in int64 (int32 would overflow past 2 GiB of tokens).
        itemsize = DType.size(self.dtype)
        running = 0
        for chunk in lengths.chunks():
            byte_lengths = numpy.asarray(chunk, dtype=numpy.int64) * itemsize
            pointers = numpy.empty(len(byte_lengths), dtype=numpy.int64)
            if len(byte_lengths):
                pointers[0] = running
                numpy.cumsum(byte_lengths[:-1], out=pointers[1:])
                pointers[1:] += running
                running += int(byte_lengths.sum())
            self.idx_writer.write(pointers.tobytes(order="C"))
        for chunk in docs.chunks():
            self.idx_writer.write(numpy.asarray(chunk, dtype=numpy.int64).tobytes(order="C"))
        if sequence_modes is not None:
            modes = sequence_modes if isinstance(sequence_modes, _SpillingArray) else _as_chunked(sequence_modes, numpy.int8)
            for chunk in modes.chunks():
                self.idx_writer.write(numpy.asarray(chunk, dtype=numpy.int8).tobytes(order="C"))


class _as_chunked:
    def __init__(self, values, dtype) -> None:
        self._values = numpy.asarray(values, dtype=dtype)

    def __len__(self) -> int:
        return len(self._values)

    def chunks(self):
        yield self._values


class IndexedDatasetBuilder:
    """Writes a ``.bin`` as items arrive and the matching ``.idx`` on ``finalize``.

    Args:
        bin_path: the ``.bin`` to write.
        dtype: token dtype (use ``DType.optimal_dtype(vocab_size)`` for text).
        multimodal: whether to record a mode per sequence.
    """

    def __init__(self, bin_path: str, dtype: Type[numpy.number] = numpy.int32, multimodal: bool = False) -> None:
        self.bin_path = bin_path
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        spill_dir = os.path.dirname(os.path.abspath(bin_path))
        self.sequence_lengths = _SpillingArray(numpy.int32, spill_dir)
        self.document_indices = _SpillingArray(numpy.int64, spill_dir)
        self.document_indices.append(0)
        self.sequence_modes = _SpillingArray(numpy.int8, spill_dir) if multimodal else None
        self._max_token = numpy.iinfo(dtype).max if numpy.issubdtype(dtype, numpy.integer) else None

    def _as_tokens(self, tensor) -> numpy.ndarray:
        array = numpy.asarray(tensor)
        if self._max_token is not None and array.size and array.dtype != self.dtype:
            low, high = int(array.min()), int(array.max())
            if low < numpy.iinfo(self.dtype).min or high > self._max_token:
                raise ValueError(
                    f"token ids in [{low}, {high}] do not fit the {numpy.dtype(self.dtype).name} dtype of "
                    f"{self.bin_path}: pass a wider dtype (DType.optimal_dtype(vocab_size))")
        return numpy.ascontiguousarray(array, dtype=self.dtype)

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence."""
        array = self._as_tokens(tensor).reshape(-1)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: List[int], modes: Optional[List[int]] = None) -> None:
        """Append a whole document: its concatenated tokens and the length of each of its sequences."""
        array = self._as_tokens(tensor).reshape(-1)
        lengths = numpy.asarray(lengths, dtype=numpy.int64)
        if int(lengths.sum()) != array.size:
            raise ValueError(f"add_document: lengths sum to {int(lengths.sum())} but {array.size} tokens were given")
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else numpy.zeros(len(lengths)))

    def add_document_batch(self, tokens: numpy.ndarray, sequence_lengths: numpy.ndarray,
                           sequences_per_document: numpy.ndarray) -> None:
        """Append many documents at once (fast path for the preprocessing tool).

        ``tokens`` is every sequence concatenated, ``sequence_lengths`` the length of each sequence and
        ``sequences_per_document`` how many consecutive sequences form each document (0 = empty document).
        """
        array = self._as_tokens(tokens).reshape(-1)
        self.data_file.write(array.tobytes(order="C"))
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(sequence_lengths)
        self.document_indices.extend(base + numpy.cumsum(numpy.asarray(sequences_per_document, dtype=numpy.int64)))
        if self.multimodal:
            self.sequence_modes.extend(numpy.zeros(len(sequence_lengths)))

    def end_document(self) -> None:
        """Close the current document after ``add_item`` calls."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every sequence and document of another ``.bin``/``.idx`` pair (same dtype)."""
        index = IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if numpy.dtype(index.dtype) != numpy.dtype(self.dtype):
            raise ValueError(
                f"cannot merge {path_prefix}: its tokens are {numpy.dtype(index.dtype).name} but this builder "
                f"writes {numpy.dtype(self.dtype).name}")
        offset = len(self.sequence_lengths)
        step = 1 << 22
        for start in range(0, index.sequence_count, step):
            self.sequence_lengths.extend(index.sequence_lengths[start:start + step])
            if self.multimodal:
                self.sequence_modes.extend(index.sequence_modes[start:start + step])
        for start in range(1, index.document_count, step):
            self.document_indices.extend(offset + index.document_indices[start:start + step])
        required = index.bin_bytes_required()
        del index
        with open(get_bin_path(path_prefix), "rb") as f:
            copied = _copy_bytes(f, self.data_file, required)
        if copied < required:
            raise IndexFormatError(f"{get_bin_path(path_prefix)} is shorter ({copied} bytes) than its index "
                                   f"claims ({required} bytes)")

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx``."""
        self.data_file.close()
        with _IndexWriter(idx_path, self.dtype) as writer:
            writer.write(self.sequence_lengths, self.sequence_modes, self.document_indices)
        for array in (self.sequence_lengths, self.document_indices, self.sequence_modes):
            if array is not None:
                array.close()

    # Names of the 2023 MMapIndexedDatasetBuilder.
    add_doc = add_document
    merge_file_ = add_index


def _copy_bytes(src, dst, count: int, block: int = 16 << 20) -> int:
    copied = 0
    while copied < count:
        data = src.read(min(block, count - copied))
        if not data:
            break
        dst.write(data)
        copied += len(data)
    return copied
