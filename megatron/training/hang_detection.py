"""Hang and straggler detection without a collective: every rank's progress goes to the rendezvous store.

Why: a rank that stops without dying (a deadlock, a stuck collective, SIGSTOP, a Python loop that never ends)
keeps every other rank waiting in its next collective until ``--distributed-timeout-minutes``, which then ends
with a message that names no rank.

Protocol (``--hang-timeout-minutes T``, 0 turns it off; multi-rank runs under fault_handling.py):

* The training loop writes its progress into a local record, ``ProgressTracker.record`` =
  ``(count, iteration, micro-batch, phase)``: a tuple assignment per phase change, no store round trip on the hot
  path. Phases: ``forward``, ``loss_func`` (it averages the loss over data-parallel ranks: a collective),
  ``backward``, ``finalize_model_grads`` (the gradient all-reduce: a collective), ``optimizer``,
  ``eval forward``, ``save and exit checks``; ``setup`` until the first iteration.
* Each rank's watchdog thread (fault_handling.FaultMonitor, about once a second) publishes the record when it
  changed, under ``progress/<rank>``, with a flag ``waiting``: its main thread is blocked in a collective (the
  innermost frames are in ``torch.distributed`` or wait on a communication handle), read from
  ``sys._current_frames()``. It also refreshes its heartbeat ``hb/<rank>``.
* Frozen ranks: every rank watches its neighbour (rank+1 mod world). A heartbeat that has not changed for ``T``
  while the process is still there means the whole process stopped (SIGSTOP, a freeze holding the GIL): the
  watcher records ``rank R hung: not responding ...`` under the job's failure key. On the same host it then
  sends the rank ``STACK_SIGNAL`` (SIGUSR2; ``faulthandler`` is registered for it on every rank, so the stack is
  written even while the GIL is held) and SIGCONT, so that the stack is printed and the rank ends itself (its
  watchdog then prints the main thread's stack read from Python too: the faulthandler dump of a process that
  resumes while it is written can come out garbled).
* Stuck ranks: rank 0's watchdog (the judge) reads every record each poll (O(world size) store reads, one
  client). A rank is *stuck* when its record has not changed for ``T`` (judged on the judge's clock). With no
  rank in ``setup``: the stuck ranks that are not waiting are the suspects; when some other rank still advances
  or waits for them, the suspects furthest behind (smallest (iteration, count)) are named. When every rank is
  stuck and waiting but in different places (mismatched collectives), the ranks furthest behind are named.
  Every rank stuck in the same place with nobody waiting (one long phase everywhere) is not a hang.
* The verdict goes under the failure key that every watchdog already polls: every rank prints one line
  ``[rank N] exiting: rank R hung: ...`` (its last iteration, micro-batch and phase) and exits 1; the named rank
  prints its main thread's Python stack (prefixed ``[rank R]``) first.

``--log-straggler`` (off by default): at every log interval, one all-gather of each rank's compute time per
iteration (time in non-collective phases of the training step: waiting for a slow peer is not counted) and
rank 0 prints the ``--straggler-minmax-count`` slowest and fastest ranks.

Limits: a save or a phase that one rank runs alone longer than ``T`` while the others wait is reported as a hang
(choose ``T`` above the longest checkpoint save). With GPU collectives the waiting ranks block later, at their
next synchronisation; they are then further ahead, and the rank behind is named.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import signal
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.fault_injection import requested_fault

STACK_SIGNAL = signal.SIGUSR2
SETUP = "setup"
Record = Tuple[int, int, int, str]  # count, iteration, micro-batch, phase


# ------------------------------------------------------------------------------------------------ training side
class ProgressTracker:
    """This rank's progress, written by the training loop (cheap), read by the watchdog thread."""

    def __init__(self, rank: int = 0, log_straggler: bool = False, straggler_minmax_count: int = 1,
                 log_interval: int = 100):
        self.rank = rank
        self.record: Record = (0, 0, 0, SETUP)
        self.log_straggler = log_straggler
        self.minmax_count = straggler_minmax_count
        self.log_interval = max(1, log_interval)
        self._compute_seconds = 0.0  # time in non-collective phases of train steps since the last report
        self._steps = 0
        self._phase_start = time.perf_counter()
        self._phase_is_compute = False
        self._first_reported_iteration = None

    # -------------------------------------------------------------- phase changes (training loop, main thread)
    def phase(self, name: str, compute: bool = False, microbatch: Optional[int] = None):
        count, iteration, mb, _ = self.record
        if self.log_straggler:
            now = time.perf_counter()
            if self._phase_is_compute:
                self._compute_seconds += now - self._phase_start
            self._phase_start, self._phase_is_compute = now, compute
        self.record = (count + 1, iteration, mb if microbatch is None else microbatch, name)

    def begin_iteration(self, iteration: int):
        """Called at the start of each training iteration (``iteration`` is the one about to run)."""
        count = self.record[0]
        self.record = (count + 1, iteration, 0, "start of iteration")
        self._steps += 1
        if self._first_reported_iteration is None:
            self._first_reported_iteration = iteration
        if self.log_straggler:
            self._phase_start, self._phase_is_compute = time.perf_counter(), False

    def wrap_forward_step(self, forward_step_func):
        """``forward_step_func`` that records ``forward`` / ``loss_func`` / ``backward`` per micro-batch."""
        def forward_step(*args, **kwargs):
            count, iteration, mb, _ = self.record
            training = torch.is_grad_enabled()
            self.phase("forward" if training else "eval forward", compute=training, microbatch=mb + 1)
            fault = requested_fault(("slow",), self.rank, iteration)
            if fault is not None and training:
                time.sleep(fault[1])  # a straggler (tests): slow but progressing
            output_tensor, loss_func = forward_step_func(*args, **kwargs)

            def tracked_loss_func(*largs, **lkwargs):
                self.phase("loss_func")
                result = loss_func(*largs, **lkwargs)
                self.phase("backward" if training else "eval forward", compute=training)
                return result
            return output_tensor, tracked_loss_func
        return forward_step

    def wrap_collective(self, func, name: str, then: str, then_compute: bool = True):
        """``func`` recorded as collective phase ``name``; phase ``then`` after it returns."""
        def collective(*args, **kwargs):
            self.phase(name)
            fault = requested_fault(("stall",), self.rank, self.record[1])
            if fault is not None:  # a rank stuck in Python inside a collective phase (tests)
                print(f"[rank {self.rank}] injected stall in {describe(self.record[:3] + (False,) + self.record[3:])}",
                      file=sys.stderr, flush=True)
                _stall(fault[1])
            result = func(*args, **kwargs)
            self.phase(then, compute=then_compute)
            return result
        return collective

    # -------------------------------------------------------------- straggler report (collective, opt-in)
    def after_step(self, iteration: int):
        """Called after each iteration's logging: the straggler report on log intervals (--log-straggler)."""
        if not self.log_straggler:
            return
        self.phase("straggler report")
        if iteration % self.log_interval != 0:
            return
        from megatron.core import device
        world = torch.distributed.get_world_size()
        mine = torch.tensor([self._compute_seconds / max(1, self._steps)], dtype=torch.float64,
                            device=device.current_device())
        every = [torch.zeros_like(mine) for _ in range(world)]
        torch.distributed.all_gather(every, mine)
        first = self._first_reported_iteration
        self._compute_seconds, self._steps, self._first_reported_iteration = 0.0, 0, None
        if self.rank == 0:
            print(format_straggler_report([float(t.item()) for t in every], first, iteration, self.minmax_count),
                  flush=True)


