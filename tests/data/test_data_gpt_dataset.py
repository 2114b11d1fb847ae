"""GPTDataset: indices from megatron-core's recipe, sample contents from the flat token stream, masks,
splits, mock data, index caches (including concurrent builders on two simulated nodes)."""
import json
import os
import socket

import numpy
import pytest
import torch

from helpers.data_support import tokenizer_args, write_indexed
from helpers.dist_harness import run_distributed
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import (
    GPTDataset, GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset, _get_ltor_masks_and_position_ids)
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from megatron.tokenizer import build_tokenizer

LENGTHS = [5, 3, 8, 1, 6, 2, 7, 4, 9, 3]  # 48 tokens
EOD = 1000


def doc_tokens(d):
    return [d * 10 + i for i in range(LENGTHS[d])]


@pytest.fixture(scope="module")
def tiny_prefix(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("gpt") / "tiny_text_document")
    write_indexed(prefix, [[doc_tokens(d)] for d in range(len(LENGTHS))])
    return prefix


def make_config(tmp_path=None, **overrides):
    fields = dict(random_seed=1234, sequence_length=4, blend=(["unused"], None), split="1,0,0",
                  tokenizer=build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=EOD)),
                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                  path_to_cache=str(tmp_path) if tmp_path is not None else None)
    fields.update(overrides)
    return GPTDatasetConfig(**fields)


def expected_indices(num_epochs, separate, num_samples_first, total, seed=1234):
    """megatron-core's recipe: one RandomState, document shuffle(s) first, then sample shuffle(s)."""
    rs = numpy.random.RandomState(seed)
    docs = numpy.arange(len(LENGTHS), dtype=numpy.int32)
    if separate:
        first = numpy.tile(docs, num_epochs - 1)
        rs.shuffle(first)
        last = docs.copy()
        rs.shuffle(last)
        document_index = numpy.concatenate([first, last])
        shuffle = numpy.arange(num_samples_first, dtype=numpy.uint32)
        rs.shuffle(shuffle)
        rest = numpy.arange(num_samples_first, total, dtype=numpy.uint32)
        rs.shuffle(rest)
        return document_index, numpy.concatenate([shuffle, rest])
    document_index = numpy.tile(docs, num_epochs)
    rs.shuffle(document_index)
    shuffle = numpy.arange(total, dtype=numpy.uint32)
    rs.shuffle(shuffle)
    return document_index, shuffle


@pytest.mark.parametrize("num_samples,separate", [(30, True), (32, False)])
def test_indices_and_samples_follow_megatron_core(tiny_prefix, num_samples, separate):
    # 48 tokens per epoch, 4-token samples: 30 samples need (30*4+1)/48 -> 3 epochs. The first two epochs
    # give (96-1)//4 = 23 samples, so the last contributes 7 (< int(0.8 * 11) = 8: separated) for 30
    # samples, and 9 (not separated) for 32.
    config = make_config()
    dataset = GPTDataset(IndexedDataset(tiny_prefix), tiny_prefix, numpy.arange(10, dtype=numpy.int32), num_samples,
                         Split.train, config)
    total = (3 * 48 - 1) // 4
    document_index, shuffle_index = expected_indices(3, separate, 23, total)
    assert dataset.document_index.dtype == numpy.int32
    assert numpy.array_equal(dataset.document_index, document_index)
    assert dataset.shuffle_index.dtype == numpy.uint32
    assert numpy.array_equal(dataset.shuffle_index, shuffle_index)
    assert len(dataset) == total == dataset.sample_index.shape[0] - 1
    if separate:  # the final epoch is a permutation of the documents on its own
        assert sorted(dataset.document_index[-10:].tolist()) == list(range(10))
    # Sample s is stream[4s : 4s + 5] of the documents concatenated in document_index order, so
    # consecutive samples share exactly one token.
    stream = numpy.concatenate([doc_tokens(d) for d in document_index])
    for i in range(len(dataset)):
        s = int(shuffle_index[i])
        item = dataset[i]
        text = torch.cat([item["tokens"], item["labels"][-1:]])
        assert text.tolist() == stream[4 * s:4 * s + 5].tolist()
        assert item["labels"].tolist() == stream[4 * s + 1:4 * s + 5].tolist()


