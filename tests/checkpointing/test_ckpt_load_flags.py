"""Load-behaviour flags (--no-load-optim, --no-load-rng, --finetune, ...) and clear errors, on one rank.

A 4-iteration run saves at iterations 2 and 4; every later leg loads from it with one flag. Losses of an
iteration computed before any optimizer step after the load depend only on the loaded weights and the data
position, so they pin down what each flag restored.
"""
import os
import shutil

import pytest

from helpers.ckpt_helpers import preprocess_corpus_slice, run_leg
from helpers.dist_harness import run_distributed


def _losses(records):
    return {r["iteration"]: r["loss"]["lm loss"] for r in records}


def _error_of(extra):
    try:
        run_leg(extra)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return None


def flags_body(data_path, root):
    data = ["--data-path", data_path]
    d = os.path.join(root, "ckpt")
    out = {}
    out["straight"] = _losses(run_leg(data + ["--train-iters", "6"])[0])
    out["saved"] = _losses(run_leg(data + ["--train-iters", "6", "--exit-interval", "4", "--save", d,
                                           "--save-interval", "2"])[0])
    out["resume"] = _losses(run_leg(data + ["--train-iters", "6", "--load", d])[0])
    out["ckpt_step"] = _losses(run_leg(data + ["--train-iters", "6", "--load", d, "--ckpt-step", "2"])[0])
    out["no_load_optim"] = _losses(run_leg(data + ["--train-iters", "6", "--load", d, "--no-load-optim"])[0])
    finetune, _ = run_leg(data + ["--train-iters", "6", "--load", d, "--finetune"])
    out["finetune"] = _losses(finetune)
    out["finetune_lr"] = [r["lr"] for r in finetune]
    out["pretrained"] = _losses(run_leg(data + ["--train-iters", "6", "--load", os.path.join(root, "empty"),
                                                "--pretrained-checkpoint", d])[0])
    # --use-checkpoint-args: a wrong --untie-embeddings-and-output-weights on the command line is overridden by
    # the checkpoint's (tied) setting, otherwise the model would not even load.
    out["use_ckpt_args"] = _losses(run_leg(data + ["--train-iters", "6", "--load", d, "--use-checkpoint-args",
                                                   "--untie-embeddings-and-output-weights"])[0])
    out["untied_error"] = _error_of(data + ["--train-iters", "6", "--load", d, "--untie-embeddings-and-output-weights"])
    records, exited = run_leg(data + ["--train-iters", "6", "--load", os.path.join(root, "empty"),
                                      "--exit-on-missing-checkpoint"])
    out["exit_on_missing"] = (records, exited)

    # A 'release' checkpoint: weights only, iteration restarts at 0 (as --finetune).
    rel = os.path.join(root, "release_ckpt")
    shutil.copytree(os.path.join(d, "iter_0000004"), os.path.join(rel, "release"))
    with open(os.path.join(rel, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release")
    out["release"] = _losses(run_leg(data + ["--train-iters", "6", "--load", rel])[0])

    # Damaged checkpoints: a truncated file, a missing file, a tracker naming a missing iteration.
    bad = os.path.join(root, "truncated")
    shutil.copytree(d, bad)
    name = os.path.join(bad, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    with open(name, "r+b") as f:
        f.truncate(os.path.getsize(name) // 2)
    out["truncated"] = (name, _error_of(data + ["--train-iters", "6", "--load", bad]))
    missing = os.path.join(root, "missing")
    shutil.copytree(d, missing)
    name = os.path.join(missing, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    os.remove(name)
    out["missing"] = (name, _error_of(data + ["--train-iters", "6", "--load", missing]))
    out["bad_step"] = _error_of(data + ["--train-iters", "6", "--load", d, "--ckpt-step", "3"])
    return out


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("flags_data")))
    root = tmp_path_factory.mktemp("flags")
    (out,) = run_distributed(flags_body, 1, data, str(root), timeout=300)
    return out, root


def test_ckpt_resume_and_ckpt_step(flags):
    out, _ = flags
    straight = out["straight"]
    assert sorted(out["saved"]) == [1, 2, 3, 4]
    assert out["resume"] == {i: straight[i] for i in (5, 6)}
    assert out["ckpt_step"] == {i: straight[i] for i in (3, 4, 5, 6)}  # --ckpt-step 2 instead of the tracker's 4


def test_ckpt_no_load_optim_keeps_weights_and_position_but_not_adam_state(flags):
    out, _ = flags
    assert sorted(out["no_load_optim"]) == [5, 6]
    assert out["no_load_optim"][5] == out["straight"][5]  # same weights, same data position
    assert out["no_load_optim"][6] != out["straight"][6]  # a fresh optimizer takes a different step


def test_ckpt_finetune_pretrained_and_release_restart_from_iteration_zero(flags):
    out, _ = flags
    straight, finetune = out["straight"], out["finetune"]
    assert sorted(finetune) == [1, 2, 3, 4, 5, 6]
    # The loaded weights are the iteration-4 ones; the data starts again from sample 0.
    assert finetune[1] != straight[1] and finetune[1] < straight[1]
    # The LR schedule restarts too (warmup from the first iteration).
    assert out["finetune_lr"][0] < out["finetune_lr"][1]
    assert out["pretrained"] == finetune
    assert out["release"] == finetune


def test_ckpt_use_checkpoint_args(flags):
    out, _ = flags
    assert out["use_ckpt_args"] == {i: out["straight"][i] for i in (5, 6)}
    assert out["untied_error"] is not None and "CheckpointError" in out["untied_error"]
    assert "model_optim_rng.pt" in out["untied_error"]


def test_ckpt_exit_on_missing_checkpoint(flags):
    out, _ = flags
    records, exited = out["exit_on_missing"]
    assert exited and records == []


def test_ckpt_damaged_checkpoints_are_named(flags):
    out, root = flags
    name, message = out["truncated"]
    assert message and "CheckpointError" in message and name in message and "corrupt" in message
    name, message = out["missing"]
    assert message and "CheckpointError" in message and name in message and "missing" in message
    message = out["bad_step"]
    assert message and os.path.join(str(root), "ckpt", "iter_0000003") in message and "--ckpt-step 3" in message
