"""How many micro-batches make one global batch, constant or ramping up with the consumed samples.

``num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)``. With
``--rampup-batch-size <start> <increment> <ramp-up samples>`` the global batch grows from ``start`` by
``increment`` in equal steps spread over ``ramp-up samples`` consumed samples, then stays at
``--global-batch-size``. With ``--step-batch-size-schedule "T0:B0 T1:B1 ..."`` (thresholds in consumed *tokens*,
K/M/B/T = 1e3/1e6/1e9/1e12, converted to samples as ``int(float(T) * mult) // seq_length``) the global batch
is a step function: ``B_i`` of the last entry whose sample threshold is ``<= consumed_samples``; the first
threshold must be 0 and thresholds strictly increase. Messages are Megatron-LM's; ``validate_args`` checks the same
conditions earlier with messages that name the flags. The calculators are megatron-core's
(:mod:`megatron.core.num_microbatches_calculator`); the 2023 class names take the 2023 argument order.
"""
from __future__ import annotations

from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatchesCalculator, NumMicroBatchesCalculator,
                                                       RampupBatchsizeNumMicroBatchesCalculator)
from megatron.training.errors import ConfigurationError


_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def parse_step_batch_size_schedule(schedule: str, seq_length: int):
    """``[(sample_threshold, global_batch_size), ...]`` of a --step-batch-size-schedule string (sorted)."""
    entries = []
    for pair in schedule.replace(",", " ").split():
        threshold, sep, batch_size = pair.partition(":")
        _require(sep == ":" and threshold and batch_size,
                 f"--step-batch-size-schedule: {pair!r} is not THRESHOLD:BATCH_SIZE (e.g. '0:16 2.4B:320')")
        mult = _SUFFIXES.get(threshold[-1].upper())
        number = threshold[:-1] if mult else threshold
        try:
            tokens = int(float(number) * (mult or 1))
            batch_size = int(batch_size)
        except ValueError:
            raise ConfigurationError(f"--step-batch-size-schedule: {pair!r} is not THRESHOLD:BATCH_SIZE with a number "
                                     "of tokens (K/M/B/T suffixes allowed) and an integer batch size") from None
        _require(tokens >= 0 and batch_size > 0,
                 f"--step-batch-size-schedule: {pair!r} needs a threshold >= 0 and a batch size > 0")
        entries.append((tokens, batch_size))
    _require(entries, "--step-batch-size-schedule is empty: pass 'THRESHOLD:BATCH_SIZE' pairs such as '0:16 2.4B:320'")
    entries.sort()
    _require(entries[0][0] == 0, f"--step-batch-size-schedule must start at threshold 0, got {entries[0][0]} tokens")
    samples = [(tokens // seq_length, batch_size) for tokens, batch_size in entries]
    for (a, _), (b, _) in zip(samples, samples[1:]):
        _require(b > a, f"--step-batch-size-schedule thresholds must strictly increase in samples (tokens // "
                        f"--seq-length {seq_length}); two thresholds fall on sample {a}")
    return samples


def build_num_microbatches_calculator(args):
    """The calculator for ``args`` (constant unless ``--rampup-batch-size`` or ``--step-batch-size-schedule`` is
    given); prints on rank 0."""
    if getattr(args, "step_batch_size_schedule", None):
        schedule = parse_step_batch_size_schedule(args.step_batch_size_schedule, args.seq_length)
        if args.rank == 0:
            print("will use a step batch-size schedule (consumed samples: global batch size) {}".format(
                ", ".join(f"{t}: {b}" for t, b in schedule)), flush=True)
        return StepBatchsizeNumMicroBatches(schedule, args.micro_batch_size, args.data_parallel_size)
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


class ConstantNumMicroBatches(ConstantNumMicroBatchesCalculator):
    """Megatron 2023's ``ConstantNumMicroBatches(global_batch_size, micro_batch_size, data_parallel_size)``."""

    def __init__(self, global_batch_size, micro_batch_size, data_parallel_size):
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size, False, 0)


class RampupBatchsizeNumMicroBatches(RampupBatchsizeNumMicroBatchesCalculator):
    """Megatron 2023's ``RampupBatchsizeNumMicroBatches(start_batch_size, batch_size_increment, ramup_samples,
    global_batch_size, micro_batch_size, data_parallel_size)``."""

    def __init__(self, start_batch_size, batch_size_increment, ramup_samples, global_batch_size,
                 micro_batch_size, data_parallel_size):
        super().__init__(global_batch_size, micro_batch_size, data_parallel_size, False, 0, start_batch_size,
                         batch_size_increment, ramup_samples)
        self.start_batch_size = start_batch_size


class StepBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    """Global batch size as a step function of the consumed samples (``--step-batch-size-schedule``)."""

    def __init__(self, schedule, micro_batch_size, data_parallel_size):
        super().__init__()
        self.schedule = list(schedule)  # [(sample threshold, global batch size)], sorted, first threshold 0
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.update(0, False)

    @property
    def last_threshold(self) -> int:
        """Consumed samples from which the batch size stays at its final value."""
        return self.schedule[-1][0]

    def update(self, consumed_samples, consistency_check, verbose=False):
        batch_size = self.schedule[0][1]
        for threshold, size in self.schedule:
            if threshold <= consumed_samples:
                batch_size = size
        self.current_global_batch_size = self.current_running_global_batch_size = batch_size
        if consistency_check:
            _require(batch_size % self.micro_batch_times_data_parallel_size == 0,
                     "current global batch size ({}) is not divisible by micro-batch-size ({}) times data parallel "
                     "size ({})".format(batch_size, self.micro_batch_size, self.data_parallel_size))
        self.num_micro_batches = batch_size // self.micro_batch_times_data_parallel_size
