"""Resume from a torch_dist checkpoint of a Llama-shaped megatron-core GPT (RMSNorm, SwiGLU, RoPE, GQA, untied, no
bias; distributed optimizer) on 2 gloo ranks.

Same layout (TP=2): 4 iterations straight vs 2 iterations + save + exit + resume for 2 more: the losses of
iterations 3 and 4 must be bit-identical (weights, Adam state, scheduler, RNG per rank). Another layout (TP=1 DP=2,
and PP=2) loading the same iteration-2 checkpoint: iterations 3 and 4 within 1e-5 relative of the straight run.
"""
import os

import pytest

from helpers.ckpt_helpers import losses, preprocess_corpus_slice, resume_case, run_leg
from helpers.dist_harness import run_distributed

LLAMA = ["--use-mcore-models", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--ckpt-format", "torch_dist", "--use-distributed-optimizer"]


def body(data, root):
    tp2 = LLAMA + ["--tensor-model-parallel-size", "2"]
    legs = resume_case(data, os.path.join(root, "tp2"), tp2, n_iters=4, k_iters=2)
    out = {name: losses(records) for name, records in legs.items()}
    base = ["--data-path", data, "--train-iters", "4", "--load", os.path.join(root, "tp2")] + LLAMA
    out["dp2"] = losses(run_leg(base)[0])
    out["pp2"] = losses(run_leg(base + ["--pipeline-model-parallel-size", "2"])[0])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("ckpt_resume_data")))
    root = str(tmp_path_factory.mktemp("ckpt_resume"))
    return run_distributed(body, 2, data, root, timeout=400)


def test_resume_same_layout_is_bit_exact(results):
    out = results[0]
    straight, second = out["straight"], out["second"]
    assert sorted(second) == [3, 4], second
    print({it: (straight[it], second[it]) for it in second})
    for it in (3, 4):
        assert second[it] == straight[it], (it, second[it], straight[it])


def test_resume_after_layout_change_within_1e5(results):
    straight = results[0]["straight"]
    for name in ("dp2", "pp2"):
        got = next(r[name] for r in results if r[name])  # the last pipeline stage logs the loss
        assert sorted(got) == [3, 4], (name, got)
        for it in (3, 4):
            rel = abs(got[it] - straight[it]) / abs(straight[it])
            print(f"{name} iteration {it}: {got[it]:.8f} vs {straight[it]:.8f} rel {rel:.2e}")
            assert rel <= 1e-5, (name, it, got[it], straight[it])
