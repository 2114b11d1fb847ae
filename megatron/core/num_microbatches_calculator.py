"""How many micro-batches make one global batch (megatron-core's ``megatron.core.num_microbatches_calculator``).

``num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)``. With a ramp-up
``[start, increment, ramp-up samples]`` the global batch grows from ``start`` by ``increment`` in equal steps spread
over the ramp-up samples consumed, then stays at ``global_batch_size``. With ``decrease_batch_size_if_needed`` a
global batch that ``micro_batch_size * data_parallel_size`` does not divide runs rounded down to a multiple of it
(``get_current_running_global_batch_size``); otherwise that is an error.

One calculator is global to the process: ``init_num_microbatches_calculator(...)`` (once),
``reconfigure_num_microbatches_calculator(...)``, ``get_num_microbatches()``, ``update_num_microbatches(consumed)``,
``destroy_num_microbatches_calculator()``. The training loop installs its own (also the step schedule of
``--step-batch-size-schedule``) with :func:`set_num_microbatches_calculator`, so both APIs see the same numbers.
Errors are :class:`~megatron.core.errors.ConfigurationError` with Megatron-LM's messages.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import List, Optional

from megatron.core.errors import ConfigurationError

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["NumMicroBatchesCalculator"] = None


def _calculator() -> "NumMicroBatchesCalculator":
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("num microbatches calculator is not initialized: call init_num_microbatches_calculator")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    """Micro-batches in the current global batch."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """The current global batch size (of the ramp-up, if any)."""
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """The global batch size actually run: the current one, rounded down to a multiple of micro batch size x data
    parallel size with ``decrease_batch_size_if_needed``."""
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    """Move the ramp-up to ``consumed_samples``; ``consistency_check``: the batch must divide evenly."""
    _calculator().update(consumed_samples, consistency_check, verbose)


def unset_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def destroy_num_microbatches_calculator() -> None:
    unset_num_microbatches_calculator()


def set_num_microbatches_calculator(calculator: Optional["NumMicroBatchesCalculator"]) -> None:
    """Install ``calculator`` (any :class:`NumMicroBatchesCalculator`) as the process-wide one."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]], global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int,
                                     decrease_batch_size_if_needed: bool = False) -> None:
    """Build the process-wide calculator (an error if one exists); ``rampup_batch_size`` is ``None`` or
    ``[start global batch size, increment, ramp-up samples]``; rank 0 logs the schedule."""
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError("num microbatches calculator is already initialized")
    set_num_microbatches_calculator(_build(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                           data_parallel_size, decrease_batch_size_if_needed))


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]],
                                            global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                                            decrease_batch_size_if_needed: bool = False) -> None:
    """Replace the process-wide calculator (e.g. another micro batch size for evaluation)."""
    set_num_microbatches_calculator(_build(rank, rampup_batch_size, global_batch_size, micro_batch_size,
                                           data_parallel_size, decrease_batch_size_if_needed))


def _build(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
           decrease_batch_size_if_needed) -> "NumMicroBatchesCalculator":
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                       decrease_batch_size_if_needed, rank)
        if rank == 0:
            logger.info("setting number of microbatches to constant %d", calculator.get())
        return calculator
    if len(rampup_batch_size) != 3:
        raise ConfigurationError("expected the following format: --rampup-batch-size <start batch size> "
                                 "<batch size incerement> <ramp-up samples>")
    start, increment, samples = (int(v) for v in rampup_batch_size)
    if rank == 0:
        logger.info("will use batch size rampup starting from global batch size %d to global batch size %d with "
                    "batch size increments %d over %d samples.", start, global_batch_size, increment, samples)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                    decrease_batch_size_if_needed, rank, start, increment, samples)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


