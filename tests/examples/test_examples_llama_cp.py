"""examples/llama/train_llama3_8b_cp.sh (long-context Llama with context parallelism) runs shrunk on CPU: torchrun
with 2 gloo processes, CP=2 (TP=1), a 2-layer model on a 64-token sequence (4 chunks of 16), mock data, 3
iterations and a torch_dist checkpoint; the log shows the context-parallel group and attention."""
from __future__ import annotations

import pytest
from helpers.examples_helpers import TINY, iteration_lines, run_script, script_env

pytestmark = pytest.mark.timeout(300)


def test_llama3_8b_cp_script_on_cpu(tmp_path):
    extra = (f"{TINY} --seq-length 64 --max-position-embeddings 64 --vocab-size 500 --ffn-hidden-size 64 "
             "--kv-channels 8 --num-query-groups 2 --transformer-impl local --no-rope-fusion --global-batch-size 2 "
             "--micro-batch-size 1 --train-samples 6 --lr-decay-samples 6 --lr-warmup-samples 2 --save-interval 3 "
             "--num-workers 0")
    env = script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", TENSORBOARD_LOGS_PATH=tmp_path / "tb",
                     DATA_CACHE_PATH=tmp_path / "cache", GPUS_PER_NODE=2, TP_SIZE=1, CP_SIZE=2,
                     MEGATRON_EXTRA_ARGS=extra)
    rc, out = run_script("llama/train_llama3_8b_cp.sh", env, timeout=240)
    assert rc == 0, out[-6000:]
    lines = iteration_lines(out)
    assert [n for _, (n, _, _, _) in lines] == [1, 2, 3], out[-6000:]
    # 2 processes = CP 2 x DP 1: each step reads the 2 samples of the global batch once (consumed samples 2, 4, 6).
    assert [consumed for _, (_, _, consumed, _) in lines] == [2, 4, 6]
    assert "context-parallel size: 2" in out and "> initialized context parallel with size 2" in out
    assert "attention: context parallel over 2 ranks, --cp-comm-type p2p" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    print("\n".join(line for line, _ in lines))
