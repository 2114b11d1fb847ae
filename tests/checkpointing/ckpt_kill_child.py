"""Child process for test_ckpt_sigkill.py: train on one rank, save at iterations 2 and 4, and SIGKILL itself
at the given stage of the second save (the n-th time checkpointing reports that stage).

    python ckpt_kill_child.py <stage> <occurrence> <save_dir> <data_prefix>
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from ckpt_helpers import run_leg  # noqa: E402


def main():
    stage, occurrence, save_dir, data = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from megatron.training import checkpointing

    seen = {"count": 0, "saves": 0}
    original = checkpointing.save_checkpoint

    def counting_save(iteration, *args, **kwargs):
        seen["saves"] += 1
        return original(iteration, *args, **kwargs)

    def kill_at(name, path):
        if seen["saves"] >= 2 and name == stage:
            seen["count"] += 1
            if seen["count"] == occurrence:
                print(f"killing myself at {name} ({path})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    checkpointing._save_stage = kill_at
    import megatron.training.training as training_mod

    training_mod.save_checkpoint = counting_save
    run_leg(["--data-path", data, "--train-iters", "4", "--save", save_dir, "--save-interval", "2",
             "--use-distributed-optimizer"])


if __name__ == "__main__":
    main()
