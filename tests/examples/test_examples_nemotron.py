"""examples/nemotron_3 (which runs examples/nemotron_h with the Nemotron-3 MoE sizes) on CPU as a user would run
it: every size from the environment (a tiny model), mock data, two iterations, a torch_dist checkpoint at the end.
The family scripts are valid bash (examples/nemotron_mini's model is trained by the configuration tests)."""
from __future__ import annotations

import os
import subprocess

import pytest
from helpers.examples_helpers import iteration_lines, run_script, script_env

pytestmark = pytest.mark.timeout(300)

TINY_ENV = dict(HIDDEN_SIZE=32, FFN_HIDDEN_SIZE=48, NUM_ATTENTION_HEADS=4, NUM_QUERY_GROUPS=2, KV_CHANNELS=8,
                SEQ_LENGTH=16, MAX_POSITION_EMBEDDINGS=16, VOCAB_SIZE=100, GLOBAL_BATCH_SIZE=2, TRAIN_ITERS=2,
                GPUS_PER_NODE=1, MEGATRON_EXTRA_ARGS="--distributed-backend gloo --num-workers 0 --eval-iters 0 "
                                                     "--save-interval 2 --lr-warmup-iters 0 --split 100,0,0")


def _check(rc, out, ckpt):
    assert rc == 0, out[-6000:]
    assert [n for _, (n, _, _, _) in iteration_lines(out)] == [1, 2], out[-6000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    print("\n".join(line for line, _ in iteration_lines(out)))


def test_nemotron_3_script_on_cpu(tmp_path):
    env = script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", HYBRID_LAYER_PATTERN="ME*-", NUM_EXPERTS=4,
                     MOE_ROUTER_TOPK=2, MOE_FFN_HIDDEN_SIZE=16, MOE_SHARED_EXPERT_INTERMEDIATE_SIZE=24,
                     MOE_LATENT_SIZE=16, MAMBA_NUM_HEADS=8, MAMBA_HEAD_DIM=8, MAMBA_NUM_GROUPS=2, MAMBA_STATE_DIM=8,
                     **TINY_ENV)
    rc, out = run_script("nemotron_3/train_nemotron_3.sh", env)
    _check(rc, out, tmp_path / "ckpt")
    assert "launching pretrain_mamba.py" in out and "building hybrid Mamba model (ME*-)" in out
    assert "seq_load_balancing_loss" in out and "Mamba-2 mixer: PyTorch" in out


@pytest.mark.parametrize("script", ["nemotron_h/train_nemotron_h.sh", "nemotron_3/train_nemotron_3.sh",
                                    "nemotron_mini/train_nemotron_mini.sh"])
def test_nemotron_scripts_are_valid_bash(script):
    from helpers.examples_helpers import REPO

    subprocess.run(["bash", "-n", os.path.join(REPO, "examples", script)], check=True)
