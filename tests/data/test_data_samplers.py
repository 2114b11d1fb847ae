"""Samplers resume exactly from consumed_samples; data loaders and iterators from an argparse-like namespace."""
from itertools import islice
from types import SimpleNamespace

import pytest
import torch

from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler, MegatronPretrainingSampler, build_pretraining_data_loader)


def batches(sampler, n=None):
    return list(islice(iter(sampler), n))


def test_single_sampler_by_hand_and_resume():
    ranks = [MegatronPretrainingSampler(20, 0, 2, r, 2) for r in range(2)]
    assert batches(ranks[0]) == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]]
    assert batches(ranks[1]) == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]
    for r in range(2):  # resuming after two global batches continues the same stream
        assert batches(MegatronPretrainingSampler(20, 8, 2, r, 2)) == batches(ranks[r])[2:]
    assert batches(MegatronPretrainingSampler(21, 16, 2, 0, 2, drop_last=False)) == [[16, 17], [20]]
    with pytest.raises(ValueError, match="no samples left to consume: 20, 20"):
        MegatronPretrainingSampler(20, 20, 2, 0, 2)
    with pytest.raises(ValueError, match="data_parallel_rank should be smaller"):
        MegatronPretrainingSampler(20, 0, 2, 2, 2)


@pytest.mark.parametrize("sharding", [True, False])
def test_cyclic_sampler_permutes_per_epoch_and_resumes(sharding):
    total, mbs, dp = 22, 2, 2  # 2 samples beyond the last full global batch are never used

    def sampler(rank, consumed):
        return MegatronPretrainingRandomSampler(None, total, consumed, mbs, rank, dp, data_sharding=sharding)

    epoch0 = [batches(sampler(r, 0), 5) for r in range(dp)]
    generator = torch.Generator()
    generator.manual_seed(0)
    if sharding:  # rank r shuffles its own bucket [10 r, 10 r + 10)
        perm = torch.randperm(10, generator=generator).tolist()
        assert sum(epoch0[1], []) == [10 + x for x in perm]
    else:  # one permutation of 22 samples, dealt to ranks alternately
        perm = torch.randperm(22, generator=generator).tolist()
        assert sum(epoch0[1], []) == perm[1::2][:10]
    flat = sum(epoch0[0] + epoch0[1], [])
    assert len(set(flat)) == 20 and max(flat) < total
    # Resume mid-epoch (3 global batches = 12 samples consumed) and across the epoch boundary.
    for rank in range(dp):
        uninterrupted = batches(sampler(rank, 0), 8)
        assert batches(sampler(rank, 12), 5) == uninterrupted[3:8]
        # The next epoch (20 samples consumed) draws a new permutation, seeded with the epoch number.
        generator.manual_seed(1)
        if sharding:
            expected = [10 * rank + x for x in torch.randperm(10, generator=generator).tolist()]
        else:
            expected = torch.randperm(22, generator=generator).tolist()[rank::2][:10]
        next_epoch = batches(sampler(rank, 20), 5)
        assert sum(next_epoch, []) == expected and next_epoch != uninterrupted[:5]


def test_data_loader_from_args_resumes_and_uses_workers():
    dataset = list(range(100, 140))
    args = SimpleNamespace(dataloader_type="single", micro_batch_size=4, num_workers=0)
    loader = build_pretraining_data_loader(dataset, 0, args)
    first = [b.tolist() for b in islice(iter(loader), 4)]
    assert first[0] == [100, 101, 102, 103]
    resumed = build_pretraining_data_loader(dataset, 8, args)
    assert next(iter(resumed)).tolist() == first[2]
    args.num_workers = 1
    assert [b.tolist() for b in islice(iter(build_pretraining_data_loader(dataset, 0, args)), 4)] == first
    args.dataloader_type, args.num_workers = "cyclic", 0
    cyclic = [b.tolist() for b in build_pretraining_data_loader(dataset, 0, args)]
    assert sorted(sum(cyclic, [])) == dataset
    args.dataloader_type = "external"
    with pytest.raises(ValueError, match="--dataloader-type 'external' is not supported"):
        build_pretraining_data_loader(dataset, 0, args)
    assert build_pretraining_data_loader(None, 0, args) is None


def test_iterators_for_mock_gpt_data(capsys):
    from megatron.training import datasets_provider

    args = SimpleNamespace(
        tokenizer_type="NullTokenizer", vocab_size=500, rank=0, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, mock_data=True, data_path=None, split="98,1,1", seq_length=16, seed=7,
        data_cache_path=None, reset_position_ids=False, reset_attention_mask=True, eod_mask_loss=True,
        train_iters=10, global_batch_size=4, micro_batch_size=2, eval_interval=5, eval_iters=2, num_workers=0,
        dataloader_type="single", iteration=2, consumed_train_samples=0, consumed_valid_samples=0)
    train, valid, test = datasets_provider.build_train_valid_test_data_iterators(
        datasets_provider.gpt_train_valid_test_datasets_provider, args)
    batch = next(train)
    assert batch["tokens"].shape == (2, 16) and batch["attention_mask"].shape == (2, 1, 16, 16)
    assert args.consumed_train_samples == 8  # iteration 2 x global batch 4 (old checkpoints)
    assert args.do_train and args.do_valid and args.do_test
    out = capsys.readouterr().out
    assert "    train:      40" in out and "    validation: 24" in out and "    test:       8" in out
    assert "> building train, validation, and test datasets for GPT ..." in out
    assert datasets_provider.get_train_valid_test_num_samples(args) == [40, 24, 8]


def _iterators_under_model_parallelism():
    import torch

    from megatron.core import parallel_state
    from megatron.training import datasets_provider

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=3)
    args = SimpleNamespace(
        tokenizer_type="NullTokenizer", vocab_size=500, rank=torch.distributed.get_rank(),
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=2, mock_data=True, data_path=None,
        split="98,1,1", seq_length=256, seed=3, data_cache_path=None, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, train_iters=4, global_batch_size=2, micro_batch_size=2,
        eval_interval=2, eval_iters=1, num_workers=0, dataloader_type="single", iteration=0,
        consumed_train_samples=0, consumed_valid_samples=0)
    train, valid, test = datasets_provider.build_train_valid_test_data_iterators(
        datasets_provider.gpt_train_valid_test_datasets_provider, args)
    first = next(train)["tokens"].tolist() if train is not None else None
    return train is not None, (args.do_train, args.do_valid, args.do_test), first


def test_only_tensor_parallel_rank_0_of_each_stage_reads_data():
    from helpers.dist_harness import run_distributed

    results = run_distributed(_iterators_under_model_parallelism, 6, timeout=150)
    # Pipeline stage s holds ranks 2s (tensor rank 0) and 2s + 1. Every stage's TP rank 0 reads the batch
    # (middle stages need attention masks too); the other TP ranks receive it by broadcast.
    assert [r[0] for r in results] == [True, False, True, False, True, False]
    assert all(r[1] == (True, True, True) for r in results)  # flags reach every rank
    assert results[0][2] == results[2][2] == results[4][2] and results[1][2] is None
