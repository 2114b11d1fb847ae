"""Asynchronous saves: :class:`AsyncRequest` (what to run in the background, what to run once it is done), the
callers that run it (:class:`TemporalAsyncCaller`: a new worker per request; :class:`PersistentAsyncCaller`: one
long-lived worker fed by a queue) and :class:`AsyncCallsQueue` (schedules requests and finalizes them in order).

``dist_checkpointing.save(..., async_sharded_save=True)`` returns an :class:`AsyncRequest` whose ``async_fn``
writes a snapshot of the shards (taken when ``save`` returned) and whose ``finalize_fns`` write ``metadata.json``.
The caller either runs it at once (``execute_sync()``) or hands it to an :class:`AsyncCallsQueue`, then calls
``maybe_finalize_async_calls(blocking=...)`` on every rank (training does so before the next save and at the end).

A request is finalized only when it is done on *every* rank: each check all-reduces (sum) this rank's "still
running" flag, so all ranks agree and run the (collective) finalize functions together. The workers here are
threads of this process (megatron-core forks processes; our writes release the GIL in file I/O and need no CUDA
context): a worker's exception is raised by the finalization in the main thread, and the request's finalize
functions are then not run.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from megatron.core.dist_checkpointing.utils import debug_time

logger = logging.getLogger(__name__)

__all__ = ["AsyncCaller", "AsyncCallsQueue", "AsyncRequest", "PersistentAsyncCaller", "TemporalAsyncCaller"]


@dataclasses.dataclass
class AsyncRequest:
    """``async_fn(*async_fn_args, **async_fn_kwargs)`` runs in the background; then every rank runs
    ``finalize_fns`` (in order) in the main thread. ``preload_fn`` (optional) stages the data first: its result
    replaces ``async_fn_args[1]``. ``call_idx``: the request's index in its queue."""

    async_fn: Optional[Callable]
    async_fn_args: Tuple
    finalize_fns: List[Callable]
    async_fn_kwargs: Dict = dataclasses.field(default_factory=dict)
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append ``fn`` to the finalize functions (refused once the request is frozen)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def _call_args(self) -> list:
        args = list(self.async_fn_args)
        if self.preload_fn is not None:
            args[1] = self.preload_fn()
        return args

    def execute_sync(self) -> None:
        """Run the request now, in this thread: the write, a barrier (when torch.distributed is initialized), then
        the finalize functions."""
        args = self._call_args()
        if self.async_fn is not None:
            self.async_fn(*args, **self.async_fn_kwargs)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        """A copy that refuses new finalize functions."""
        return dataclasses.replace(self, is_frozen=True)


def _flag_device() -> torch.device:
    """Where the agreement flags travel: the current CUDA device under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class AsyncCaller(ABC):
    """Runs one request at a time in the background and says when it is done on every rank."""

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req`` in the background (every rank calls this)."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool, no_dist: bool) -> bool:
        """True when the current request is done on every rank (after waiting for it, with ``blocking``). Every
        rank calls this; ``no_dist``: look at this rank's worker only, without the all-reduce."""

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank's worker is alive (an all-reduce of ``is_alive`` over all ranks)."""
        if not torch.distributed.is_initialized():
            return not is_alive
        flag = torch.tensor([int(is_alive)], dtype=torch.int, device=_flag_device())
        torch.distributed.all_reduce(flag)
        return int(flag[0]) == 0

    @abstractmethod
    def close(self, abort: bool = False):
        """Stop the caller (at exit): wait for the running request, or with ``abort`` do not wait for it."""

    def _take_error(self) -> Optional[BaseException]:
        """The exception of the request that just finished (cleared), or None."""
        error, self._error = getattr(self, "_error", None), None
        return error


def _run_guarded(async_req: AsyncRequest, args: list) -> Optional[BaseException]:
    try:
        async_req.async_fn(*args, **async_req.async_fn_kwargs)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread, raised at finalization
        return e
    return None


class TemporalAsyncCaller(AsyncCaller):
    """A new background worker (thread) per request, joined when the request is done."""

    def __init__(self):
        self.process: Optional[threading.Thread] = None
        self.start_time: Optional[float] = None
        self._error: Optional[BaseException] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        args = async_req._call_args()

        def work():
            self._error = _run_guarded(async_req, args)

        self.start_time = time.time()
        self.process = threading.Thread(target=work, name=f"async-save-{async_req.call_idx}", daemon=False)
        self.process.start()

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        is_alive = int(self.process is not None and self.process.is_alive())
        done = (not is_alive) if no_dist else self.sync_all_async_calls(is_alive)
        if done or blocking:
            self.close()
            done = True
        return done

    def close(self, abort: bool = False):
        """Join the worker (with ``abort``: forget it, it cannot be killed, and drop its error)."""
        if self.process is None:
            return
        if abort:
            logger.warning("TemporalAsyncCaller: aborted; the running write is not waited for")
            self._error = None
        else:
            self.process.join()
            logger.debug(f"TemporalAsyncCaller: worker joined {time.time() - self.start_time:.2f}s after start")
        self.process = None
        self.start_time = None

    def __del__(self):
        pass


