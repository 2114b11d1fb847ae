"""The legacy ``torch`` checkpoint format: Megatron's names and keys, exact resume, and the layout error.

Exact resume: 6 iterations straight must equal 3 iterations + save + exit (--exit-interval) followed by a
fresh ``pretrain`` with --load for the last 3, bit for bit (losses, learning rates, loss scales), with dropout
on so that the RNG state matters.
"""
import math
import os

import pytest
import torch

from helpers.ckpt_helpers import preprocess_corpus_slice, resume_case, run_leg
from helpers.dist_harness import run_distributed

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
FP16 = ["--fp16", "--initial-loss-scale", "4294967296"]  # starts far too high: skipped steps, a moving scale


def _tp_pp(tp, pp, *extra):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]


RESUME_CASES = {
    1: [("1-1-1", _tp_pp(1, 1, *DROPOUT)), ("1-1-1-fp16", _tp_pp(1, 1, *DROPOUT, *FP16))],
    2: [("1-1-2-distopt-fp16", _tp_pp(1, 1, "--use-distributed-optimizer", *DROPOUT, *FP16))],
    4: [("1-4-1-vpp2", _tp_pp(1, 4, "--num-layers-per-virtual-pipeline-stage", "1", *DROPOUT))],
    8: [("2-2-2-distopt", _tp_pp(2, 2, "--use-distributed-optimizer", *DROPOUT))],
}


def resume_body(cases, data_path, root, layout_dir=None):
    out = {name: resume_case(data_path, os.path.join(root, name), extra) for name, extra in cases}
    if layout_dir is not None:
        # A 2x2 (TP, PP) save with the distributed optimizer, then a load of it with another layout.
        # Legacy models write Megatron's legacy nested layout (megatron-core models, the default, write mcore keys).
        run_leg(["--data-path", data_path, "--train-iters", "4", "--exit-interval", "2", "--save", layout_dir,
                 "--save-interval", "2", "--use-legacy-models",
                 *_tp_pp(2, 2, "--use-distributed-optimizer")])
        try:
            run_leg(["--data-path", data_path, "--train-iters", "4", "--load", layout_dir, "--use-legacy-models",
                     *_tp_pp(1, 4)])
            out["mismatch_error"] = None
        except Exception as e:  # noqa: BLE001 - the test inspects the message
            out["mismatch_error"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def gpt_data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("ckpt_data")))


@pytest.fixture(scope="module")
def world4(gpt_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_w4")
    layout_dir = str(root / "layout_2x2")
    results = run_distributed(resume_body, 4, RESUME_CASES[4], gpt_data, str(root), layout_dir, timeout=400)
    return results, root, layout_dir


def _check_resume(name, results_per_rank, save_dir):
    """Bit-identical losses, learning rates and loss scales on the last rank; returns the max |difference|."""
    last = results_per_rank[-1][name]
    straight = {r["iteration"]: r for r in last["straight"]}
    first = {r["iteration"]: r for r in last["first"]}
    second = {r["iteration"]: r for r in last["second"]}
    assert sorted(straight) == [1, 2, 3, 4, 5, 6] and sorted(first) == [1, 2, 3] and sorted(second) == [4, 5, 6]
    assert open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read() == "3"
    worst = 0.0
    for it, rec in second.items():
        a, b = straight[it], rec
        diff = abs(a["loss"]["lm loss"] - b["loss"]["lm loss"])
        worst = max(worst, diff)
        assert a["loss"] == b["loss"], f"{name}: iteration {it} loss {b['loss']} after resume, {a['loss']} straight"
        assert a["lr"] == b["lr"] and a["loss_scale"] == b["loss_scale"] and a["skipped"] == b["skipped"], \
            f"{name}: iteration {it}: {b} after resume, {a} straight"
    print(f"exact resume {name}: max |loss difference| over iterations 4-6 = {worst:.3e}")
    return worst


@pytest.mark.parametrize("world", [1, 2, pytest.param(8, marks=pytest.mark.slow)])
def test_ckpt_exact_resume(world, gpt_data, tmp_path):
    results = run_distributed(resume_body, world, RESUME_CASES[world], gpt_data, str(tmp_path), timeout=400)
    for name, extra in RESUME_CASES[world]:
        _check_resume(name, results, str(tmp_path / name))
        if "--fp16" in extra:
            scales = [r["loss_scale"] for r in results[-1][name]["straight"]]
            assert len(set(scales)) > 1, f"{name}: the loss scale never moved ({scales}): the case tests nothing"


def test_ckpt_exact_resume_virtual_pipeline(world4):
    results, root, _ = world4
    _check_resume("1-4-1-vpp2", results, str(root / "1-4-1-vpp2"))
    state = torch.load(os.path.join(root, "1-4-1-vpp2", "iter_0000003", "mp_rank_00_002", "model_optim_rng.pt"),
                       map_location="cpu", weights_only=False)
    assert "model" not in state and sorted(k for k in state if k.startswith("model")) == ["model0", "model1"]


EXPECTED_KEYS = {"args", "checkpoint_version", "iteration", "model", "optimizer", "opt_param_scheduler", "rng_state",
                 "num_floating_point_operations_so_far"}
RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}


