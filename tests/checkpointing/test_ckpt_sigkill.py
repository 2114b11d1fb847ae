"""A process SIGKILLed in the middle of a save leaves the previous checkpoint complete, loadable, and named by
the tracker. The child (ckpt_kill_child.py, one rank) saves at iteration 2, then kills itself at one stage of
the iteration-4 save; afterwards the tracker must still say 2 and a fresh run must resume from it (and save
again over the debris). In 'resave' mode the killed save re-writes iteration 4, which the tracker names."""
import os
import subprocess
import sys

import pytest

from helpers import child_pythonpath
from helpers.ckpt_helpers import preprocess_corpus_slice, run_leg
from helpers.dist_harness import free_ports, run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
# (mode, stage, occurrence). fresh: during the iteration-4 save, after the model file's temporary write (the
# 1st file written is distrib_optim.pt, the 2nd model_optim_rng.pt), after its rename, once every file is written
# (before the directory rename), and before the tracker's rename. resave: iteration 4, which the tracker names,
# is saved again and the process dies right after moving the complete copy aside.
KILL_POINTS = [("fresh", "file-temp-written", 2), ("fresh", "file-renamed", 2), ("fresh", "all-files-written", 1),
               ("fresh", "tracker-temp-written", 1), ("resave", "previous-copy-moved-aside", 1)]
MAX_CHILDREN = 5


def resume_body(data_path, dirs):
    """Resume from each killed directory and keep saving into it (iterations up to 6, a save every 2)."""
    out = {}
    for d in dirs:
        records, _ = run_leg(["--data-path", data_path, "--train-iters", "6", "--load", d, "--save", d,
                              "--save-interval", "2", "--use-distributed-optimizer"])
        out[d] = [r["iteration"] for r in records]
    return out


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("kill_data")))
    root = tmp_path_factory.mktemp("kill")
    ports = free_ports(len(KILL_POINTS))
    jobs = []
    for (mode, stage, occurrence), port in zip(KILL_POINTS, ports):
        save_dir = str(root / f"{mode}-{stage}-{occurrence}")
        env = dict(os.environ, PYTHONPATH=child_pythonpath(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.join(HERE, "ckpt_kill_child.py"), mode, stage, str(occurrence), save_dir, data]
        jobs.append((save_dir, cmd, env))
    results = {}
    for start in range(0, len(jobs), MAX_CHILDREN):  # a few children at a time (2-core machines)
        batch = [(d, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                 for d, cmd, env in jobs[start:start + MAX_CHILDREN]]
        for save_dir, proc in batch:
            output, _ = proc.communicate(timeout=240)
            results[save_dir] = (proc.returncode, output)
    return data, results


def test_ckpt_sigkill_mid_save_keeps_previous_checkpoint(killed_saves):
    data, results = killed_saves
    for save_dir, (code, output) in results.items():
        assert code == -9, f"{save_dir}: the child was not killed (exit code {code})\n{output[-3000:]}"
        assert "killing myself at" in output
        previous = 4 if "resave" in os.path.basename(save_dir) else 2
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
            assert f.read() == str(previous), save_dir
    resumed = run_distributed(resume_body, 1, data, sorted(results), timeout=240)[0]
    for save_dir, iterations in resumed.items():
        previous = 4 if "resave" in os.path.basename(save_dir) else 2
        assert iterations == list(range(previous + 1, 7)), f"{save_dir}: resumed at {iterations}"
        # The later saves cleaned up after the killed one and completed.
        assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                                 "latest_checkpointed_iteration.txt"], os.listdir(save_dir)
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
            assert f.read() == "6"
