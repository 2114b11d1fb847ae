"""The MMIDIDX .bin/.idx format: an index written byte by byte from the format description parses, and
our builder writes exactly those bytes; reader API and errors."""
import os
import pickle
import struct

import numpy
import pytest

from helpers.data_support import read_file, write_indexed
from megatron.core.datasets import indexed_format as idx_mod
from megatron.core.datasets.indexed_dataset import (
    DType, IndexedDataset, IndexedDatasetBuilder, IndexFormatError, get_bin_path, get_idx_path)

# Three documents: two sequences, an empty document, then one sequence.
DOCUMENTS = [[[5, 6, 7], [8]], [], [[9, 10, 11, 12, 13]]]


def hand_written_index(lengths, doc_indices, dtype_code, itemsize, modes=None) -> bytes:
    """The .idx bytes from the format description, field by field."""
    out = b"MMIDIDX\x00\x00"
    out += struct.pack("<Q", 1)
    out += struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths))
    out += struct.pack("<Q", len(doc_indices))
    for length in lengths:
        out += struct.pack("<i", length)
    pointer = 0
    for length in lengths:
        out += struct.pack("<q", pointer)
        pointer += length * itemsize
    for d in doc_indices:
        out += struct.pack("<q", d)
    if modes is not None:
        for m in modes:
            out += struct.pack("<b", m)
    return out


@pytest.mark.parametrize("dtype,code,fmt", [(numpy.uint16, 8, "<H"), (numpy.int32, 4, "<i")])
def test_builder_writes_the_documented_bytes(tmp_path, dtype, code, fmt):
    prefix = str(tmp_path / "ds")
    write_indexed(prefix, DOCUMENTS, dtype=dtype)
    lengths, doc_indices = [3, 1, 5], [0, 2, 2, 3]
    expected_idx = hand_written_index(lengths, doc_indices, code, numpy.dtype(dtype).itemsize)
    assert read_file(prefix + ".idx") == expected_idx
    assert len(expected_idx) == 34 + 12 * 3 + 8 * 4
    tokens = [t for doc in DOCUMENTS for seq in doc for t in seq]
    assert read_file(prefix + ".bin") == b"".join(struct.pack(fmt, t) for t in tokens)


def test_reader_parses_a_hand_written_index(tmp_path):
    prefix = str(tmp_path / "hand")
    lengths, doc_indices = [2, 4, 1], [0, 1, 3]
    tokens = [100, 101, 7, 8, 9, 10, 65535]
    with open(prefix + ".idx", "wb") as f:
        f.write(hand_written_index(lengths, doc_indices, 8, 2))
    with open(prefix + ".bin", "wb") as f:
        f.write(b"".join(struct.pack("<H", t) for t in tokens))
    ds = IndexedDataset(prefix)
    assert len(ds) == 3 and ds.dtype == numpy.uint16
    assert ds.sequence_lengths.tolist() == lengths
    assert ds.document_indices.tolist() == doc_indices
    assert ds[0].tolist() == [100, 101] and ds[2].tolist() == [65535]
    assert [s.tolist() for s in ds[0:2]] == [[100, 101], [7, 8, 9, 10]]
    assert ds.get(1, offset=1, length=2).tolist() == [8, 9]
    assert ds.get(1, offset=2).tolist() == [9, 10]
    with pytest.raises(ValueError, match="contiguous"):
        ds[0:3:2]
    # Legacy names and pickling (DataLoader workers reopen the files).
    assert ds.sizes.tolist() == lengths and ds.doc_idx.tolist() == doc_indices
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[1].tolist() == [7, 8, 9, 10]
    no_mmap = IndexedDataset(prefix, mmap=False)
    assert no_mmap.get(1, offset=1, length=3).tolist() == [8, 9, 10]
    assert IndexedDataset.exists(prefix) and not IndexedDataset.exists(prefix + "x")


def test_multimodal_modes_follow_document_indices(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32, multimodal=True)
    builder.add_item([1, 2], mode=3)
    builder.add_item([4], mode=1)
    builder.end_document()
    builder.finalize(prefix + ".idx")
    assert read_file(prefix + ".idx") == hand_written_index([2, 1], [0, 2], 4, 4, modes=[3, 1])
    ds = IndexedDataset(prefix, multimodal=True)
    sequence, mode = ds[0]
    assert sequence.tolist() == [1, 2] and mode == 3
    assert ds.sequence_modes.tolist() == [3, 1]


