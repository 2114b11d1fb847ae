"""Crash-consistent checkpoints under faults (reliability):

* SIGKILL at random I/O events of a save. A child job (ckpt_rel_fault_child.py, 1 rank, or 2 ranks with TP=2)
  saves at iterations 2, 4, 6; an uninterrupted run first counts the file-system events (open, write, fsync,
  rename, mkdir, remove) of the iteration-4 save on each rank, then each trial kills one rank right before an
  event drawn with a fixed seed (the other rank of a 2-rank job is killed too, as a launcher would). Afterwards
  the tracker names a complete checkpoint that loads, and a resumed run reproduces the uninterrupted run's
  losses bit for bit (and its own later saves sweep the debris of the killed one).
* A full disk during a save: a writer that raises ENOSPC after N bytes on one rank of two, and a real, small
  tmpfs. Every rank raises the same one-line error naming the checkpoint directory and "no space left" (no rank
  hangs in a barrier), the tracker and the previous checkpoint are unchanged, the failed save leaves no files,
  and the run resumes from the previous checkpoint with the uninterrupted run's losses.
"""
import builtins
import errno
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import child_pythonpath
from helpers.ckpt_helpers import FileProxy, losses, preprocess_corpus_slice, run_leg
from helpers.dist_harness import free_ports, run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "ckpt_rel_fault_child.py")
SEED = 20240917
FORMATS = ("torch", "torch_dist")
# Per format: (world size, number of trials drawn). CI runs half of the drawn kill points (6 kills: per format both
# kill classes with 1 rank and one class with 2 ranks); REL_KILL_TRIALS_SCALE=n multiplies the trials, REL_KILL_ALL=1
# runs every drawn point (a longer soak).
TRIALS = [(1, 4), (2, 2)]
TRIALS = [(w, n * int(os.environ.get("REL_KILL_TRIALS_SCALE", "1"))) for w, n in TRIALS]
KILL_ALL = os.environ.get("REL_KILL_ALL") == "1"
MAX_PROCESSES = 4  # children running at once (2-core machines)
TRACKER = "latest_checkpointed_iteration.txt"


def _launch(mode, ckpt_format, kill_at_by_rank, world_size, save_dir, data, port):
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, PYTHONPATH=child_pythonpath(), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, CHILD, mode, ckpt_format, kill_at_by_rank.get(rank, "any:0"), save_dir, data]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _run_jobs(jobs, timeout=180):
    """Run jobs (dicts with mode, format, kill_at, world, dir) at most MAX_PROCESSES processes at a time. When one
    rank of a job is SIGKILLed the job's other ranks are killed as well. Fills job['codes'], job['output']."""
    pending, running = list(jobs), []
    ports = iter(free_ports(len(jobs)))
    deadline = time.time() + timeout
    try:
        while pending or running:
            while pending and sum(j["world"] for j in running) + pending[0]["world"] <= MAX_PROCESSES:
                job = pending.pop(0)
                job["procs"] = _launch(job["mode"], job["format"], job["kill_at"], job["world"], job["dir"],
                                       job["data"], next(ports))
                running.append(job)
            time.sleep(0.1)
            for job in list(running):
                codes = [p.poll() for p in job["procs"]]
                if any(c == -signal.SIGKILL for c in codes):
                    for p in job["procs"]:
                        if p.poll() is None:
                            p.kill()  # the launcher takes the whole job down
                if all(p.poll() is not None for p in job["procs"]):
                    job["codes"] = [p.returncode for p in job["procs"]]
                    job["output"] = [p.stdout.read() for p in job["procs"]]
                    running.remove(job)
            assert time.time() < deadline, f"fault-injection children still running after {timeout} s"
    finally:
        for job in running:
            for p in job["procs"]:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _result(output):
    lines = [line for line in output.splitlines() if line.startswith("REL_RESULT ")]
    assert lines, output[-3000:]
    result = json.loads(lines[-1][len("REL_RESULT "):])
    return result["events"], {int(k): v for k, v in result["losses"].items()}


