"""tools/preprocess_data.py and tools/merge_datasets.py: round trips for every tokenizer, Megatron's names and
progress line, parallel runs equal to a serial run byte for byte, malformed input, bounded memory."""
import json
import os
import re
import shutil
import subprocess
import sys
import unicodedata

import numpy
import pytest

from helpers.data_support import (
    CORPUS, GPT2_MERGES, GPT2_VOCAB, REPO, read_file, sample_texts, tokenizer_args, tokenizer_flags, write_jsonl)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.tokenizer import build_tokenizer
from tools import merge_datasets, preprocess_data


def documents(prefix):
    """Per document, the list of its sequences (lists of ids)."""
    ds = IndexedDataset(prefix)
    bounds = ds.document_indices.tolist()
    return [[ds[i].tolist() for i in range(bounds[d], bounds[d + 1])] for d in range(len(bounds) - 1)]


def run(tmp_path, input_path, name, *extra, tokenizer="GPT2BPETokenizer", workers=1, hf_path=None):
    prefix = str(tmp_path / name)
    rc = preprocess_data.main(["--input", input_path, "--output-prefix", prefix, "--workers", str(workers),
                               *tokenizer_flags(tokenizer, hf_path), *extra])
    return rc, prefix


def _strip_accents(text):
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                                            "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                                            "HuggingFaceTokenizer", "NullTokenizer"])
def test_text_to_bin_idx_to_text_round_trip(tmp_path, tokenizer_type):
    texts = sample_texts(30, max_chars=2000)
    if tokenizer_type == "BertWordPieceCase":
        texts = [t.lower() for t in texts]  # the shipped WordPiece vocabulary is lower-case
    if tokenizer_type == "NullTokenizer":
        texts = [" ".join(str((7 * i + j) % 1000) for j in range(1 + i % 17)) for i in range(30)]
    hf_path = None
    if tokenizer_type == "HuggingFaceTokenizer":
        from megatron.tokenizer.gpt2_bpe import build_byte_level_bpe, load_gpt2_merges, load_gpt2_vocab

        hf_path = str(tmp_path / "tokenizer.json")
        build_byte_level_bpe(load_gpt2_vocab(GPT2_VOCAB), load_gpt2_merges(GPT2_MERGES)).save(hf_path)
    source = write_jsonl(str(tmp_path / "docs.jsonl"), texts)
    append_eod = [] if tokenizer_type.startswith("Bert") else ["--append-eod"]
    rc, prefix = run(tmp_path, source, "out", *append_eod, tokenizer=tokenizer_type, hf_path=hf_path)
    assert rc == 0
    tokenizer = build_tokenizer(tokenizer_args(tokenizer_type, tokenizer_model=hf_path or tokenizer_args(
        tokenizer_type).tokenizer_model))
    docs = documents(prefix + "_text_document")
    assert len(docs) == len(texts)
    dtype = IndexedDataset(prefix + "_text_document").dtype
    assert dtype == (numpy.uint16 if tokenizer.vocab_size < 65500 else numpy.int32)
    for text, sequences in zip(texts, docs):
        assert len(sequences) == 1  # one sequence per document without --split-sentences
        ids = sequences[0]
        if append_eod:
            assert ids[-1] == tokenizer.eod
            ids = ids[:-1]
        decoded = tokenizer.detokenize(ids)
        if tokenizer_type.startswith("Bert"):
            assert tokenizer.vocab["[UNK]"] not in ids
            assert "".join(decoded.split()) == "".join(_strip_accents(text.lower()).split())
        else:
            assert decoded == text


