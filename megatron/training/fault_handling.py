"""When one rank fails, every rank stops soon, says which rank failed first and why, and leaves no process behind.

Why this exists: a multi-rank job has no natural way to stop. A rank that raises exits, but its peers sit in
their next collective until the distributed timeout (10 minutes by default), then die with a generic
"timeout"/"connection closed" error that does not say which rank broke or why; a SIGKILLed rank leaves no message
at all. Under SLURM without torchrun nothing tears the survivors down.

How: ``fault_handling(args)`` wraps the body of ``pretrain`` (multi-rank runs only; one process has no peers):

* On an exception, the failing rank prints its traceback once, every line prefixed ``[rank R]``, records
  ``rank R failed: <ExcType: msg>`` under one key of the rendezvous TCPStore (first writer wins, so the rank that
  failed *first* is the one named), then exits with code 1 via ``os._exit`` after flushing (no atexit handler, no
  ``destroy_process_group`` that could wait on a dead peer).
* A rank whose exception is only the consequence of a peer's death (gloo's "Connection closed by peer", a
  collective timeout) first looks for the real culprit: the failure key, or a peer process that is gone. It then
  prints one line naming that rank and its exception and exits 1, instead of blaming itself.
* A daemon watchdog thread on every rank polls the store about once a second (no collective, nothing on the
  training path): when another rank's failure is recorded it prints one line naming it and ends the process. It
  also watches one neighbour (rank+1 mod world): on the same host by its pid (a SIGKILLed process is gone at once),
  on another host by a heartbeat key that must advance; a dead neighbour is recorded as
  ``rank N died (...)``, so the whole job learns about it through the same key. Watching one neighbour keeps the
  store's load O(world size). Losing the store itself (its host, rank 0 or torchrun's agent, died) also ends the
  rank with a message.
* A :class:`FatalRunError` raised with ``same_on_every_rank`` (a failed checkpoint save that the ranks agreed on, the
  NaN check) is an orderly stop: every rank raises it after the same collective, so the handler only stops the
  watchdog and lets it propagate to the entry point, which prints the one line once.
* Normal exit (end of ``pretrain``, or ``sys.exit`` from --exit-interval / --exit-duration-in-mins / SIGTERM, or
  the rerun state machine's agreed exit codes 16 / 17, :class:`~megatron.training.errors.AgreedExit`) marks the
  rank done in the store and stops the thread, so a neighbour that finishes first is not a failure.

torchrun tears the other workers down itself (SIGTERM, then SIGKILL) when one exits non-zero; the failing rank has
already printed its prefixed traceback before exiting, so the first failure is still named.

* A rank that stops without dying (a deadlock, SIGSTOP, a stuck collective) is found by the same thread, from
  the progress record the training loop keeps (``--hang-timeout-minutes``): megatron/training/hang_detection.py
  states that protocol.

``MEGATRON_FAULT_INJECT`` (tests only) injects a fault at the start of an iteration, e.g.
``raise:rank=1:iter=3`` (ZeroDivisionError), ``raise:rank=1:iter=3:delay=2`` (sleep first, so that the peers are
blocked inside a collective when it raises), ``kill:rank=1:iter=3`` (SIGKILL itself), ``sigterm:rank=1:iter=3`` (SIGTERM to itself only),
``sigterm_group:rank=0:iter=3`` (SIGTERM to its whole process group).
When unset the hook is one environment lookup per iteration.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch

from megatron.training import hang_detection
from megatron.training.errors import AgreedExit, FatalRunError
from megatron.training.fault_injection import requested_fault
from megatron.training.hang_detection import ProgressTracker

POLL_SECONDS = 1.0
_RUN_COUNTER = [0]  # pretrain may run several times in one process (tests): each run gets its own store keys


def maybe_inject_fault(iteration, rank):
    """Test hook, called at the start of each iteration (``iteration`` is the one about to run); the spec is
    parsed by megatron/training/fault_injection.py (one parser for every injected fault)."""
    fault = requested_fault(("raise", "kill", "sigterm", "sigterm_group"), rank, iteration)
    if fault is None:
        return
    kind, delay = fault
    time.sleep(delay)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "sigterm_group":  # every process of the job's process group, as SLURM or a batch system does
        os.killpg(os.getpgid(0), signal.SIGTERM)
    else:
        1 / 0  # noqa: B018  the injected ZeroDivisionError


def _describe(exc, limit=None):
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if limit is None or len(text) <= limit else text[:limit] + " ..."


def _process_state(pid):
    """The state letter of ``pid`` in /proc (R, S, T stopped, Z zombie, ...); None when it is absent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _process_gone(pid):
    """True when ``pid`` no longer runs on this host (absent, or a zombie waiting to be reaped)."""
    try:
        state = _process_state(pid)
        return state is None or state in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False


