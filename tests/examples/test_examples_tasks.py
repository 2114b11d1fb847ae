"""The three task scripts of examples/ run as a user would, shrunk to tiny CPU jobs (MEGATRON_EXTRA_ARGS) on files
written here: evaluate_zeroshot_gpt.sh (LAMBADA) on a saved tiny GPT, finetune_mnli_distributed.sh
(2 processes) and finetune_race_distributed.sh from a saved tiny BERT."""
from __future__ import annotations

import json
import os
import random
import re

import pytest
from helpers.dist_harness import run_distributed
from helpers.examples_helpers import run_script, script_env
from helpers.tasks_helpers import write_mnli, write_race


pytestmark = pytest.mark.timeout(300)
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --distributed-backend gloo --num-workers 0 --initial-loss-scale 4096 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1")


def _save_checkpoints(tmp):
    """A tiny GPT (GPT-2 BPE) and a tiny BERT (megatron-core, pooler), saved in the torch format."""
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model
    from tasks.main import get_tasks_args

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name, tokenizer, entry in (
            ("gpt", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{repo}/data/tokenizers/gpt2/vocab.json",
                     "--merge-file", f"{repo}/data/tokenizers/gpt2/merges.txt"], "pretrain_gpt"),
            ("bert", ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                      f"{repo}/data/tokenizers/bert/vocab.txt"], "pretrain_bert")):
        initialize_megatron(extra_args_provider=get_tasks_args, argv=TINY.split() + tokenizer + [
            "--task", "LAMBADA", "--save", os.path.join(tmp, name), "--save-interval", "1", "--ckpt-format", "torch"])
        provider = __import__(entry).model_provider
        save_checkpoint(1, get_model(provider), None, None)
        global_vars.destroy_global_vars()
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("task_checkpoints")
    run_distributed(_save_checkpoints, 1, str(tmp), timeout=120)
    return tmp


def test_evaluate_zeroshot_gpt_script(tmp_path, checkpoints):
    lambada = tmp_path / "lambada_test.jsonl"
    with open(lambada, "w") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"After {i + 1} days at sea the sailors finally saw the island"}) + "\n")
    # one launch (LAMBADA, --strict-lambada from the script); WIKITEXT103 is the same script with TASK set, and its
    # numbers are tested in tests/tasks/test_tasks_zeroshot.py
    env = script_env(tmp_path, VALID_DATA=lambada, CHECKPOINT=checkpoints / "gpt", GPUS_PER_NODE=1,
                     MEGATRON_EXTRA_ARGS=TINY)
    rc, out = run_script("evaluate_zeroshot_gpt.sh", env)
    assert rc == 0, out[-4000:]
    assert re.search(r" validation results on LAMBADA \| number correct: .* \| total examples: 5\.0000E\+00 \| avg "
                     r"accuracy: ", out), out[-3000:]
    assert "using torch.float16 for parameters" in out and "done :-)" in out


def test_finetune_mnli_script(tmp_path, checkpoints):
    glue = tmp_path / "glue_data" / "MNLI"
    glue.mkdir(parents=True)
    rng = random.Random(0)
    for name, n in (("train.tsv", 16), ("dev_matched.tsv", 8), ("dev_mismatched.tsv", 8)):
        write_mnli(glue / name, n, rng)
    env = script_env(tmp_path, GLUE_DIR=tmp_path / "glue_data", PRETRAINED_CHECKPOINT=checkpoints / "bert",
                     CHECKPOINT_PATH=tmp_path / "mnli", GPUS_PER_NODE=2,
                     MEGATRON_EXTRA_ARGS=TINY + " --epochs 1")
    rc, out = run_script("finetune_mnli_distributed.sh", env)
    assert rc == 0, out[-4000:]
    assert "using world size: 2, data-parallel-size: 2" in out
    assert re.search(r" > \|epoch: 0\| metrics for dev-matched: correct / total = \d+ / 8 = ", out), out[-3000:]
    assert re.search(r" >> \|epoch: 0\| overall: correct / total = \d+ / 16 = ", out), out[-3000:]
    assert " iteration        4/       4 |" in out  # 16 samples / (2 x 2 ranks)
    assert (tmp_path / "mnli" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


@pytest.mark.slow  # RACE finetuning: tests/tasks/test_tasks_finetune.py
def test_finetune_race_script(tmp_path, checkpoints):
    rng = random.Random(1)
    for part, n in (("train/middle", 2), ("dev/middle", 1), ("dev/high", 1)):
        write_race(tmp_path / "RACE" / part, n, rng)
    env = script_env(tmp_path, RACE_DIR=tmp_path / "RACE", PRETRAINED_CHECKPOINT=checkpoints / "bert",
                     CHECKPOINT_PATH=tmp_path / "race", GPUS_PER_NODE=1, MEGATRON_EXTRA_ARGS=TINY + " --epochs 1")
    rc, out = run_script("finetune_race_distributed.sh", env)
    assert rc == 0, out[-4000:]
    for name in ("dev-middle", "dev-high"):
        assert re.search(rf" > \|epoch: 0\| metrics for {name}: correct / total = \d+ / 4 = ", out), out[-3000:]
    assert (tmp_path / "race" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
