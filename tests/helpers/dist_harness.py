"""Run a test body on N gloo processes and fail fast, with every rank's traceback.

    from helpers.dist_harness import run_distributed
    results = run_distributed(body, world_size=4, tp=2)   # body(tp=2) runs on ranks 0..3

``body`` must be a module-level function (it is pickled into spawned processes). It runs after
``torch.distributed.init_process_group('gloo')`` with RANK/WORLD_SIZE/MASTER_* set as torchrun sets
them; its return values come back as a list indexed by rank. If a rank raises, the test fails with that
rank's traceback (and any others'); if a collective hangs, every process is killed after ``timeout``
seconds and the failure shows the Python stack of each rank that was still running.

Ranks start from a fork server that has imported torch once (``forkserver`` with ``torch`` preloaded): a rank then
starts in milliseconds instead of re-importing torch for ~2 s of CPU. Each rank gets exactly the parent's
environment of the moment (plus the harness's variables), as with ``spawn``, and imports everything else fresh.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from datetime import timedelta

DEFAULT_TIMEOUT = 60.0


def free_ports(n: int) -> list:
    """``n`` distinct free TCP ports on 127.0.0.1 (held open together while chosen, so no two are equal)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def _worker(rank, world_size, port, fn, args, kwargs, results, stack_path, timeout, env):
    os.environ.clear()  # the fork server's environment is from when it started: use the caller's, as spawn would
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
    })
    stack_file = open(stack_path, "w")
    # If this rank is still running shortly before the parent gives up, write where it is stuck.
    faulthandler.dump_traceback_later(max(timeout - 4.0, 1.0), exit=False, file=stack_file)
    try:
        import torch

        torch.set_num_threads(1)
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}", timeout=timedelta(seconds=max(timeout - 8.0, 5.0)),
        )
        out = fn(*args, **kwargs)
        # Plain pickle bytes: torch's queue reducer would pass tensors as shared-memory file descriptors,
        # which disappear if this process exits before the parent reads them.
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put(("error", rank, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:
            pass
        try:
            import torch

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass
        stack_file.close()


def _context():
    """The forkserver context with torch preloaded (spawn where forkserver does not exist)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # takes effect when the server starts (first use in this process)
    return ctx


class DistributedTestFailure(AssertionError):
    pass


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, env: dict | None = None, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    tmpdir = tempfile.mkdtemp(prefix="dist_test_")
    stack_paths = [os.path.join(tmpdir, f"rank{r}.stack") for r in range(world_size)]
    child_env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_FORCE_CPU="1")
    child_env.update(env or {})
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, stack_paths[r], timeout, child_env),
                    daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    outputs, errors = {}, {}
    deadline = time.monotonic() + timeout
    first_error_at = None
    while len(outputs) + len(errors) < world_size:
        now = time.monotonic()
        # Once one rank failed, give the others a moment to report their own errors, then stop.
        limit = deadline if first_error_at is None else min(deadline, first_error_at + 5.0)
        if now >= limit:
            break
        try:
            status, rank, payload = results.get(timeout=min(0.5, limit - now))
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                # Drain anything still in flight, then stop waiting for ranks that died silently.
                try:
                    while True:
                        status, rank, payload = results.get(timeout=0.5)
                        if status == "ok":
                            outputs[rank] = pickle.loads(payload)
                        else:
                            errors[rank] = payload
                except queue.Empty:
                    break
            continue
        if status == "ok":
            outputs[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            first_error_at = first_error_at or time.monotonic()

    for p in procs:
        p.join(timeout=2.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()

    if errors or len(outputs) < world_size:
        lines = []
        for r in sorted(errors):
            lines.append(f"----- rank {r} raised -----\n{errors[r]}")
        missing = [r for r in range(world_size) if r not in outputs and r not in errors]
        for r in missing:
            stack = ""
            try:
                with open(stack_paths[r]) as f:
                    stack = f.read().strip()
            except OSError:
                pass
            code = procs[r].exitcode
            lines.append(f"----- rank {r} did not finish (exit code {code}) -----\n{stack or '(no stack captured)'}")
        header = (f"distributed test failed: {len(errors)} rank(s) raised, {len(missing)} rank(s) hung or died "
                  f"(world size {world_size}, timeout {timeout:.0f}s)")
        raise DistributedTestFailure(header + "\n" + "\n".join(lines))
    return [outputs[r] for r in range(world_size)]