class FaultMonitor:
    """One rank's view of the job's health, kept in the rendezvous store (a client connection of its own)."""

    def __init__(self, rank, world_size, timeout_seconds, hang_seconds=0.0, progress=None):
        self.rank, self.world_size = rank, world_size
        self.stale_after = min(60.0, max(5.0, timeout_seconds / 2))  # a heartbeat older than this is a dead rank
        self.hang_seconds, self.progress = hang_seconds, progress
        self.poll = min(POLL_SECONDS, max(0.2, hang_seconds / 5)) if hang_seconds > 0 else POLL_SECONDS
        self.judge = hang_detection.HangJudge(world_size, hang_seconds) if hang_seconds > 0 and rank == 0 else None
        self.published = None  # the progress text last written to the store
        _RUN_COUNTER[0] += 1
        # A restarted job (torchrun --max-restarts) may find the previous attempt's keys in the agent's store.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"megatron_fault/{attempt}/{_RUN_COUNTER[0]}/"
        self.host = socket.gethostname()
        self.addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(os.environ.get("MASTER_PORT", "6000"))
        self.store = torch.distributed.TCPStore(self.addr, self.port, None, False, timedelta(seconds=30))
        self.store.set(self._key("info", rank), f"{self.host} {os.getpid()}")
        self.store.set(self._key("hb", rank), str(time.time()))
        self.peers = {}  # rank -> (host, pid), filled lazily: peers register at about the same time
        self.beats = {}  # rank -> (last heartbeat value seen, local time it was first seen)
        self.lock = threading.Lock()  # the main thread (on failure) and the watchdog share the store client
        if hang_seconds > 0:
            hang_detection.register_stack_dump()
            self._publish_progress()
        self.stopped = threading.Event()
        self.reporting = threading.Lock()  # only one thread (main or watchdog) reports and exits
        self.thread = threading.Thread(target=self._watch, name="megatron-fault-watchdog", daemon=True)
        self.thread.start()

    def _key(self, kind, rank=None):
        return self.prefix + kind + ("" if rank is None else f"/{rank}")

    # ---------------------------------------------------------------- store access (under the lock)
    def _recorded_failure(self):
        with self.lock:
            if self.store.check([self._key("failure")]):
                return self.store.get(self._key("failure")).decode()
        return None

    def record_failure(self, message):
        """Record ``message`` unless another failure came first; return the message that is recorded."""
        with self.lock:
            return self.store.compare_set(self._key("failure"), "", message).decode()

    def _peer(self, rank):
        if rank not in self.peers:
            with self.lock:
                if not self.store.check([self._key("info", rank)]):
                    return None
                host, pid = self.store.get(self._key("info", rank)).decode().split()
            self.peers[rank] = (host, int(pid))
        return self.peers[rank]

    def _learn_peers(self):
        """Cache every peer's host and pid while the store is up: if the store's host dies, a rank can still tell
        which local process is gone. Above 256 ranks only the neighbour is cached (the store's load stays O(N))."""
        if len(self.peers) >= self.world_size - 1 or self.world_size > 256:
            return
        for rank in range(self.world_size):
            if rank != self.rank:
                self._peer(rank)

    def _dead_peer(self, rank):
        """A message when ``rank`` is gone without having finished normally, else None."""
        peer = self._peer(rank)
        if peer is None:
            return None
        host, pid = peer
        if host == self.host:
            if not _process_gone(pid):
                return None
        else:
            # A heartbeat that stopped changing, timed on this host's clock (hosts' clocks may disagree).
            with self.lock:
                beat = self.store.get(self._key("hb", rank))
            if self.beats.get(rank, (None,))[0] != beat:
                self.beats[rank] = (beat, time.time())
            if time.time() - self.beats[rank][1] < self.stale_after:
                return None
        try:
            with self.lock:
                if self.store.check([self._key("done", rank)]):
                    return None
        except Exception:  # noqa: BLE001  the store died too: a vanished local process is still a death
            if host != self.host:
                raise
        where = f"pid {pid}" if host == self.host else f"host {host}, no heartbeat for {self.stale_after:.0f} s"
        return f"rank {rank} died ({where}) without reporting an exception (killed by a signal?)"

    # ---------------------------------------------------------------- hang detection (hang_detection.py)
    def _publish_progress(self):
        text = hang_detection.encode(self.progress.record, hang_detection.main_thread_waiting())
        if text != self.published:
            with self.lock:
                self.store.set(self._key("progress", self.rank), text)
            self.published = text

    def _frozen(self, rank, named=False):
        """Seconds since ``rank``'s watchdog last beat when that exceeds the hang timeout (its whole process is
        stopped or frozen, yet not gone), else None. Same host: its heartbeat (same clock); a rank the judge named
        also counts when its process is in the stopped state (SIGSTOP)."""
        peer = self._peer(rank)
        if peer is None or self.hang_seconds <= 0:
            return None
        host, pid = peer
        with self.lock:
            beat = self.store.get(self._key("hb", rank))
        stopped = False
        if host == self.host:
            age = time.time() - float(beat)
        else:
            if self.beats.get(rank, (None,))[0] != beat:
                self.beats[rank] = (beat, time.time())
            age = time.time() - self.beats[rank][1]
        with contextlib.suppress(OSError):
            stopped = named and host == self.host and _process_state(pid) in ("T", "t")
        if (age < self.hang_seconds and not stopped) or (host == self.host and _process_gone(pid)):
            return None
        with self.lock:
            if self.store.check([self._key("done", rank)]):
                return None
        return age

    def _report_frozen(self, rank, age):
        """Record that ``rank`` is not responding; on this host make it print its stack and run to its end."""
        host, pid = self._peer(rank)
        with self.lock:
            last = self.store.get(self._key("progress", rank)).decode() \
                if self.store.check([self._key("progress", rank)]) else None
        failure = self.record_failure(hang_detection.frozen_message(rank, host, pid, age, last))
        if failure.startswith(f"rank {rank} hung: not responding") and host == self.host:
            hang_detection.ask_for_stack(pid)
        return failure

    def _check_hang(self, neighbour):
        """One poll: publish this rank's progress, watch the neighbour's heartbeat, and on rank 0 judge everyone."""
        self._publish_progress()
        age = self._frozen(neighbour)
        if age is not None:
            return self._report_frozen(neighbour, age)
        if self.judge is None:
            return None
        keys = [self._key("progress", r) for r in range(self.world_size)]
        with self.lock:
            if not self.store.check(keys):
                return None
            texts = [v.decode() for v in self.store.multi_get(keys)]
        now = time.monotonic()
        for r, text in enumerate(texts):
            self.judge.observe(r, text, now)
        named = self.judge.verdict(now)
        if named is None:
            return None
        ranks, message = named
        with self.lock:
            if any(self.store.check([self._key("done", r)]) for r in ranks):
                return None  # a rank that finished normally is not hung
        for r in ranks:
            age = self._frozen(r, named=True) if r != self.rank else None
            if age is not None:
                return self._report_frozen(r, age)
        return self.record_failure(message)

    # ---------------------------------------------------------------- watchdog thread
    def _watch(self):
        neighbour = (self.rank + 1) % self.world_size
        store_errors_since = None
        while not self.stopped.wait(self.poll):
            try:
                with self.lock:
                    self.store.set(self._key("hb", self.rank), str(time.time()))
                self._learn_peers()
                failure = self._recorded_failure()
                if failure is None:
                    dead = self._dead_peer(neighbour)
                    if dead is not None:
                        failure = self.record_failure(dead)
                if failure is None and self.hang_seconds > 0:
                    failure = self._check_hang(neighbour)
                store_errors_since = None
            except Exception as exc:  # the store's host is gone, or a transient network error
                if self.stopped.is_set():
                    return
                store_errors_since = store_errors_since or time.time()
                if time.time() - store_errors_since < min(self.stale_after, 3 * POLL_SECONDS):
                    continue
                failure = (f"lost the rendezvous store at {self.addr}:{self.port} (its host, rank 0 or the "
                           f"launcher, is gone): {_describe(exc, 100)}")
            if failure is not None and not self.stopped.is_set():
                self._stop_because_of(failure)  # exits, unless the main thread is already reporting
                return

    def _stop_because_of(self, failure):
        if failure.startswith(f"rank {self.rank} failed"):
            return  # our own failure: the main thread is reporting it and exiting
        if not self.reporting.acquire(blocking=False):
            return  # the main thread is already reporting
        if re.search(rf"(^|; )rank {self.rank} hung: ", failure):
            # Stuck, or frozen and now running again (SIGCONT): the main thread's stack read from Python, which
            # stays readable when the faulthandler dump of a process that resumed mid-dump comes out garbled.
            print(hang_detection.main_thread_stack(self.rank), file=sys.stderr, flush=True)
        print(f"[rank {self.rank}] exiting: {failure}", file=sys.stderr, flush=True)
        self.leave(1)

    def leave(self, code):
        """Exit after a failure. The process hosting the store (rank 0 when not under torchrun) waits until every
        other rank has read the failure (or is gone), so that no rank is left with only "store unreachable"."""
        self.stopped.set()
        with contextlib.suppress(Exception):
            with self.lock:
                self.store.set(self._key("left", self.rank), "1")
            hosts_store = self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            deadline = time.time() + 3 * POLL_SECONDS + 2
            waiting = set(range(1, self.world_size)) if hosts_store else set()
            while waiting and time.time() < deadline:
                with self.lock:
                    waiting = {r for r in waiting if not self.store.check([self._key("left", r)])}
                waiting = {r for r in waiting if not (self._peer(r) and self._peer(r)[0] == self.host
                                                      and _process_gone(self._peer(r)[1]))}
                time.sleep(POLL_SECONDS / 10)
        _hard_exit(code)

    # ---------------------------------------------------------------- main-thread failure path
    def culprit(self, exc):
        """The failure that explains ``exc``: another rank's recorded failure or death, else this rank's own."""
        consequential = isinstance(exc, torch.distributed.DistBackendError) or any(
            text in str(exc) for text in ("Connection closed by peer", "Connection reset", "Broken pipe",
                                          "Timed out", "timed out", "Socket Timeout"))
        deadline = time.time() + (self.stale_after + 2 * POLL_SECONDS if consequential else 0)
        while True:
            try:
                failure = self._recorded_failure()
            except Exception:  # noqa: BLE001  the store is gone with its host
                failure = None
            for rank in range(self.world_size):
                if failure is not None:
                    break
                try:
                    failure = None if rank == self.rank else self._dead_peer(rank)
                except Exception:  # noqa: BLE001
                    continue
                if failure is not None:
                    with contextlib.suppress(Exception):
                        failure = self.record_failure(failure)
            if failure is not None or time.time() >= deadline:
                break
            time.sleep(POLL_SECONDS / 4)
        own = f"rank {self.rank} failed: {_describe(exc)}"
        if failure is None:
            try:
                failure = self.record_failure(own)
            except Exception:
                failure = own
        return failure, failure == own

    def shutdown(self):
        """Normal exit: tell the neighbours this rank is done and stop the thread."""
        if self.stopped.is_set():
            return
        self.stopped.set()
        with contextlib.suppress(Exception):
            with self.lock:
                self.store.set(self._key("done", self.rank), "1")
        self.thread.join(timeout=5 * POLL_SECONDS)


