"""Child process (one rank of a 1- or 2-rank job) for test_ckpt_rel_faults.py: trains a tiny GPT that saves at
iterations 2, 4 and 6 and counts the I/O events of the iteration-4 save (every open(), write(), fsync, rename,
mkdir and removal any code makes while it runs), or SIGKILLs itself right before one of them. Writes are by far
the most numerous events, so a kill point names its class: ``any:<k>`` (the k-th event of any kind) or
``meta:<k>`` (the k-th event that is not a write(): opens, fsyncs, renames, directory changes).

    python ckpt_rel_fault_child.py count <ckpt_format> any:0   <save_dir> <data_prefix>
        runs 6 iterations uninterrupted; prints ``REL_RESULT {"events": {"any": N, "meta": M}, "losses": {...}}``.
    python ckpt_rel_fault_child.py kill  <ckpt_format> <class>:<k> <save_dir> <data_prefix>
        the same run, killed right before that event of the iteration-4 save (prints the event first).

RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT come from the environment; with WORLD_SIZE=2 the job uses
--tensor-model-parallel-size 2, so that both ranks write checkpoint files.
"""
import builtins
import io
import json
import os
import shutil
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from helpers.ckpt_helpers import FileProxy, losses, run_leg  # noqa: E402


def leg_args(ckpt_format, save_dir, data, world_size):
    args = ["--data-path", data, "--train-iters", "6", "--save", save_dir, "--save-interval", "2",
            "--ckpt-format", ckpt_format]
    return args + (["--tensor-model-parallel-size", "2"] if world_size == 2 else [])


class _CountingFile(FileProxy):
    """A file whose every write() is an event."""

    def __init__(self, f, on_event):
        super().__init__(f)
        self._on_event = on_event

    def write(self, data):
        self._on_event("write", getattr(self._f, "name", "?"))
        return self._f.write(data)


class EventHook:
    """While armed, every file-system operation is an event: count them, or die before event number kill_at."""

    def __init__(self, kill_at):
        kill_class, k = kill_at.split(":")
        self.kill_class, self.kill_at = kill_class, int(k)
        self.counts, self.armed = {"any": 0, "meta": 0}, False
        self.saved = {}

    def event(self, kind, path):
        if not self.armed:
            return
        self.counts["any"] += 1
        self.counts["meta"] += kind != "write"
        if (kind != "write" or self.kill_class == "any") and self.counts[self.kill_class] == self.kill_at:
            print(f"REL_KILL rank {os.environ['RANK']} before {self.kill_class} event {self.kill_at}: {kind} {path}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def _wrap(self, module, name, kind):
        original = getattr(module, name)
        self.saved[(module, name)] = original

        def wrapped(*args, **kwargs):
            self.event(kind, args[0] if args else "")
            result = original(*args, **kwargs)
            if kind == "open":
                return _CountingFile(result, self.event)
            return result
        setattr(module, name, wrapped)

    def __enter__(self):
        for module, name in [(builtins, "open"), (io, "open")]:
            self._wrap(module, name, "open")
        for name in ("fsync", "replace", "rename", "makedirs", "mkdir", "remove", "unlink"):
            self._wrap(os, name, name)
        self._wrap(shutil, "rmtree", "rmtree")
        self.armed = True
        return self

    def __exit__(self, *exc):
        self.armed = False
        for (module, name), original in self.saved.items():
            setattr(module, name, original)


def main():
    mode, ckpt_format, kill_at, save_dir, data = sys.argv[1:6]
    import megatron.training.training as training_mod

    hook = EventHook(kill_at if mode == "kill" else "any:0")
    original_save = training_mod.save_checkpoint
    seen = set()

    def hooked_save(iteration, *args, **kwargs):
        if iteration != 4 or iteration in seen:
            return original_save(iteration, *args, **kwargs)
        seen.add(iteration)
        with hook:
            return original_save(iteration, *args, **kwargs)

    training_mod.save_checkpoint = hooked_save
    try:
        records, _ = run_leg(leg_args(ckpt_format, save_dir, data, int(os.environ["WORLD_SIZE"])))
    finally:
        training_mod.save_checkpoint = original_save
    if mode == "kill":
        print(f"REL_NOT_KILLED: the save had only {hook.counts} events", flush=True)
        sys.exit(3)
    print("REL_RESULT " + json.dumps({"events": hook.counts, "losses": losses(records)}), flush=True)


if __name__ == "__main__":
    main()