class NumMicroBatchesCalculator(ABC):
    """The number of micro-batches and the global batch size, as a function of the consumed samples."""

    def __init__(self) -> None:
        self.num_micro_batches = None
        self.current_global_batch_size = None
        self.micro_batch_size = None
        self.current_running_global_batch_size = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    @abstractmethod
    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        """Move to ``consumed_samples``."""


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A fixed global batch size."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool = False, rank: int = 0) -> None:
        super().__init__()
        unit = micro_batch_size * data_parallel_size
        _require(unit > 0, "micro batch size times data parallel size must be > 0")
        if decrease_batch_size_if_needed:
            running = global_batch_size // unit * unit
            if rank == 0 and running != global_batch_size:
                logger.info("decreasing batch size from %d to %d to keep divisibility by micro_batch_size=%d * "
                            "data_parallel_size=%d", global_batch_size, running, micro_batch_size,
                            data_parallel_size)
        else:
            _require(global_batch_size % unit == 0,
                     "global batch size ({}) is not divisible by micro batch size ({}) times data parallel size "
                     "({})".format(global_batch_size, micro_batch_size, data_parallel_size))
            running = global_batch_size
        self.num_micro_batches = running // unit
        _require(self.num_micro_batches >= 1,
                 "number of micro-batches should be at least 1, got {}.".format(self.num_micro_batches))
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """The global batch grows from ``start_global_batch_size`` by ``batch_size_increment`` every
    ``ramup_samples / number of increments`` consumed samples, up to ``global_batch_size``."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int, start_global_batch_size: int,
                 batch_size_increment: int, ramup_samples: int) -> None:
        super().__init__()
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        _require(self.micro_batch_times_data_parallel_size > 0, "micro batch size times data parallel size must be > 0")
        _require(start_global_batch_size > 0, "start batch size ({}) must be > 0".format(start_global_batch_size))
        _require(global_batch_size > 0, "global batch size ({}) must be > 0".format(global_batch_size))
        diff = global_batch_size - start_global_batch_size
        _require(diff >= 0, "expected global batch size ({}) to be at least the start batch size "
                            "({})".format(global_batch_size, start_global_batch_size))
        _require(batch_size_increment > 0, "batch size increment ({}) must be > 0".format(batch_size_increment))
        _require(diff % batch_size_increment == 0,
                 "expected global batch size interval ({}) to be divisible by global batch size increment "
                 "({})".format(diff, batch_size_increment))
        _require(ramup_samples >= 0, "ramp-up samples ({}) must be >= 0".format(ramup_samples))
        self.global_batch_size = global_batch_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        increments = diff // batch_size_increment
        # With start == global there is nothing to ramp: every update lands on the global batch size.
        self.rampup_samples_per_increment = ramup_samples / increments if increments else float("inf")
        self.update(0, consistency_check=False, verbose=True)

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        previous = self.current_global_batch_size
        if consumed_samples > self.ramup_samples:
            current = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            current = self.start_global_batch_size + steps * self.batch_size_increment
        self.current_global_batch_size = current
        if verbose and self.rank == 0 and previous != current:
            logger.info("setting initial batch size to %d" if previous is None else
                        f"ramping up batch size from {previous} to %d", current)
        unit = self.micro_batch_times_data_parallel_size
        if consistency_check and not self.decrease_batch_size_if_needed:
            _require(current % unit == 0,
                     "current global batch size ({}) is not divisible by micro-batch-size ({}) times data parallel "
                     "size ({})".format(current, self.micro_batch_size, self.data_parallel_size))
        self.current_running_global_batch_size = (current // unit * unit if self.decrease_batch_size_if_needed
                                                  else current)
        self.num_micro_batches = self.current_running_global_batch_size // unit


__all__ = ["ConstantNumMicroBatchesCalculator", "NumMicroBatchesCalculator",
           "RampupBatchsizeNumMicroBatchesCalculator", "destroy_num_microbatches_calculator",
           "get_current_global_batch_size", "get_current_running_global_batch_size", "get_micro_batch_size",
           "get_num_microbatches", "init_num_microbatches_calculator", "reconfigure_num_microbatches_calculator",
           "set_num_microbatches_calculator", "unset_num_microbatches_calculator", "update_num_microbatches"]
