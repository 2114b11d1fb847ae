"""Automatic restart: under ``torchrun --max-restarts`` a job that stops resumes from its last complete checkpoint
with the same command line (``--save D --load D``: the first start finds no checkpoint in D and starts from
scratch, each restart loads the newest one) and reaches exactly the losses of a clean run. torchrun runs with
``--standalone``, the one-node configuration of examples/pretrain_gpt_auto_restart.sh.

One job of 4 workers, 10 iterations, saving every 2, stops twice:

* attempt 0: the rerun state machine's injected transient error (``--error-injection-rate``) hits rank 1 at
  iteration 5; rank 1 is named ("Possible transient error!") and every rank exits with code 17;
* attempt 1 (restarted from iteration 4): rank 1 is SIGKILLed at the start of iteration 7;
* attempt 2 (restarted from iteration 6) finishes; torchrun exits 0.

The losses of iterations 1-10 (each from the attempt that logged it last) equal those of a clean run of the same
flags, to every printed digit.
"""
import re

import pytest

from helpers.dist_harness import run_distributed
from helpers.rel_jobs import Job, first_injection, logged_losses, rate_for
from helpers.train_helpers import preprocess_corpus_slice

BASE = ["--num-layers", "2", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0",
        "--train-iters", "10", "--distributed-timeout-minutes", "1"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("restart_data")), num_docs=200)


def clean_body(argv):
    from helpers.train_helpers import run_pretrain

    return run_pretrain("pretrain_gpt", argv, deterministic=False)


@pytest.mark.timeout(400)
def test_rel_restart_transient_error_then_sigkill_resume_exactly(tmp_path, data_path):
    # 4 ranks x 1 micro-batch: 4 validations per iteration. The injector's stream restarts with every attempt: the
    # first injection lands on rank 1 at iteration 5 of attempt 0; attempt 1 (from 4) would inject at 9 but is
    # killed at 7; attempt 2 (from 6) would inject at 11, after the end.
    rate = rate_for(4, 4, iteration=5, rank=1)
    assert first_injection(rate, 4, 4) == (5, [1])
    save = str(tmp_path / "ckpt")
    job = Job(str(tmp_path), data_path, 4, base=BASE, torchrun=True,
              torchrun_args=["--standalone", "--max-restarts", "2"],
              extra=["--save", save, "--load", save, "--save-interval", "2", "--error-injection-rate", str(rate)],
              env={"MEGATRON_FAULT_INJECT": "kill:rank=1:iter=7:attempt=1"})
    clean = run_distributed(clean_body, 4, ["--data-path", data_path, *BASE], timeout=300)
    codes, _ = job.wait(360)
    out = job.output()
    assert codes == [0], f"torchrun exit code {codes}\n{out[-5000:]}"
    assert "will start from random" in out, out[-5000:]  # attempt 0: nothing to load yet
    assert re.search(r"\[rerun\] Rank 1, node \S+, device cpu:1: unexpected result \S+ at iteration 5, validation "
                     r"call #\d+ \(message='[^']+'\) \[injected transient_error\]", out), out[-5000:]
    assert re.search(r"\[rerun\] Rank 1, node \S+, device cpu:1: Possible transient error!", out)
    assert "exiting program at iteration 5 with exit code 17" in out
    assert re.search(r"successfully loaded checkpoint from \S+ at iteration 4\b", out), out[-5000:]
    assert re.search(r"rank 1 died|exitcode\s*:\s*-9|Signal 9", out), out[-5000:]
    assert re.search(r"successfully loaded checkpoint from \S+ at iteration 6\b", out), out[-5000:]
    losses = logged_losses(out)  # the last attempt's line of each iteration
    reference = {r["iteration"]: "{:.6E}".format(r["loss"]["lm loss"]) for r in clean[-1]}
    assert sorted(losses) == list(range(1, 11)) == sorted(reference)
    assert all("{:.6E}".format(losses[i]) == reference[i] for i in range(1, 11)), (losses, reference)
    job.assert_no_process_left()
    print("REL_RESTART transient error (exit 17) at iteration 5 and SIGKILL at 7, restarted from 4 and 6: losses 1-10 "
          "equal to a clean run's:", [reference[i] for i in range(1, 11)])
