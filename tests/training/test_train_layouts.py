"""pretrain_gpt.py end to end: the loss curve must not depend on the parallel layout.

20 iterations of a tiny GPT on mock data, fp32, no dropout, global batch 4. The reference is the
(TP, PP, DP) = (1, 1, 1) run; every other layout must give the same loss at every iteration within 1e-4
relative. Also: the distributed optimizer against the plain one, --overlap-grad-reduce against not.
"""
import math
import os
import re

import pytest

from helpers.dist_harness import run_distributed
from helpers.train_helpers import REPO, preprocess_corpus_slice, run_pretrain

REL_TOL = 1e-4


def layouts_body(runs, data_path):
    return {name: run_pretrain("pretrain_gpt", ["--data-path", data_path] + extra) for name, extra in runs}


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("gpt_data")))


def _tp_pp(tp, pp, *extra):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]


RUNS = {
    1: [("1-1-1", _tp_pp(1, 1))],
    2: [("2-1-1", _tp_pp(2, 1)), ("1-2-1", _tp_pp(1, 2)), ("1-1-2", _tp_pp(1, 1)),
        ("2-1-1-sp", _tp_pp(2, 1, "--sequence-parallel")),
        ("1-1-2-distopt", _tp_pp(1, 1, "--use-distributed-optimizer")),
        ("1-1-2-overlap", _tp_pp(1, 1, "--overlap-grad-reduce", "--ddp-bucket-size", "2000"))],
    4: [("2-2-1", _tp_pp(2, 2)),
        ("1-4-1-vpp2", _tp_pp(1, 4, "--num-layers-per-virtual-pipeline-stage", "1"))],
    8: [("2-2-2", _tp_pp(2, 2))],
}


def _losses(records_per_rank):
    """The loss per iteration as reported on the last rank (where Megatron logs)."""
    records = records_per_rank[-1]
    assert [r["iteration"] for r in records] == list(range(1, 21))
    return [r["loss"]["lm loss"] for r in records]


@pytest.fixture(scope="module")
def reference_losses(gpt_data):
    (out,) = run_distributed(layouts_body, 1, RUNS[1], gpt_data, timeout=240)
    losses = _losses([out["1-1-1"]])
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, f"the model did not learn: {losses[0]:.3f} -> {losses[-1]:.3f}"
    return losses


@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_loss_curve_is_layout_independent(world, reference_losses, gpt_data):
    results = run_distributed(layouts_body, world, RUNS[world], gpt_data, timeout=400)
    for name, _ in RUNS[world]:
        losses = _losses([rank[name] for rank in results])
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses))
        assert worst <= REL_TOL, f"layout {name}: max relative loss difference {worst:.2e}\n{losses}\n{reference_losses}"


LOG_FIELDS = re.compile(
    r"^ iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \|"
    r" time to finish \(h:mm:ss\): \d+:\d\d:\d\d \|"
    r"( throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \| tokens per second: [\d.]+ \|)?"
    r" learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \|( lm loss: [\d.E+-]+ \|)?"
    r" loss scale: ([\d.]+) \|( grad norm: [\d.]+ \|)? number of skipped iterations:\s+(\d+) \|"
    r" number of nan iterations:\s+(\d+) \|$")


