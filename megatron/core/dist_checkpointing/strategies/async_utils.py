"""Asynchronous saves: :class:`AsyncRequest` (what to run in the background, what to run once it is done) and
:class:`AsyncCallsQueue` (runs requests in a background thread and finalizes them in order).

``dist_checkpointing.save(..., async_sharded_save=True)`` returns an :class:`AsyncRequest` whose ``async_fn``
writes a snapshot of the shards (taken when ``save`` returned) and whose ``finalize_fns`` write ``metadata.json``.
The caller either runs it at once (``execute_sync()``) or hands it to an :class:`AsyncCallsQueue`, then calls
``maybe_finalize_async_calls(blocking=...)`` (training does so before the next save and at the end).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, List, Optional, Tuple


@dataclasses.dataclass
class AsyncRequest:
    """``async_fn(*async_fn_args, **async_fn_kwargs)`` runs in the background; then every rank runs
    ``finalize_fns`` (in order) in the main thread."""

    async_fn: Optional[Callable]
    async_fn_args: Tuple
    finalize_fns: List[Callable]
    async_fn_kwargs: dict = dataclasses.field(default_factory=dict)
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable) -> None:
        if self.is_frozen:
            raise RuntimeError("cannot add a finalize function to a request that was scheduled")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run the request now, in this thread: the write, then the finalize functions."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        self.is_frozen = True
        return self


class _Call:
    def __init__(self, call_idx: int, request: AsyncRequest):
        self.call_idx = call_idx
        self.request = request
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name=f"async-save-{call_idx}", daemon=False)

    def _run(self):
        try:
            if self.request.async_fn is not None:
                self.request.async_fn(*self.request.async_fn_args, **self.request.async_fn_kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised by the finalization in the main thread
            self.error = e


class AsyncCallsQueue:
    """Background writes, finalized in scheduling order. Every rank must schedule and finalize the same
    requests (the writes are collective)."""

    def __init__(self, persistent: bool = False):
        self.persistent = persistent
        self._calls: List[_Call] = []
        self._next_idx = 0

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the background write of ``async_request``; returns its call index."""
        request = async_request.freeze()
        if request.preload_fn is not None:
            request.preload_fn()
        call = _Call(self._next_idx, request)
        self._next_idx += 1
        call.thread.start()
        self._calls.append(call)
        return call.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize the finished requests (all of them, waiting, when ``blocking``); returns their indices. An
        error of a background write is raised here."""
        done = []
        while self._calls:
            call = self._calls[0]
            if call.thread.is_alive() and not blocking:
                break
            call.thread.join()
            self._calls.pop(0)
            if call.error is not None:
                raise call.error
            for fn in call.request.finalize_fns:
                fn()
            done.append(call.call_idx)
        return done

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def close(self, abort: bool = False) -> None:
        """Finish (wait for) every scheduled request."""
        self.maybe_finalize_async_calls(blocking=True)
