"""Megatron's batch samplers and ``build_pretraining_data_loader``.

A sampler yields, for this data-parallel rank, the dataset indices of one micro-batch at a time. Both
resume exactly from ``consumed_samples`` (the global number of samples already trained on, saved in the
checkpoint): the sample stream after a restart is the one an uninterrupted run would have seen.

* ``single`` (MegatronPretrainingSampler): indices ``consumed_samples, consumed_samples + 1, ...`` in
  global batches of ``micro_batch_size * data_parallel_size``; rank r takes slice ``[r*mbs, (r+1)*mbs)``.
* ``cyclic`` (MegatronPretrainingRandomSampler): every epoch a fresh ``torch.randperm`` seeded by the
  epoch number, either over each rank's own contiguous bucket (data sharding, default) or over the whole
  dataset strided across ranks.
"""
from __future__ import annotations

import random
from typing import Iterator, List, Optional

import numpy
import torch



def _check_sampler_args(total_samples, micro_batch_size, data_parallel_size, data_parallel_rank):
    """Checks shared by both samplers (Megatron's messages)."""
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: {total_samples}")
    if micro_batch_size <= 0 or data_parallel_size <= 0:
        raise ValueError(f"micro batch size ({micro_batch_size}) and data parallel size ({data_parallel_size}) "
                         f"must be positive")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank should be smaller than data size: {data_parallel_rank}, "
                         f"{data_parallel_size}")

class MegatronPretrainingSampler:
    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last
        _check_sampler_args(total_samples, micro_batch_size, data_parallel_size, data_parallel_rank)
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left to consume: {consumed_samples}, {total_samples}")

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        start_idx = self.data_parallel_rank * self.micro_batch_size
        return start_idx, start_idx + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        batch = []
        start_idx, end_idx = self.get_start_end_idx()
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                yield batch[start_idx:end_idx]
                batch = []
        if batch and not self.drop_last:
            yield batch[start_idx:end_idx]


class RandomSeedDataset(torch.utils.data.Dataset):
    """Seeds torch, ``random`` and NumPy with ``seed + epoch + idx`` before each item (for random augmentations)."""

    def __init__(self, dataset, seed: int) -> None:
        self.base_seed = seed
        self.curr_seed = seed
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.curr_seed = self.base_seed + epoch

    def __getitem__(self, idx: int):
        seed = idx + self.curr_seed
        torch.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed % 2**32)
        return self.dataset[idx]


class MegatronPretrainingRandomSampler:
    def __init__(self, dataset, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool = True) -> None:
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        _check_sampler_args(total_samples, micro_batch_size, data_parallel_size, data_parallel_rank)
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(f"the dataset has {total_samples} samples, fewer than one global batch "
                             f"({self.micro_batch_times_data_parallel_size}) of the cyclic sampler")

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        assert current_epoch_samples % self.micro_batch_times_data_parallel_size == 0
        if isinstance(self.dataset, RandomSeedDataset):
            self.dataset.set_epoch(epoch)

        generator = torch.Generator()
        generator.manual_seed(epoch)
        if self.data_sharding:
            # Each rank draws from its own contiguous bucket of the dataset.
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=generator).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            idx_range_total = torch.randperm(full_bucket_size, generator=generator).tolist()
            idx_range = idx_range_total[current_epoch_samples:][self.data_parallel_rank::self.data_parallel_size]

        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def build_pretraining_data_loader(dataset, consumed_samples: int, args=None) -> Optional[torch.utils.data.DataLoader]:
    """A DataLoader over ``dataset`` with Megatron's sampler for ``--dataloader-type`` (single | cyclic).

    ``args`` defaults to the global arguments; ``--num-workers`` loader processes are used.
    """
    if dataset is None:
        return None
    if args is None:
        from megatron.training.global_vars import get_args

        args = get_args()
    from megatron.core import device, parallel_state

    if parallel_state.model_parallel_is_initialized():
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
    elif torch.distributed.is_initialized():  # no model parallelism set up: every rank is a data-parallel rank
        dp_rank, dp_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        dp_rank, dp_size = 0, 1
    dataloader_type = getattr(args, "dataloader_type", None) or "single"
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                                   micro_batch_size=args.micro_batch_size, data_parallel_rank=dp_rank,
                                                   data_parallel_size=dp_size)
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(dataset, total_samples=len(dataset),
                                                         consumed_samples=consumed_samples,
                                                         micro_batch_size=args.micro_batch_size,
                                                         data_parallel_rank=dp_rank, data_parallel_size=dp_size,
                                                         data_sharding=getattr(args, "data_sharding", True))
    else:
        raise ValueError(f"--dataloader-type {dataloader_type!r} is not supported; use single or cyclic")
    num_workers = getattr(args, "num_workers", 2)
    # Starting an iterator draws a worker base seed; from a private generator, so that building the loaders
    # after a checkpoint's RNG state was restored does not shift the global stream (exact resume with dropout).
    generator = torch.Generator().manual_seed(getattr(args, "seed", 1234) or 1234)
    return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                                       pin_memory=device.cuda_available(), persistent_workers=num_workers > 0,
                                       generator=generator)
