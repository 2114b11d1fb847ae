"""BERT finetuning tasks (tasks/main.py --task MNLI / RACE / QQP) on tiny files written here, on 2 data-parallel ranks.

One run: a tiny megatron-core BERT is saved as the pretrained checkpoint (torch format, megatron-core keys); MNLI
finetunes from it (Classification, legacy keys) on a separable toy set -- accuracy on the dev files must rise from
the first to the last epoch; a run stopped by --exit-interval in the middle of an epoch and resumed from its
checkpoint logs the same losses, bit for bit, as the straight run (dropout on); --epochs 0 on the finetuned
checkpoint measures the last epoch's accuracy again; the converter reshards the classifier; RACE finetunes one epoch
(MultipleChoice) with tensor parallelism 2 and reports accuracy; QQP finetunes 3 epochs on a separable toy set and
reaches at least 13 / 16 on its dev file (chance 8).
"""
from __future__ import annotations

import contextlib
import io
import os
import random
import re

import pytest
from helpers.dist_harness import run_distributed
from helpers.tasks_helpers import write_mnli, write_qqp, write_race

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BERT = ["--tokenizer-type", "BertWordPieceLowerCase",
        "--vocab-file", os.path.join(REPO, "data/tokenizers/bert/vocab.txt"),
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "4", "--lr", "5e-3", "--lr-decay-style", "linear",
        "--lr-warmup-fraction", "0.1", "--weight-decay", "0.01", "--seed", "1234", "--log-interval", "1",
        "--eval-interval", "5", "--eval-iters", "1", "--save-interval", "1000", "--num-workers", "0",
        "--distributed-backend", "gloo", "--ckpt-format", "torch"]
LOSS = re.compile(r" iteration +(\d+)/ +\d+ \|.*lm loss: ([0-9.E+-]+)")
ACC = re.compile(r" >> \|epoch: (-?\d+)\| overall: correct / total = (\d+) / (\d+)")


def _run(argv):
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from tasks.main import main

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(argv)
    except SystemExit:  # --exit-interval
        pass
    finally:
        global_vars.destroy_global_vars()
        parallel_state.destroy_model_parallel()
    return out.getvalue()


def _losses(out):
    return {int(m.group(1)): m.group(2) for m in LOSS.finditer(out)}


def _body(tmp):
    import torch
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model
    from pretrain_bert import model_provider
    from tasks.main import get_tasks_args

    pre = os.path.join(tmp, "bert_pre")
    mnli = os.path.join(tmp, "MNLI")
    common = BERT + ["--task", "MNLI", "--train-data", f"{mnli}/train.tsv",
                     "--valid-data", f"{mnli}/dev_matched.tsv", f"{mnli}/dev_mismatched.tsv",
                     "--pretrained-checkpoint", pre]
    # the "pretrained" BERT: megatron-core BertModel (pooler, binary head), saved in the torch format
    initialize_megatron(extra_args_provider=get_tasks_args, argv=common + ["--epochs", "1", "--save", pre])
    save_checkpoint(1, get_model(model_provider), None, None)
    global_vars.destroy_global_vars()
    parallel_state.destroy_model_parallel()

    out = {}
    out["straight"] = _run(common + ["--epochs", "6", "--save", os.path.join(tmp, "straight")])
    resumed = os.path.join(tmp, "resumed")
    out["first"] = _run(common + ["--epochs", "6", "--save", resumed, "--exit-interval", "5"])
    out["second"] = _run(common + ["--epochs", "6", "--save", resumed, "--load", resumed])
    out["eval_only"] = _run(common + ["--epochs", "0", "--load", os.path.join(tmp, "straight")])
    race = os.path.join(tmp, "RACE")
    # RACE with TP 2 starts from the pretrained BERT resharded by the converter (torch checkpoints keep their layout)
    pre_tp2 = pre + "_tp2"
    if torch.distributed.get_rank() == 0:
        from tools.checkpoint.convert import convert, get_args
        convert(get_args(["--model-type", "BERT", "--load-dir", pre, "--save-dir", pre_tp2, "--true-vocab-size",
                          "8194", "--target-tensor-parallel-size", "2"]))
    torch.distributed.barrier()
    out["race"] = _run(BERT + ["--task", "RACE", "--epochs", "1", "--train-data", f"{race}/train/middle",
                               "--valid-data", f"{race}/dev/middle", "--pretrained-checkpoint", pre_tp2,
                               "--micro-batch-size", "2", "--tensor-model-parallel-size", "2"])
    qqp = os.path.join(tmp, "QQP")
    out["qqp"] = _run(BERT + ["--task", "QQP", "--epochs", "3", "--train-data", f"{qqp}/train.tsv",
                              "--valid-data", f"{qqp}/dev.tsv", "--pretrained-checkpoint", pre])
    return out


