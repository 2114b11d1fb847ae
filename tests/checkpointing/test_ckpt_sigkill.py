"""A process SIGKILLed in the middle of a save leaves the previous checkpoint complete, loadable, and named by
the tracker. The child (ckpt_kill_child.py, one rank) saves at iteration 2, then kills itself at one stage of
the iteration-4 save; afterwards the tracker must still say 2 and a fresh run must resume from it."""
import os
import socket
import subprocess
import sys

import pytest

from ckpt_helpers import REPO, preprocess_corpus_slice, run_leg
from dist_harness import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
# (stage, occurrence): the model file's temp write (1st file is distrib_optim.pt, 2nd model_optim_rng.pt),
# before its rename, once all files are written, after the directory rename, before the tracker rename.
KILL_POINTS = [("file-temp-written", 1), ("file-temp-written", 2), ("file-renamed", 2),
               ("all-files-written", 1), ("iteration-dir-renamed", 1), ("tracker-temp-written", 1)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resume_body(data_path, dirs):
    out = {}
    for d in dirs:
        records, _ = run_leg(["--data-path", data_path, "--train-iters", "4", "--load", d,
                              "--use-distributed-optimizer"])
        out[d] = [r["iteration"] for r in records]
    return out


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("kill_data")))
    root = tmp_path_factory.mktemp("kill")
    procs = []
    for stage, occurrence in KILL_POINTS:
        save_dir = str(root / f"{stage}-{occurrence}")
        env = dict(os.environ, PYTHONPATH=REPO, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.join(HERE, "ckpt_kill_child.py"), stage, str(occurrence), save_dir, data]
        procs.append((save_dir, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                 text=True)))
    results = {}
    for save_dir, proc in procs:
        output, _ = proc.communicate(timeout=240)
        results[save_dir] = (proc.returncode, output)
    return data, results


def test_ckpt_sigkill_mid_save_keeps_previous_checkpoint(killed_saves):
    data, results = killed_saves
    for save_dir, (code, output) in results.items():
        assert code == -9, f"{save_dir}: the child was not killed (exit code {code})\n{output[-3000:]}"
        assert "killing myself at" in output
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
            assert f.read() == "2", save_dir
        for name in ("model_optim_rng.pt", "distrib_optim.pt"):
            assert os.path.isfile(os.path.join(save_dir, "iter_0000002", "mp_rank_00", name))
    resumed = run_distributed(resume_body, 1, data, sorted(results), timeout=240)[0]
    for save_dir, iterations in resumed.items():
        assert iterations == [3, 4], f"{save_dir}: resumed at {iterations}"
