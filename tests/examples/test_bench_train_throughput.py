"""Smoke test of benchmarks/train_throughput.py: a tiny GPT through both sides (ours and the HF baseline).

The step-0 losses are the independent-reference check: our training path (pretrain_gpt's model_provider,
setup_model_and_optimizer, train_step) and transformers' GPT2LMHeadModel, started from the same weights on the
same batch, must compute the same loss.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "train_throughput.py")


@pytest.mark.slow  # the benchmark itself lives in benchmarks/; training throughput paths are tested elsewhere
@pytest.mark.timeout(300)
def test_train_throughput_tiny_both_sides(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, SCRIPT, "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "1000",
           "--train-iters", "2", "--warmup-steps", "1", "--threads", "1", "--json-out", str(out)]
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_FORCE_CPU="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "sanity: step-0 loss" in proc.stdout and "ours/HF" in proc.stdout

    res = json.loads(out.read_text())
    assert res["config"]["padded_vocab_size"] == 1024          # 1000 padded to a multiple of 128
    assert res["tokens_per_step"] == 4 * 32
    assert res["flops_per_step"] > 0 and res["peak_tflops"] > 0
    for side in ("ours", "hf"):
        r = res[side]
        for key in ("tokens_per_s", "tflops_per_device", "mfu", "step_s_median", "step_s_min", "step_s_max",
                    "peak_memory_bytes", "loss_step0", "loss_last"):
            assert r[key] > 0, (side, key, r[key])
        assert len(r["windows_s"]) == 2
        assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
    assert res["ours"]["theoretical_memory_bytes"] > 0
    assert res["ratio_tokens_per_s"] > 0 and res["ratio_peak_memory"] > 0
    # Independent reference: same weights, same batch -> same loss (fp32), and both trained the same way.
    ours, hf = res["ours"]["loss_step0"], res["hf"]["loss_step0"]
    assert abs(ours - hf) / abs(hf) < 1e-4, (ours, hf)
    assert abs(res["ours"]["loss_last"] - res["hf"]["loss_last"]) / abs(res["hf"]["loss_last"]) < 1e-3