@pytest.mark.timeout(300)
def test_finetune_mnli_accuracy_rises_resume_exact_and_race(tmp_path):
    rng = random.Random(0)
    (tmp_path / "MNLI").mkdir()
    write_mnli(tmp_path / "MNLI" / "train.tsv", 48, rng)
    write_mnli(tmp_path / "MNLI" / "dev_matched.tsv", 12, rng)
    write_mnli(tmp_path / "MNLI" / "dev_mismatched.tsv", 12, rng)
    write_race(tmp_path / "RACE" / "train" / "middle", 4, rng)
    write_race(tmp_path / "RACE" / "dev" / "middle", 2, rng)
    (tmp_path / "QQP").mkdir()
    write_qqp(tmp_path / "QQP" / "train.tsv", 48, rng)
    write_qqp(tmp_path / "QQP" / "dev.tsv", 16, rng)
    out = run_distributed(_body, 2, str(tmp_path), timeout=280)[1]  # the last rank logs

    straight = out["straight"]
    assert "could not find classification_head in the checkpoint, initializing to random" in straight
    assert " > |epoch: 0| metrics for dev-matched: correct / total = " in straight
    assert " > |epoch: 5| metrics for dev-mismatched: correct / total = " in straight
    assert "validation loss at iteration 5" in straight
    acc = [(int(c), int(t)) for _, c, t in ACC.findall(straight)]
    print(acc)
    # 12 rows per dev file, 6 per rank, batches of 4: the last partial batch is dropped with 2 ranks (Megatron)
    assert len(acc) == 6 and all(t == 16 for _, t in acc)
    assert acc[-1][0] > acc[0][0] and acc[-1][0] >= 10, acc  # chance: 16 / 3

    losses = _losses(straight)
    assert sorted(losses) == list(range(1, 37))  # 48 samples / (4 x 2 ranks) = 6 per epoch, 6 epochs
    first, second = _losses(out["first"]), _losses(out["second"])
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == list(range(6, 37)), (first, second)
    assert {**first, **second} == losses  # the resumed run continues bit for bit (printed digits)

    # --epochs 0 loads the finetuned classifier and measures the same accuracy as the last epoch did
    assert ACC.findall(out["eval_only"]) == [("-1", str(acc[-1][0]), "16")], out["eval_only"][-2000:]

    _check_converter(tmp_path)

    race = out["race"]
    assert "could not find multichoice_head in the checkpoint, initializing to random" in race
    assert " > |epoch: 0| metrics for dev-middle: correct / total = " in race, race[-3000:]
    race_acc = ACC.findall(race)
    assert race_acc and int(race_acc[0][2]) == 8  # 2 files x 2 articles x 2 questions

    qqp = out["qqp"]
    assert "could not find classification_head in the checkpoint, initializing to random" in qqp
    assert " > |epoch: 2| metrics for de: correct / total = " in qqp, qqp[-3000:]  # Megatron's name for dev.tsv
    qqp_acc = [(int(c), int(t)) for _, c, t in ACC.findall(qqp)]
    print("QQP dev accuracy per epoch:", qqp_acc)
    assert len(qqp_acc) == 3 and all(t == 16 for _, t in qqp_acc), qqp_acc
    assert qqp_acc[-1][0] >= 13, qqp_acc  # chance: 8 / 16


def _check_converter(tmp_path):
    """tools/checkpoint/convert.py reshards the finetuned classifier (torch format, legacy keys with its
    classification_head): TP 1 -> 2 -> 1 gives back every tensor; the head is replicated and nested as Megatron's
    Classification loads it; a torch_dist target is refused with one line."""
    import torch

    from tools.checkpoint.convert import convert, get_args
    from tools.checkpoint.legacy_io import ConversionError, load_legacy

    src, tp2, back = tmp_path / "straight", tmp_path / "conv_tp2", tmp_path / "conv_tp1"
    # the BERT tokenizer's 8194 ids (vocab.txt plus [BOS]/[EOS]) are padded to 8320 = 65 x 128; TP 2 needs 256k
    base = ["--model-type", "BERT", "--loader", "legacy", "--saver", "legacy", "--true-vocab-size", "8194"]
    convert(get_args(base + ["--load-dir", str(src), "--save-dir", str(tp2), "--target-tensor-parallel-size", "2"]))
    convert(get_args(base + ["--load-dir", str(tp2), "--save-dir", str(back), "--target-tensor-parallel-size", "1"]))
    original, _, _ = load_legacy(str(src))
    again, _, _ = load_legacy(str(back))
    assert "classification_head.weight" in original and "language_model.pooler.dense.weight" in original
    assert sorted(original) == sorted(again)
    for key, value in original.items():
        if key == "language_model.embedding.word_embeddings.weight":  # re-padded: the 8194 real rows are kept
            assert again[key].shape == value.shape and torch.equal(value[:8194], again[key][:8194])
        else:
            assert torch.equal(value, again[key]), key
    shards = [torch.load(tp2 / "iter_0000036" / f"mp_rank_0{r}" / "model_optim_rng.pt", weights_only=False)["model"]
              for r in range(2)]
    for shard in shards:
        assert torch.equal(shard["classification_head"]["weight"], original["classification_head.weight"])
    with pytest.raises(ConversionError, match="finetuned classifier .*classification_head.* --saver legacy"):
        convert(get_args(["--model-type", "BERT", "--loader", "legacy", "--saver", "torch_dist", "--load-dir",
                          str(src), "--save-dir", str(tmp_path / "conv_dist")]))
