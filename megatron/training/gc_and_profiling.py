"""``--manual-gc*`` and ``--profile*``: what the training loop does around iterations and evaluations.

Manual garbage collection (``--manual-gc``): Python's automatic collector is disabled at the start of
training (one full ``gc.collect()`` then), so that no rank pauses at a random point; a full collection runs
after every iteration ``i`` with ``i % --manual-gc-interval == 0`` (interval 0: never), and, unless
``--no-manual-gc-eval``, a full collection before each periodic evaluation and a generation-0 collection after
it. The collector is re-enabled when training ends.

Profiling (``--profile``, on the ranks of ``--profile-ranks``; an empty list means every rank). With ``s`` =
``--profile-step-start`` and ``e`` = ``--profile-step-end``, iterations ``s+1 .. e`` (1-based) are captured:

* ``--use-pytorch-profiler``: ``torch.profiler`` with schedule ``wait = max(s-1, 0)``, ``warmup = 1 if s > 0
  else 0``, ``active = e - s``, one cycle, stepped after every iteration; shapes and stacks are recorded and
  the trace is written by ``tensorboard_trace_handler`` into ``--tensorboard-dir`` (file names start with
  ``rank<R>``).
* otherwise nsys mode: ``cudaProfilerStart`` and ``emit_nvtx(record_shapes=True)`` before iteration ``s+1``,
  ``cudaProfilerStop`` after iteration ``e`` (launch under ``nsys --capture-range=cudaProfilerApi``). It needs
  CUDA; on CPU a log line says that nothing is captured.
"""
from __future__ import annotations

import gc
import socket

import torch

from megatron.core import device


class ManualGC:
    """The ``--manual-gc`` collection points of the training loop (no-ops without ``--manual-gc``)."""

    def __init__(self, enabled: bool, interval: int, around_eval: bool):
        self.enabled, self.interval, self.around_eval = enabled, interval, around_eval

    @classmethod
    def from_args(cls, args) -> "ManualGC":
        return cls(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval)

    def start(self):
        if self.enabled:
            gc.disable()
            gc.collect()

    def after_iteration(self, iteration: int):
        if self.enabled and self.interval != 0 and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self):
        if self.enabled and self.around_eval:
            gc.collect()

    def after_eval(self):
        if self.enabled and self.around_eval:
            gc.collect(generation=0)

    def stop(self):
        if self.enabled:
            gc.enable()


class IterationProfiler:
    """``--profile`` for this rank: call ``before_iteration(i)`` / ``after_iteration(i)`` with the number of
    iterations completed before / after the iteration, and ``stop()`` when training ends."""

    def __init__(self, args, rank: int, log=print):
        self.args = args
        self.active = bool(args.profile) and (not args.profile_ranks or rank in args.profile_ranks)
        self.torch_profiler = None
        self.nvtx = None
        if not self.active:
            return
        start, end = args.profile_step_start, args.profile_step_end
        if args.use_pytorch_profiler:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    args.tensorboard_dir, worker_name=f"rank{rank}_{socket.gethostname()}"),
                record_shapes=True, with_stack=True)
            self.torch_profiler.start()
            log(f"rank {rank}: PyTorch profiler on for iterations {start + 1}..{end}, traces in {args.tensorboard_dir}")
        elif not device.on_gpu():
            log(f"rank {rank}: --profile without --use-pytorch-profiler is nsys (CUDA profiler) mode and this run is "
                "on CPU: nothing is captured; add --use-pytorch-profiler --tensorboard-dir DIR for a CPU trace")
            self.active = False

    def before_iteration(self, completed: int):
        if self.active and self.torch_profiler is None and completed == self.args.profile_step_start:
            device.cuda_profiler_start()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_iteration(self, completed: int):
        if not self.active:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif completed == self.args.profile_step_end:
            self._stop_nsys()

    def _stop_nsys(self):
        if self.nvtx is not None:
            device.cuda_profiler_stop()
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None

    def stop(self):
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        self._stop_nsys()