def _assert_complete(save_dir, ckpt_format, world):
    """The tracker names a checkpoint whose files are all there and readable; return its iteration."""
    with open(os.path.join(save_dir, TRACKER)) as f:
        iteration = int(f.read())
    iter_dir = os.path.join(save_dir, "iter_{:07d}".format(iteration))
    if ckpt_format == "torch":
        for tp_rank in range(world):
            state = torch.load(os.path.join(iter_dir, f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt"),
                               map_location="cpu", weights_only=False)
            assert state["iteration"] == iteration
    else:
        from megatron.training.checkpointing.torch_dist import load_full_checkpoint
        assert os.path.isfile(os.path.join(iter_dir, "metadata.json")), os.listdir(iter_dir)
        assert load_full_checkpoint(iter_dir)["iteration"] == iteration
    return iteration


def resume_body(data, jobs):
    """Resume every killed directory to iteration 6 (saving into it again); this rank's losses per directory."""
    from ckpt_rel_fault_child import leg_args
    world = torch.distributed.get_world_size()
    out = {}
    for save_dir, ckpt_format in jobs:
        records, _ = run_leg(leg_args(ckpt_format, save_dir, data, world) + ["--load", save_dir])
        out[save_dir] = losses(records)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("rel_fault_data")))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """Uninterrupted runs: {(format, world): (events of the iteration-4 save per rank, losses by iteration)}."""
    root = tmp_path_factory.mktemp("rel_reference")
    jobs = [dict(mode="count", format=f, kill_at={}, world=w, dir=str(root / f"{f}-{w}"), data=data)
            for f in FORMATS for w, _ in TRIALS]
    _run_jobs(jobs)
    out = {}
    for job in jobs:
        assert job["codes"] == [0] * job["world"], job["output"]
        results = [_result(o) for o in job["output"]]
        out[(job["format"], job["world"])] = ([r[0] for r in results], results[-1][1], job["dir"])
    return out


def _kept(job):
    """Half of the drawn kill points: with 1 rank trials 0-1 (both classes) of the first format and 2-3 of the
    second; with 2 ranks trial 0 (any event) of the first format and 1 (a non-write event) of the second."""
    position = job["trial"] // 2 if job["world"] == 1 else job["trial"]
    return position % 2 == FORMATS.index(job["format"]) % 2


@pytest.mark.timeout(400)
def test_ckpt_rel_sigkill_at_random_save_events(data, reference, tmp_path_factory):
    root = tmp_path_factory.mktemp("rel_kill")
    rng = random.Random(SEED)
    jobs = []
    for ckpt_format in FORMATS:
        for world, trials in TRIALS:
            events = reference[(ckpt_format, world)][0]
            for trial in range(trials):
                # Alternate: any event (mostly the many write() calls inside files), or a non-write event (file
                # creation, fsync, rename, directory creation/removal: where the publishing steps are).
                kill_class = ("any", "meta")[trial % 2]
                rank = rng.randrange(world)
                # With 2 ranks the count of a rank's last events varies by one between runs (which rank creates a
                # shared directory first), so the kill point stays below the counted total.
                k = rng.randint(1, max(1, events[rank][kill_class] - (world > 1)))
                jobs.append(dict(mode="kill", format=ckpt_format, kill_at={rank: f"{kill_class}:{k}"}, world=world,
                                 trial=trial, data=data,
                                 dir=str(root / f"{ckpt_format}-w{world}-t{trial}-r{rank}-{kill_class}{k}")))
    if not KILL_ALL:  # half of the drawn points (the draws stay those of the full soak)
        jobs = [job for job in jobs if _kept(job)]
    print(f"random kill points (seed {SEED}): format, ranks, rank killed, before event k of n of its class")
    for job in jobs:
        (rank, point), = job["kill_at"].items()
        kill_class, k = point.split(":")
        print(f"  {job['format']:10s} world={job['world']} rank={rank} {kill_class} event {k}/"
              f"{reference[(job['format'], job['world'])][0][rank][kill_class]}")
    _run_jobs(jobs)

    trackers = {}
    for job in jobs:
        (rank, _), = job["kill_at"].items()
        out = job["output"][rank]
        assert job["codes"][rank] == -signal.SIGKILL and "REL_KILL" in out, (job["dir"], job["codes"], out[-3000:])
        trackers[job["dir"]] = _assert_complete(job["dir"], job["format"], job["world"])
        assert trackers[job["dir"]] in (2, 4), job["dir"]
    print("tracker after each kill:", {os.path.basename(d): t for d, t in trackers.items()})

    resumed = {}
    for world, _ in TRIALS:
        dirs = [(j["dir"], j["format"]) for j in jobs if j["world"] == world]
        for rank_result in run_distributed(resume_body, world, data, dirs, timeout=300):
            for d, got in rank_result.items():
                resumed.setdefault(d, {}).update(got)
    for job in jobs:
        expected = reference[(job["format"], job["world"])][1]
        got = resumed[job["dir"]]
        first = trackers[job["dir"]] + 1
        assert sorted(got) == list(range(first, 7)), (job["dir"], sorted(got))
        for it, loss in got.items():
            assert loss == expected[it], f"{job['dir']}: iteration {it} loss {loss!r} != uninterrupted {expected[it]!r}"
        # The resumed run's own saves completed over the debris of the killed one.
        assert sorted(os.listdir(job["dir"])) == ["iter_0000002", "iter_0000004", "iter_0000006", TRACKER], \
            os.listdir(job["dir"])
        assert _assert_complete(job["dir"], job["format"], job["world"]) == 6
    for ckpt_format in FORMATS:
        mine = [j for j in jobs if j["format"] == ckpt_format]
        print(f"REL_SUMMARY sigkill {ckpt_format}: {len(mine)} trials ({sum(j['world'] == 2 for j in mine)} with 2 "
              f"ranks), {len(mine)} tracker-consistent (tracker 2: {sum(trackers[j['dir']] == 2 for j in mine)}, "
              f"tracker 4: {sum(trackers[j['dir']] == 4 for j in mine)}), {len(mine)} resumed with identical losses")