def test_dtype_codes_and_optimal_dtype():
    assert [(d.name, d.value) for d in DType] == [("uint8", 1), ("int8", 2), ("int16", 3), ("int32", 4),
                                                  ("int64", 5), ("float64", 6), ("float32", 7), ("uint16", 8)]
    assert DType.optimal_dtype(65499) == numpy.uint16
    assert DType.optimal_dtype(65500) == numpy.int32
    assert DType.optimal_dtype(None) == numpy.int32
    assert DType.code_from_dtype(numpy.uint16) == 8 and DType.size(8) == 2


def test_add_document_add_index_and_spilling_match_one_pass(tmp_path, monkeypatch):
    """Merging shards and spilling the index to disk give the bytes of one in-memory build."""
    docs = [[[i, i + 1, i + 2][: 1 + i % 3] for _ in range(1 + i % 2)] for i in range(40)]
    whole = str(tmp_path / "whole")
    write_indexed(whole, docs)

    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    write_indexed(first, docs[:15])
    builder = IndexedDatasetBuilder(second + ".bin", dtype=numpy.uint16)
    for doc in docs[15:]:
        builder.add_document(numpy.concatenate([numpy.asarray(s) for s in doc]), [len(s) for s in doc])
    builder.finalize(second + ".idx")

    real_init = idx_mod._SpillingArray.__init__
    monkeypatch.setattr(idx_mod._SpillingArray, "__init__",
                        lambda self, dtype, directory, chunk=4: real_init(self, dtype, directory, chunk=4))
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", dtype=numpy.uint16)
    builder.add_index(first)
    builder.add_index(second)
    builder.finalize(merged + ".idx")
    assert read_file(merged + ".idx") == read_file(whole + ".idx")
    assert read_file(merged + ".bin") == read_file(whole + ".bin")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".index-spill")]


def test_builder_rejects_tokens_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="do not fit the uint16"):
        builder.add_item(numpy.array([1, 70000], dtype=numpy.int64))
    other = str(tmp_path / "int32")
    write_indexed(other, DOCUMENTS, dtype=numpy.int32)
    with pytest.raises(ValueError, match="int32 but this builder writes uint16"):
        builder.add_index(other)


def _corrupt(tmp_path, mutate):
    prefix = str(tmp_path / "bad")
    write_indexed(prefix, DOCUMENTS)
    data = bytearray(read_file(prefix + ".idx"))
    data = mutate(data)
    with open(prefix + ".idx", "wb") as f:
        f.write(bytes(data))
    return prefix


@pytest.mark.parametrize("mutate,message", [
    (lambda d: b"NOTMAGIC!" + d[9:], "is not a Megatron MMIDIDX index"),
    (lambda d: b"TNTIDX\x00\x00" + d[8:], "legacy 'lazy'/'cached'"),
    (lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], "index version 2"),
    (lambda d: d[:17] + bytes([9]) + d[18:], "unknown token dtype code 9"),
    (lambda d: d[:-5], "is truncated"),
    (lambda d: d[:20], "is truncated"),
    (lambda d: d[:5], "is truncated"),
    (lambda d: d + b"\x00" * 7, "more than its header declares"),
    (lambda d: d[:-8] + struct.pack("<q", 7), "document_indices must run from 0"),
])
def test_reader_errors_name_the_file_and_the_problem(tmp_path, mutate, message):
    prefix = _corrupt(tmp_path, mutate)
    with pytest.raises(IndexFormatError) as error:
        IndexedDataset(prefix)
    assert message in str(error.value) and get_idx_path(prefix) in str(error.value)


def test_bin_shorter_than_index_and_missing_files(tmp_path):
    prefix = str(tmp_path / "short")
    write_indexed(prefix, DOCUMENTS)
    with open(get_bin_path(prefix), "r+b") as f:
        f.truncate(10)
    with pytest.raises(IndexFormatError, match="shorter than its index claims"):
        IndexedDataset(prefix)
    with pytest.raises(FileNotFoundError, match="without the extension"):
        IndexedDataset(str(tmp_path / "nothing"))
    os.remove(get_bin_path(prefix))
    with pytest.raises(FileNotFoundError, match="short.bin does not exist"):
        IndexedDataset(prefix)


def test_empty_dataset_round_trips(tmp_path):
    prefix = str(tmp_path / "empty")
    write_indexed(prefix, [])
    assert read_file(prefix + ".idx") == hand_written_index([], [0], 8, 2)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
