"""--ckpt-format torch_dist: save with one (TP, PP, DP) layout, load with another, continue training.

Leg A trains 4 iterations at (TP, PP, DP) = (2, 2, 1) with the distributed optimizer and saves at iteration 2
(and 4). Legs B (1, 1, 2, distributed optimizer over 2 DP ranks, asynchronous save) and C (4, 1, 1, plain
optimizer) and D (1, 4, 1 with 2 virtual stages per rank) load iteration 2 and train iterations 3 and 4. Iteration 3's loss checks the weights, iteration 4's
the Adam moments, step count and LR schedule.
"""
import math
import os

import pytest
import torch

from helpers.dist_harness import run_distributed  # noqa: E402
from helpers.train_helpers import preprocess_corpus_slice, run_pretrain  # noqa: E402

REL_TOL = 1e-5


def _leg(tp, pp, *extra):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--train-iters", "4", "--save-interval", "2", "--ckpt-format", "torch_dist", *extra]


def world4_body(data_path, root):
    data = ["--data-path", data_path]
    a = run_pretrain("pretrain_gpt", data + _leg(2, 2, "--use-distributed-optimizer",
                                                 "--save", os.path.join(root, "a")))
    # The same run in the legacy torch format (read by test_torch_checkpoint_converts_to_the_same_weights).
    run_pretrain("pretrain_gpt", data + _leg(2, 2, "--use-distributed-optimizer", "--ckpt-format", "torch",
                                             "--save", os.path.join(root, "t")))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # resume the others from iteration 2, not from the final save
        with open(os.path.join(root, "a", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("2")
    torch.distributed.barrier()
    c = run_pretrain("pretrain_gpt", data + _leg(4, 1, "--load", os.path.join(root, "a"),
                                                 "--save", os.path.join(root, "c")))
    d = run_pretrain("pretrain_gpt", data + _leg(1, 4, "--num-layers-per-virtual-pipeline-stage", "1",
                                                 "--load", os.path.join(root, "a")))
    return {"a": a, "c": c, "d": d}


def world2_body(data_path, root):
    data = ["--data-path", data_path]
    return {"b": run_pretrain("pretrain_gpt", data + _leg(1, 1, "--use-distributed-optimizer", "--async-save",
                                                          "--load", os.path.join(root, "a"),
                                                          "--save", os.path.join(root, "b")))}


def _losses(records):
    return {r["iteration"]: r["loss"]["lm loss"] for r in records}


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    data = preprocess_corpus_slice(str(tmp_path_factory.mktemp("ckpt_dist_data")))
    root = str(tmp_path_factory.mktemp("ckpt_dist"))
    out4 = run_distributed(world4_body, 4, data, root, timeout=300)
    out2 = run_distributed(world2_body, 2, data, root, timeout=300)
    return root, {"a": _losses(out4[-1]["a"]), "c": _losses(out4[-1]["c"]), "d": _losses(out4[-1]["d"]),
                  "b": _losses(out2[-1]["b"])}


def test_reshard_on_load_continues_the_loss_curve(legs):
    _, losses = legs
    ref = losses["a"]
    assert sorted(ref) == [1, 2, 3, 4] and all(math.isfinite(v) for v in ref.values())
    report = []
    for name in ("b", "c", "d"):
        assert sorted(losses[name]) == [3, 4], f"leg {name} did not resume at iteration 3: {losses[name]}"
        for it in (3, 4):
            rel = abs(losses[name][it] - ref[it]) / abs(ref[it])
            report.append(f"{name} iter {it}: {losses[name][it]:.7f} vs {ref[it]:.7f} rel {rel:.2e}")
            assert rel <= REL_TOL, "\n".join(report)
    print("\n".join(report))


def test_offline_read_and_async_save(legs):
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint

    root, _ = legs
    full_a = load_full_checkpoint(os.path.join(root, "a", "iter_0000002"))
    assert full_a["iteration"] == 2 and full_a["checkpoint_version"] == 3.0
    assert (full_a["args"].tensor_model_parallel_size, full_a["args"].pipeline_model_parallel_size) == (2, 2)
    assert full_a["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    model = full_a["model"]
    # Megatron's keys: all 8 layers stacked on a leading axis, the full (padded) vocabulary, full fused QKV / MLP.
    vocab = full_a["args"].padded_vocab_size
    assert model["embedding.word_embeddings.weight"].shape == (vocab, 32)
    assert model["decoder.layers.self_attention.linear_qkv.weight"].shape == (8, 96, 32)
    assert model["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].shape == (8, 32)
    assert model["decoder.layers.mlp.linear_fc2.weight"].shape == (8, 32, 128)
    assert not any(k.startswith("language_model.") for k in model)
    state = full_a["optimizer_state"]
    assert set(state) == {"param", "exp_avg", "exp_avg_sq"} and set(state["exp_avg"]) == set(model)
    assert all(torch.equal(state["param"][k], model[k]) for k in model)  # fp32 run: main params = weights
    assert state["exp_avg_sq"]["decoder.layers.mlp.linear_fc1.weight"].abs().sum() > 0
    assert full_a["opt_param_scheduler"]["num_steps"] == 2 * 4
    assert sorted(full_a["rng_state"]) == [f"rng_state/shard_{p}.{t}_2.2" for p in (0, 1) for t in (0, 1)]

    # B saved iteration 4 asynchronously at (1,1,2), C synchronously at (4,1,1): the same training, the same weights.
    for leg in ("b", "c"):
        with open(os.path.join(root, leg, "latest_checkpointed_iteration.txt")) as f:
            assert f.read().strip() == "4"
        assert os.path.isfile(os.path.join(root, leg, "iter_0000004", "metadata.json"))
    b = load_full_checkpoint(os.path.join(root, "b", "iter_0000004"))
    c = load_full_checkpoint(os.path.join(root, "c", "iter_0000004"))
    assert set(b["model"]) == set(c["model"]) == set(model)
    for k in model:
        torch.testing.assert_close(b["model"][k], c["model"][k], rtol=1e-3, atol=1e-5)  # two layouts, 2 Adam steps
    changed = [k for k in model if not torch.equal(b["model"][k], model[k])]
    assert len(changed) > len(model) // 2, "iterations 3 and 4 did not change the saved weights"
    assert b["iteration"] == 4 and b["args"].consumed_train_samples == 16


def test_torch_checkpoint_converts_to_the_same_weights(legs, tmp_path):
    """The trainer's legacy (2,2) checkpoint, merged by tools/checkpoint/convert.py, equals the torch_dist
    checkpoint of the same run read offline: two independent paths from shards to full tensors."""
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint import convert
    from tools.checkpoint.legacy_io import load_legacy

    root, _ = legs
    convert.convert(convert.get_args(["--model-type", "GPT", "--loader", "legacy", "--saver", "legacy",
                                      "--load-dir", os.path.join(root, "t"), "--save-dir", str(tmp_path / "t11"),
                                      "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1"]))
    merged, args, info = load_legacy(str(tmp_path / "t11"))
    assert (info["tp"], info["pp"], info["iteration"]) == (1, 1, 4) and args.tensor_model_parallel_size == 1
    reference = load_full_checkpoint(os.path.join(root, "a", "iter_0000004"))["model"]
    from megatron.core.models.conversion.keys import legacy_to_mcore_key
    from tools.checkpoint.dist_keys import disk_key

    stacked = {}
    for key, value in merged.items():
        name, layer = disk_key(legacy_to_mcore_key(key), 0, True)
        stacked.setdefault(name, {})[layer] = value
    assert set(stacked) == set(reference), set(stacked) ^ set(reference)
    for key, layers in stacked.items():
        value = layers[None] if None in layers else torch.stack([layers[i] for i in range(len(layers))])
        assert torch.equal(value, reference[key]), key
