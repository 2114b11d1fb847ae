"""The rerun state machine on its own (one process, no process group): its transitions, verdicts, exit codes,
messages, tracker file, checkpoint state, data replay and the error injector's formula (checked against the formula
computed here with Python's random.Random)."""
import math
import random

import pytest
import torch

from megatron.core import rerun_state_machine as rsm
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    ResultRejectedError,
    compare_floats,
    iterations_to_skip_from_tracker,
)


def _machine(mode="validate_results", rate=0, kind="transient_error", tracker=None, lines=None):
    return RerunStateMachine(mode=mode, error_injector=RerunErrorInjector(rate, kind, seed=1),
                             result_rejected_tracker_filename=tracker, checks_requested=True,
                             log=(lines.append if lines is not None else (lambda s: None)))


def _iteration(machine, values, data=None, fatal=True):
    """Run one iteration: pass k validates values[k] (NaN rejected); returns (passes, (checkpoint, exit, code))."""
    passes = 0
    while machine.should_run_forward_backward(data):
        if data is not None:
            next(data)
        value = values[min(passes, len(values) - 1)]
        machine.validate_result(torch.tensor(value), torch.isnan, "found NaN in local forward loss calculation",
                                fatal=fatal)
        passes += 1
    return passes, machine.should_checkpoint_and_exit()


def test_compare_floats_and_large_values():
    assert compare_floats(1.0, 1.0) == 0 and compare_floats(math.nan, math.nan) == 0
    assert compare_floats(math.nan, 1.0) == math.inf and compare_floats(1.0, math.inf) == math.inf
    assert compare_floats(1.0, 1.1) == pytest.approx(2 * 0.1 / 2.1)
    m = _machine()
    m.state = RerunState.INITIAL_RUN
    assert not any(m.is_unexpectedly_large(float(x), 10.0, "loss") for x in range(1, 101))  # recording only
    assert not m.is_unexpectedly_large(999.0, 10.0, "loss") and m.is_unexpectedly_large(1000.0, 10.0, "loss")
    assert not m.is_unexpectedly_large(math.nan, 10.0, "loss") and not m.is_unexpectedly_large(-5.0, 10.0, "grads")


def test_clean_iterations_run_once_and_rejections_rerun_in_place(tmp_path):
    lines = []
    m = _machine(lines=lines, tracker=str(tmp_path / "t.txt"))
    assert _iteration(m, [1.0]) == (1, (False, False, 0))
    assert m.current_iteration == 1 and m.state == RerunState.NOT_RUNNING_YET
    # Transient: NaN at first, then a finite value: exit 17, no checkpoint.
    assert _iteration(m, [math.nan, 2.0]) == (2, (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION))
    assert any("Possible transient error!" in line for line in lines)
    tracked = (tmp_path / "t.txt").read_text().splitlines()
    assert [line.split(" status=")[1].split()[0] for line in tracked] == ["INITIAL_RUN", "FIRST_RERUN_NOT_REPRODUCIBLE"]
    assert " rank=0 iteration=2 " in tracked[0] and tracked[0].endswith("message='found NaN in local forward loss "
                                                                         "calculation'")
    # Reproducible: checkpoint and 16; the state waits for a re-run from the checkpoint.
    assert _iteration(m, [math.nan, math.nan]) == (2, (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE))
    assert m.state == RerunState.WILL_RERUN_FROM_CHECKPOINT and m.current_iteration == 2
    # A non-fatal rejection that reproduces goes on training.
    m2 = _machine()
    assert _iteration(m2, [math.nan, math.nan], fatal=False) == (2, (False, False, 0))


@pytest.mark.parametrize("kind,verdict,code", [
    ("persistent_error", "Possible persistent error!", EXIT_CODE_FAILED_ON_RESULT_VALIDATION),
    ("correct_result", "Correct result (but possible Application error)", EXIT_CODE_FAILED_ON_RESULT_VALIDATION)])
def test_injected_error_paths_through_a_checkpoint(kind, verdict, code, monkeypatch, tmp_path):
    tracker = str(tmp_path / "t.txt")
    lines = []
    m = _machine(rate=1, kind=kind, tracker=tracker, lines=lines)  # rate 1: the first validation injects on rank 0
    assert _iteration(m, [1.0]) == (2, (True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE))
    assert "[injected " + kind + "]" in "\n".join(lines)
    saved = m.state_dict()
    assert saved["state"] == "WILL_RERUN_FROM_CHECKPOINT" and saved["failed"]["injected"] == kind

    # Resumed on the same node and device: says so and exits 16 again, keeping the pending re-run.
    again = _machine(rate=0, lines=lines, tracker=tracker)
    again.load_state_dict(saved)
    assert _iteration(again, [1.0]) == (1, (False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE))
    assert "got rescheduled on the same device" in lines[-1]
    assert again.state_dict()["state"] == "WILL_RERUN_FROM_CHECKPOINT"

    # Resumed on another device (identity overridden): the verdict, exit 17, the checkpoint then holds no re-run.
    monkeypatch.setattr(rsm, "node_and_device", lambda: ("other-node", "7"))
    other = _machine(rate=0, lines=lines, tracker=tracker)
    other.load_state_dict(saved)
    assert _iteration(other, [1.0]) == (1, (True, True, code))
    assert verdict in "\n".join(lines[-3:])
    assert other.state_dict()["state"] == "NOT_RUNNING_YET" and other.state_dict()["failed"] is None
    statuses = [line.split(" status=")[1].split()[0] for line in open(tracker)]
    second = "SECOND_RERUN_NOT_REPRODUCIBLE" if kind == "persistent_error" else "SECOND_RERUN_REPRODUCIBLE"
    assert statuses == ["INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE", second]
    # The tracker file: only a result that reproduced twice (bad data) makes the iteration skipped.
    assert iterations_to_skip_from_tracker(tracker) == ([] if kind == "persistent_error" else [1])


