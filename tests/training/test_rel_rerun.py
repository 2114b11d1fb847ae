"""The rerun state machine end to end (pretrain_gpt.py on gloo ranks), driven by its error injection (the transient
error on rank 1 of 4 restarted by torchrun is tests/training/test_rel_restart.py):

* persistent error (torch_dist): checkpoint and exit 16; resumed on the same node and device: exit 16 again;
  resumed on "another device" (the device identity overridden): "Possible persistent error!", exit 17;
* correct result (torch format, with the tracker file): 16, then "Correct result (but possible Application error)"
  and 17 on another device; the next start reads the tracker file and skips the iteration;
* --rerun-mode report_stats re-runs every iteration and reports zero differences on CPU, with a clean run's losses.

Which rank and iteration an injection hits follows from the formula ``(randint(0, N-1) + rank) % N == 0`` with one
random stream seeded by --seed (helpers.rel_jobs.first_injection, independent of the library).
"""
import re

import pytest
from helpers.dist_harness import run_distributed
from helpers.rel_jobs import first_injection, rate_for
from helpers.train_helpers import preprocess_corpus_slice

BASE = ["--num-layers", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0",
        "--distributed-timeout-minutes", "1"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("rerun_data")), num_docs=200)


def _run(argv, other_device=False, deterministic=True):
    """One pretrain_gpt job in this rank; (exit code, records). ``other_device`` plays a restart elsewhere."""
    from helpers.train_helpers import run_pretrain

    from megatron.core import rerun_state_machine as rsm

    original = rsm.node_and_device
    if other_device:
        rsm.node_and_device = lambda: ("another-node", "3")
    try:
        return 0, run_pretrain("pretrain_gpt", argv, deterministic=deterministic)
    except SystemExit as exit_:
        return exit_.code, None
    finally:
        rsm.node_and_device = original


def paths_body(tmp, data_path, persistent_rate, correct_rate):
    import io
    import sys

    out, log = {}, io.StringIO()
    stdout, sys.stdout = sys.stdout, log
    common = ["--data-path", data_path, *BASE, "--train-iters", "5"]
    try:
        save = ["--save", f"{tmp}/persistent", "--load", f"{tmp}/persistent", "--save-interval", "10",
                "--ckpt-format", "torch_dist"]
        injected = ["--error-injection-rate", str(persistent_rate), "--error-injection-type", "persistent_error"]
        out["clean"] = _run(common + ["--train-iters", "3"])
        out["persistent"] = [_run(common + save + injected)[0], _run(common + save + injected)[0],
                             _run(common + save + injected, other_device=True)[0]]
        save = ["--save", f"{tmp}/correct", "--load", f"{tmp}/correct", "--save-interval", "10",
                "--result-rejected-tracker-filename", f"{tmp}/tracker.txt"]
        injected = ["--error-injection-rate", str(correct_rate), "--error-injection-type", "correct_result"]
        out["correct"] = [_run(common + save + injected)[0], _run(common + save + injected, other_device=True)[0],
                          _run(common + save)]
        out["stats"] = _run(common + ["--train-iters", "3", "--rerun-mode", "report_stats"])
    finally:
        sys.stdout = stdout
    out["log"] = log.getvalue()
    return out


@pytest.mark.timeout(300)
def test_rel_rerun_persistent_and_correct_result_paths(tmp_path, data_path):
    # 2 ranks x 2 micro-batches: per iteration each rank validates 2 losses x (NaN, Inf) and one grad norm x 2.
    persistent_rate = rate_for(2, 6, iteration=3)
    correct_rate = rate_for(2, 6, iteration=2)
    results = run_distributed(paths_body, 2, str(tmp_path), data_path, persistent_rate, correct_rate, timeout=280)
    log = results[0]["log"]
    for out in results:
        assert out["persistent"] == [16, 16, 17], (out["persistent"], out["log"][-6000:])
        assert out["correct"][:2] == [16, 17] and out["correct"][2][0] == 0, (out["correct"][:2], out["log"][-6000:])
    _, ranks = first_injection(persistent_rate, 2, 6)
    assert re.search(rf"\[rerun\] Rank {ranks[0]}, node \S+, device cpu:{ranks[0]}: unexpected result \S+ at iteration "
                     r"3, validation call #\d+ \(message='[^']+'\) \[injected persistent_error\]", log), log[-3000:]
    assert "first rerun: the unexpected result is reproducible within the tolerance" in log
    assert re.search(r"successfully saved checkpoint at iteration\s+2 to \S+/persistent", log)
    assert "exit code 16: resume from the last checkpoint on another device" in log
    assert re.search(r"got rescheduled on the same device: need to resume again from the same checkpoint "
                     r"\(node: \S+, device: cpu:\d\)", log)
    assert "Possible persistent error!" in log and "exit code 17: restart from the last checkpoint" in log
    # Correct result: both re-runs agree; the tracker file makes the next start skip iteration 2, then train on.
    assert "Correct result (but possible Application error)" in log
    tracker = open(tmp_path / "tracker.txt").read()
    assert re.findall(r"status=(\w+)", tracker) == ["INITIAL_RUN", "FIRST_RERUN_REPRODUCIBLE",
                                                     "SECOND_RERUN_REPRODUCIBLE"], tracker
    assert "iterations [2] gave a bad result that reproduced twice" in log and "skipping iteration 2" in log
    assert [r["iteration"] for r in results[1]["correct"][2][1]] == [3, 4, 5]
    # report_stats: every iteration re-run, no difference on CPU, the clean run's losses.
    assert re.search(r"found NaN in local forward loss calculation: \d+ samples, min 0\.000e\+00, median "
                     r"0\.000e\+00, mean 0\.000e\+00, max 0\.000e\+00", results[1]["log"]), results[1]["log"][-2000:]
    assert [r["loss"] for r in results[1]["stats"][1]] == [r["loss"] for r in results[1]["clean"][1]]
    print("\n".join(line for line in log.splitlines() if line.startswith(("[rerun]", "[exiting", "skipping"))))