# ---------------------------------------------------------------------------------------------- full disk

class _FullDiskFile(FileProxy):
    """A file on a disk that fills up after ``budget`` more bytes."""

    def __init__(self, f, budget):
        super().__init__(f)
        self._budget = budget

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if n > self._budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self._f, "name", None))
        self._budget[0] -= n
        return self._f.write(data)


def full_disk_body(data, save_dir, ckpt_format, failing_rank, budget_bytes):
    """Iterations 1-4 saving every 2; the iteration-4 save finds the disk full on ``failing_rank`` (all ranks when
    it is None: a real full filesystem). Then resume from what is left. Returns what each rank saw."""
    import megatron.training.training as training_mod
    from ckpt_rel_fault_child import leg_args
    world = torch.distributed.get_world_size()
    original_save = training_mod.save_checkpoint

    def save_on_full_disk(iteration, *args, **kwargs):
        if iteration != 4 or failing_rank != torch.distributed.get_rank():
            return original_save(iteration, *args, **kwargs)
        budget = [budget_bytes]
        originals = builtins.open, io.open

        def full_open(*a, **k):
            f = originals[0](*a, **k)
            mode = a[1] if len(a) > 1 else k.get("mode", "r")
            return _FullDiskFile(f, budget) if any(c in mode for c in "wax") else f
        builtins.open = io.open = full_open
        try:
            return original_save(iteration, *args, **kwargs)
        finally:
            builtins.open, io.open = originals

    training_mod.save_checkpoint = save_on_full_disk
    error = None
    try:
        run_leg(leg_args(ckpt_format, save_dir, data, world) + ["--exit-interval", "4"])
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = f"{type(e).__name__}: {e}"
    finally:
        training_mod.save_checkpoint = original_save
    torch.distributed.barrier()
    listing = sorted(os.listdir(save_dir))
    with open(os.path.join(save_dir, TRACKER)) as f:
        tracker = f.read()
    torch.distributed.barrier()
    # Resume without saving (the disk is still full): the previous checkpoint must load and continue exactly.
    records, _ = run_leg(["--data-path", data, "--train-iters", "6", "--ckpt-format", ckpt_format, "--load", save_dir]
                         + (["--tensor-model-parallel-size", "2"] if world == 2 else []))
    return {"error": error, "listing": listing, "tracker": tracker, "losses": losses(records)}