def _flops_per_iteration(batch, seq, layers, hidden, ffn, vocab):
    # Megatron's formula (reference: megatron-api.md, "Throughput / TFLOPs"), no GQA, no swiglu.
    return (12 * batch * seq * layers * hidden ** 2
            * (1 + ffn / hidden + 1 + seq / hidden + vocab / (2 * layers * hidden)))


def test_ckpt_layout_names_and_keys_2x2(world4):
    _, _, layout_dir = world4
    assert sorted(os.listdir(layout_dir)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert open(os.path.join(layout_dir, "latest_checkpointed_iteration.txt")).read() == "2"
    iter_dir = os.path.join(layout_dir, "iter_0000002")
    assert sorted(os.listdir(iter_dir)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    padded_vocab = math.ceil(8192 / 256) * 256  # the shipped 8192-token BPE, padded to a multiple of 128 * TP
    for rank_dir in os.listdir(iter_dir):
        assert sorted(os.listdir(os.path.join(iter_dir, rank_dir))) == ["distrib_optim.pt", "model_optim_rng.pt"]
        state = torch.load(os.path.join(iter_dir, rank_dir, "model_optim_rng.pt"), map_location="cpu",
                           weights_only=False)
        assert set(state) == EXPECTED_KEYS, sorted(state)
        assert state["checkpoint_version"] == 3.0 and isinstance(state["checkpoint_version"], float)
        assert state["iteration"] == 2
        assert state["args"].tensor_model_parallel_size == 2 and state["args"].pipeline_model_parallel_size == 2
        assert state["args"].consumed_train_samples == 8
        assert isinstance(state["rng_state"], list) and len(state["rng_state"]) == 1
        assert set(state["rng_state"][0]) == RNG_KEYS
        flops = _flops_per_iteration(4, 32, 8, 32, 128, padded_vocab) * 2
        assert math.isclose(state["num_floating_point_operations_so_far"], flops, rel_tol=1e-12)
        model = _flatten(state["model"])  # Megatron's legacy nested layout: language_model -> embedding ...
        if rank_dir.endswith("_000"):
            assert model["language_model.embedding.word_embeddings.weight"].shape == (padded_vocab // 2, 32)
            assert model["language_model.embedding.position_embeddings.weight"].shape == (32, 32)
        else:
            assert model["word_embeddings_for_head.weight"].shape == (padded_vocab // 2, 32)
        # 8 layers over 2 stages, numbered from 0 in each stage's file; column-parallel (dim 0) fused QKV,
        # row-parallel (dim 1) output projection.
        for i in range(4):
            layer = f"language_model.encoder.layers.{i}."
            assert model[layer + "self_attention.query_key_value.weight"].shape == (3 * 32 // 2, 32)
            assert model[layer + "self_attention.dense.weight"].shape == (32, 32 // 2)
            assert model[layer + "mlp.dense_h_to_4h.weight"].shape == (128 // 2, 32)
            assert model[layer + "mlp.dense_4h_to_h.weight"].shape == (32, 128 // 2)
        assert "language_model.encoder.layers.4.input_layernorm.weight" not in model


def _flatten(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, prefix + key + "."))
        else:
            flat[prefix + key] = value
    return flat


def test_ckpt_layout_mismatch_error_names_file_and_both_layouts(world4):
    results, _, layout_dir = world4
    message = results[0]["mismatch_error"]
    assert message is not None, "loading a TP=2 PP=2 checkpoint with TP=1 PP=4 did not fail"
    assert "CheckpointError" in message
    assert os.path.join(layout_dir, "iter_0000002") in message and "model_optim_rng.pt" in message
    assert "(TP=2, PP=2)" in message and "(TP=1, PP=4)" in message
    assert "tools/checkpoint/convert.py" in message and "--ckpt-format torch_dist" in message