def test_sentences_keys_empty_documents_and_eod(tmp_path):
    records = [
        {"text": "First sentence here. Second one follows! And a third one.", "title": "One title."},
        {"text": "", "title": "Empty body."},
        {"text": ["Pre-split one.", "", "Pre-split two."], "title": "Listed."},
    ]
    source = str(tmp_path / "docs.jsonl")
    with open(source, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    rc, prefix = run(tmp_path, source, "out", "--json-keys", "text", "title", "--split-sentences", "--append-eod")
    assert rc == 0
    tokenizer = build_tokenizer(tokenizer_args("GPT2BPETokenizer"))
    text_docs = documents(prefix + "_text_sentence")
    titles = documents(prefix + "_title_sentence")
    assert len(text_docs) == len(titles) == 3
    eod = tokenizer.eod
    # Three sentences; the EOD is part of the last sentence of the document.
    assert [tokenizer.detokenize(s) for s in text_docs[0][:2]] == ["First sentence here.", "Second one follows!"]
    assert text_docs[0][2][-1] == eod and tokenizer.detokenize(text_docs[0][2][:-1]) == "And a third one."
    assert text_docs[1] == []  # an empty document keeps its boundary and gets no EOD
    assert [tokenizer.detokenize(s) for s in text_docs[2]] == ["Pre-split one.", "Pre-split two." + "<|endoftext|>"]
    assert IndexedDataset(prefix + "_text_sentence").document_indices.tolist() == [0, 3, 3, 5]
    assert tokenizer.detokenize(titles[1][0]) == "Empty body.<|endoftext|>"


@pytest.fixture
def small_blocks(monkeypatch):
    # Many blocks from a small file, so that the worker pool and its window really get exercised.
    monkeypatch.setattr(preprocess_data, "BLOCK_BYTES", 6000)


def test_parallel_runs_equal_a_serial_run_byte_for_byte(tmp_path, small_blocks):
    texts = sample_texts(120, max_chars=1500)
    paths = {}
    for name in ("serial", "pool", "sequential_partitions", "round_robin"):
        os.makedirs(tmp_path / name)
        paths[name] = write_jsonl(str(tmp_path / name / "docs.jsonl"), texts)
    flags = ["--append-eod"]
    _, serial = run(tmp_path / "serial", paths["serial"], "out", *flags, workers=1)
    _, pool = run(tmp_path / "pool", paths["pool"], "out", *flags, workers=2)
    _, partitioned = run(tmp_path / "sequential_partitions", paths["sequential_partitions"], "out", *flags,
                         "--partitions", "2", "--keep-sequential-samples", workers=2)
    _, round_robin = run(tmp_path / "round_robin", paths["round_robin"], "out", *flags, "--partitions", "2",
                         workers=2)
    for other in (pool, partitioned):
        for ext in (".bin", ".idx"):
            assert read_file(other + "_text_document" + ext) == read_file(serial + "_text_document" + ext)
    # Megatron's partition files and per-partition outputs are next to the input and the output.
    assert os.path.isfile(tmp_path / "round_robin" / "docs_0.jsonl")
    assert os.path.isfile(str(tmp_path / "round_robin" / "out_1_text_document.idx"))
    # Without --keep-sequential-samples lines are dealt round-robin: even lines first, then odd lines.
    serial_docs = documents(serial + "_text_document")
    assert documents(round_robin + "_text_document") == serial_docs[0::2] + serial_docs[1::2]


def test_malformed_line_reports_its_number_and_keeps_earlier_documents(tmp_path, small_blocks, capsys):
    texts = sample_texts(12, max_chars=1500)
    lines = [json.dumps({"text": t}) for t in texts[:2]] + [""] + [json.dumps({"text": t}) for t in texts[2:6]]
    lines += ['{"text": "oops, no closing brace"'] + [json.dumps({"text": t}) for t in texts[6:]]
    source = str(tmp_path / "docs.jsonl")
    with open(source, "w") as f:
        f.write("\n".join(lines) + "\n")
    rc, prefix = run(tmp_path, source, "out", "--append-eod", workers=2)
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{source}:8: malformed JSON line" in err and "The 6 documents before it were written" in err
    good = write_jsonl(str(tmp_path / "good.jsonl"), texts[:6])
    _, expected = run(tmp_path, good, "expected", "--append-eod")
    assert read_file(prefix + "_text_document.partial.idx") == read_file(expected + "_text_document.idx")
    assert read_file(prefix + "_text_document.partial.bin") == read_file(expected + "_text_document.bin")

    with open(source, "w") as f:
        f.write(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text key"}) + "\n")
    rc, _ = run(tmp_path, source, "missing_key")
    assert rc == 1 and f"{source}:2: bad JSON record: no key 'text' (--json-keys)" in capsys.readouterr().err
    with open(source, "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "fine"}\n{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    rc, prefix = run(tmp_path, source, "latin1")
    assert rc == 1 and f"{source}:3: not valid UTF-8" in capsys.readouterr().err
    assert len(IndexedDataset(prefix + "_text_document.partial")) == 2


def test_command_line_names_progress_line_and_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    prefix = str(tmp_path / "stdlib")
    head = str(tmp_path / "head.jsonl.gz")
    import gzip

    with gzip.open(CORPUS, "rb") as src, gzip.open(head, "wb") as dst:
        for _ in range(25):
            dst.write(src.readline())
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", head, "--output-prefix",
           prefix, "--workers", "2", "--log-interval", "10", "--append-eod", *tokenizer_flags("GPT2BPETokenizer")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"Opening {head}" in done.stdout and "Time to startup:" in done.stdout
    progress = [line for line in done.stderr.splitlines() if line.startswith("Processed")]
    number = r"\d+(\.\d+)?(e[-+]?\d+)?"
    assert [line.split()[1] for line in progress] == ["10", "20"]
    assert all(re.fullmatch(rf"Processed \d+ documents \({number} docs/s, {number} MB/s\)\.", line) for line in progress)
    assert len(IndexedDataset(prefix + "_text_document")) == 25

    bad = str(tmp_path / "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"text": "ok"}\n[broken\n')
    cmd[cmd.index(head)] = bad
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and f"error: {bad}:2: malformed JSON line" in done.stderr
    cmd[cmd.index("--workers") + 1] = "3"
    odd = subprocess.run(cmd + ["--partitions", "2"], env=env, capture_output=True, text=True, timeout=120)
    assert odd.returncode == 2 and "--workers (3) must be a multiple of --partitions (2)" in odd.stderr


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "BertWordPieceLowerCase"])
def test_preprocessing_never_imports_torch(tmp_path, tokenizer_type):
    """Start-up is most of a small preprocessing run, and importing torch costs about a second: the tool, the
    tokenizers and the indexed-dataset format stay torch-free (megatron.core loads its top-level names lazily)."""
    data = str(tmp_path / "docs.jsonl")
    write_jsonl(data, sample_texts(20))
    argv = ["--input", data, "--output-prefix", str(tmp_path / "out"), "--workers", "2", "--append-eod",
            *tokenizer_flags(tokenizer_type)]
    script = ("import sys\nfrom tools import preprocess_data\nrc = preprocess_data.main(sys.argv[1:])\n"
              "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
              "print('torch modules:', len(loaded), loaded[:3])\nsys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", script, *argv], env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch modules: 0 []" in done.stdout, done.stdout
    assert len(IndexedDataset(str(tmp_path / "out_text_document"))) == 20


def test_merge_datasets_equals_one_preprocessing_run(tmp_path):
    texts = sample_texts(40, max_chars=1200)
    shards = tmp_path / "shards"
    os.makedirs(shards)
    _, first = run(shards, write_jsonl(str(tmp_path / "a.jsonl"), texts[:25]), "a", "--append-eod")
    _, second = run(shards, write_jsonl(str(tmp_path / "b.jsonl"), texts[25:]), "b", "--append-eod")
    _, whole = run(tmp_path, write_jsonl(str(tmp_path / "all.jsonl"), texts), "all", "--append-eod")
    merged = str(tmp_path / "merged_text_document")
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", merged]) == 0
    assert read_file(merged + ".idx") == read_file(whole + "_text_document.idx")
    assert read_file(merged + ".bin") == read_file(whole + "_text_document.bin")
    os.remove(second + "_text_document.bin")
    assert merge_datasets.main(["--input", str(shards), "--output-prefix", merged]) == 1
    shutil.rmtree(shards)


def test_reading_is_streamed_with_a_bounded_window(tmp_path, monkeypatch):
    """No more than 2 * workers + 1 blocks are in flight, whatever the input size."""
    from tools.preprocess_encoder import read_line_blocks

    lines = [json.dumps({"text": f"line {i}"}) + "\n" for i in range(1000)]
    source = str(tmp_path / "many.jsonl")
    with open(source, "w") as f:
        f.writelines(lines)
    with open(source, "rb") as f:
        blocks = list(read_line_blocks(f, 300))
    counts = [blob.count(b"\n") for _, blob in blocks]
    assert sum(counts) == 1000 and max(len(blob) for _, blob in blocks) < 300 + 30
    assert all(blob.endswith(b"\n") for _, blob in blocks)  # whole lines only
    assert [first for first, _ in blocks][:3] == [1, 1 + counts[0], 1 + counts[0] + counts[1]]

    class CountingPool:
        def __init__(self):
            self.outstanding = self.peak = 0

        def apply_async(self, fn, args):
            self.outstanding += 1
            self.peak = max(self.peak, self.outstanding)
            pool = self

            class Result:
                def get(self):
                    pool.outstanding -= 1
                    return fn(*args)
            return Result()

    args = preprocess_data.get_args(["--input", source, "--output-prefix", "x", "--workers", "2",
                                     *tokenizer_flags("GPT2BPETokenizer")])
    partition = preprocess_data.Partition(args, 2)
    encoder = preprocess_data.Encoder(args)
    encoder.initializer()
    monkeypatch.setattr(preprocess_data, "BLOCK_BYTES", 300)
    pool = CountingPool()
    with open(source, "rb") as f:
        results = list(partition._encoded_blocks(f, pool, encoder))
    assert sum(len(r.chars_per_doc) for r in results) == 1000 and pool.peak == 5


def test_rule_based_sentence_splitter():
    from tools.preprocess_encoder import _RuleSentenceSplitter

    text = 'Alpha beta. Gamma delta!\n\nNew paragraph, e.g. this one, by Dr. Smith. "Quoted?" Yes.\nlower case. End'
    assert _RuleSentenceSplitter(False).tokenize(text) == [
        "Alpha beta.", "Gamma delta!", "New paragraph, e.g. this one, by Dr. Smith.", '"Quoted?"',
        "Yes.\nlower case.", "End"]
    # --keep-newlines keeps the whitespace after each sentence, so sentences concatenate back to the text.
    kept = _RuleSentenceSplitter(True).tokenize(text)
    assert "".join(kept) == text and kept[1] == "Gamma delta!\n\n"