def _check_full_disk(results, save_dir, expected_losses):
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank}: the save on a full disk did not fail"
        assert "\n" not in r["error"] and save_dir in r["error"] and "no space left" in r["error"], r["error"]
        assert r["tracker"] == "2"
        # The failed save left nothing behind: no staging directory, no temporary file, no iteration 4.
        assert r["listing"] == ["iter_0000002", TRACKER], r["listing"]
        assert sorted(r["losses"]) == [3, 4, 5, 6], r["losses"]
        for it, loss in r["losses"].items():
            assert loss == expected_losses[it], (rank, it, loss, expected_losses[it])
    return results[0]["error"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ckpt_format", FORMATS)
def test_ckpt_rel_disk_full_on_one_rank(data, reference, tmp_path, ckpt_format):
    """Rank 1 of 2 (TP=2) gets ENOSPC 4 KiB into its iteration-4 files; rank 0 writes fine and must not hang."""
    save_dir = str(tmp_path / "save")
    results = run_distributed(full_disk_body, 2, data, save_dir, ckpt_format, 1, 4096, timeout=200)
    error = _check_full_disk(results, save_dir, reference[(ckpt_format, 2)][1])
    assert "failed on rank 1" in error, error
    print(f"REL_SUMMARY disk-full writer {ckpt_format}: {error}")


def _checkpoint_bytes(directory):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


@pytest.mark.timeout(240)
def test_ckpt_rel_disk_full_real_tmpfs(data, reference, tmp_path):
    """A real filesystem too small for a second checkpoint (tmpfs, needs root and mount permission)."""
    mount_point = str(tmp_path / "small_fs")
    os.makedirs(mount_point)
    one_checkpoint = _checkpoint_bytes(os.path.join(reference[("torch", 2)][2], "iter_0000002"))
    size_kib = int(one_checkpoint * 1.5) // 1024
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", mount_point],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mount.stderr.strip() or 'mount failed'}): the failing-writer "
                    "tests cover the full disk instead")
    try:
        save_dir = os.path.join(mount_point, "save")
        results = run_distributed(full_disk_body, 2, data, save_dir, "torch", None, 0, timeout=200)
        error = _check_full_disk(results, save_dir, reference[("torch", 2)][1])
        print(f"REL_SUMMARY disk-full tmpfs ({size_kib} KiB, one checkpoint {one_checkpoint} B): {error}")
    finally:
        subprocess.run(["umount", mount_point], check=False)
        shutil.rmtree(mount_point, ignore_errors=True)


# ---------------------------------------------------------------------------------- torch_dist re-save

def resave_body(data, save_dir):
    """torch_dist: save 2 and 4; resume from --ckpt-step 2 and save 4 again, failing right after the complete copy
    of iteration 4 (the one the tracker names) was moved aside; then resume from the tracker."""
    from megatron.training.checkpointing import protocol
    base = ["--data-path", data, "--train-iters", "6", "--exit-interval", "4", "--ckpt-format", "torch_dist",
            "--save", save_dir, "--save-interval", "2"]
    run_leg(base)

    def fail_after_moving_aside(stage, path):
        if stage == "previous-copy-moved-aside":
            raise OSError(errno.EIO, "simulated crash between the two renames", path)

    protocol.save_stage = fail_after_moving_aside
    try:
        run_leg(base + ["--load", save_dir, "--ckpt-step", "2"])
        error = None
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = str(e)
    finally:
        protocol.save_stage = lambda stage, path: None
    listing = sorted(os.listdir(save_dir))
    records, _ = run_leg(["--data-path", data, "--train-iters", "6", "--ckpt-format", "torch_dist",
                          "--load", save_dir])
    return error, listing, losses(records)


@pytest.mark.timeout(200)
def test_ckpt_rel_torch_dist_resave_interrupted_between_renames(data, reference, tmp_path):
    save_dir = str(tmp_path / "save")
    error, listing, got = run_distributed(resave_body, 1, data, save_dir, timeout=180)[0]
    assert error is not None and "simulated crash" in error and save_dir in error, error
    # The tracker still says 4; iteration 4 exists only as the copy moved aside, which the loader falls back to.
    assert listing == ["iter_0000002", "iter_0000004.old", TRACKER], listing
    assert sorted(got) == [5, 6], got
    expected = reference[("torch_dist", 1)][1]
    assert all(got[it] == expected[it] for it in got), (got, expected)
