"""Number of micro-batches per iteration, constant or with a batch-size ramp-up (``--rampup-batch-size``).

``num_microbatches = current_global_batch_size / (micro_batch_size * data_parallel_size)``.

With ``--rampup-batch-size START INCR SAMPLES`` the global batch size starts at ``START`` and grows by ``INCR``
every ``SAMPLES / ((GLOBAL - START) / INCR)`` consumed samples, reaching ``--global-batch-size`` after
``SAMPLES`` samples: ``current = START + INCR * int(consumed / samples_per_increment)`` while
``consumed <= SAMPLES``, ``GLOBAL`` afterwards. The training loop calls ``update_num_microbatches`` with the
consumed sample count before every iteration.

The process-wide calculator (``init_num_microbatches_calculator`` / ``get_num_microbatches`` /
``update_num_microbatches``) follows megatron-core; the classes also answer to their 2023 names
(``ConstantNumMicroBatches``, ``RampupBatchsizeNumMicroBatches``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["NumMicroBatchesCalculator"] = None


def _calculator() -> "NumMicroBatchesCalculator":
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("the micro-batch calculator is not initialized: call init_num_microbatches_calculator() "
                           "(initialize_megatron does it)")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().micro_batch_size


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    _calculator().update(consumed_samples, consistency_check)


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]], global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int) -> None:
    """Create the process-wide calculator (and print Megatron's line about it on rank 0)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError("the micro-batch calculator is already initialized")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


def destroy_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def build_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]], global_batch_size: int,
                                      micro_batch_size: int, data_parallel_size: int) -> "NumMicroBatchesCalculator":
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size)
        if rank == 0:
            print(f"setting number of micro-batches to constant {calculator.get()}", flush=True)
        return calculator
    if len(rampup_batch_size) != 3:
        raise ValueError("expected the following format: --rampup-batch-size <start batch size> "
                         "<batch size incerement> <ramp-up samples>")
    start, increment, samples = (int(v) for v in rampup_batch_size)
    if rank == 0:
        print(f"will use batch size rampup starting from global batch size {start} to global batch size "
              f"{global_batch_size} with batch size increments {increment} over {samples} samples.", flush=True)
    return RampupBatchsizeNumMicroBatchesCalculator(start, increment, samples, global_batch_size, micro_batch_size,
                                                    data_parallel_size)


class NumMicroBatchesCalculator(ABC):
    def __init__(self, micro_batch_size: int, data_parallel_size: int):
        if micro_batch_size is None or micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be a positive integer, got {micro_batch_size}")
        if data_parallel_size <= 0:
            raise ValueError(f"data parallel size must be positive, got {data_parallel_size}")
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.num_micro_batches: Optional[int] = None
        self.current_global_batch_size: Optional[int] = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        ...


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        super().__init__(micro_batch_size, data_parallel_size)
        if global_batch_size % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                             f"({micro_batch_size}) times data parallel size ({data_parallel_size})")
        self.num_micro_batches = global_batch_size // self.micro_batch_times_data_parallel_size
        if self.num_micro_batches < 1:
            raise ValueError(f"--global-batch-size ({global_batch_size}) gives no micro-batch")
        self.current_global_batch_size = global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    def __init__(self, start_batch_size: int, batch_size_increment: int, ramup_samples: int, global_batch_size: int,
                 micro_batch_size: int, data_parallel_size: int):
        super().__init__(micro_batch_size, data_parallel_size)
        if start_batch_size <= 0 or global_batch_size <= 0:
            raise ValueError("--rampup-batch-size start and --global-batch-size must be positive")
        diff = global_batch_size - start_batch_size
        if diff < 0:
            raise ValueError(f"--rampup-batch-size start ({start_batch_size}) exceeds --global-batch-size "
                             f"({global_batch_size})")
        if batch_size_increment <= 0:
            raise ValueError(f"--rampup-batch-size increment must be positive, got {batch_size_increment}")
        if diff % batch_size_increment != 0:
            raise ValueError(f"expected global batch size interval ({diff}) to be divisible by global batch size "
                             f"increment ({batch_size_increment})")
        if ramup_samples < 0:
            raise ValueError(f"--rampup-batch-size samples must be >= 0, got {ramup_samples}")
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.global_batch_size = global_batch_size
        num_increments = diff // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else None
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        if consumed_samples > self.ramup_samples or self.rampup_samples_per_increment is None:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = self.start_batch_size + steps * self.batch_size_increment
        if consistency_check and self.current_global_batch_size % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(f"current global batch size ({self.current_global_batch_size}) is not divisible by "
                             f"micro-batch-size ({self.micro_batch_size}) times data parallel size "
                             f"({self.data_parallel_size})")
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size


# The 2023 (megatron/microbatches.py) names.
ConstantNumMicroBatches = ConstantNumMicroBatchesCalculator
RampupBatchsizeNumMicroBatches = RampupBatchsizeNumMicroBatchesCalculator
