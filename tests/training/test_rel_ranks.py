"""Reliability of multi-rank runs: a failing or killed rank ends the whole job with a message naming it, and
preemption (SIGTERM, --exit-duration-in-mins, --exit-interval) saves a resumable checkpoint and exits 0.

Every case launches real processes of pretrain_gpt.py (plain subprocesses with RANK/WORLD_SIZE/MASTER_* as SLURM
would, or torchrun) on a tiny GPT on CPU, and checks exit codes, timing, messages and that no process remains.
"""
import os
import re
import signal
import time

import pytest

from helpers.rel_jobs import Job as _Job
from helpers.rel_jobs import logged_losses as _losses
from helpers.train_helpers import preprocess_corpus_slice

TIMEOUT_MIN = 0.25  # --distributed-timeout-minutes: 15 s
MARGIN_S = 20  # exit must happen within the timeout plus this (startup of the test's poll loop, a loaded machine)
TINY = ["--num-layers", "2", "--global-batch-size", "6", "--log-interval", "1", "--train-iters", "8", "--eval-iters", "0",
        "--distributed-timeout-minutes", str(TIMEOUT_MIN)]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("rel_data")), num_docs=200)


def Job(tmp, data_path, nranks, extra=(), env=None, torchrun=False):
    return _Job(tmp, data_path, nranks, extra, env, torchrun, base=TINY)


def _check_failure_reported(job, codes, times, failed_rank, exc_name, fault_time):
    out = job.output()
    assert all(code != 0 for code in codes), f"exit codes {codes}:\n{out[-4000:]}"
    limit = TIMEOUT_MIN * 60 + MARGIN_S
    assert max(times) - fault_time < limit, f"exits at {times} s, fault at {fault_time} s:\n{out[-4000:]}"
    if exc_name is not None:
        # The failing rank's traceback, prefixed with its rank, appears exactly once.
        assert out.count("Traceback (most recent call last)") == 1, out[-6000:]
        assert len(re.findall(rf"^\[rank {failed_rank}\] {exc_name}: ", out, re.M)) == 1, out[-6000:]
        cause = f"rank {failed_rank} failed: {exc_name}"
    else:
        cause = f"rank {failed_rank} died"
    for rank in range(len(job.procs)):
        if rank == failed_rank:
            continue
        own = job.output(rank)
        lines = [line for line in own.splitlines() if line.startswith(f"[rank {rank}] exiting: ")]
        assert len(lines) == 1 and cause in lines[0], f"rank {rank} said {lines}:\n{own[-3000:]}"
    job.assert_no_process_left()
    print(f"REL_TRIAL cause={cause!r} codes={codes} exit_after_fault_s={[round(t - fault_time, 1) for t in times]}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay", [pytest.param(0, marks=pytest.mark.slow), 2],
                         ids=["raise", "raise_while_peers_in_collective"])
def test_rel_ranks_exception_on_one_rank_ends_all(tmp_path, data_path, delay):
    job = Job(str(tmp_path), data_path, 3, env={"MEGATRON_FAULT_INJECT": f"raise:rank=1:iter=3:delay={delay}"})
    job.wait_for(r"iteration\s+2/")
    fault_time = time.time() - job.start
    codes, times = job.wait(TIMEOUT_MIN * 60 + MARGIN_S + 60)
    assert codes[1] == 1
    _check_failure_reported(job, codes, times, 1, "ZeroDivisionError", fault_time)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed", [pytest.param(2, marks=pytest.mark.slow), 0], ids=["rank2", "rank0_store_host"])
def test_rel_ranks_sigkill_of_one_rank_ends_all(tmp_path, data_path, killed):
    job = Job(str(tmp_path), data_path, 3, extra=["--train-iters", "100000"])
    job.wait_for(r"iteration\s+3/")
    fault_time = time.time() - job.start
    os.kill(job.procs[killed].pid, signal.SIGKILL)
    codes, times = job.wait(TIMEOUT_MIN * 60 + MARGIN_S + 60)
    assert codes[killed] == -signal.SIGKILL
    _check_failure_reported(job, codes, times, killed, None, fault_time)