def restart_safe_store(timeout):
    """Under torchrun, a rendezvous store for ``init_process_group`` whose keys are prefixed by the restart count.

    torchrun's workers share the agent's store across restarts (``TORCHELASTIC_USE_AGENT_STORE``); torch does not
    prefix its keys per attempt, so a restarted worker can read the process-group addresses of the previous
    attempt's dead workers and fail with "Gloo connectFullMesh failed ... Connection refused". None elsewhere
    (the default rendezvous is used)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return torch.distributed.PrefixStore(f"/megatron/attempt_{attempt}/", base)


def _hard_exit(code):
    """Leave now: no atexit handlers, no process-group teardown that could wait on a dead peer."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _print_prefixed(text, rank):
    lines = [f"[rank {rank}] {line}" for line in text.rstrip("\n").splitlines()]
    print("\n".join(lines), file=sys.stderr, flush=True)


@contextlib.contextmanager
def fault_handling(args):
    """Wrap the body of ``pretrain`` (after torch.distributed is initialised); see the module docstring."""
    progress = ProgressTracker(getattr(args, "rank", 0) or 0, bool(getattr(args, "log_straggler", False)),
                               getattr(args, "straggler_minmax_count", 1), getattr(args, "log_interval", 100) or 100)
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1 or os.environ.get("MEGATRON_FAULT_HANDLER", "1") == "0" \
            or getattr(args, "fake_process_group", False):  # one process, no peers, no rendezvous store
        yield progress
        return
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    hang_minutes = getattr(args, "hang_timeout_minutes", 0.0) or 0.0
    if rank == 0 and 0 < hang_minutes and hang_minutes >= args.distributed_timeout_minutes:
        print(f"note: --hang-timeout-minutes {hang_minutes:g} is not below --distributed-timeout-minutes "
              f"{args.distributed_timeout_minutes:g}: a hung rank may end the job by the collective timeout first",
              flush=True)
    monitor = FaultMonitor(rank, world_size, args.distributed_timeout_minutes * 60.0, hang_minutes * 60.0, progress)
    try:
        yield progress
    except SystemExit as exc:  # --exit-interval, --exit-duration-in-mins, SIGTERM, the rerun machine's 16 / 17
        if exc.code in (None, 0) or isinstance(exc, AgreedExit):
            monitor.shutdown()
            raise
        _fail(monitor, rank, exc)
    except FatalRunError as exc:
        if not exc.same_on_every_rank:
            _fail(monitor, rank, exc)
        # Every rank reached this error through the same collective (a failed save's agreement, the NaN check):
        # nobody is left waiting, so this is an orderly stop; the entry point prints the one line once.
        monitor.shutdown()
        raise
    except BaseException as exc:  # noqa: BLE001  every failure must end the whole job
        _fail(monitor, rank, exc)
    else:
        monitor.shutdown()


def _fail(monitor, rank, exc):
    from megatron.training.errors import ConfigurationError

    if not monitor.reporting.acquire(blocking=False):
        while True:  # the watchdog is printing the failure and ending the process
            time.sleep(1)
    failure, is_own = monitor.culprit(exc)
    if is_own:
        if isinstance(exc, ConfigurationError):
            _print_prefixed(f"error: {' '.join(str(exc).split())}", rank)
        else:
            _print_prefixed("".join(traceback.format_exception(exc)), rank)
        monitor.leave(2 if isinstance(exc, ConfigurationError) else 1)
    print(f"[rank {rank}] exiting: {failure} (this rank then saw {_describe(exc, 100)})", file=sys.stderr, flush=True)
    monitor.leave(1)
