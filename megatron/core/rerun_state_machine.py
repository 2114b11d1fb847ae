"""Megatron's rerun state machine (megatron.core.rerun_state_machine): tell a transient hardware fault from a
persistent one or from a genuinely bad result, by re-running the suspicious iteration.

The trainer drives it around the forward/backward passes of every iteration::

    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):
        <zero the gradients; forward and backward over every micro-batch>
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

and validation sites (the loss function, the gradients before the data-parallel reduction, or a user's code)
call ``machine.validate_result(result, rejection_func, message, comparison_func, tolerance, fatal)``. The k-th
call with a given message inside one pass of one iteration is the *validation call* ``(message, k)``; the
control flow is deterministic, so the same call of a re-run sees the same quantity.

Modes (``--rerun-mode``):

* ``disabled``: a rejected result is logged (status ``RERUN_DISABLED``) and, when fatal, every rank stops with
  the same one-line error after the end-of-pass agreement (``ResultRejectedError``).
* ``validate_results``: a rejected result (or an injected error) on any rank makes *every* rank redo the
  iteration in place from the same state (RNG states and model buffers restored by the trainer's state
  functions, data iterators rewound to replay the same micro-batches). At the failing call the rank compares
  the new result with the first one, ``d = compare(initial, rerun)`` (default: 0 when equal or both NaN,
  infinity when only one is NaN/Inf, else ``|2 (a - b) / (a + b)|``):

  - ``d > tolerance``: "Possible transient error!" (``FIRST_RERUN_NOT_REPRODUCIBLE``); fatal: exit with
    ``EXIT_CODE_FAILED_ON_RESULT_VALIDATION`` (17) without saving, so the job restarts from its last checkpoint;
  - ``d <= tolerance``: reproducible on this device (``FIRST_RERUN_REPRODUCIBLE``); the node and device are
    remembered; fatal: save a checkpoint holding this machine's state and exit with
    ``EXIT_CODE_RESUME_TO_DISAMBIGUATE`` (16), to be resumed on another device;
  - resumed (state ``RERUNNING_FROM_CHECKPOINT``) on the same node and device: says so and exits 16 again;
    elsewhere, a different result means the first device is faulty ("Possible persistent error!",
    ``SECOND_RERUN_NOT_REPRODUCIBLE``), an equal one that the result was correct and the cause is the data
    or the application ("Correct result (but possible Application error)", ``SECOND_RERUN_REPRODUCIBLE``); a
    fatal verdict exits 17 (non-fatal verdicts continue). This library then saves a checkpoint at the same
    iteration without the pending re-run (Megatron leaves the earlier one), so that the restart trains on
    instead of re-running the verdict forever.
* ``report_determinism_stats`` (``--rerun-mode report_stats``): every iteration is re-run once in place and the
  relative differences per message are collected (:class:`QuickStats`, :meth:`stats_report`); never exits.

Every rejection and verdict is appended to ``--result-rejected-tracker-filename`` as one line
``ts=... node=... device=... jobID=... rank=... iteration=... status=... result=... message='...'``;
:func:`iterations_to_skip_from_tracker` reads it back at start-up: an iteration reported twice for the same rank
with status ``RERUN_DISABLED``, ``FIRST_RERUN_REPRODUCIBLE`` or ``SECOND_RERUN_REPRODUCIBLE`` (a result that
reproduces: bad data) is skipped, unless one job reported it on more than one rank.

Error injection (``--error-injection-rate N``, ``--error-injection-type``): at a validation call of an initial
run, at most once per iteration, rank ``r`` injects iff ``(randint(0, N - 1) + r) % N == 0`` (one random
stream seeded alike on every rank, so each draw picks at most one rank out of N consecutive ones). An injected
call is rejected whatever its value; ``transient_error`` then mis-compares on the in-place re-run,
``persistent_error`` on the re-run from the checkpoint, ``correct_result`` never.

Agreement: one all-reduce (MAX) of a few integers over the world after each pass (when the mode is not
``disabled`` or checks were requested); when something happened, one ``all_gather_object`` of the events so that
every rank reports and decides the same.
"""
from __future__ import annotations

import datetime
import enum
import math
import os
import random
import socket
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17

