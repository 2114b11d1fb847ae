"""--manual-gc and --profile --use-pytorch-profiler inside the real training loop (pretrain_gpt.py, 2 gloo ranks).

Manual GC, 8 iterations, --manual-gc-interval 3, evaluation every 4 iterations. Hand-made schedule of the
collector calls on every rank: one full collection at the start; full ones after iterations 3 and 6; around
the evaluations after iterations 4 and 8 a full one before and a generation-0 one after. So 5 full and 2
generation-0 collections, the automatic collector disabled during training and enabled again afterwards.
With --no-manual-gc-eval only the 3 full ones (start, 3, 6) remain.

Profiler: --profile-step-start 2 --profile-step-end 4 --profile-ranks 1: only rank 1 writes a trace into
--tensorboard-dir, and it covers exactly profiler steps 2 and 3 (iterations 3 and 4).

--empty-unused-memory-level (Megatron's levels): 1 empties the allocator cache after every forward-backward and
after every evaluation iteration, 2 also after every optimizer step; 0 never. Counted by the caller of
``device.empty_cache`` (a no-op on CPU, so counting the calls is how the behaviour is seen here).
"""
import glob
import json
import os
import re

import pytest

from helpers.dist_harness import run_distributed
from helpers.train_helpers import run_pretrain

BASE = ["--mock-data", "--use-mcore-models", "--num-layers", "2", "--train-iters", "8", "--log-interval", "4",
        "--eval-iters", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"]


class _CountingGC:
    """Stands in for the gc module inside megatron.training.gc_and_profiling."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def collect(self, generation=2):
        self.calls.append(generation)
        return self.real.collect(generation)

    def disable(self):
        self.calls.append("disable")
        self.real.disable()

    def enable(self):
        self.calls.append("enable")
        self.real.enable()


def _count_gc_calls(extra):
    import gc

    from megatron.training import gc_and_profiling

    counting = _CountingGC(gc)
    gc_and_profiling.gc = counting
    try:
        run_pretrain("pretrain_gpt", BASE + list(extra))
    finally:
        gc_and_profiling.gc = gc
        gc.enable()
    return counting.calls


GC_ARGS = ["--manual-gc", "--manual-gc-interval", "3", "--eval-interval", "4"]


def _count_empty_cache_calls(level):
    import collections
    import sys

    from megatron.core import device

    real, callers = device.empty_cache, collections.Counter()

    def counting():
        callers[sys._getframe(1).f_code.co_name] += 1
        real()

    device.empty_cache = counting
    try:
        run_pretrain("pretrain_gpt", BASE + ["--eval-interval", "4", "--empty-unused-memory-level", str(level)])
    finally:
        device.empty_cache = real
    return dict(callers)


def gc_and_profile_body(tb_dir):
    calls = [_count_gc_calls(GC_ARGS), _count_gc_calls(GC_ARGS + ["--no-manual-gc-eval"]),
             [_count_empty_cache_calls(level) for level in (0, 1, 2)]]
    run_pretrain("pretrain_gpt", BASE + ["--eval-interval", "1000", "--profile", "--use-pytorch-profiler",
                                         "--profile-step-start", "2", "--profile-step-end", "4",
                                         "--profile-ranks", "1", "--tensorboard-dir", tb_dir])
    return calls


@pytest.fixture(scope="module")
def gc_and_profile(tmp_path_factory):
    """Both features in one pair of ranks (three short runs): the per-rank gc calls and the trace directory."""
    tb_dir = str(tmp_path_factory.mktemp("tb"))
    return run_distributed(gc_and_profile_body, 2, tb_dir, timeout=300), tb_dir


def test_manual_gc_schedule(gc_and_profile):
    per_rank, _ = gc_and_profile
    # start | it 3 | eval at 4: before, after | it 6 | eval at 8: before, after | end
    expected = ["disable", 2, 2, 2, 0, 2, 2, 0, "enable"]
    for with_eval, without_eval, _ in per_rank:
        assert with_eval == expected, with_eval
        assert without_eval == ["disable", 2, 2, 2, "enable"], without_eval


def test_pytorch_profiler_trace_for_requested_steps_and_ranks(gc_and_profile):
    _, tb_dir = gc_and_profile
    traces = glob.glob(os.path.join(tb_dir, "*.pt.trace.json*"))
    assert [os.path.basename(t).split("_")[0] for t in traces] == ["rank1"], traces
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    steps = {int(m.group(1)) for e in events for m in [re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name")))] if m}
    assert steps == {2, 3}, steps


def test_nsys_mode_on_cpu_logs_and_captures_nothing():
    import types

    from megatron.training.gc_and_profiling import IterationProfiler

    args = types.SimpleNamespace(profile=True, profile_ranks=[], use_pytorch_profiler=False, profile_step_start=1,
                                 profile_step_end=2, tensorboard_dir=None)
    lines = []
    profiler = IterationProfiler(args, rank=0, log=lines.append)
    assert len(lines) == 1 and "nsys" in lines[0] and "CPU" in lines[0]
    for completed in range(3):  # no CUDA profiler call may happen on CPU
        profiler.before_iteration(completed)
        profiler.after_iteration(completed + 1)
    profiler.stop()
    assert profiler.nvtx is None
    # Ranks outside --profile-ranks do nothing and say nothing.
    args.profile_ranks = [1]
    assert not IterationProfiler(args, rank=0, log=lines.append).active and len(lines) == 1


def test_empty_unused_memory_levels(gc_and_profile):
    per_rank, _ = gc_and_profile
    for _, _, (level0, level1, level2) in per_rank:
        assert level0 == {}, level0
        # 8 training steps; evaluation iterations: 1 each at iterations 4 and 8, then the final validation and
        # test evaluations (1 iteration each)
        assert level1 == {"train_step": 8, "evaluate": 4}, level1
        assert level2 == {"train_step": 16, "evaluate": 4}, level2
