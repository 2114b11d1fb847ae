"""The torch_dist data-file writer: PyTorch DCP's ``FileSystemWriter`` with its write split into stages, so that
the slow part can run in the background.

1. ``prepare_write_data(plan, planner)`` (in the caller): the plan's items are spread over ``thread_count`` buckets
   (objects round-robin, tensors largest first onto the lightest bucket), each bucket one data file
   ``{prefix}__{rank}_{n}.distcp``; the data is resolved now (a tensor that is a view of a larger storage is copied,
   so the file gets only its bytes). With ``separation_hint`` the items whose keys begin with it go to their own
   files, named with the hint as prefix (half the buckets each), so they can later be removed on their own
   (``remove_sharded_tensors``).
2. ``get_save_function_and_args()``: ``(write function, staging function, args)``; the write function writes every
   bucket (one thread per file: the calling one, and workers named after it), with ``fsync``, and leaves the
   results in a queue.
3. ``retrieve_write_results()`` and ``finish(metadata, results)`` (after every rank wrote): the ``.metadata``.

``write_data`` (DCP's one-call entry) runs the three stages in a row, so ``torch.distributed.checkpoint.save`` can
drive this writer directly; the torch_dist save of :mod:`megatron.core.dist_checkpointing.sharded_io` does.
Object storage (``use_msc``, a GPU cluster's storage client) is not available here.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
from functools import partial
from itertools import chain
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StoragePrefix, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import _wrap_exception
from torch.futures import Future

logger = logging.getLogger(__name__)

__all__ = ["FileSystemWriterAsync"]

# (file path, file name, ([(item, bytes)], [(item, tensor)]))
WriteBucket = Tuple[str, str, Tuple[list, list]]


def _item_size(item: WriteItem) -> int:
    """Bytes a tensor item writes: its chunk's elements times the element size."""
    numel = 1
    for size in item.tensor_data.chunk.sizes:
        numel *= size
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def _split_by_size_and_type(bins: int, items: List[WriteItem]) -> List[List[WriteItem]]:
    """``bins`` buckets: objects dealt round-robin, tensors (largest first) each onto the lightest bucket."""
    if bins <= 1:
        return [list(items)]
    buckets: List[List[WriteItem]] = [[] for _ in range(bins)]
    load = [0] * bins
    objects = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for i, item in enumerate(objects):
        buckets[i % bins].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True):
        lightest = min(range(bins), key=lambda b: load[b])
        buckets[lightest].append(item)
        load[lightest] += _item_size(item)
    return buckets


def _split_by_separation_hint(buckets: List[List[WriteItem]], separation_hint: Optional[str] = None
                              ) -> Dict[str, List[List[WriteItem]]]:
    """``{file-name prefix: buckets}``: ``""`` for the items whose keys do not begin with ``separation_hint``, the
    hint itself for those that do."""
    if separation_hint is None:
        return {"": buckets}
    plain = [[i for i in bucket if not i.index.fqn.startswith(separation_hint)] for bucket in buckets]
    hinted = [[i for i in bucket if i.index.fqn.startswith(separation_hint)] for bucket in buckets]
    return {"": plain, separation_hint: hinted}


def _own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached; copied when it is a view into a larger storage (the file must get only its bytes)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu" and tensor.untyped_storage().size() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


