"""Build-once, share-everywhere storage for dataset index arrays (``.npy`` files in a cache directory).

Megatron builds index caches on global rank 0 behind a barrier, which breaks when nodes do not share a
filesystem and makes every rank wait on one. Here each process that needs a cache looks for it; the
first one to find it missing takes a lock file (``O_CREAT | O_EXCL``), builds the arrays and publishes
every file atomically (temporary file + ``os.replace``), writing the description last as the
completion marker. Processes that find the lock taken wait for the description and then memory-map the
files. With node-local cache directories this builds once per node; with a shared one, once in total.
No collective is involved, so ranks that do not build data never block.

A lock left by a crashed builder is broken when its process is gone (same host) or when it has not been
refreshed for ``MEGATRON_INDEX_CACHE_STALE_SECONDS`` (default 600); the temporary files it left are removed.
A complete-looking cache whose ``.npy`` file cannot be read (truncated, overwritten) is rebuilt under the lock,
with a warning that names the file.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy

from megatron.core.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
_MAX_POLL_SECONDS = 1.0


def _stale_after() -> float:
    return float(os.environ.get("MEGATRON_INDEX_CACHE_STALE_SECONDS", "600"))


def _write_atomically(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class IndexCache:
    """The cache files of one dataset split: ``{stem}-{name}`` for each array name plus a description.

    Args:
        directory: the cache directory (created if needed), or None to keep everything in memory.
        stem: ``{hash}-{DatasetClass}-{split}`` (or ``{hash}-{DatasetClass}``), as megatron-core names them.
        array_names: suffixes of the ``.npy`` files, e.g. ``("document_index.npy", ...)``.
        description: the text written to ``{stem}-description.txt``.
    """

    def __init__(self, directory: Optional[str], stem: str, array_names: Sequence[str], description: str) -> None:
        self.directory = directory
        self.stem = stem
        self.array_names = tuple(array_names)
        self.description = description
        self._reported_corrupt = set()

    def path_to(self, suffix: str) -> str:
        return os.path.join(self.directory, f"{self.stem}-{suffix}")

    @property
    def description_path(self) -> str:
        return self.path_to("description.txt")

    @property
    def lock_path(self) -> str:
        return self.path_to("lock")

    def is_complete(self) -> bool:
        if self.directory is None:
            return False
        return all(os.path.isfile(self.path_to(name)) for name in self.array_names + ("description.txt",))

    def load(self) -> Dict[str, numpy.ndarray]:
        return {name: numpy.load(self.path_to(name), allow_pickle=True, mmap_mode="r") for name in self.array_names}

    def load_or_none(self) -> Optional[Dict[str, numpy.ndarray]]:
        """The arrays, or None (with a warning naming the file) when a file is corrupt and must be rebuilt."""
        arrays = {}
        for name in self.array_names:
            path = self.path_to(name)
            try:
                arrays[name] = numpy.load(path, allow_pickle=True, mmap_mode="r")
            except (ValueError, OSError, EOFError) as error:
                if path not in self._reported_corrupt:
                    self._reported_corrupt.add(path)
                    log_single_rank(logger, logging.WARNING,
                                    f"index cache file {path} is corrupt or truncated ({error}); rebuilding the "
                                    f"{self.stem} indices")
                return None
        return arrays

    def get_or_build(self, build: Callable[[], Dict[str, numpy.ndarray]]) -> Tuple[Dict[str, numpy.ndarray], bool]:
        """Return ``(arrays, built_here)``, building with ``build()`` only if nobody has or is doing it."""
        if self.directory is None:
            return build(), True
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            log_single_rank(logger, logging.WARNING,
                            f"cannot create the index cache directory {self.directory} ({error}); building the "
                            f"indices in memory without caching them (set --data-cache-path to a writable place)")
            return build(), True
        deadline_without_progress = _stale_after()
        poll = _POLL_SECONDS
        while True:
            if self.is_complete():
                arrays = self.load_or_none()
                if arrays is not None:
                    return arrays, False
            if self._try_lock():
                try:
                    if self.is_complete():  # finished by someone else between our check and the lock
                        arrays = self.load_or_none()
                        if arrays is not None:
                            return arrays, False
                        self._remove(self.description_path)  # incomplete again: others wait for the rebuild
                    with _LockHeartbeat(self.lock_path):
                        arrays = build()
                        self._publish(arrays)
                    return arrays, True
                finally:
                    self._unlock()
            self._break_lock_if_stale(deadline_without_progress)
            time.sleep(poll)
            poll = min(poll * 2, _MAX_POLL_SECONDS)

    # ------------------------------------------------------------------------------------------ internals

    def _try_lock(self) -> bool:
        try:
            fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except PermissionError as error:
            raise PermissionError(
                f"cannot write the index cache lock {self.lock_path} ({error}): pass a writable "
                f"--data-cache-path (config.path_to_cache)") from error
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} {os.getpid()} {time.time()}\n")
        return True

    def _unlock(self) -> None:
        self._remove(self.lock_path)

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def _break_lock_if_stale(self, stale_after: float) -> None:
        try:
            with open(self.lock_path) as f:
                content = f.read()
            host, pid, _ = content.split()
            age = time.time() - os.path.getmtime(self.lock_path)
        except (FileNotFoundError, ValueError):
            return  # released meanwhile, or being written right now
        holder_gone = host == socket.gethostname() and not _pid_alive(int(pid))
        if not (holder_gone or age > stale_after):
            return
        # Break it under a second lock, after checking that it is still the lock judged stale: otherwise two
        # waiters could both break it, the second one removing the fresh lock of whoever took over.
        breaker = self.lock_path + ".break"
        try:
            os.close(os.open(breaker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if time.time() - os.path.getmtime(breaker) > 10.0:  # a breaker that died while breaking
                    self._remove(breaker)
            except FileNotFoundError:
                pass
            return
        try:
            with open(self.lock_path) as f:
                if f.read() != content:
                    return
            log_single_rank(logger, logging.WARNING,
                            f"breaking stale index cache lock {self.lock_path} held by {host}:{pid} "
                            f"({'process gone' if holder_gone else f'{age:.0f} s old'})")
            self._unlock()
            if holder_gone:  # the crashed builder's partial files (a live one elsewhere may still need its own)
                for name in self.array_names + ("description.txt",):
                    self._remove(f"{self.path_to(name)}.tmp-{host}-{pid}")
        except FileNotFoundError:
            pass
        finally:
            self._remove(breaker)

    def _publish(self, arrays: Dict[str, numpy.ndarray]) -> None:
        for name in self.array_names:
            _write_atomically(self.path_to(name), lambda f, a=arrays[name]: numpy.save(f, a, allow_pickle=True))
        _write_atomically(self.description_path, lambda f: f.write(self.description.encode("utf-8")))


class _LockHeartbeat:
    """Touch the lock file while a long build runs, so that waiting processes do not think it stale."""

    def __init__(self, path: str, every: float = 30.0) -> None:
        self._path, self._every = path, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                os.utime(self._path)
            except OSError:
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
