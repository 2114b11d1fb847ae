"""tools/generate_text.py (the quickstart's last step) loads a checkpoint saved by
megatron.training.checkpointing and prints the same greedy completion as generating in memory from the model
that was saved."""
import os
import subprocess
import sys

from helpers.dist_harness import run_distributed
from helpers.gen_helpers import REPO, TINY_GPT, build_tiny_gpt

PROMPT = "The quick brown fox"


def save_and_generate(save_dir):
    from megatron.inference.text_generation import generate_and_post_process
    from megatron.training.checkpointing import save_checkpoint

    model = build_tiny_gpt(extra=["--save", save_dir, "--save-interval", "1"])
    save_checkpoint(7, [model], None, None)
    return generate_and_post_process(model, prompts=[PROMPT], tokens_to_generate=10, top_k_sampling=1)[0][0]


def test_gen_generate_text_tool_from_saved_checkpoint(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    expected = run_distributed(save_and_generate, 1, save_dir, timeout=120)[0]
    env = dict(os.environ, MEGATRON_FORCE_CPU="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "generate_text.py"), *TINY_GPT,
                           "--load", save_dir, "--greedy", "--out-seq-length", "10", "--prompt", PROMPT],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loading checkpoint from {} at iteration 7".format(save_dir) in proc.stdout
    printed = proc.stdout.split("== generated text:\n", 1)[1]
    assert printed.rstrip("\n") == expected.rstrip("\n") and expected.startswith(PROMPT) and len(expected) > len(PROMPT)

    missing = subprocess.run([sys.executable, os.path.join(REPO, "tools", "generate_text.py"), *TINY_GPT,
                              "--load", save_dir], capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode != 0 and "--prompt" in missing.stdout + missing.stderr