def test_masks_and_position_ids_by_hand():
    data = torch.tensor([5, 6, EOD, 7, 8, EOD, 9])
    attention, loss, positions = _get_ltor_masks_and_position_ids(data, EOD, True, True, True, True)
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert loss.tolist() == [1, 1, 0, 1, 1, 0, 1]
    allowed = torch.zeros(7, 7, dtype=torch.bool)  # block-diagonal causal: documents [0,3) [3,6) [6,7)
    for begin, end in [(0, 3), (3, 6), (6, 7)]:
        for q in range(begin, end):
            allowed[q, begin:q + 1] = True
    assert attention.shape == (1, 7, 7) and torch.equal(attention[0], ~allowed)  # True = masked
    attention, loss, positions = _get_ltor_masks_and_position_ids(data, EOD, False, False, False, False)
    assert attention is None and positions.tolist() == list(range(7)) and loss.tolist() == [1.0] * 7
    attention, _, _ = _get_ltor_masks_and_position_ids(data, EOD, False, False, False, True)
    assert torch.equal(attention[0], torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1))


def test_sample_dict_options(tiny_prefix, tmp_path):
    prefix = str(tmp_path / "eod_text_document")
    write_indexed(prefix, [[[1, 2, EOD]], [[3, 4, 5, EOD]], [[6, EOD]]])
    config = make_config(sequence_length=6, eod_mask_loss=True, reset_position_ids=True, create_attention_mask=False)
    dataset = GPTDataset(IndexedDataset(prefix), prefix, numpy.arange(3, dtype=numpy.int32), None, Split.train, config)
    assert len(dataset) == 1  # 9 tokens: (9 - 1) // 6
    item = dataset[0]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    tokens = item["tokens"].tolist()
    assert item["loss_mask"].tolist() == [0.0 if t == EOD else 1.0 for t in tokens]
    eod_at = tokens.index(EOD)
    assert item["position_ids"].tolist()[eod_at + 1] == 0
    padding = dataset[None]
    assert padding["loss_mask"].sum() == 0 and torch.equal(padding["tokens"], item["tokens"])


def test_num_epochs_and_splits_through_the_builder(tmp_path):
    prefix = str(tmp_path / "split_text_document")
    write_indexed(prefix, [[[d, d + 1, d + 2]] for d in range(1000)])
    config = make_config(blend=([prefix], None), split="969,30,1", sequence_length=8)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [100, 20, 5], lambda: True, config).build()
    # GPT splits by sequence: round(0.969 * 1000) = 969 and round(0.999 * 1000) = 999.
    assert (train.indices[0], train.indices[-1], len(train.indices)) == (0, 968, 969)
    assert (valid.indices[0], valid.indices[-1], len(valid.indices)) == (969, 998, 30)
    assert test.indices.tolist() == [999]
    # The test split has 3 tokens per epoch: 5 samples of 8 tokens need ceil(41 / 3) = 14 epochs.
    assert len(test.document_index) == 14 and len(test) == (14 * 3 - 1) // 8
    assert len(train) == (2907 - 1) // 8  # one epoch: 969 * 3 tokens

    tiny = str(tmp_path / "tiny37_text_document")
    write_indexed(tiny, [[[1, 2]] for _ in range(37)])
    config = make_config(blend=([tiny], None), split="949,50,1")
    with pytest.raises(ValueError, match="test split of .*tiny37_text_document has no tokens"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 2, 1], lambda: True, config).build()


def test_mock_dataset():
    big_vocab = build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=50000))
    config = make_config(blend=None, split="990,9,1", sequence_length=16, tokenizer=big_vocab)
    assert config.mock
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [40, 8, 4], lambda: True, config).build()
    low = train.dataset
    expected_lengths = numpy.random.default_rng(seed=0).integers(1, 4096, size=100000, dtype=numpy.int32)
    assert isinstance(low, MockGPTLowLevelDataset) and numpy.array_equal(low.sequence_lengths, expected_lengths)
    assert low[0].tolist() == list(range(1, int(expected_lengths[0]))) + [50000]  # megatron-core's documents
    item = train[0]
    assert item["tokens"].shape == (16,) and item["attention_mask"].shape == (1, 16, 16)
    assert len(valid) >= 8 and len(test) >= 4
    # A vocabulary smaller than the mock documents: ids wrap within [1, vocab - 2], eod stays the last id.
    small = make_config(blend=None, split="1,0,0", sequence_length=512,
                        tokenizer=build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=119)))
    tiny_vocab = BlendedMegatronDatasetBuilder(MockGPTDataset, [4, None, None], lambda: True, small).build()[0]
    document = tiny_vocab.dataset[0]
    assert document[:-1].max() == 118 and document[:-1].min() == 1 and document[-1] == 119
    assert tiny_vocab[0]["tokens"].max() < 120


