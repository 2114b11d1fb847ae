"""Today's data flags, from the command line to the samples: --no-mmap-bin-files (file reads equal to mmap reads,
byte for byte), --data-cache-path (index caches land in that directory, named {md5}-GPTDataset-{split}-...),
--no-create-attention-mask-in-dataloader (no attention_mask key), --num-workers, --mock-data."""
import os

import numpy
import pytest
import torch
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.data_support import tokenizer_args, write_indexed

from megatron.core.datasets.indexed_dataset import FileBinReader, IndexedDataset, MMapBinReader
from megatron.tokenizer import build_tokenizer
from megatron.training.arguments import parse_args
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.datasets_provider import gpt_train_valid_test_datasets_provider
from megatron.training.errors import ConfigurationError

LENGTHS = [5, 3, 8, 1, 6, 2, 7, 4, 9, 3, 11, 6]


@pytest.fixture
def prefix(tmp_path):
    path = str(tmp_path / "data" / "tiny_text_document")
    os.makedirs(os.path.dirname(path))
    rng = numpy.random.default_rng(0)
    write_indexed(path, [[list(rng.integers(0, 500, size=n))] for n in LENGTHS])
    return path


def _datasets(flags, tokenizer, seq=4):
    args = validated(f"--seq-length {seq} --max-position-embeddings {seq} --split 8,1,1 " + flags)
    return args, gpt_train_valid_test_datasets_provider([20, 4, 4], args=args, tokenizer=tokenizer)


def test_no_mmap_bin_files_reads_equal_mmap_reads(clean_env, prefix):
    file_reads, mmap_reads = IndexedDataset(prefix, mmap=False), IndexedDataset(prefix, mmap=True)
    assert isinstance(file_reads.bin_reader, FileBinReader) and isinstance(mmap_reads.bin_reader, MMapBinReader)
    for i in range(len(LENGTHS)):
        assert file_reads[i].tobytes() == mmap_reads[i].tobytes()
        assert file_reads.get(i, offset=1, length=2).tobytes() == mmap_reads.get(i, offset=1, length=2).tobytes()

    tokenizer = build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=500))
    _, (train_file, _, _) = _datasets(f"--data-path {prefix} --no-mmap-bin-files", tokenizer)
    _, (train_mmap, _, _) = _datasets(f"--data-path {prefix}", tokenizer)
    assert train_file.dataset.mmap is False and train_mmap.dataset.mmap is True
    for i in range(len(train_file)):
        a, b = train_file[i], train_mmap[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_data_cache_path_holds_the_index_caches(clean_env, prefix, tmp_path):
    tokenizer = build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=500))
    cache = tmp_path / "my_cache"
    _datasets(f"--data-path {prefix} --data-cache-path {cache}", tokenizer)
    names = sorted(os.listdir(cache))
    for split in ("train", "valid", "test"):
        for suffix in ("description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"):
            assert sum(n.endswith(f"-GPTDataset-{split}-{suffix}") for n in names) == 1, names
    md5 = names[0].split("-")[0]
    assert len(md5) == 32 and all(c in "0123456789abcdef" for c in md5)
    assert not os.path.exists(os.path.join(os.path.dirname(prefix), "cache"))  # nothing next to the data


def test_attention_mask_in_dataloader_or_not(clean_env, prefix):
    tokenizer = build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=500))
    _, (with_mask, _, _) = _datasets(f"--data-path {prefix}", tokenizer)
    args, (without, _, _) = _datasets(f"--data-path {prefix} --no-create-attention-mask-in-dataloader "
                                      "--num-workers 1", tokenizer)
    assert set(with_mask[0]) == {"tokens", "labels", "loss_mask", "attention_mask", "position_ids"}
    assert set(without[0]) == {"tokens", "labels", "loss_mask", "position_ids"}
    mask = with_mask[0]["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (1, 4, 4)
    assert torch.equal(mask[0], torch.ones(4, 4).tril() < 0.5)  # True = masked (above the diagonal)
    args.consumed_train_samples = 0
    loader = build_pretraining_data_loader(without, 0, args)
    assert loader.num_workers == 1 and loader.persistent_workers
    batch = next(iter(loader))
    assert "attention_mask" not in batch and batch["tokens"].shape == (2, 4)


def test_reset_attention_mask_needs_the_mask(clean_env):
    with pytest.raises(ConfigurationError, match="--reset-attention-mask needs the attention mask"):
        validated("--mock-data --reset-attention-mask --no-create-attention-mask-in-dataloader")


def test_mock_data_and_defaults(clean_env):
    args = parse_args(argv=[])
    assert (args.mmap_bin_files, args.create_attention_mask_in_dataloader, args.num_workers,
            args.data_cache_path, args.mock_data) == (True, True, 2, None, False)
    tokenizer = build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=500))
    # Megatron's mock corpus: 100000 documents of 1..4095 tokens (a long sequence keeps the index small)
    _, (train, valid, _) = _datasets("--mock-data", tokenizer, seq=2048)
    assert type(train).__name__ == "MockGPTDataset" and len(train) >= 20
    assert train[0]["tokens"].shape == (2048,)


def test_no_mmap_reads_retry_after_10_20_40_seconds(prefix, monkeypatch):
    reader = IndexedDataset(prefix, mmap=False).bin_reader
    sleeps, real = [], FileBinReader._read_once
    failures = iter([OSError("stale file handle")] * 3)

    def flaky(self, *a):
        error = next(failures, None)
        if error is not None:
            raise error
        return real(self, *a)

    monkeypatch.setattr(FileBinReader, "_read_once", flaky)
    monkeypatch.setattr("megatron.core.datasets.indexed_format.time.sleep", sleeps.append)
    assert reader.read(numpy.uint16, 3, 0).tobytes() == IndexedDataset(prefix)[0][:3].tobytes()
    assert sleeps == [10, 20, 40]
    failures = iter([OSError("gone")] * 4)
    with pytest.raises(OSError, match="gone"):
        reader.read(numpy.uint16, 3, 0)