def test_transient_injection_and_the_injector_formula():
    lines = []
    m = _machine(rate=1, kind="transient_error", lines=lines)
    assert _iteration(m, [1.0]) == (2, (False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION))
    assert "Possible transient error!" in lines[-1]
    # (randint(0, N-1) + rank) % N == 0 with one stream seeded alike on every rank, at most once per iteration.
    for rank in range(4):
        injector = RerunErrorInjector(7, "transient_error", seed=5)
        reference = random.Random(5)
        expected = next(i for i in range(1000) if (reference.randint(0, 6) + rank) % 7 == 0)
        got = next(i for i in range(1000) if injector.maybe_inject(rank))
        assert got == expected
        assert not injector.maybe_inject(rank)  # the iteration already has its injected error


def test_tracker_file_rules(tmp_path):
    path = tmp_path / "tracker.txt"

    def line(job, rank, iteration, status):
        return (f"ts=2026-01-01T00:00:00 node=n device=0 jobID={job} rank={rank} iteration={iteration} "
                f"status={status} result=nan message='found NaN in local forward loss calculation'\n")

    path.write_text(line(1, 3, 5, "FIRST_RERUN_REPRODUCIBLE") + line(2, 3, 5, "SECOND_RERUN_REPRODUCIBLE")
                    + line(1, 0, 7, "RERUN_DISABLED") + line(1, 1, 7, "RERUN_DISABLED")
                    + line(2, 0, 7, "RERUN_DISABLED")  # rank 0 twice, but job 1 saw iteration 7 on two ranks
                    + line(1, 2, 9, "FIRST_RERUN_NOT_REPRODUCIBLE") + line(2, 2, 9, "INITIAL_RUN")
                    + line(3, 4, 11, "RERUN_DISABLED") + line(4, 4, 11, "RERUN_DISABLED"))
    assert iterations_to_skip_from_tracker(str(path)) == [5, 11]
    assert iterations_to_skip_from_tracker(str(tmp_path / "absent.txt")) == []


def test_data_replay_report_stats_and_disabled_mode():
    data = RerunDataIterator(iter(range(100)))
    m = _machine()
    seen = []
    while m.should_run_forward_backward(data):
        seen.append([next(data), next(data)])
        m.validate_result(torch.tensor(math.nan if len(seen) == 1 else 1.0), torch.isnan, "x")
    assert seen == [[0, 1], [0, 1]] and next(data) == 2  # the re-run replayed the same two micro-batches

    stats = _machine(mode="report_stats")
    assert stats.mode == RerunMode.REPORT_DETERMINISM_STATS
    for _ in range(3):
        assert _iteration(stats, [1.0, 1.0 + 2 ** -10]) == (2, (False, False, 0))  # exact in float32
    assert "found NaN in local forward loss calculation: 3 samples" in stats.stats_report()
    assert stats.stats[next(iter(stats.stats))].values == [2 * 2 ** -10 / (2 + 2 ** -10)] * 3

    disabled = _machine(mode="disabled")
    assert _iteration(disabled, [1.0]) == (1, (False, False, 0))
    with pytest.raises(ResultRejectedError, match=r"^iteration 2: found NaN in local forward loss calculation on "
                                                   r"rank 0 \(node \S+, device \S+\): unexpected result nan"):
        _iteration(disabled, [math.nan])


def test_spiky_loss_and_large_grads_flags_validate_through_the_machine(monkeypatch):
    """--check-for-spiky-loss / --check-for-large-grads (megatron/training/numerical_checks.py): the first 100
    losses / grad norms only record their largest value; then a loss (grad norm) of 10x that is rejected, re-run
    in place and, reproducible and non-fatal, the run goes on (exit nothing); a NaN is left to the NaN check."""
    from megatron.training import numerical_checks as nc

    lines = []
    m = _machine(lines=lines)
    monkeypatch.setattr(rsm, "_MACHINE", m)
    checks = nc.ResultChecks(nan=False, allow_inf=False, spiky_loss=True, large_grads=True)
    layer = torch.nn.Linear(2, 2, bias=False)

    def iteration(loss, grad):
        passes = 0
        while m.should_run_forward_backward(None):
            nc.validate_loss(torch.tensor(loss), checks)
            layer.weight.grad = torch.full((2, 2), grad / 2.0)  # norm = grad
            nc.validate_grads([layer], checks)
            passes += 1
        return passes, m.should_checkpoint_and_exit()

    for i in range(100):
        assert iteration(1.0 + i / 100, 0.5) == (1, (False, False, 0))
    assert iteration(19.8, 4.9) == (1, (False, False, 0))  # below 10 x 1.99 and 10 x 0.5
    assert iteration(20.0, 0.5) == (2, (False, False, 0))  # spiky (>= 19.9): re-run, reproducible, go on
    assert any("unexpected result 20 at iteration 102, validation call #1 (message='Spiky loss')" in line
               for line in lines), lines
    assert lines[-1].endswith("first rerun: the unexpected result is reproducible within the tolerance 0 (20 = 20); not "
                              "a fatal check (Spiky loss): training goes on"), lines
    lines.clear()
    assert iteration(1.0, 5.0) == (2, (False, False, 0))  # large grads (>= 5.0)
    assert any("unexpected result 5 at iteration 103, validation call #1 (message='found unexpectedly large "
               "grads')" in line for line in lines), lines
    assert iteration(math.nan, math.nan) == (1, (False, False, 0))  # not "large": the NaN check's job (off here)
