"""BlendedDataset and the builder's blends: weights, the 0.5 % surplus, size-weighted blends, per-split blends."""
import math

import numpy
import pytest

from helpers.data_support import tokenizer_args, write_indexed
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix, parse_and_normalize_split)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split, get_blend_from_list
from megatron.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    out = []
    for k, num_docs in enumerate([60, 40, 25]):
        prefix = str(root / f"part{k}_text_document")
        # Dataset k's tokens are k * 1000 + position, so every sample says where it came from.
        write_indexed(prefix, [[[k * 1000 + d % 997, k * 1000 + (d + 1) % 997, k * 1000 + 7]] for d in range(num_docs)])
        out.append(prefix)
    return out


def config(**fields):
    base = dict(random_seed=5, sequence_length=4, tokenizer=build_tokenizer(tokenizer_args("NullTokenizer")),
                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    base.update(fields)
    return GPTDatasetConfig(**base)


def test_weighted_blend_requests_the_surplus_and_follows_the_weights(prefixes):
    weights = [0.5, 0.3, 0.2]
    sizes = [200, 30, 10]
    cfg = config(blend=(prefixes, [5, 3, 2]), split="8,1,1")  # weights are normalised
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()
    for blended, size in [(train, 200), (valid, 30), (test, 10)]:
        assert isinstance(blended, BlendedDataset)
        # Size = sum of ceil(size * w); each component asked for ceil(ceil(size * w) * 1.005) samples.
        assert len(blended) == sum(math.ceil(size * w) for w in weights)
        for component, w in zip(blended.datasets, weights):
            assert component.num_samples == math.ceil(math.ceil(size * w) * 1.005)
    counts = numpy.bincount(train.dataset_index, minlength=3)
    assert numpy.all(numpy.abs(counts - numpy.array(weights) * len(train)) <= 1)
    # Items come from the component named by dataset_id, in the component's own order.
    for i in [0, 1, 2, 17, len(train) - 1]:
        item = train[i]
        d, s = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        assert item["dataset_id"] == d
        assert item["tokens"].tolist() == train.datasets[d][s]["tokens"].tolist()
        assert item["tokens"].min() >= d * 1000 and item["tokens"].max() < (d + 1) * 1000


def test_blend_without_weights_uses_dataset_sizes(prefixes):
    cfg = config(blend=(prefixes, None), split="1,0,0")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [50, None, None], lambda: True, cfg).build()
    assert valid is None and test is None
    lengths = [len(d) for d in train.datasets]
    assert all(d.num_samples is None for d in train.datasets)  # one pass over each
    assert train.weights == pytest.approx([n / sum(lengths) for n in lengths])
    assert len(train) == 50
    # With no size at all, every sample of every component is used exactly once.
    exhaustive = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()[0]
    assert len(exhaustive) == sum(lengths)
    assert numpy.bincount(exhaustive.dataset_index).tolist() == lengths


def test_per_split_blends(prefixes):
    cfg = config(blend_per_split=[([prefixes[0], prefixes[1]], [0.7, 0.3]), ([prefixes[2]], None), None])
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 6, 0], lambda: True, cfg).build()
    assert isinstance(train, BlendedDataset) and [d.dataset_path for d in train.datasets] == prefixes[:2]
    assert train.datasets[0].indices.tolist() == list(range(60))  # the whole dataset is the split
    assert isinstance(valid, GPTDataset) and valid.dataset_path == prefixes[2] and test is None


def test_blend_overrunning_a_component_is_a_clear_error(prefixes):
    cfg = config(blend=(prefixes, None), split="1,0,0")
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, cfg).build()[0].datasets
    with pytest.raises(ValueError, match="needs .* lower its weight"):
        BlendedDataset(datasets, [0.98, 0.01, 0.01], 1000, cfg)


def test_split_and_blend_parsing():
    assert parse_and_normalize_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("99") == [1.0, 0.0, 0.0]
    matrix = convert_split_vector_to_split_matrix([0.8, 0.2, 0.0])
    assert matrix[0] == (0, 0.8) and matrix[1] == pytest.approx((0.8, 1.0)) and matrix[2] is None
    assert convert_split_vector_to_split_matrix([0.5, 0.5, 0.0], [0.25, 0.5, 0.25]) == [(0, 0.25), (0.5, 0.75), None]
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert get_blend_from_list(["c"]) == (["c"], None)
    with pytest.raises(ValueError, match="--split is required"):
        config(blend=(["x"], None))
    with pytest.raises(ValueError, match="2 weights for 1 dataset prefixes"):
        config(blend=(["x"], [0.5, 0.5]), split="1")
    assert Split.valid.value == 1
