"""Glue between the command-line arguments and megatron.core's datasets, with Megatron's function names.

The training loop calls ``build_train_valid_test_data_iterators(provider)``; ``provider`` is
``gpt_train_valid_test_datasets_provider`` or ``bert_train_valid_test_datasets_provider`` (what
pretrain_gpt.py / pretrain_bert.py pass). Every function takes ``args`` explicitly or falls back to the
global arguments; the tokenizer likewise falls back to the global one (or is built from ``args``).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

import torch

from megatron.core import device, parallel_state
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.fake_process_group import is_fake_process_group
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.utils import print_rank_0


def _args(args):
    if args is not None:
        return args
    from megatron.training.global_vars import get_args

    return get_args()


def _tokenizer(args, tokenizer):
    if tokenizer is not None:
        return tokenizer
    try:
        from megatron.training.global_vars import get_tokenizer

        found = get_tokenizer()
        if found is not None:
            return found
    except (ImportError, AssertionError, AttributeError):
        pass
    from megatron.tokenizer import build_tokenizer

    return build_tokenizer(args)


def is_dataset_built_on_rank() -> bool:
    """Data is read on tensor-parallel rank 0 of every pipeline stage (others in the TP group get it broadcast).

    Middle stages need the attention mask too (BERT's padding mask, GPT's --reset-attention-mask), so, as in
    Megatron-LM 2023, every stage reads its own copy of the batch instead of only the first and last.
    """
    if not parallel_state.model_parallel_is_initialized() or is_fake_process_group():
        return True  # a fake process group broadcasts nothing: every rank reads its own batch
    return parallel_state.get_tensor_model_parallel_rank() == 0


def get_blend_and_blend_per_split(args):
    """``--data-path`` -> blend; ``--train/valid/test-data-path`` -> blend_per_split."""
    data_path = getattr(args, "data_path", None)
    per_split = [getattr(args, f"{name}_data_path", None) for name in ("train", "valid", "test")]
    if data_path and any(per_split):
        raise ValueError("use either --data-path or --train-data-path/--valid-data-path/--test-data-path, not both")
    if data_path:
        return get_blend_from_list(data_path), None
    if any(per_split):
        return None, [get_blend_from_list(paths) if paths else None for paths in per_split]
    return None, None


def core_gpt_dataset_config_from_args(args, tokenizer=None) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    mock = bool(getattr(args, "mock_data", False))
    if not mock and blend is None and blend_per_split is None:
        raise ValueError("no training data: pass --data-path (or --train/valid/test-data-path), or --mock-data")
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if mock else blend,
        blend_per_split=None if mock else blend_per_split,
        split=getattr(args, "split", None),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        tokenizer=_tokenizer(args, tokenizer),
        reset_position_ids=bool(getattr(args, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
        eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
        create_attention_mask=getattr(args, "create_attention_mask_in_dataloader", True),
        mock=mock,
    )


def core_bert_dataset_config_from_args(args, tokenizer=None) -> BERTMaskedWordPieceDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    if blend is None and blend_per_split is None:
        raise ValueError("no training data: pass --data-path (or --train/valid/test-data-path)")
    return BERTMaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=getattr(args, "split", None),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        tokenizer=_tokenizer(args, tokenizer),
        masking_probability=getattr(args, "mask_prob", 0.15),
        short_sequence_probability=getattr(args, "short_seq_prob", 0.1),
        masking_max_ngram=3,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=False,
        classification_head=getattr(args, "bert_binary_head", True),
    )


def core_t5_dataset_config_from_args(args, tokenizer=None) -> T5MaskedWordPieceDatasetConfig:
    """megatron-core's T5 dataset config: span corruption with whole-word n-grams, n = min(Geometric(0.2), 10)."""
    from megatron.training.errors import ConfigurationError

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    if blend is None and blend_per_split is None:
        raise ConfigurationError("no training data: pass --data-path (or --train/valid/test-data-path)")
    if args.decoder_seq_length is None:
        raise ConfigurationError("T5 needs --decoder-seq-length (the decoder's input length)")
    tokenizer = _tokenizer(args, tokenizer)
    if not list(getattr(tokenizer, "additional_special_tokens_ids", None) or []):
        raise ConfigurationError("T5 needs sentinel tokens <extra_id_N>: the tokenizer has none; pass "
                                 "--vocab-extra-ids 100")
    return T5MaskedWordPieceDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=getattr(args, "split", None),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        tokenizer=tokenizer,
        masking_probability=getattr(args, "mask_prob", 0.15),
        short_sequence_probability=getattr(args, "short_seq_prob", 0.1),
        masking_max_ngram=10,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        masking_use_geometric_distribution=True,
    )


def gpt_train_valid_test_datasets_provider(train_val_test_num_samples: List[Optional[int]], args=None,
                                           tokenizer=None):
    """GPT (or mock GPT with ``--mock-data``) train/valid/test datasets of the requested sizes."""
    args = _args(args)
    config = core_gpt_dataset_config_from_args(args, tokenizer)
    dataset_type = MockGPTDataset if config.mock else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_dataset_built_on_rank,
                                             config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return tuple(datasets)


