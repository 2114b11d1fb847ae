"""Child process (one rank of a 2-rank job, TP=2) for test_rel_async_save.py: a tiny GPT trained through
``pretrain`` with ``--async-save --ckpt-format torch_dist``, saving every 2 iterations.

    python rel_async_child.py straight -        <save_dir> <data_prefix>   6 iterations, no checkpoint
    python rel_async_child.py fault    enospc   <save_dir> <data_prefix>   rank 1's background write of iteration 4
                                                                          finds the disk full after 4 KiB
    python rel_async_child.py fault    kill     <save_dir> <data_prefix>   rank 1 SIGKILLs itself 4 KiB into the
                                                                          background write of iteration 4
    python rel_async_child.py resume   -        <save_dir> <data_prefix>   --load the save directory, train to 6

The faults act only on files opened by the background save thread (``async-save-<call index>``) under
``iter_0000004``; every other file (the earlier checkpoint, the data) is untouched. Prints ``REL_RESULT {...}``:
this rank's losses, the error the run ended with (one line, or null), the save directory's listing and tracker.
"""
import builtins
import errno
import io
import json
import os
import signal
import sys
import threading

from helpers.ckpt_helpers import FileProxy, losses, run_leg

TRACKER = "latest_checkpointed_iteration.txt"


class _FaultyFile(FileProxy):
    """A file that, after ``budget`` bytes, raises ENOSPC (a full disk) or SIGKILLs its process."""

    def __init__(self, f, budget, action):
        super().__init__(f)
        self._budget, self._action = budget, action

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if n > self._budget[0]:
            if self._action == "kill":
                print(f"REL_KILL rank {os.environ['RANK']} in thread {threading.current_thread().name} writing "
                      f"{getattr(self._f, 'name', '?')}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self._f, "name", None))
        self._budget[0] -= n
        return self._f.write(data)


def install_fault(action):
    budget = [4096]
    originals = builtins.open, io.open

    def faulty_open(*args, **kwargs):
        f = originals[0](*args, **kwargs)
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
        path = str(args[0]) if args else str(kwargs.get("file", ""))
        if (any(c in mode for c in "wax") and "iter_0000004" in path
                and threading.current_thread().name.startswith("async-save")):
            return _FaultyFile(f, budget, action)
        return f
    builtins.open = io.open = faulty_open


def main():
    mode, fault, save_dir, data = sys.argv[1:5]
    args = ["--data-path", data, "--train-iters", "6", "--tensor-model-parallel-size", "2"]
    if mode != "straight":
        args += ["--ckpt-format", "torch_dist", "--async-save", "--save", save_dir, "--save-interval", "2"]
    if mode == "resume":
        args += ["--load", save_dir]
    if mode == "fault" and os.environ["RANK"] == "1":
        install_fault(fault)
    error, records = None, []
    try:
        records, _ = run_leg(args)
    except Exception as e:  # noqa: BLE001 - reported to the test
        error = f"{type(e).__name__}: {e}"
    result = {"losses": losses(records) if records else {}, "error": error}
    if mode != "straight":
        result["listing"] = sorted(os.listdir(save_dir))
        with open(os.path.join(save_dir, TRACKER)) as f:
            result["tracker"] = f.read().strip()
    print("REL_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