@pytest.mark.timeout(120)
def test_rel_ranks_torchrun_names_the_failing_rank(tmp_path, data_path):
    job = Job(str(tmp_path), data_path, 2, torchrun=True, env={"MEGATRON_FAULT_INJECT": "raise:rank=1:iter=3"})
    codes, _ = job.wait(TIMEOUT_MIN * 60 + MARGIN_S + 60)
    out = job.output()
    assert codes[0] != 0, out[-4000:]
    assert out.count("Traceback (most recent call last)") >= 1
    assert len(re.findall(r"^\[rank 1\] ZeroDivisionError: ", out, re.M)) == 1, out[-6000:]
    assert not re.search(r"^\[rank 0\] ZeroDivisionError", out, re.M), out[-6000:]
    job.assert_no_process_left()


# ------------------------------------------------------------------------------------------------ preemption

def _saved_iteration(save_dir):
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        return int(f.read())


def _start(tmp, data_path, extra=(), env=None):
    os.makedirs(tmp, exist_ok=True)
    return Job(tmp, data_path, 2, extra=extra, env=env)


def _finish(job, timeout=200):
    codes, _ = job.wait(timeout)
    job.assert_no_process_left()
    return codes


PREEMPTION_CASES = {
    # SIGTERM reaches rank 1 only, during iteration 3: both ranks agree, finish iteration 3, save it.
    "sigterm_one": (["--exit-signal-handler"], {"MEGATRON_FAULT_INJECT": "sigterm:rank=1:iter=3"}, 3,
                    "exiting program after receiving SIGTERM"),
    # SIGTERM to the whole process group (SLURM's preemption) during iteration 5.
    "sigterm_all": (["--exit-signal-handler"], {"MEGATRON_FAULT_INJECT": "sigterm_group:rank=0:iter=5"}, 5,
                    "exiting program after receiving SIGTERM"),
    "exit_interval": (["--exit-interval", "4"], None, 4, "exiting program at iteration 4"),
    # 0.001 minutes have passed since the start by the end of iteration 1.
    "exit_duration": (["--exit-duration-in-mins", "0.001"], None, 1, "exiting program after"),
}


@pytest.mark.timeout(400)
def test_rel_ranks_preemption_saves_exits_zero_and_resumes(tmp_path, data_path):
    # Two or three 2-rank jobs at a time (at most 6 processes) to keep the wall time down.
    def case(name):
        flags, env, _, _ = PREEMPTION_CASES[name]
        save_dir = str(tmp_path / name / "ckpt")
        return _start(str(tmp_path / name), data_path, [*flags, "--save", save_dir, "--save-interval", "1000"], env)

    def check(name, job):
        _, _, expected_iteration, log_line = PREEMPTION_CASES[name]
        codes, out = _finish(job), job.output()
        assert codes == [0, 0], f"{name}: exit codes {codes}\n{out[-3000:]}"
        assert log_line in out, f"{name}: no '{log_line}'\n{out[-3000:]}"
        assert _saved_iteration(str(tmp_path / name / "ckpt")) == expected_iteration, name
        assert max(_losses(out)) == expected_iteration, name

    straight = _start(str(tmp_path / "straight"), data_path)
    first = {name: case(name) for name in ("sigterm_one", "sigterm_all")}
    assert _finish(straight) == [0, 0], straight.output()[-3000:]
    reference = _losses(straight.output())
    assert sorted(reference) == list(range(1, 9))
    for name, job in first.items():
        check(name, job)

    # The SIGTERM checkpoint loads, and the resumed run reproduces the uninterrupted losses exactly.
    resumed = _start(str(tmp_path / "resume"), data_path, ["--load", str(tmp_path / "sigterm_one" / "ckpt")])
    second = {name: case(name) for name in ("exit_interval", "exit_duration")}
    for name, job in second.items():
        check(name, job)
    assert _finish(resumed) == [0, 0], resumed.output()[-3000:]
    losses = _losses(resumed.output())
    assert sorted(losses) == list(range(4, 9))
    for iteration, loss in losses.items():
        assert loss == reference[iteration], f"iteration {iteration}: {loss} != {reference[iteration]}"
