"""``--async-save`` under faults: a full disk and a SIGKILL during the background write of a checkpoint leave the
tracker on the previous complete checkpoint, which loads and resumes with the uninterrupted run's losses.

Each job is 2 ranks (TP=2, both write checkpoint files) of ``pretrain`` in child processes
(rel_async_child.py), saving every 2 iterations with ``--async-save --ckpt-format torch_dist``; the fault hits
rank 1's background write of iteration 4 (files opened by an ``async-save-<call index>`` thread under
``iter_0000004``).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import child_pythonpath
from helpers.dist_harness import free_ports
from helpers.train_helpers import preprocess_corpus_slice

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rel_async_child.py")
TRACKER = "latest_checkpointed_iteration.txt"


def _start(mode, fault, save_dir, data, port):
    procs = []
    for rank in range(2):
        env = dict(os.environ, PYTHONPATH=child_pythonpath(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MEGATRON_FORCE_CPU="1")
        env.pop("MEGATRON_FAULT_INJECT", None)
        procs.append(subprocess.Popen([sys.executable, CHILD, mode, fault, save_dir, data], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs, timeout=200):
    deadline = time.time() + timeout
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("an async-save child hung:\n" + (p.communicate()[0] or "")[-3000:])
    return [p.returncode for p in procs], outputs


def _result(output):
    lines = [line for line in output.splitlines() if line.startswith("REL_RESULT ")]
    assert lines, output[-3000:]
    result = json.loads(lines[-1][len("REL_RESULT "):])
    result["losses"] = {int(k): v for k, v in result["losses"].items()}
    return result


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("async_data")), num_docs=200)


@pytest.mark.timeout(420)
def test_rel_async_save_full_disk_and_sigkill_keep_the_previous_checkpoint(data, tmp_path):
    dirs = {name: str(tmp_path / name) for name in ("straight", "enospc", "kill")}
    ports = iter(free_ports(5))
    jobs = {"straight": _start("straight", "-", dirs["straight"], data, next(ports)),
            "enospc": _start("fault", "enospc", dirs["enospc"], data, next(ports)),
            "kill": _start("fault", "kill", dirs["kill"], data, next(ports))}
    done = {name: _finish(procs) for name, procs in jobs.items()}

    codes, outputs = done["straight"]
    assert codes == [0, 0], outputs[1][-3000:]
    reference = _result(outputs[1])["losses"]  # TP=2: both ranks see the loss; take rank 1's
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    # Full disk on rank 1: the background save fails on every rank (they agree on it); the error comes out of
    # the next save (iteration 6) as one line on every rank; the staging directory is gone; tracker still 2.
    codes, outputs = done["enospc"]
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    for rank, output in enumerate(outputs):
        r = _result(output)
        error = r["error"]
        assert error is not None and "\n" not in error, (rank, output[-3000:])
        assert "asynchronous checkpoint save failed" in error and "iteration 4" in error, error
        assert "failed on rank 1" in error and "no space left" in error.lower(), error
        assert r["tracker"] == "2" and r["listing"] == ["iter_0000002", TRACKER], r
    print(f"REL_ASYNC enospc error: {error}")

    # SIGKILL of rank 1 during its background write: rank 0 ends too (its watchdog sees rank 1 die).
    codes, outputs = done["kill"]
    killed = [line for line in outputs[1].splitlines() if line.startswith("REL_KILL rank 1 in thread async-save-")]
    assert codes[1] == -signal.SIGKILL and killed and "iter_0000004.incomplete" in killed[0], outputs[1][-3000:]
    assert codes[0] != 0 and "rank 1 died" in outputs[0], outputs[0][-3000:]
    with open(os.path.join(dirs["kill"], TRACKER)) as f:
        assert f.read().strip() == "2"

    # Both directories load from iteration 2 and continue exactly; the resumed run's async saves complete.
    resumed = {name: _start("resume", "-", dirs[name], data, next(ports)) for name in ("enospc", "kill")}
    for name, procs in resumed.items():
        codes, outputs = _finish(procs)
        assert codes == [0, 0], (name, outputs[0][-3000:])
        r = _result(outputs[1])
        assert r["error"] is None, (name, r["error"])
        assert sorted(r["losses"]) == [3, 4, 5, 6], (name, r["losses"])
        for it, loss in r["losses"].items():
            assert loss == reference[it], f"{name}: iteration {it} resumed {loss!r} != uninterrupted {reference[it]!r}"
        assert r["tracker"] == "6", (name, r)
        assert r["listing"] == ["iter_0000002", "iter_0000004", "iter_0000006", TRACKER], (name, r["listing"])
        print(f"REL_ASYNC {name}: resumed from iteration 2, losses 3-6 identical: {r['losses']}")