def test_index_cache_is_written_once_and_reused(tiny_prefix, tmp_path):
    config = make_config(tmp_path)
    args = (IndexedDataset(tiny_prefix), tiny_prefix, numpy.arange(10, dtype=numpy.int32), 30, Split.train, config)
    first = GPTDataset(*args)
    assert first.built_anew_on_cache_miss
    stem = f"{first.unique_description_hash}-GPTDataset-train-"
    names = sorted(os.listdir(tmp_path))
    assert names == [stem + s for s in ("description.txt", "document_index.npy", "sample_index.npy",
                                        "shuffle_index.npy")]
    description = json.loads((tmp_path / (stem + "description.txt")).read_text())
    assert description["class"] == "GPTDataset" and description["num_samples"] == 30
    assert description["index_split"] == "train" and description["tokenizer"]["class"] == "_NullTokenizer"
    second = GPTDataset(*args)
    assert not second.built_anew_on_cache_miss
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert numpy.array_equal(getattr(first, name), getattr(second, name))
    # Without --data-cache-path the cache sits under <prefix>/cache/GPTDataset_indices.
    default = GPTDataset(IndexedDataset(tiny_prefix), tiny_prefix, numpy.arange(10, dtype=numpy.int32), 31,
                         Split.train, make_config())
    assert os.path.isfile(os.path.join(tiny_prefix, "cache", "GPTDataset_indices",
                                       f"{default.unique_description_hash}-GPTDataset-train-sample_index.npy"))


def test_a_stale_lock_is_broken(tiny_prefix, tmp_path):
    config = make_config(tmp_path)
    args = (IndexedDataset(tiny_prefix), tiny_prefix, numpy.arange(10, dtype=numpy.int32), 12, Split.train, config)
    probe = GPTDataset(*args)  # learn the file names, then pretend a crashed process holds the lock
    for name in os.listdir(tmp_path):
        os.remove(tmp_path / name)
    dead_pid = 2**22 + 12345
    (tmp_path / f"{probe.unique_description_hash}-GPTDataset-train-lock").write_text(
        f"{socket.gethostname()} {dead_pid} 0\n")
    rebuilt = GPTDataset(*args)
    assert rebuilt.built_anew_on_cache_miss and numpy.array_equal(rebuilt.shuffle_index, probe.shuffle_index)
    assert not [n for n in os.listdir(tmp_path) if n.endswith("lock")]


def _build_on_two_nodes(prefix, base_dir):
    """Ranks 0-1 share cache dir node0, ranks 2-3 node1; rank 3 builds no data."""
    rank = torch.distributed.get_rank()
    config = make_config(blend=([prefix], None), split="1,0,0",
                         path_to_cache=os.path.join(base_dir, f"node{rank // 2}"))
    torch.distributed.barrier()  # start together so that builders really race for the lock
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, [30, None, None], lambda: rank != 3, config).build()
    train = datasets[0]
    if train is None:
        return None
    return (bool(train.built_anew_on_cache_miss), train.shuffle_index.tolist(), train.document_index.tolist(),
            [train[i]["tokens"].tolist() for i in range(3)])


def test_caches_build_once_per_node_under_torch_distributed(tiny_prefix, tmp_path):
    results = run_distributed(_build_on_two_nodes, 4, tiny_prefix, str(tmp_path), timeout=90)
    assert results[3] is None
    assert [results[0][0], results[1][0]].count(True) == 1  # one builder on node0, the other rank reused
    assert results[2][0] is True  # the only builder on node1
    assert results[0][1:] == results[1][1:] == results[2][1:]
    for node in ("node0", "node1"):
        assert len([n for n in os.listdir(tmp_path / node) if n.endswith(".npy")]) == 3
        assert not [n for n in os.listdir(tmp_path / node) if "lock" in n or ".tmp-" in n]


def test_data_loader_workers_and_legacy_import_paths(tiny_prefix):
    from megatron.data import blendable_dataset, data_samplers, gpt_dataset, indexed_dataset

    assert gpt_dataset.GPTDataset is GPTDataset and indexed_dataset.MMapIndexedDataset is IndexedDataset
    assert blendable_dataset.BlendableDataset.__name__ == "BlendedDataset"
    assert data_samplers.MegatronPretrainingSampler.__module__ == "megatron.training.datasets.data_samplers"
    dataset = GPTDataset(IndexedDataset(tiny_prefix), tiny_prefix, numpy.arange(10, dtype=numpy.int32), 11,
                         Split.train, make_config())
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=1)  # pickles the dataset
    first = next(iter(loader))
    assert first["tokens"].tolist() == [dataset[i]["tokens"].tolist() for i in range(4)]
