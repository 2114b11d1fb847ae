"""Automatic restart: under ``torchrun --max-restarts 1`` a job that loses a rank resumes from its last complete
checkpoint with the same command line (``--save D --load D``: the first start finds no checkpoint in D and
starts from scratch, the restart loads the newest one) and reaches exactly the losses of an uninterrupted run.
torchrun runs with ``--standalone``, the one-node configuration of examples/pretrain_gpt_auto_restart.sh.
"""
import re

import pytest

from helpers.rel_jobs import Job, logged_losses
from helpers.train_helpers import preprocess_corpus_slice

BASE = ["--num-layers", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0",
        "--train-iters", "10", "--distributed-timeout-minutes", "1"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("restart_data")), num_docs=200)


@pytest.mark.timeout(300)
def test_rel_restart_torchrun_max_restarts_resumes_exactly(tmp_path, data_path):
    save = str(tmp_path / "ckpt")
    (tmp_path / "straight").mkdir()
    (tmp_path / "restarted").mkdir()
    straight = Job(str(tmp_path / "straight"), data_path, 2, base=BASE)
    # Rank 1 is SIGKILLed at the start of iteration 5 of the first attempt only (attempt=0); the last complete
    # checkpoint is iteration 4. The command line of the restart is the same.
    restarted = Job(str(tmp_path / "restarted"), data_path, 2, base=BASE, torchrun=True,
                    torchrun_args=["--standalone", "--max-restarts", "1"],
                    extra=["--save", save, "--load", save, "--save-interval", "2"],
                    env={"MEGATRON_FAULT_INJECT": "kill:rank=1:iter=5:attempt=0"})
    codes, _ = straight.wait(240)
    assert codes == [0, 0], straight.output()[-3000:]
    reference = logged_losses(straight.output())
    assert sorted(reference) == list(range(1, 11))

    codes, _ = restarted.wait(240)
    out = restarted.output()
    assert codes == [0], f"torchrun exit code {codes}\n{out[-5000:]}"
    assert "will start from random" in out, out[-5000:]  # the first attempt: nothing to load yet
    assert re.search(r"successfully loaded checkpoint from \S+ at iteration 4\b", out), out[-5000:]
    assert re.search(r"rank 1 died|exitcode\s*:\s*-9|Signal 9", out), out[-5000:]
    # Iteration lines of the first attempt (1-4) and of the restart (5-10); the restart's lines come last.
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 11)), sorted(losses)
    for iteration in range(5, 11):
        assert losses[iteration] == reference[iteration], \
            f"iteration {iteration}: restarted {losses[iteration]!r} != uninterrupted {reference[iteration]!r}"
    restarted.assert_no_process_left()
    straight.assert_no_process_left()
    print(f"REL_RESTART losses 5-10 identical to the uninterrupted run: {[losses[i] for i in range(5, 11)]}")
