"""Child process for test_ckpt_sigkill.py: train on one rank and SIGKILL itself at a given stage of a save
(the n-th time checkpointing reports that stage while armed).

    python ckpt_kill_child.py fresh  <stage> <occurrence> <save_dir> <data_prefix>
        saves at iterations 2 and 4; armed during the iteration-4 save.
    python ckpt_kill_child.py resave <stage> <occurrence> <save_dir> <data_prefix>
        a complete run saves 2 and 4 (tracker 4); then a run resumed from --ckpt-step 2 saves iteration 4 again,
        armed: the copy of iteration 4 the tracker names must survive.
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from helpers.ckpt_helpers import run_leg  # noqa: E402


def main():
    mode, stage, occurrence, save_dir, data = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    from megatron.training import checkpointing
    from megatron.training.checkpointing import protocol
    import megatron.training.training as training_mod

    state = {"armed": False, "count": 0}
    original_save = checkpointing.save_checkpoint

    def arming_save(iteration, *args, **kwargs):
        state["armed"] = mode == "fresh" and iteration == 4 or state["armed"]
        return original_save(iteration, *args, **kwargs)

    def kill_at(name, path):
        if state["armed"] and name == stage:
            state["count"] += 1
            if state["count"] == occurrence:
                print(f"killing myself at {name} ({path})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    protocol.save_stage = kill_at
    training_mod.save_checkpoint = arming_save
    base = ["--data-path", data, "--train-iters", "6", "--exit-interval", "4", "--save", save_dir,
            "--save-interval", "2", "--use-distributed-optimizer"]
    if mode == "fresh":
        run_leg(base)
        return
    run_leg(base)
    state["armed"] = True
    run_leg(base + ["--load", save_dir, "--ckpt-step", "2"])


if __name__ == "__main__":
    main()