SPIKY_LOSS_FACTOR = 10.0  # --check-for-spiky-loss: a loss >= 10x the largest of the first 100 is spiky
LARGE_GRADS_FACTOR = 10.0  # --check-for-large-grads
LARGE_VALUE_SAMPLES = 100  # calls per context that only record the largest magnitude


class RerunMode(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"

    @classmethod
    def from_flag(cls, value) -> "RerunMode":
        """``--rerun-mode`` value (``report_stats`` is the command line's name of report_determinism_stats)."""
        if isinstance(value, RerunMode):
            return value
        return cls.REPORT_DETERMINISM_STATS if value == "report_stats" else cls(value)


class RerunState(enum.Enum):
    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunDiagnostic(str, enum.Enum):
    """The injected error types (``--error-injection-type``)."""
    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunValidationStatus(str, enum.Enum):
    """The ``status=`` of a tracker-file line."""
    RERUN_DISABLED = "RERUN_DISABLED"
    INITIAL_RUN = "INITIAL_RUN"
    FIRST_RERUN_NOT_REPRODUCIBLE = "FIRST_RERUN_NOT_REPRODUCIBLE"
    FIRST_RERUN_REPRODUCIBLE = "FIRST_RERUN_REPRODUCIBLE"
    SECOND_RERUN_NOT_REPRODUCIBLE = "SECOND_RERUN_NOT_REPRODUCIBLE"
    SECOND_RERUN_REPRODUCIBLE = "SECOND_RERUN_REPRODUCIBLE"


SKIPPABLE_STATUSES = (RerunValidationStatus.RERUN_DISABLED, RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE,
                      RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE)


class ResultRejectedError(RuntimeError):
    """A fatal rejection with ``--rerun-mode disabled``; every rank raises the same message."""


def compare_floats(a, b) -> float:
    """Relative difference of two scalars: 0 if equal (or both NaN), inf if only one is NaN/Inf, else
    ``|2 (a - b) / (a + b)|``."""
    a, b = float(a), float(b)
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if a + b == 0.0:
        return math.inf
    return abs(2.0 * (a - b) / (a + b))


def _scalar(result) -> float:
    if isinstance(result, torch.Tensor):
        return float(result.detach().float().reshape(-1)[0]) if result.numel() == 1 else math.nan
    return float(result)


def node_and_device() -> Tuple[str, str]:
    """Where this process runs: (host name, accelerator index, or ``cpu:<local rank>`` without one). Tests override
    it to play a restart on another device."""
    from megatron.core import device as _device

    if _device.on_gpu():
        return socket.gethostname(), str(torch.cuda.current_device())
    return socket.gethostname(), f"cpu:{os.environ.get('LOCAL_RANK', '0')}"


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


class QuickStats:
    """Relative differences of one validation site (report_determinism_stats)."""

    def __init__(self):
        self.values: List[float] = []

    def record(self, value: float):
        self.values.append(float(value))

    def summary(self) -> str:
        if not self.values:
            return "no samples"
        v = self.values
        return (f"{len(v)} samples, min {min(v):.3e}, median {statistics.median(v):.3e}, mean "
                f"{statistics.fmean(v):.3e}, max {max(v):.3e}")


class RerunDataIterator:
    """A data iterator that remembers the micro-batches of the current iteration so that a re-run replays them."""

    def __init__(self, iterable):
        self.iterable = iterable
        self.saved: List[Any] = []
        self.replay_position: Optional[int] = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.replay_position is not None and self.replay_position < len(self.saved):
            item = self.saved[self.replay_position]
            self.replay_position += 1
            return item
        item = next(self.iterable)
        self.saved.append(item)
        if self.replay_position is not None:
            self.replay_position += 1
        return item

    def rewind(self):
        self.replay_position = 0

    def advance(self):
        """The iteration is over: forget its micro-batches."""
        self.saved, self.replay_position = [], None


def _iterators(data_iterator) -> List[RerunDataIterator]:
    items = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    return [it for it in items if isinstance(it, RerunDataIterator)]


class RerunErrorInjector:
    """``--error-injection-rate`` / ``--error-injection-type`` (module docstring)."""

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR, seed: int = 1234):
        self.rate = int(error_injection_rate or 0)
        self.type = RerunDiagnostic(error_injection_type)
        self.rng = random.Random(seed)
        self.injected_this_iteration = False

    def maybe_inject(self, rank: int) -> bool:
        if self.rate <= 0 or self.injected_this_iteration:
            return False
        if (self.rng.randint(0, self.rate - 1) + rank) % self.rate == 0:
            self.injected_this_iteration = True
            return True
        return False

    def miscompare(self, injected: Optional[str], state: RerunState) -> Optional[float]:
        """The forced comparison for an injected call (None: compare the real values)."""
        if injected == RerunDiagnostic.TRANSIENT_ERROR and state == RerunState.RERUNNING_IN_PLACE:
            return math.inf
        if injected == RerunDiagnostic.PERSISTENT_ERROR and state == RerunState.RERUNNING_FROM_CHECKPOINT:
            return math.inf
        return None


