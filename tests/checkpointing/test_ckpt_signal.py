"""--exit-signal-handler: SIGTERM delivered to one rank makes every rank save the same iteration and exit.

Two ranks with TP=2 (each writes its own file). Rank 1 sends itself SIGTERM during iteration 3; the loop's
all-gather of the per-rank flags must stop both ranks after iteration 3, with a complete checkpoint."""
import os
import signal

import torch

from helpers.ckpt_helpers import preprocess_corpus_slice, run_leg
from helpers.dist_harness import run_distributed


def sigterm_body(data_path, save_dir):
    rank = torch.distributed.get_rank()

    def maybe_signal(iteration):
        if iteration == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    records, exited = run_leg(["--data-path", data_path, "--train-iters", "20", "--save", save_dir,
                               "--save-interval", "1000", "--exit-signal-handler", "--tensor-model-parallel-size", "2"],
                              on_iteration=maybe_signal)
    return [r["iteration"] for r in records], exited


def test_ckpt_sigterm_on_one_rank_saves_everywhere_and_exits(tmp_path):
    data = preprocess_corpus_slice(str(tmp_path))
    save_dir = str(tmp_path / "ckpt")
    results = run_distributed(sigterm_body, 2, data, save_dir, timeout=240)
    for rank, (iterations, exited) in enumerate(results):
        assert exited, f"rank {rank} did not exit"
        assert iterations == [1, 2, 3], f"rank {rank} ran iterations {iterations}"
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "3"
    for tp_rank in (0, 1):
        state = torch.load(os.path.join(save_dir, "iter_0000003", f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt"),
                           map_location="cpu", weights_only=False)
        assert state["iteration"] == 3
