"""Train / validation / test data iterators (built on TP rank 0, flags shared with the TP group)."""
from __future__ import annotations

import torch

from megatron.core import device, parallel_state
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0


def train_valid_test_num_samples(args):
    """Samples each split must provide: train for every iteration, valid for every evaluation, test once."""
    train_samples = args.train_samples if args.train_samples else args.train_iters * args.global_batch_size
    eval_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    return [train_samples, eval_iters * args.global_batch_size, args.eval_iters * args.global_batch_size]


def _cyclic_iter(iterable):
    while True:
        for x in iterable:
            yield x


def _to_iterator(dataloader, dataloader_type):
    if dataloader is None:
        return None
    if dataloader_type == "single":
        return iter(dataloader)
    if dataloader_type == "cyclic":
        return iter(_cyclic_iter(dataloader))
    raise RuntimeError(f"--dataloader-type {dataloader_type} is not supported (use single or cyclic)")


def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider):
    """Dataloaders on TP rank 0 (None elsewhere); sets ``args.do_train/do_valid/do_test`` on every rank."""
    from megatron.training.datasets_provider import build_pretraining_data_loader

    args = get_args()
    print_rank_0("> building train, validation, and test datasets ...")
    # Checkpoints from runs that did not record consumed samples: assume a constant batch size.
    if args.iteration > 0 and args.consumed_train_samples == 0:
        if args.train_samples is not None:
            raise RuntimeError("the checkpoint does not record consumed_train_samples; cannot resume --train-samples")
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0 and args.train_samples is None:
        args.consumed_valid_samples = (args.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size

    train_dataloader = valid_dataloader = test_dataloader = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        sizes = train_valid_test_num_samples(args)
        print_rank_0(" > datasets target sizes (minimum size):")
        print_rank_0("    train:      {}".format(sizes[0]))
        print_rank_0("    validation: {}".format(sizes[1]))
        print_rank_0("    test:       {}".format(sizes[2]))
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets_provider(sizes)
        train_dataloader = build_pretraining_data_loader(train_ds, args.consumed_train_samples)
        valid_dataloader = build_pretraining_data_loader(valid_ds, args.consumed_valid_samples)
        test_dataloader = build_pretraining_data_loader(test_ds, 0)
        flags = torch.tensor([int(train_dataloader is not None and args.train_iters > 0),
                              int(valid_dataloader is not None and args.eval_iters > 0),
                              int(test_dataloader is not None and args.eval_iters > 0)],
                             dtype=torch.long, device=device.current_device())
    else:
        flags = torch.tensor([0, 0, 0], dtype=torch.long, device=device.current_device())
    torch.distributed.broadcast(flags, parallel_state.get_tensor_model_parallel_src_rank(),
                                group=parallel_state.get_tensor_model_parallel_group())
    args.do_train, args.do_valid, args.do_test = (bool(x) for x in flags.tolist())
    return train_dataloader, valid_dataloader, test_dataloader


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """Iterators over the three dataloaders (``--dataloader-type single`` or ``cyclic``)."""
    args = get_args()
    loaders = build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider)
    return tuple(_to_iterator(loader, args.dataloader_type) for loader in loaders)