@dataclass
class _Deferred:
    """A validation call of an initial run, judged at the end of the pass (``rejected``: a bool or 0-dim tensor)."""
    message: str
    sequence: int
    result: Any
    rejected: Any
    fatal: bool
    tolerance: float
    injected: Optional[str] = None


@dataclass
class _FailedCall:
    message: str
    sequence: int
    result: float
    fatal: bool
    tolerance: float
    injected: Optional[str] = None


# Slots of the per-pass agreement vector (MAX over the world).
_RERUN, _CHECKPOINT, _EXIT, _RESTART_AGAIN, _REJECTED_DISABLED, _EVENTS = range(6)


@dataclass
class _Verdict:
    checkpoint: bool = False
    exit: bool = False
    code: int = 0


@dataclass
class RerunStateMachine:
    """One per process (:func:`initialize_rerun_state_machine`); see the module docstring."""
    mode: RerunMode = RerunMode.DISABLED
    error_injector: RerunErrorInjector = field(default_factory=RerunErrorInjector)
    result_rejected_tracker_filename: Optional[str] = None
    state_save_func: Optional[Callable[[], Any]] = None
    state_restore_func: Optional[Callable[[Any], None]] = None
    checks_requested: bool = False  # with mode disabled: agree on fatal rejections (one all-reduce per pass)
    log: Callable[[str], None] = print

    def __post_init__(self):
        self.mode = RerunMode.from_flag(self.mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = 0
        self.failed: Optional[_FailedCall] = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[str] = None
        self.saved_state = None
        self.sequence: Dict[str, int] = {}
        self.deferred: List[_Deferred] = []
        self.flags = [0] * 6
        self.events: List[str] = []  # this pass's log lines, shared with every rank at the agreement
        self.verdict = _Verdict()
        self.saved_results: Dict[Tuple[str, int], float] = {}
        self.stats: Dict[str, QuickStats] = {}
        self.large_values: Dict[str, Tuple[int, float]] = {}  # context -> (samples, max |x|)
        self.shared_events: List[str] = []
        self.announced = False

    # ------------------------------------------------------------------------------------------ driving
    def should_run_forward_backward(self, data_iterator) -> bool:
        """True while the trainer must (re)run the forward and backward passes of the current iteration."""
        if self.state in (RerunState.NOT_RUNNING_YET, RerunState.WILL_RERUN_FROM_CHECKPOINT):
            resumed = self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
            self.current_iteration += 1
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT if resumed else RerunState.INITIAL_RUN
            self.verdict = _Verdict()
            self.error_injector.injected_this_iteration = False
            self.saved_results = {}
            self._begin_pass()
            if self.mode != RerunMode.DISABLED and self.state_save_func is not None:
                self.saved_state = self.state_save_func()
            return True
        agreed = self._agree()
        if self.state == RerunState.INITIAL_RUN and agreed[_RERUN]:
            self.state = RerunState.RERUNNING_IN_PLACE
            if self.mode == RerunMode.VALIDATE_RESULTS and _rank() == 0:
                self.log(f"[rerun] iteration {self.current_iteration}: re-running the iteration in place to check the "
                         "result (--rerun-mode validate_results)")
            if self.state_restore_func is not None:
                self.state_restore_func(self.saved_state)
            for it in _iterators(data_iterator):
                it.rewind()
            self._begin_pass()
            return True
        self._decide(agreed)
        for it in _iterators(data_iterator):
            it.advance()
        self.saved_state = None
        return False

    def should_checkpoint_and_exit(self) -> Tuple[bool, bool, int]:
        """(save a checkpoint?, exit?, exit code) for the iteration just run; call it before the optimizer step."""
        verdict = self.verdict
        self.verdict = _Verdict()
        return verdict.checkpoint, verdict.exit, verdict.code

    def _begin_pass(self):
        self.sequence = {}
        self.flags = [0] * 6
        self.events = []
        self.deferred = []

    def _agree(self) -> List[int]:
        """MAX of every rank's flags over the world, after judging this pass's deferred checks: one host-device
        synchronisation per pass (the list read back). When anything happened, everyone's log lines are shared."""
        if self.mode == RerunMode.DISABLED and not self.checks_requested:  # no agreement: this rank alone
            first = None
            if self.deferred:
                rejected = [bool(torch.as_tensor(d.rejected)) for d in self.deferred]
                first = rejected.index(True) if any(rejected) else None
            self._judge_deferred(first)
            flags = list(self.flags)
            if any(line.startswith("[fatal] ") for line in self.events):
                flags[_REJECTED_DISABLED], self.shared_events = 1, list(self.events)
            return flags
        flags = list(self.flags)
        flags[_EVENTS] = int(bool(self.events))
        if _world() == 1 and not self.deferred:  # nothing on the device, nobody to agree with: no synchronisation
            if flags[_EVENTS]:
                self._print_everyones_events()
            return flags
        dev = _collective_device()
        t = torch.tensor(flags, dtype=torch.int64, device=dev)
        local = torch.zeros(2, dtype=torch.int64, device=dev)
        if self.deferred:
            rejected = torch.stack([torch.as_tensor(d.rejected, device=dev).reshape(()) for d in self.deferred]).bool()
            if self.mode == RerunMode.DISABLED:
                fatal = torch.tensor([d.fatal for d in self.deferred], device=dev)
                t[_REJECTED_DISABLED] = (rejected & fatal).any().long()
            else:
                t[_RERUN] = torch.maximum(t[_RERUN], rejected.any().long())
            local = torch.stack([rejected.any().long(), rejected.long().argmax()])
        if _world() > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        values = torch.cat([t, local]).tolist()
        flags, (any_local, first) = values[:len(flags)], values[len(flags):]
        self._judge_deferred(int(first) if any_local else None)
        if flags[_EVENTS] or flags[_REJECTED_DISABLED] or (
                self.mode == RerunMode.VALIDATE_RESULTS and self.state == RerunState.INITIAL_RUN and flags[_RERUN]):
            self._print_everyones_events()
        return flags

    def _judge_deferred(self, first: Optional[int]):
        """Turn this pass's deferred checks into the failed call and the log lines (``first``: the index of the
        first rejected one, None when none was)."""
        deferred, self.deferred = self.deferred, []
        if first is None:
            return
        rank = _rank()
        if self.mode == RerunMode.DISABLED:
            fatal_seen = False
            for d in deferred:
                if not bool(torch.as_tensor(d.rejected)):
                    continue
                value = _scalar(d.result)
                self._track(RerunValidationStatus.RERUN_DISABLED, value, d.message)
                node, dev = node_and_device()
                line = (f"iteration {self.current_iteration}: {d.message} on rank {rank} (node {node}, device {dev}): "
                        f"unexpected result {value:g} (--rerun-mode disabled)")
                if d.fatal and not fatal_seen:
                    fatal_seen = True
                    self.events.append("[fatal] " + line)
                elif not d.fatal:
                    self.log("WARNING: " + line)
            return
        d = deferred[first]
        value = _scalar(d.result)
        self.failed = _FailedCall(d.message, d.sequence, value, d.fatal, d.tolerance, d.injected)
        self._track(RerunValidationStatus.INITIAL_RUN, value, d.message)
        self.events.append(f"[rerun] {self._where(rank)}: unexpected result {value:g} at iteration "
                           f"{self.current_iteration}, validation call #{d.sequence} (message='{d.message}')"
                           + (f" [injected {d.injected}]" if d.injected else ""))

    def _print_everyones_events(self):
        events = [self.events]
        if _world() > 1:
            events = [None] * _world()
            torch.distributed.all_gather_object(events, self.events)
        self.shared_events = [line for rank_events in events for line in (rank_events or [])]
        if _rank() == 0:
            for line in self.shared_events:
                self.log(line)

    def _decide(self, agreed: List[int]):
        if self.mode == RerunMode.DISABLED:
            if agreed[_REJECTED_DISABLED]:
                fatal = [line for line in self.shared_events if line.startswith("[fatal] ")]
                raise ResultRejectedError((fatal[0] if fatal else self.shared_events[0]).removeprefix("[fatal] "))
        elif agreed[_RESTART_AGAIN]:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self.verdict = _Verdict(checkpoint=False, exit=True, code=EXIT_CODE_RESUME_TO_DISAMBIGUATE)
            return
        elif agreed[_CHECKPOINT]:
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self.current_iteration -= 1  # the resumed job runs this iteration again
            self.verdict = _Verdict(checkpoint=True, exit=True, code=EXIT_CODE_RESUME_TO_DISAMBIGUATE)
            return
        elif agreed[_EXIT]:
            # After a second re-run the verdict is in: the checkpoint saved now holds no pending re-run.
            second = self.state == RerunState.RERUNNING_FROM_CHECKPOINT
            self.verdict = _Verdict(checkpoint=second, exit=True, code=EXIT_CODE_FAILED_ON_RESULT_VALIDATION)
        self.state = RerunState.NOT_RUNNING_YET
        self.failed = None

    # ------------------------------------------------------------------------------------------ validation
    def validate_result(self, result, rejection_func: Callable[[Any], Any], message: str = "unexpected result",
                        comparison_func: Optional[Callable[[Any, Any], float]] = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Check ``result`` (a 0-dim tensor or a number; a DTensor is read as this rank's local value) at one
        validation site (module docstring)."""
        result = getattr(result, "to_local", lambda: result)()
        if self.state == RerunState.NOT_RUNNING_YET and self.mode != RerunMode.DISABLED:
            return  # outside the training passes (evaluation): nothing to re-run
        compare = comparison_func or compare_floats
        if isinstance(result, torch.Tensor):
            result = result.detach()
        sequence = self.sequence.get(message, 0) + 1
        self.sequence[message] = sequence
        rank = _rank()
        if self.mode == RerunMode.DISABLED:
            if self.state == RerunState.NOT_RUNNING_YET:  # outside a driven pass (library use): judge it now
                self.deferred.append(_Deferred(message, sequence, result, rejection_func(result), fatal, tolerance))
                self._judge_deferred(0 if bool(torch.as_tensor(self.deferred[0].rejected)) else None)
                if self.events:
                    events, self.events = self.events, []
                    raise ResultRejectedError(events[0].removeprefix("[fatal] "))
                return
            self.deferred.append(_Deferred(message, sequence, result, rejection_func(result), fatal, tolerance))
            return
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.flags[_RERUN] = 1
                self.saved_results[(message, sequence)] = _scalar(result)
            elif self.state == RerunState.RERUNNING_IN_PLACE and (message, sequence) in self.saved_results:
                diff = compare(self.saved_results.pop((message, sequence)), _scalar(result))
                self.stats.setdefault(message, QuickStats()).record(diff)
            return
        self._announce()
        if self.state == RerunState.INITIAL_RUN:
            # Judged at the end of the pass, all calls at once (one host-device synchronisation per pass).
            injected = self.error_injector.maybe_inject(rank)
            self.deferred.append(_Deferred(message, sequence, result, True if injected else rejection_func(result),
                                           fatal, tolerance, self.error_injector.type.value if injected else None))
            return
        if self.failed is None or (message, sequence) != (self.failed.message, self.failed.sequence):
            return
        value = _scalar(result)
        forced = self.error_injector.miscompare(self.failed.injected, self.state)
        diff = forced if forced is not None else compare(self.failed.result, value)
        initial = self.failed.result
        note = f" [injected {self.failed.injected}]" if self.failed.injected else ""
        differs = f"{value:g} != {initial:g}" if forced is None else \
            f"{value:g} vs {initial:g}: a mismatch forced by the error injection"
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if diff > tolerance:
                self._track(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, value, message)
                self.events.append(f"[rerun] {self._where(rank)}: first rerun: the unexpected result is not "
                                   f"reproducible within the tolerance {tolerance:g} ({differs}){note}")
                self.events.append(f"[rerun] {self._where(rank)}: Possible transient error!")
                if fatal:
                    self.flags[_EXIT] = 1
            else:
                node, dev = node_and_device()
                self.suspicious_node, self.suspicious_device = node, dev
                self._track(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, value, message)
                then = "need to rerun on a different device to verify correctness" if fatal else \
                    f"not a fatal check ({message}): training goes on"
                self.events.append(f"[rerun] {self._where(rank)}: first rerun: the unexpected result is reproducible "
                                   f"within the tolerance {tolerance:g} ({value:g} = {initial:g}); {then}{note}")
                if fatal:
                    self.flags[_CHECKPOINT] = 1
        elif self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            node, dev = node_and_device()
            if (node, dev) == (self.suspicious_node, self.suspicious_device):
                self.events.append(f"[rerun] {self._where(rank)}: got rescheduled on the same device: need to resume "
                                   f"again from the same checkpoint (node: {node}, device: {dev})")
                self.flags[_RESTART_AGAIN] = 1
            elif diff > tolerance:
                self._track(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, value, message)
                self.events.append(f"[rerun] {self._where(rank)}: second rerun: the unexpected result is not "
                                   f"reproducible on a different device ({differs}), therefore was "
                                   f"likely incorrect; the first device (node {self.suspicious_node}, device "
                                   f"{self.suspicious_device}) is suspect{note}")
                self.events.append(f"[rerun] {self._where(rank)}: Possible persistent error!")
                if fatal:
                    self.flags[_EXIT] = 1
            else:
                self._track(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, value, message)
                self.events.append(f"[rerun] {self._where(rank)}: second rerun: the unexpected result is reproducible "
                                   f"on a different device ({value:g} = {initial:g}), therefore it was likely correct"
                                   f"{note}")
                self.events.append(f"[rerun] {self._where(rank)}: Correct result (but possible Application error) "
                                   f"({message})")
                if fatal:
                    self.flags[_EXIT] = 1

    def is_unexpectedly_large(self, result, threshold: float, context: str,
                              num_samples: int = LARGE_VALUE_SAMPLES) -> bool:
        """Rejection function: the first ``num_samples`` calls for ``context`` record the largest ``|x|``; later calls
        reject ``|x| >= threshold * largest``. NaN and Inf are never "large" (the NaN/Inf checks see them). Re-runs
        neither record nor shift the statistics."""
        value = abs(_scalar(result))
        if not math.isfinite(value):
            return False
        samples, largest = self.large_values.get(context, (0, 0.0))
        if samples < num_samples:
            if self.state in (RerunState.INITIAL_RUN, RerunState.NOT_RUNNING_YET):
                self.large_values[context] = (samples + 1, max(largest, value))
            return False
        return value >= threshold * largest

    # ------------------------------------------------------------------------------------------ reporting
    def _where(self, rank: int) -> str:
        node, dev = node_and_device()
        return f"Rank {rank}, node {node}, device {dev}"

    def _announce(self):
        if not self.announced:
            self.announced = True
            if _rank() == 0:
                self.log("[rerun] result validation enabled (--rerun-mode validate_results)")

    def _track(self, status: RerunValidationStatus, value: float, message: str):
        if not self.result_rejected_tracker_filename:
            return
        node, dev = node_and_device()
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        job = os.environ.get("SLURM_JOBID", "N/A")
        line = (f"ts={stamp} node={node} device={dev} jobID={job} rank={_rank()} iteration={self.current_iteration} "
                f"status={status.value} result={value!r} message='{message}'\n")
        with open(self.result_rejected_tracker_filename, "a") as f:
            f.write(line)

    def stats_report(self) -> str:
        """report_determinism_stats: the relative differences per validation site so far."""
        if not self.stats:
            return "[rerun] determinism stats: no validation site reported yet"
        rows = [f"[rerun] determinism stats (relative difference between the run and its re-run, rank {_rank()}):"]
        rows += [f"  {message}: {stats.summary()}" for message, stats in sorted(self.stats.items())]
        return "\n".join(rows)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Optional[dict]:
        """This rank's part of a checkpoint (None when disabled); the re-run details only while one is pending."""
        if self.mode == RerunMode.DISABLED:
            return None
        pending = self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT
        return {"mode": self.mode.value, "state": self.state.name if pending else RerunState.NOT_RUNNING_YET.name,
                "current_iteration": self.current_iteration,
                "failed": vars(self.failed).copy() if pending and self.failed is not None else None,
                "suspicious_node": self.suspicious_node if pending else None,
                "suspicious_device": self.suspicious_device if pending else None,
                "large_values": dict(self.large_values)}

    def load_state_dict(self, state: Optional[dict]):
        if state is None or self.mode == RerunMode.DISABLED:
            return
        self.large_values = dict(state.get("large_values", {}))
        if state.get("state") == RerunState.WILL_RERUN_FROM_CHECKPOINT.name:
            if self.mode != RerunMode.VALIDATE_RESULTS:
                self.log(f"[rerun] the checkpoint waits for a re-run of iteration {state['current_iteration'] + 1}, "
                         f"which --rerun-mode {self.mode.value} does not do: training on")
                return
            self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self.current_iteration = int(state["current_iteration"])
            self.failed = _FailedCall(**state["failed"]) if state.get("failed") else None
            self.suspicious_node, self.suspicious_device = state["suspicious_node"], state["suspicious_device"]
            if _rank() == 0:
                self.log(f"[rerun] resuming to re-run iteration {self.current_iteration + 1} from the checkpoint "
                         "(its result was reproducible on the first device)")


def _collective_device():
    from megatron.core import device as _device

    return _device.current_device()


def iterations_to_skip_from_tracker(filename: Optional[str]) -> List[int]:
    """Iterations the tracker file says to skip (module docstring); [] when there is no file."""
    if not filename or not os.path.isfile(filename):
        return []
    counts: Dict[Tuple[int, int], int] = {}
    ranks_per_job: Dict[Tuple[str, int], set] = {}
    skippable = {s.value for s in SKIPPABLE_STATUSES}
    with open(filename) as f:
        for line in f:
            fields = dict(part.split("=", 1) for part in line.split(" message=")[0].split() if "=" in part)
            try:
                rank, iteration = int(fields["rank"]), int(fields["iteration"])
            except (KeyError, ValueError):
                continue
            if fields.get("status") in skippable:
                counts[(rank, iteration)] = counts.get((rank, iteration), 0) + 1
                ranks_per_job.setdefault((fields.get("jobID", "N/A"), iteration), set()).add(rank)
    several_ranks = {it for (_, it), ranks in ranks_per_job.items() if len(ranks) > 1}
    return sorted({it for (_, it), n in counts.items() if n >= 2 and it not in several_ranks})


# ---------------------------------------------------------------------------------------------- the instance
_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> RerunStateMachine:
    """Create this process's machine (keywords of :class:`RerunStateMachine`)."""
    global _MACHINE
    _MACHINE = RerunStateMachine(**kwargs)
    return _MACHINE


def get_rerun_state_machine() -> RerunStateMachine:
    """This process's machine; a disabled one when none was initialised (library use without the trainer)."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = RerunStateMachine()
    return _MACHINE


def destroy_rerun_state_machine() -> None:
    global _MACHINE
    _MACHINE = None


def wrap_data_iterators(data_iterator) -> Any:
    """Wrap the trainer's data iterator(s) (one, a list per virtual stage, or None) in RerunDataIterator. Anything
    that is not an iterator (a batch handed to the forward step as is) is left alone: a re-run sees it again."""
    if isinstance(data_iterator, list):
        return [wrap_data_iterators(it) for it in data_iterator]
    if isinstance(data_iterator, RerunDataIterator) or not hasattr(data_iterator, "__next__"):
        return data_iterator
    return RerunDataIterator(data_iterator)


def advance_data_iterators(data_iterator, count: int) -> None:
    """Consume ``count`` micro-batches from every iterator (a skipped iteration)."""
    items: Iterable = data_iterator if isinstance(data_iterator, list) else [data_iterator]
    for it in items:
        if it is None:
            continue
        for _ in range(count):
            next(it)
        if isinstance(it, RerunDataIterator):
            it.advance()
