"""Named wall-clock timers with Megatron-LM's log levels and report formats (megatron-core's
``megatron.core.timers``; ``megatron.training.timers`` re-exports it).

``timers = Timers(log_level, log_option)``; ``timers('forward-compute', log_level=2).start()`` ... ``.stop()``.
A timer asked for with a level above ``--timing-log-level`` is a shared :class:`DummyTimer` that does nothing,
so fine-grained timers cost nothing unless requested. ``timers.log(names, normalizer)`` gathers every rank's
elapsed times (one all-gather of a small tensor) and prints, on the last rank by default, either the
``(min, max)`` or the ``max`` over ranks, or every rank's value (``--timing-log-option``).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from megatron.core import device
from megatron.core.utils import all_gather_into_tensor


def distributed_is_initialized() -> bool:
    """True when torch.distributed is usable (timers also work in a single process without it)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class TimerBase(ABC):
    def __init__(self, name):
        self.name = name

    @abstractmethod
    def start(self, barrier=False):
        pass

    @abstractmethod
    def stop(self, barrier=False):
        pass

    @abstractmethod
    def reset(self):
        pass

    @abstractmethod
    def elapsed(self, reset=True, barrier=False):
        pass


class DummyTimer(TimerBase):
    """Stands in for timers above the chosen log level."""

    def __init__(self):
        super().__init__("dummy timer")

    def start(self, barrier=False):
        return

    def stop(self, barrier=False):
        return

    def reset(self):
        return

    def elapsed(self, reset=True, barrier=False):
        raise Exception("dummy timer should not be used to calculate elapsed time")


class Timer(TimerBase):
    """Accumulates elapsed seconds over start/stop pairs; synchronises the device so GPU work is counted."""

    def __init__(self, name):
        super().__init__(name)
        self._elapsed = 0.0
        self._started = False
        self._barrier_group = None
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group):
        self._barrier_group = barrier_group

    def _sync(self, barrier):
        if barrier and distributed_is_initialized():
            torch.distributed.barrier(group=self._barrier_group)
        device.synchronize()

    def start(self, barrier=False):
        assert not self._started, "timer has already been started"
        self._sync(barrier)
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier=False):
        assert self._started, "timer is not started"
        self._sync(barrier)
        self._elapsed += time.time() - self._start_time
        self._started = False

    def reset(self):
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset=True, barrier=False):
        """Seconds accumulated so far; a running timer keeps running."""
        started = self._started
        if started:
            self.stop(barrier=barrier)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start(barrier=barrier)
        return elapsed


class Timers:
    """The group of timers of a run."""

    _max_log_level = 2

    def __init__(self, log_level, log_option):
        if log_option not in ("max", "minmax", "all"):
            raise ValueError(f"unknown timing log option {log_option!r}: use max, minmax or all")
        self._log_level = log_level
        self._log_option = log_option
        self._timers = {}
        self._log_levels = {}
        self._dummy_timer = DummyTimer()

    def __call__(self, name, log_level=None):
        if name in self._timers:
            if log_level is not None:
                assert log_level == self._log_levels[name], (
                    "input log level {} does not match already existing log level {} for {} timer".format(
                        log_level, self._log_levels[name], name))
            return self._timers[name]
        if log_level is None:
            log_level = self._max_log_level
        assert log_level <= self._max_log_level, "log level {} is larger than max supported log level {}".format(
            log_level, self._max_log_level)
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _get_elapsed_time_all_ranks(self, names, reset, barrier):
        """A [world_size, len(names)] tensor of elapsed seconds (0 where a rank has no such timer).

        Every rank must call this with the same ``names`` (it is a collective).
        """
        if distributed_is_initialized():
            if barrier:
                torch.distributed.barrier()
            world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        else:
            world_size, rank = 1, 0
        # An all-gather of one small tensor is simpler than a gather to the printing rank and costs the same.
        times = torch.zeros((world_size, len(names)), dtype=torch.float, device=device.current_device())
        for i, name in enumerate(names):
            if name in self._timers:
                # No barrier here: the ranks are already in step and timers may have different barrier groups.
                times[rank, i] = self._timers[name].elapsed(reset=reset)
        if world_size > 1:
            all_gather_into_tensor(times.view(-1), times[rank, :].contiguous().view(-1))
        return times.cpu()

    def _get_global_min_max_time(self, names, reset, barrier, normalizer):
        times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        name_to_min_max_time = {}
        for i, name in enumerate(names):
            rank_to_time = times[:, i]
            rank_to_time = rank_to_time[rank_to_time > 0.0]  # ranks that never ran this timer
            if rank_to_time.numel() > 0:
                name_to_min_max_time[name] = (rank_to_time.min().item() / normalizer,
                                              rank_to_time.max().item() / normalizer)
        return name_to_min_max_time

    def _get_global_min_max_time_string(self, names, reset, barrier, normalizer, max_only):
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if not name_to_min_max_time:
            return None
        if max_only:
            output_string = "max time across ranks (ms):"
        else:
            output_string = "(min, max) time across ranks (ms):"
        for name, (min_time, max_time) in name_to_min_max_time.items():
            label = (name + " ").ljust(48, ".")
            if max_only:
                output_string += "\n    {}: {:.2f}".format(label, max_time)
            else:
                output_string += "\n    {}: ({:.2f}, {:.2f})".format(label, min_time, max_time)
        return output_string

    def _get_all_ranks_time_string(self, names, reset, barrier, normalizer):
        times = self._get_elapsed_time_all_ranks(names, reset, barrier)
        output_string = "times across ranks (ms):"
        reported = False
        for i, name in enumerate(names):
            header_written = False
            for rank in range(times.shape[0]):
                if times[rank, i] > 0:
                    reported = True
                    if not header_written:
                        header_written = True
                        output_string += "\n  {}:".format(name)
                    output_string += "\n     rank {:2d}: {:.2f}".format(rank, times[rank, i].item() / normalizer)
        return output_string if reported else None

    def get_log_string(self, names, normalizer=1.0, reset=True, barrier=False):
        """The report :meth:`log` prints (collective: call it on every rank)."""
        assert normalizer > 0.0
        # Elapsed times are seconds; reports are milliseconds.
        if self._log_option in ("max", "minmax"):
            return self._get_global_min_max_time_string(names, reset, barrier, normalizer / 1000.0,
                                                        max_only=self._log_option == "max")
        return self._get_all_ranks_time_string(names, reset, barrier, normalizer / 1000.0)

    def log(self, names, rank=None, normalizer=1.0, reset=True, barrier=False):
        """Print the report for ``names`` on ``rank`` (the last rank if None); every rank must call it."""
        output_string = self.get_log_string(names, normalizer=normalizer, reset=reset, barrier=barrier)
        world_size = torch.distributed.get_world_size() if distributed_is_initialized() else 1
        my_rank = torch.distributed.get_rank() if distributed_is_initialized() else 0
        if rank is None:
            rank = world_size - 1
        if rank == my_rank and output_string is not None:
            print(output_string, flush=True)

    def write(self, names, writer, iteration, normalizer=1.0, reset=False, barrier=False):
        """Write the max time over ranks of each timer to a TensorBoard writer as ``<name>-time``."""
        assert normalizer > 0.0
        name_to_min_max_time = self._get_global_min_max_time(names, reset, barrier, normalizer)
        if writer is not None:
            for name, (_, max_time) in name_to_min_max_time.items():
                writer.add_scalar(name + "-time", max_time, iteration)