class PersistentAsyncCaller(AsyncCaller):
    """One long-lived background worker (thread) that runs the requests put on its queue, in order, and reports
    each finished ``call_idx`` (with its exception, if any) on a completion queue."""

    def __init__(self):
        self.process: Optional[threading.Thread] = None
        self.start_time: Optional[float] = None
        self.queue: "queue.Queue" = queue.Queue()
        self.comp_q: "queue.Queue" = queue.Queue()
        self.cur_item: Optional[int] = None
        self.cur_idx: int = -1
        self._error: Optional[BaseException] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        self.start_time = time.time()
        if self.process is None:
            self.process = threading.Thread(target=PersistentAsyncCaller.async_loop,
                                            args=(self._rank(), self.queue, None, self.comp_q,
                                                  logger.getEffectiveLevel()),
                                            name="async-save-worker", daemon=True)
            self.process.start()
        # Staging (preload) happens here, before this call returns, as megatron-core's caller waits for it.
        self.queue.put((async_req, async_req._call_args()))

    @staticmethod
    def _rank() -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        is_alive = False
        if self.process is not None and self.cur_item is None:
            try:
                self.cur_item, error = self.comp_q.get(block=blocking)
                self._error = self._error or error
            except queue.Empty:
                is_alive = True
        done = (not is_alive) if no_dist else self.sync_all_async_calls(int(is_alive))
        if done:
            self.cur_item = None
        return done

    def close(self, abort: bool = False):
        """Let the worker finish its queue and stop (with ``abort``: tell it to stop without waiting)."""
        if self.process is None:
            return
        self.queue.put("DONE")
        if not abort:
            self.process.join()
        self.process = None

    def __del__(self):
        try:
            self.close(abort=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @staticmethod
    def async_loop(rank: int, queue, preload_q, comp_q, log_level: int = logging.INFO):
        """The worker: run each queued ``(request, args)`` in order and put ``(call_idx, exception or None)`` on
        ``comp_q``; stop at ``"DONE"``. ``preload_q`` is unused (staging is done before a request is queued)."""
        worker_logger = logging.getLogger(__name__)
        worker_logger.debug(f"PersistentAsyncCaller: worker of rank {rank} started")
        while True:
            item = queue.get()
            if isinstance(item, str) and item == "DONE":
                break
            async_req, args = item
            comp_q.put((async_req.call_idx, _run_guarded(async_req, args)))
        worker_logger.debug(f"PersistentAsyncCaller: worker of rank {rank} stopped")


class _ActiveAsyncRequest(NamedTuple):
    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest


class AsyncCallsQueue:
    """Background writes, finalized in scheduling order. Every rank must schedule and finalize the same
    requests (the writes and the finalizations are collective). ``persistent``: one worker for all requests
    (:class:`PersistentAsyncCaller`) instead of one per request."""

    def __init__(self, persistent: bool = False):
        self.async_calls: deque = deque()
        self.call_idx: int = -1
        self.persistent: bool = persistent
        self.persistent_caller: Optional[AsyncCaller] = None

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller()
        if self.persistent_caller is None:
            self.persistent_caller = PersistentAsyncCaller()
        return self.persistent_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the background write of ``async_request``; returns its call index."""
        self.call_idx += 1
        caller = self._get_async_caller()
        request = async_request.freeze()
        caller.schedule_async_call(dataclasses.replace(request, call_idx=self.call_idx, finalize_fns=[]))
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, caller, request))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize the requests done on every rank (all of them, waiting, when ``blocking``), in order; returns
        their indices. A background write's exception is raised here (its finalize functions are not run)."""
        finalized = []
        while self.async_calls:
            if not self.async_calls[0].async_caller.is_current_async_call_done(blocking, no_dist):
                break
            call_idx, caller, request = self.async_calls.popleft()
            error = caller._take_error()
            if error is not None:
                raise error
            with debug_time("finalize", logger):
                for fn in request.finalize_fns:
                    fn()
            if torch.distributed.is_initialized() and not no_dist:
                latest = torch.tensor([call_idx], dtype=torch.int, device=_flag_device())
                torch.distributed.all_reduce(latest, op=torch.distributed.ReduceOp.MAX)
                if int(latest[0]) != call_idx:
                    raise RuntimeError(f"Unmatched async calls: rank finalized call {call_idx}, another "
                                       f"{int(latest[0])}: not every rank takes part in the async finalization")
            finalized.append(call_idx)
        return finalized

    def get_num_unfinalized_calls(self) -> int:
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every scheduled request (unless ``abort``), then stop the persistent worker."""
        if not abort:
            self.maybe_finalize_async_calls(blocking=True)
        if self.persistent and self.persistent_caller is not None:
            self.persistent_caller.close(abort=abort)