class FileSystemWriterAsync(FileSystemWriter):
    """DCP's file-system writer with a staged write (see the module docstring). One writer per save: the staged
    state lives on it between the stages."""

    def __init__(self, path: Union[str, os.PathLike], *args, separation_hint: Optional[str] = None,
                 use_msc: bool = False, **kwargs):
        if use_msc:
            raise NotImplementedError("FileSystemWriterAsync(use_msc=True): object storage (multi-storage client) "
                                      "is not available in this library; write to a file system path")
        self.checkpoint_dir = path
        self.use_msc = use_msc
        super().__init__(path, *args, **kwargs)
        if not self.single_file_per_rank:
            raise NotImplementedError("single_file_per_rank flag not supported for FileSystemWriterAsync")
        self.can_run_decentralized_global_plan = True
        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_queue: Optional[queue.Queue] = None
        self.separation_hint = separation_hint

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Stage 1: bucket the plan's items into files and resolve their data (kept in ``write_buckets``)."""
        if self.separation_hint and self.thread_count < 2:
            raise ValueError("thread_count must be at least 2 if separation_hint is provided")
        bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
        prefix = plan.storage_data.prefix
        count = 0
        self.write_buckets = []
        for group, buckets in _split_by_separation_hint(_split_by_size_and_type(bins, plan.items),
                                                        self.separation_hint).items():
            for bucket in buckets:
                objects = [(i, planner.resolve_data(i)) for i in bucket if i.type == WriteItemType.BYTE_IO]
                tensors = [(i, _own_bytes(planner.resolve_data(i))) for i in bucket
                           if i.type != WriteItemType.BYTE_IO]
                if objects or tensors:
                    name = f"{group}{prefix}{count}{DEFAULT_SUFFIX}"
                    count += 1
                    self.write_buckets.append((os.path.join(str(self.checkpoint_dir), name), name,
                                               (objects, tensors)))
        self.results_queue = queue.Queue() if self.write_buckets else None

    def get_save_function_and_args(self) -> Tuple[Optional[Callable], Optional[Callable], List]:
        """Stage 2: ``(write function, staging function, [rank, buckets, results queue])``, or
        ``(None, None, [])`` when this rank has nothing to write. The staging function's result replaces the
        buckets argument."""
        if not self.write_buckets:
            return None, None, []
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (partial(self.write_preloaded_data_multiproc, [self.transforms], self.use_msc),
                partial(self.preload_tensors, self.write_buckets, True),
                [rank, self.write_buckets, self.results_queue])

    @staticmethod
    def preload_tensors(write_buckets: List[WriteBucket], non_blocking=True) -> List[WriteBucket]:
        """The buckets with every tensor on the CPU (a device-to-host copy, waited for)."""
        staged = [(path, name, (objects, [(i, t.to("cpu", non_blocking=non_blocking)) for i, t in tensors]))
                  for path, name, (objects, tensors) in write_buckets]
        if non_blocking and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return staged

    @staticmethod
    def write_preloaded_data_multiproc(transform_list: list, use_msc: bool, rank: int,
                                       write_buckets: List[WriteBucket], global_results_queue) -> None:
        """Write every bucket, one thread per file (this one and workers named after it); put
        ``{bucket index: [WriteResult]}`` (or the first exception) on ``global_results_queue``."""
        local_results: queue.Queue = queue.Queue()
        # The first file is written by this thread, each other one by a worker named after it.
        here = threading.current_thread().name
        workers = [threading.Thread(target=FileSystemWriterAsync.write_preloaded_data, name=f"{here}-writer{idx}",
                                    args=(transform_list, idx, bucket, local_results, None, True))
                   for idx, bucket in enumerate(write_buckets) if idx > 0]
        for worker in workers:
            worker.start()
        FileSystemWriterAsync.write_preloaded_data(transform_list, 0, write_buckets[0], local_results, None, True)
        for worker in workers:
            worker.join()
        results: Union[dict, BaseException] = {}
        for _ in write_buckets:
            idx, outcome = local_results.get_nowait()
            if isinstance(outcome, BaseException):
                logger.error(f"rank {rank}: writer {idx} failed: {outcome}")
                results = outcome
                break
            results[idx] = outcome
        global_results_queue.put(results)

    @staticmethod
    def write_preloaded_data(transform_list: list, local_proc_idx: int, write_bucket: WriteBucket, results_queue,
                             count_queue, use_fsync: bool, **kwargs) -> None:
        """Write one bucket's objects then tensors into its file (``fsync`` it with ``use_fsync``); put
        ``(local_proc_idx, [WriteResult] or the exception)`` on ``results_queue``. ``count_queue`` (optional) is
        told when done."""
        from torch.distributed.checkpoint.filesystem import SerializationFormat

        try:
            path, name, (objects, tensors) = write_bucket
            written = []
            with open(path, "wb") as stream:
                for item, data in chain(objects, tensors):
                    written.append(_write_item(*transform_list, stream, data, item, name,
                                               serialization_format=SerializationFormat.TORCH_SAVE))
                if use_fsync:
                    stream.flush()
                    os.fsync(stream.fileno())
            outcome = (local_proc_idx, written)
        except Exception as e:  # noqa: BLE001 - reported through the queue
            outcome = (local_proc_idx, e)
        results_queue.put(outcome)
        if count_queue is not None:
            count_queue.get()
            count_queue.task_done()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """DCP's one-call write: the three stages in a row, in this thread."""
        self.prepare_write_data(plan, planner)
        write, stage, args = self.get_save_function_and_args()
        if write is not None:
            args[1] = stage()
            write(*args)
        future: Future = Future()
        results = self.retrieve_write_results()
        if isinstance(results, list):
            future.set_result(results)
        else:  # DCP's wrapped exception (exception, traceback summary): hand DCP the writer's own error (an
            # OSError such as a full disk keeps its errno when DCP sends it to the other ranks)
            future.set_exception(results[0].__cause__ or results[0])
        return future

    def retrieve_write_results(self):
        """The written items' results (a list), or DCP's wrapped exception when a writer failed or a result is
        missing."""
        if self.write_buckets is None:
            raise RuntimeError("retrieve_write_results before prepare_write_data")
        if self.results_queue is None:
            return []
        try:
            results = self.results_queue.get_nowait()
        except queue.Empty:
            return _wrap_exception(RuntimeError("results_queue should not be empty"))
        if isinstance(results, BaseException):
            try:
                raise RuntimeError(f"Worker failure: {results}") from results
            except RuntimeError as e:
                return _wrap_exception(e)
        if len(results) != len(self.write_buckets):
            return _wrap_exception(RuntimeError(f"Incomplete worker results (expected {len(self.write_buckets)}, "
                                                f"got {len(results)}. This probably indicates a worker failure."))
        return list(chain.from_iterable(results[i] for i in sorted(results)))

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """This rank's plan with its file prefix ``__{rank}_`` (what the coordinator would assign)."""
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{torch.distributed.get_rank()}_"))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Create the directory (DCP's checks of an existing checkpoint apply)."""
        return super().prepare_local_plan(plan)

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return str(self.checkpoint_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)