def precision_body(data_path):
    data = ["--data-path", data_path]
    out = {"bf16": run_pretrain("pretrain_gpt", data + ["--bf16", "--log-throughput"])}
    # fp16 with dynamic loss scaling; iteration 3's loss is made infinite, which must skip that step and,
    # with --hysteresis 1, halve the scale.
    from megatron.training import global_vars

    from helpers import train_helpers

    original = train_helpers.load_entry_point

    def poisoned(name):
        module = original(name)
        loss_func = module.loss_func

        def bad_loss(loss_mask, output_tensor):
            # (loss_sum, num_tokens, report) today, (loss, report) in 2023: the loss first, the report last.
            result = loss_func(loss_mask, output_tensor)
            loss, report = result[0], result[-1]
            if global_vars.get_args().iteration == 2:  # the 3rd iteration is running
                loss = loss * float("inf")
                report = {"lm loss": report["lm loss"] * float("inf")}
            return (loss, *result[1:-1], report)

        module.loss_func = bad_loss
        return module

    train_helpers.load_entry_point = poisoned
    try:
        out["fp16"] = run_pretrain("pretrain_gpt", data + ["--fp16", "--initial-loss-scale", "4096", "--hysteresis", "1",
                                                    "--log-interval", "1"])
    finally:
        train_helpers.load_entry_point = original
    return out


def test_bf16_fp16_loss_scaling_and_log_line(reference_losses, gpt_data):
    (out,) = run_distributed(precision_body, 1, gpt_data, timeout=300)
    bf16 = [r["loss"]["lm loss"] for r in out["bf16"]]
    assert all(math.isfinite(x) for x in bf16) and bf16[-1] < bf16[0] - 0.3
    # bf16 follows the fp32 curve loosely (8-bit mantissa).
    assert max(abs(a - b) / b for a, b in zip(bf16, reference_losses)) < 0.05

    fp16 = out["fp16"]
    assert [r["skipped"] for r in fp16[:4]] == [0, 0, 1, 0]
    assert fp16[1]["loss_scale"] == 4096.0 and fp16[2]["loss_scale"] == 2048.0
    line = fp16[2]["line"]
    m = LOG_FIELDS.match(line)
    assert m, f"log line does not parse: {line!r}"
    assert int(m.group(11)) == 1 and int(m.group(12)) == 1  # one skipped, one nan iteration in this interval
    assert float(m.group(9)) == 2048.0
    assert m.group(8) is None and m.group(10) is None  # nothing advanced: no loss, no grad norm (as Megatron)
    m = LOG_FIELDS.match(fp16[3]["line"])
    assert m and m.group(8) and m.group(10) and int(m.group(11)) == 0
    # The bf16 run logged throughput; parse one of its lines too.
    m = LOG_FIELDS.match(out["bf16"][4]["line"])
    assert m and m.group(5) and int(m.group(1)) == 5 and int(m.group(7)) == 4


def bert_body(runs, data_path):
    bert = ["--data-path", data_path, "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", os.path.join(REPO, "data/tokenizers/bert/vocab.txt"), "--train-iters", "10",
            # 8192 WordPieces + [BOS]/[EOS] = 8194 ids; padding to 128*TP would give TP=1 and TP=2 different
            # dummy rows in the softmax, so pad to a multiple of 1*TP (8194 for both).
            "--make-vocab-size-divisible-by", "1"]
    return {name: run_pretrain("pretrain_bert", bert + extra) for name, extra in runs}


@pytest.fixture(scope="module")
def bert_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("bert_data")), tokenizer="bert")


def test_bert_mlm_and_sop_losses_are_layout_independent(bert_data):
    (ref,) = run_distributed(bert_body, 1, [("1-1-1", _tp_pp(1, 1))], bert_data, timeout=240)
    ref = ref["1-1-1"]
    runs = [("2-1-1", _tp_pp(2, 1)), ("1-2-1", _tp_pp(1, 2)), ("1-1-2", _tp_pp(1, 1))]
    results = run_distributed(bert_body, 2, runs, bert_data, timeout=300)
    for key in ("lm loss", "sop loss"):
        ref_curve = [r["loss"][key] for r in ref]
        assert len(ref_curve) == 10 and all(math.isfinite(x) for x in ref_curve)
        for name, _ in runs:
            curve = [r["loss"][key] for r in results[-1][name]]
            worst = max(abs(a - b) / abs(b) for a, b in zip(curve, ref_curve))
            assert worst <= REL_TOL, f"BERT {name} {key}: max relative difference {worst:.2e}"
