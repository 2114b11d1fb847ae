"""Helpers for the checkpointing tests: ``pretrain`` legs (straight, stop-and-save, resume) inside one rank."""
from __future__ import annotations

from helpers.train_helpers import GPT_ARGS, REPO, preprocess_corpus_slice, run_pretrain  # noqa: F401 (re-exported)


class FileProxy:
    """An open file that behaves as itself except for what a subclass overrides (``write``, to inject faults
    or count events)."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        return self._f.write(data)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def run_leg(extra_args, on_iteration=None):
    """Run pretrain_gpt with GPT_ARGS + extra_args; the loop's sys.exit() (--exit-interval, SIGTERM) ends
    the leg normally. ``on_iteration(iteration)`` is called after each iteration's training step.
    Returns (records, exited): this rank's per-iteration records and whether it exited."""
    from megatron.training import training as training_mod

    records = []
    original_log = training_mod.training_log

    def recording_log(state, loss_dict, learning_rate, iteration, loss_scale, skipped_iter, *rest):
        records.append({"iteration": iteration, "loss": {k: float(v) for k, v in loss_dict.items()},
                        "lr": learning_rate, "loss_scale": float(loss_scale), "skipped": skipped_iter})
        if on_iteration is not None:
            on_iteration(iteration)
        return original_log(state, loss_dict, learning_rate, iteration, loss_scale, skipped_iter, *rest)

    # run_pretrain wraps whatever training_log is installed, so this recorder sees every iteration even
    # when the loop leaves through sys.exit() and run_pretrain's own records are lost.
    training_mod.training_log = recording_log
    exited = False
    try:
        run_pretrain("pretrain_gpt", list(extra_args))
    except SystemExit:
        exited = True  # run_pretrain's finally has already reset the global state
    finally:
        training_mod.training_log = original_log
    return records, exited


def losses(records):
    """{iteration: lm loss} for the iterations this rank saw a loss for (the last pipeline stage)."""
    return {r["iteration"]: r["loss"]["lm loss"] for r in records if r["loss"]}


def resume_case(data_path, save_dir, extra, n_iters=6, k_iters=3):
    """N iterations straight; k iterations, save and exit; a fresh pretrain resuming from the save for the rest.
    Returns this rank's records of the three legs."""
    base = ([] if data_path is None else ["--data-path", data_path]) + ["--train-iters", str(n_iters)] + list(extra)
    straight, _ = run_leg(base)
    first, exited = run_leg(base + ["--save", save_dir, "--save-interval", "1000", "--exit-interval", str(k_iters)])
    assert exited, "--exit-interval did not stop the first leg"
    second, _ = run_leg(base + ["--load", save_dir])
    return {"straight": straight, "first": first, "second": second}