def bert_train_valid_test_datasets_provider(train_val_test_num_samples: List[Optional[int]], args=None,
                                            tokenizer=None):
    args = _args(args)
    config = core_bert_dataset_config_from_args(args, tokenizer)
    print_rank_0("> building train, validation, and test datasets for BERT ...")
    datasets = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, train_val_test_num_samples,
                                             is_dataset_built_on_rank, config).build()
    print_rank_0("> finished creating BERT datasets ...")
    return tuple(datasets)


def t5_train_valid_test_datasets_provider(train_val_test_num_samples: List[Optional[int]], args=None,
                                          tokenizer=None):
    args = _args(args)
    config = core_t5_dataset_config_from_args(args, tokenizer)
    print_rank_0("> building train, validation, and test datasets for T5 ...")
    datasets = BlendedMegatronDatasetBuilder(T5MaskedWordPieceDataset, train_val_test_num_samples,
                                             is_dataset_built_on_rank, config).build()
    print_rank_0("> finished creating T5 datasets ...")
    return tuple(datasets)


# Megatron's providers are marked distributed-aware: they run on every rank and decide themselves.
gpt_train_valid_test_datasets_provider.is_distributed = True
bert_train_valid_test_datasets_provider.is_distributed = True
t5_train_valid_test_datasets_provider.is_distributed = True


def get_train_valid_test_num_samples(args=None) -> List[int]:
    """Samples the trainer will draw: train iters (or samples), evaluation runs, one final test run."""
    args = _args(args)
    if getattr(args, "train_samples", None):
        train_samples = args.train_samples
    else:
        train_samples = args.train_iters * args.global_batch_size
    # One evaluation every --eval-interval iterations plus the one after training (only that one without it).
    eval_runs = args.train_iters // args.eval_interval + 1 if args.eval_interval else 1
    eval_iters = eval_runs * args.eval_iters
    test_iters = args.eval_iters
    return [train_samples, eval_iters * args.global_batch_size, test_iters * args.global_batch_size]


def build_train_valid_test_datasets(build_train_valid_test_datasets_provider: Callable, args=None):
    args = _args(args)
    train_val_test_num_samples = get_train_valid_test_num_samples(args)
    print_rank_0(" > datasets target sizes (minimum size):")
    print_rank_0("    train:      {}".format(train_val_test_num_samples[0]))
    print_rank_0("    validation: {}".format(train_val_test_num_samples[1]))
    print_rank_0("    test:       {}".format(train_val_test_num_samples[2]))
    return build_train_valid_test_datasets_provider(train_val_test_num_samples)


def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider: Callable, args=None):
    """Data loaders on the ranks that read data; ``args.do_train/do_valid/do_test`` set on every rank."""
    args = _args(args)
    provider = build_train_valid_test_datasets_provider
    if getattr(provider, "__code__", None) is not None and "args" in provider.__code__.co_varnames:
        provider = partial(provider, args=args)
    print_rank_0("> building train, validation, and test datasets ...")
    iteration = getattr(args, "iteration", 0) or 0
    if iteration > 0 and getattr(args, "consumed_train_samples", 0) == 0:
        if getattr(args, "train_samples", None) is not None:
            raise ValueError("only backward compatiblity support for iteration-based training")
        args.consumed_train_samples = iteration * args.global_batch_size
    if iteration > 0 and getattr(args, "consumed_valid_samples", 0) == 0 and getattr(args, "train_samples", None) is None:
        evaluations = iteration // args.eval_interval if args.eval_interval else 0
        args.consumed_valid_samples = evaluations * args.eval_iters * args.global_batch_size

    train_loader = valid_loader = test_loader = None
    reads_data = getattr(build_train_valid_test_datasets_provider, "is_distributed", False) or \
        is_dataset_built_on_rank()
    flags = torch.zeros(3, dtype=torch.long, device=device.current_device())
    if reads_data:
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(provider, args)
        train_loader = build_pretraining_data_loader(train_ds, getattr(args, "consumed_train_samples", 0), args)
        valid_consumed = 0 if getattr(args, "skip_train", False) else getattr(args, "consumed_valid_samples", 0)
        valid_loader = build_pretraining_data_loader(valid_ds, valid_consumed, args)
        test_loader = build_pretraining_data_loader(test_ds, 0, args)
        flags[0] = int(train_loader is not None and args.train_iters > 0)
        flags[1] = int(valid_loader is not None and args.eval_iters > 0)
        flags[2] = int(test_loader is not None and args.eval_iters > 0)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # Global rank 0 always reads data; ranks that read none learn from it what will run.
        torch.distributed.broadcast(flags, 0)
    args.do_train = bool(getattr(args, "do_train", False) or flags[0].item())
    args.do_valid = bool(getattr(args, "do_valid", False) or flags[1].item())
    args.do_test = bool(getattr(args, "do_test", False) or flags[2].item())
    return train_loader, valid_loader, test_loader


def cyclic_iter(iterable):
    while True:
        for x in iterable:
            yield x


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider: Callable, args=None):
    """Iterators over the loaders (restarting forever for ``--dataloader-type cyclic``); None where no loader."""
    args = _args(args)
    loaders = build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider, args)
    dataloader_type = getattr(args, "dataloader_type", None) or "single"
    if dataloader_type not in ("single", "cyclic"):
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use single or cyclic")

    def make(loader):
        if loader is None:
            return None
        return iter(loader) if dataloader_type == "single" else iter(cyclic_iter(loader))

    return tuple(make(loader) for loader in loaders)
