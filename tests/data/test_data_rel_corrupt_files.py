"""Corrupt or mismatched dataset files fail when the datasets are opened — in ``initialize_megatron``, on every
rank, before any process group exists — with one ConfigurationError line naming the flag and the file."""
import struct
from types import SimpleNamespace

import numpy
import pytest
from helpers.data_support import GPT2_MERGES, GPT2_VOCAB

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.training import data_checks
from megatron.training.data_checks import check_data_files
from megatron.training.errors import ConfigurationError

DOCS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def build(prefix, docs=DOCS, dtype=numpy.uint16):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(numpy.array(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def patch(path, fn):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(bytes(fn(data)))


def _pointers_offset(n):
    return 34 + 4 * n  # header, then n int32 lengths, then n int64 pointers


def corruptions(tmp_path):
    """(name, prefix, substring of the error) for each damaged dataset."""
    cases = []

    def case(name, mutate_idx=None, mutate_bin=None, message=""):
        prefix = build(str(tmp_path / name))
        if mutate_idx:
            patch(prefix + ".idx", mutate_idx)
        if mutate_bin:
            patch(prefix + ".bin", mutate_bin)
        cases.append((name, prefix, message.format(p=prefix)))

    case("bad_magic", lambda d: b"NOTMAGIC!" + d[9:], message="{p}.idx is not a Megatron MMIDIDX index")
    case("wrong_version", lambda d: d[:9] + struct.pack("<Q", 3) + d[17:], message="{p}.idx has index version 3")
    case("bad_dtype", lambda d: d[:17] + bytes([42]) + d[18:], message="{p}.idx has unknown token dtype code 42")
    case("truncated_idx", lambda d: d[:-9], message="{p}.idx is truncated")
    case("truncated_bin", None, lambda d: d[:-3], message="{p}.bin is shorter than its index claims")
    case("empty_bin", None, lambda d: b"", message="{p}.bin is shorter than its index claims")
    # The middle document's pointer moved past the end of the .bin (the last one still fits).
    case("pointer_beyond_bin",
         lambda d: d[:_pointers_offset(3) + 8] + struct.pack("<q", 10_000) + d[_pointers_offset(3) + 16:],
         message="{p}.idx points beyond {p}.bin: sequence 1 spans bytes [10000, 10004)")
    # An .idx from one run next to the .bin of another (a longer one).
    mismatched = build(str(tmp_path / "mismatched"))
    other = build(str(tmp_path / "other"), DOCS + [[1, 2, 3]])
    with open(other + ".bin", "rb") as src, open(mismatched + ".bin", "wb") as dst:
        dst.write(src.read())
    cases.append(("mismatched_pair", mismatched, f"{mismatched}.bin does not match its index"))
    missing_bin = build(str(tmp_path / "missing_bin"))
    (tmp_path / "missing_bin.bin").unlink()
    cases.append(("missing_bin", missing_bin, f"data file {missing_bin}.bin does not exist"))
    return cases


def args_for(prefix, flag="data_path"):
    args = SimpleNamespace(mock_data=False, tokenizer_type="GPT2BPETokenizer", data_path=None, train_data_path=None,
                           valid_data_path=None, test_data_path=None)
    setattr(args, flag, [prefix])
    return args


def test_corrupt_files_fail_at_open_with_one_line_naming_the_file(tmp_path):
    cases = corruptions(tmp_path)
    for name, prefix, message in cases:
        with pytest.raises(ConfigurationError) as error:
            check_data_files(args_for(prefix), vocab_size=100)
        text = str(error.value)
        assert text.startswith(f"--data-path {prefix}: ") and message in text and "\n" not in text, (name, text)
    # the same through a per-split flag and inside a weighted blend
    good = build(str(tmp_path / "good"))
    args = args_for(good)
    args.data_path = ["0.7", good, "0.3", cases[0][1]]
    with pytest.raises(ConfigurationError, match=f"--data-path {cases[0][1]}: "):
        check_data_files(args, vocab_size=100)
    with pytest.raises(ConfigurationError, match=f"--valid-data-path {cases[1][1]}: "):
        check_data_files(args_for(cases[1][1], "valid_data_path"), vocab_size=100)
    check_data_files(args_for(good), vocab_size=100)  # the intact dataset opens
    assert len(cases) == 9


def test_token_ids_beyond_the_tokenizer_vocab(tmp_path, monkeypatch):
    prefix = build(str(tmp_path / "big_ids"), [[1, 2, 3], [4, 60000]])
    with pytest.raises(ConfigurationError) as error:
        check_data_files(args_for(prefix), vocab_size=50257)
    text = str(error.value)
    assert (f"{prefix}.bin holds token id 60000 but the tokenizer (--tokenizer-type GPT2BPETokenizer) has only 50257 "
            "ids: the data was preprocessed with another tokenizer") in text and "\n" not in text
    check_data_files(args_for(prefix), vocab_size=60001)
    # Large files are sampled at both ends (bounded time), and the message says so.
    with pytest.raises(ConfigurationError, match="checked the first and last"):
        check_data_files(args_for(prefix), vocab_size=50257, max_scan_bytes=4)
    assert data_checks.max_token_id.__defaults__[0] == data_checks.MAX_SCAN_BYTES


def test_initialize_megatron_checks_the_data_before_the_process_group(tmp_path, monkeypatch):
    """Through the real initialisation: a GPT-2 run on data whose ids exceed the GPT-2 vocab of this repo."""
    import torch

    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.initialize import initialize_megatron

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    prefix = build(str(tmp_path / "ids"), [[1, 2, 3], [60000, 4]])
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
            f"--micro-batch-size 1 --tokenizer-type GPT2BPETokenizer --vocab-file {GPT2_VOCAB} --merge-file "
            f"{GPT2_MERGES} --distributed-backend gloo --data-path {prefix}").split()
    try:
        with pytest.raises(ConfigurationError, match=f"{prefix}.bin holds token id 60000"):
            initialize_megatron(argv=argv)
        assert not torch.distributed.is_initialized()
    finally:
        destroy_global_vars()


def test_preprocess_failure_keeps_existing_output_and_marks_the_partial_one(tmp_path, capsys):
    """tools/preprocess_data.py: a malformed JSONL line is reported with file and line number; the output of an
    earlier successful run under the same prefix is left byte-identical; the failed run's documents are in
    ``<prefix>.partial.bin/.idx`` (a valid dataset); no temporary file is left behind."""
    import json
    import os

    from tools import preprocess_data

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(5)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "first"}) + "\n" + json.dumps({"text": "second"}) + "\n" + "{not json\n"
                   + json.dumps({"text": "fourth"}) + "\n")
    prefix = str(tmp_path / "out")
    flags = ["--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", GPT2_VOCAB,
             "--merge-file", GPT2_MERGES, "--workers", "1"]
    assert preprocess_data.main(["--input", str(good), *flags]) == 0
    out = prefix + "_text_document"
    before = {s: open(out + s, "rb").read() for s in (".bin", ".idx")}
    capsys.readouterr()
    assert preprocess_data.main(["--input", str(bad), *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {bad}:3: malformed JSON line (Expecting property name enclosed in double quotes: "
                   f"line 1 column 2 (char 1)). The 2 documents before it were written to {out}.partial.bin/.idx; "
                   "no existing output was replaced."] or (len(err) == 1 and f"{bad}:3: malformed JSON line" in err[0]
                                                          and f"{out}.partial.bin/.idx" in err[0]), err
    assert {s: open(out + s, "rb").read() for s in (".bin", ".idx")} == before
    assert len(IndexedDataset(out)) == 5 and len(IndexedDataset(out + ".partial")) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(["good.jsonl", "bad.jsonl", "out_text_document.bin",
                                                   "out_text_document.idx", "out_text_document.partial.bin",
                                                   "out_text_document.partial.idx"])