def format_straggler_report(seconds: List[float], first: int, last: int, count: int) -> str:
    order = sorted(range(len(seconds)), key=lambda r: (-seconds[r], r))
    count = max(1, min(count, len(seconds)))
    slow = ", ".join(f"rank {r} {seconds[r] * 1e3:.1f} ms" for r in order[:count])
    fast = ", ".join(f"rank {r} {seconds[r] * 1e3:.1f} ms" for r in reversed(order[-count:]))
    return (f"straggler report (iterations {first}-{last}, compute time per iteration, waits in collectives "
            f"excluded): slowest {slow} | fastest {fast}")


def _stall(seconds: float):
    deadline = time.time() + (seconds if seconds > 0 else 1e9)
    while time.time() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.time())))


# ------------------------------------------------------------------------------------------------ watchdog side
def main_thread_waiting() -> bool:
    """True when the main thread is blocked in a collective: one of its innermost frames is in torch.distributed,
    or the innermost one waits on a communication handle (``handle.wait()``)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    for depth in range(4):
        if frame is None:
            return False
        filename = frame.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in filename:
            return True
        if depth == 0 and ".wait(" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
            return True
        frame = frame.f_back
    return False


def main_thread_stack(rank: int) -> str:
    import traceback
    frame = sys._current_frames().get(threading.main_thread().ident)
    lines = traceback.format_stack(frame) if frame is not None else ["(no main thread)\n"]
    text = "Python stack of the main thread (most recent call last):\n" + "".join(lines)
    return "\n".join(f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines())


def encode(record: Record, waiting: bool) -> str:
    count, iteration, mb, phase = record
    return f"{count} {iteration} {mb} {int(waiting)} {phase}"


def decode(text: str):
    count, iteration, mb, waiting, phase = text.split(" ", 4)
    return int(count), int(iteration), int(mb), waiting == "1", phase


def describe(record) -> str:
    _, iteration, mb, _, phase = record
    if phase == SETUP:
        return "setup (before the first iteration)"
    return f"iteration {iteration}" + (f", micro-batch {mb}" if mb else "") + f", phase {phase}"


class HangJudge:
    """Rank 0's view of every rank's progress; ``verdict`` returns a failure message or None."""

    def __init__(self, world_size: int, timeout_seconds: float):
        self.world_size, self.timeout = world_size, timeout_seconds
        self.records: Dict[int, tuple] = {}
        self.changed_at: Dict[int, float] = {}

    def observe(self, rank: int, text: str, now: float):
        if self.records.get(rank, (None,))[0:4] != decode(text)[0:4] or rank not in self.records:
            self.changed_at[rank] = now
        self.records[rank] = decode(text)

    def verdict(self, now: float) -> Optional[Tuple[List[int], str]]:
        """None, or (the ranks named, the one-line message)."""
        if len(self.records) < self.world_size or any(r[4] == SETUP for r in self.records.values()):
            return None
        stuck = {r for r in self.records if now - self.changed_at[r] >= self.timeout}
        if not stuck:
            return None
        waiting = {r for r in self.records if self.records[r][3]}
        suspects = stuck - waiting
        if suspects and (len(suspects) < self.world_size or self._differ(suspects)):
            return self._name(self._behind(suspects), now, "while the others went on or wait for it")
        if not suspects and len(stuck) == self.world_size and self._differ(stuck):
            return self._name(self._behind(stuck), now, "waiting in another place than the others "
                                                         "(mismatched collectives?)")
        return None

    def _differ(self, ranks) -> bool:
        return len({(self.records[r][1], self.records[r][0]) for r in ranks}) > 1

    def _behind(self, ranks) -> List[int]:
        least = min((self.records[r][1], self.records[r][0]) for r in ranks)
        return sorted(r for r in ranks if (self.records[r][1], self.records[r][0]) == least)

    def _name(self, ranks, now, why) -> str:
        parts = [f"rank {r} hung: no progress for {now - self.changed_at[r]:.1f} s in {describe(self.records[r])}"
                 for r in ranks]
        others = sorted(set(self.records) - set(ranks))
        ahead = "; ".join(f"rank {r}: {describe(self.records[r])}" + (" (waiting)" if self.records[r][3] else "")
                          for r in others[:4]) + (" ..." if len(others) > 4 else "")
        return ranks, f"{'; '.join(parts)}, {why} [{ahead}]"


def frozen_message(rank: int, host: str, pid: int, seconds: float, last: Optional[str]) -> str:
    where = describe(decode(last)) if last else "setup (before the first iteration)"
    return (f"rank {rank} hung: not responding for {seconds:.1f} s (host {host}, pid {pid}: the process is "
            f"stopped or frozen), last progress {where}")


def register_stack_dump():
    """Every rank: write every thread's Python stack to stderr on STACK_SIGNAL (works while the GIL is held)."""
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)


def ask_for_stack(pid: int):
    """Same host: make a stopped or frozen rank print its stack (pending until it runs), then let it run."""
    for sig in (STACK_SIGNAL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except OSError:
            return
