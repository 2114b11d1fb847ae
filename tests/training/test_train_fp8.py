"""--fp8-format end to end through pretrain_gpt.py (FP8 GEMMs without Transformer Engine, emulated on CPU).

* bf16 with --fp8-format hybrid (delayed scaling, amax history 16, max) and e4m3 (tensorwise): the losses of a
  12-iteration run stay within 2 % of the same bf16 run without FP8 at every iteration, and differ from it (the flag
  used to be silently ignored, giving bit-identical losses);
* the FP8 scaling state is part of the checkpoint: 6 iterations straight vs 3 + save (torch_dist) + exit + resume
  for 3 more give bit-identical losses (a resumed run that restarted its scales at 1 would not).
"""
import os

import pytest

from helpers.ckpt_helpers import losses, preprocess_corpus_slice, resume_case, run_leg
from helpers.dist_harness import run_distributed

BF16 = ["--bf16", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--lr", "3e-3"]
HYBRID = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"]
E4M3 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]


def body(data, root):
    base = ["--data-path", data, "--train-iters", "12"] + BF16
    out = {"bf16": losses(run_leg(base)[0]), "hybrid": losses(run_leg(base + HYBRID)[0]),
           "e4m3": losses(run_leg(base + E4M3)[0])}
    legs = resume_case(data, os.path.join(root, "ckpt"), BF16 + HYBRID + ["--ckpt-format", "torch_dist"],
                       n_iters=6, k_iters=3)
    out.update({f"resume_{name}": losses(records) for name, records in legs.items()})
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("fp8_data")))
    root = str(tmp_path_factory.mktemp("fp8_ckpt"))
    return run_distributed(body, 1, data, root, timeout=400)[0]


def test_fp8_losses_within_2_percent_of_bf16(results):
    bf16 = results["bf16"]
    assert sorted(bf16) == list(range(1, 13)) and bf16[12] < bf16[1] - 0.3
    for fmt in ("hybrid", "e4m3"):
        got = results[fmt]
        worst = max(abs(got[i] - bf16[i]) / bf16[i] for i in bf16)
        print(f"{fmt}: last loss {got[12]:.5f} vs bf16 {bf16[12]:.5f}; worst relative difference {worst:.4f}")
        assert worst < 0.02, (fmt, got, bf16)
        assert got != bf16, f"--fp8-format {fmt} changed nothing"


def test_fp8_state_resumes_bit_exact(results):
    straight, second = results["resume_straight"], results["resume_second"]
    assert sorted(second) == [4, 5, 6], second
    for it in second:
        assert second[it] == straight[it], (it, second[it], straight[it])


def _from_bf16_body(data, root):
    """A bf16 checkpoint (torch_dist and torch) loads into an FP8 run, whose scales then start at 1."""
    out = {}
    for fmt in ("torch_dist", "torch"):
        save = os.path.join(root, fmt)
        base = ["--data-path", data, "--train-iters", "4", "--ckpt-format", fmt] + BF16
        run_leg(base + ["--save", save, "--save-interval", "1000", "--exit-interval", "2"])
        out[fmt] = losses(run_leg(base + HYBRID + ["--load", save])[0])
    return out


def test_bf16_checkpoint_loads_into_fp8_run(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("fp8_data2")))
    out = run_distributed(_from_bf16_body, 1, data, str(tmp_path_factory.mktemp("fp8_from_bf16")), timeout=300)[0]
    for fmt in ("torch_dist", "torch"):
        assert sorted(out[fmt]) == [3, 4], (fmt, out[fmt])
