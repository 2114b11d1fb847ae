"""How many micro-batches make one global batch, constant or ramping up with the consumed samples.

``num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)``. With
``--rampup-batch-size <start> <increment> <ramp-up samples>`` the global batch grows from ``start`` by
``increment`` in equal steps spread over ``ramp-up samples`` consumed samples, then stays at
``--global-batch-size``. Messages are Megatron-LM's; ``validate_args`` checks the same conditions earlier with
messages that name the flags.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from megatron.training.errors import ConfigurationError


def build_num_microbatches_calculator(args):
    """The calculator for ``args`` (constant unless ``--rampup-batch-size`` is given); prints on rank 0."""
    if args.rampup_batch_size is None:
        calculator = ConstantNumMicroBatches(args.global_batch_size, args.micro_batch_size, args.data_parallel_size)
        if args.rank == 0:
            print("setting number of micro-batches to constant {}".format(calculator.get()), flush=True)
        return calculator

    if len(args.rampup_batch_size) != 3:
        raise ConfigurationError("expected the following format: --rampup-batch-size <start batch size> "
                                 "<batch size incerement> <ramp-up samples>")
    start_batch_size, batch_size_increment, rampup_samples = (int(v) for v in args.rampup_batch_size)
    if args.rank == 0:
        print("will use batch size rampup starting from global batch size {} to global batch size {} with batch "
              "size increments {} over {} samples.".format(start_batch_size, args.global_batch_size,
                                                           batch_size_increment, rampup_samples), flush=True)
    return RampupBatchsizeNumMicroBatches(start_batch_size, batch_size_increment, rampup_samples,
                                          args.global_batch_size, args.micro_batch_size, args.data_parallel_size)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


class NumMicroBatchesCalculator(ABC):
    def __init__(self):
        self.num_micro_batches = None
        self.current_global_batch_size = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    @abstractmethod
    def update(self, consumed_samples, consistency_check):
        pass


class ConstantNumMicroBatches(NumMicroBatchesCalculator):
    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size):
        super().__init__()
        micro_batch_times_data_parallel = micro_batch_size * data_parallel_size
        _require(global_batch_size % micro_batch_times_data_parallel == 0,
                 "global batch size ({}) is not divisible by micro batch size ({}) times data parallel size "
                 "({})".format(global_batch_size, micro_batch_size, data_parallel_size))
        self.num_micro_batches = global_batch_size // micro_batch_times_data_parallel
        _require(self.num_micro_batches >= 1,
                 "number of micro-batches should be at least 1, got {}.".format(self.num_micro_batches))
        self.current_global_batch_size = global_batch_size

    def update(self, consumed_samples, consistency_check):
        pass


class RampupBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    def __init__(self, start_batch_size, batch_size_increment, ramup_samples, global_batch_size,
                 micro_batch_size, data_parallel_size):
        super().__init__()
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        _require(self.micro_batch_times_data_parallel_size > 0, "micro batch size times data parallel size must be > 0")
        _require(start_batch_size > 0, "start batch size ({}) must be > 0".format(start_batch_size))
        self.start_batch_size = start_batch_size
        _require(global_batch_size > 0, "global batch size ({}) must be > 0".format(global_batch_size))
        self.global_batch_size = global_batch_size
        diff_batch_size = global_batch_size - start_batch_size
        _require(diff_batch_size >= 0, "expected global batch size ({}) to be at least the start batch size "
                                       "({})".format(global_batch_size, start_batch_size))
        _require(batch_size_increment > 0, "batch size increment ({}) must be > 0".format(batch_size_increment))
        self.batch_size_increment = batch_size_increment
        _require(diff_batch_size % batch_size_increment == 0,
                 "expected global batch size interval ({}) to be divisible by global batch size increment "
                 "({})".format(diff_batch_size, batch_size_increment))
        num_increments = diff_batch_size // batch_size_increment
        self.ramup_samples = ramup_samples
        _require(ramup_samples >= 0, "ramp-up samples ({}) must be >= 0".format(ramup_samples))
        # With start == global there is nothing to ramp: every update lands on the global batch size.
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else float("inf")
        self.update(0, False)

    def update(self, consumed_samples, consistency_check):
        if consumed_samples > self.ramup_samples:
            self.current_global_batch_size = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            self.current_global_batch_size = self.start_batch_size + steps * self.batch_size_increment
            assert self.current_global_batch_size <= self.global_batch_size
        if consistency_check:
            _require(self.current_global_batch_size % self.micro_batch_times_data_parallel_size == 0,
                     "current global batch size ({}) is not divisible by micro-batch-size ({}) times data parallel "
                     "size ({})".format(self.current_global_batch_size, self.micro_batch_size,
                                        self.data_parallel_size))
        self.num_micro_batches = self.current_global_batch_size // self.micro_batch_times_data_parallel_size
