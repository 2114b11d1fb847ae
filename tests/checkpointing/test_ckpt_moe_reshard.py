"""MoE checkpoints: expert weights (and their Adam state) under Megatron's torch_dist keys
(``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight [L, E, ...]``) load under another EP / expert TP / TP / PP
and expert implementation, and the loss curve continues; the torch format saves one file per (TP, PP, EP) rank.

Leg A trains 4 iterations at (TP, EP, PP) = (2, 2, 1) (+SP, expert TP 2, distributed optimizer, a gated shared
expert, sigmoid routing with the aux-loss-free expert bias), saving at 2 and 4.
Leg B loads iteration 2 at (1, 1, 2); leg C at (1, 4, 1) with grouped GEMM (GroupedMLP reads SequentialMLP's
experts). Iteration 3's loss checks the weights (a gate/up row order that depended on expert TP would show here),
iteration 4's the optimizer state. The slow test saves the torch format (distributed optimizer) at (2, 2, 1) and resumes it in that layout.
"""
import math
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.train_helpers import preprocess_corpus_slice, run_pretrain

REL_TOL = 1e-5
MOE = ["--num-layers", "2", "--seq-length", "16", "--max-position-embeddings", "16", "--swiglu",
       "--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-shared-expert-intermediate-size", "48", "--moe-shared-expert-gate",
       "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
       "--moe-router-bias-update-rate", "0.05",
       "--train-iters", "4", "--save-interval", "2", "--log-interval", "1"]


def _leg(tp, ep, pp, *extra):
    return MOE + ["--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
                  "--pipeline-model-parallel-size", str(pp)] + (["--sequence-parallel"] if tp > 1 else []) + list(extra)


def _set_latest(path, iteration):
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def moe_ckpt_body(data_path, root):
    data = ["--data-path", data_path]
    a_dir, t_dir = os.path.join(root, "a"), os.path.join(root, "t")
    a = run_pretrain("pretrain_gpt", data + _leg(2, 2, 1, "--use-distributed-optimizer", "--ckpt-format",
                                                 "torch_dist", "--save", a_dir))
    _set_latest(a_dir, 2)
    b = run_pretrain("pretrain_gpt", data + _leg(1, 1, 2, "--ckpt-format", "torch_dist", "--load", a_dir))
    c = run_pretrain("pretrain_gpt", data + _leg(1, 4, 1, "--moe-grouped-gemm", "--moe-token-dispatcher-type",
                                                 "alltoall", "--ckpt-format", "torch_dist", "--load", a_dir))
    return {"a": a, "b": b, "c": c}


def moe_torch_format_body(data_path, root):
    data = ["--data-path", data_path]
    t_dir = os.path.join(root, "t")
    opt = ["--use-distributed-optimizer", "--ckpt-format", "torch"]  # distrib_optim.pt: expert state over expert DP
    t = run_pretrain("pretrain_gpt", data + _leg(2, 2, 1, *opt, "--save", t_dir))
    _set_latest(t_dir, 2)
    t2 = run_pretrain("pretrain_gpt", data + _leg(2, 2, 1, *opt, "--load", t_dir))
    return {"t": t, "t2": t2, "files": sorted(os.listdir(os.path.join(t_dir, "iter_0000002")))}


def _losses(records):
    return {r["iteration"]: r["loss"]["lm loss"] for r in records}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return preprocess_corpus_slice(str(tmp_path_factory.mktemp("moe_ckpt_data")), num_docs=100)


@pytest.fixture(scope="module")
def legs(tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("moe_ckpt"))
    out = run_distributed(moe_ckpt_body, 4, data, root, timeout=400)
    return root, out[-1]


@pytest.mark.timeout(450)
def test_moe_checkpoint_reshards_across_ep_tp_pp(legs):
    root, out = legs
    ref = _losses(out["a"])
    assert sorted(ref) == [1, 2, 3, 4] and all(math.isfinite(v) for v in ref.values())
    report = []
    for name in ("b", "c"):
        losses = _losses(out[name])
        assert sorted(losses) == [3, 4], f"leg {name} did not resume at iteration 3: {losses}"
        for it in (3, 4):
            rel = abs(losses[it] - ref[it]) / abs(ref[it])
            report.append(f"{name} iter {it}: {losses[it]:.7f} vs {ref[it]:.7f} rel {rel:.2e}")
    print("\n".join(report))
    for line in report:
        assert float(line.rsplit(" ", 1)[1]) <= REL_TOL, "\n".join(report)


@pytest.mark.timeout(300)
def test_moe_torch_format_saves_per_ep_rank_and_resumes(data, tmp_path):
    out = run_distributed(moe_torch_format_body, 4, data, str(tmp_path), timeout=280)[-1]
    t_ref, t2 = _losses(out["t"]), _losses(out["t2"])
    for it in (3, 4):
        assert abs(t2[it] - t_ref[it]) <= REL_TOL * abs(t_ref[it]), (it, t2, t_ref)
    # Megatron's torch-format names with EP > 1: mp_rank_{tp:02d}_{ep:03d}.
    assert out["files"] == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"], out["files"]


def test_moe_torch_dist_keys_are_megatrons(legs):
    """The stored expert tensors: Megatron's keys and global shapes [L, E, 2F, h] / [L, E, h, F]."""
    import pickle

    root, _ = legs
    with open(os.path.join(root, "a", "iter_0000002", ".metadata"), "rb") as f:
        meta = pickle.load(f)
    shapes = {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if hasattr(v, "size")}
    fc1 = shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    fc2 = shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    assert fc1[:2] == (2, 4) and fc1[3] == 32 and fc2[:3] == (2, 4, 32) and fc1[2] == 2 * fc2[3], (fc1, fc2)
    assert shapes["decoder.layers.mlp.router.weight"] == (2, 4, 32)
    # The gated shared expert (Qwen-MoE style): an MLP whose fc1 holds [gate; up] for the whole width 48, whatever the
    # TP size that saved it (a TP-ordered [gate_0; up_0; gate_1; up_1] would change leg B's losses), and its gate.
    assert shapes["decoder.layers.mlp.shared_experts.linear_fc1.weight"] == (2, 96, 32)
    assert shapes["decoder.layers.mlp.shared_experts.linear_fc2.weight"] == (2, 32, 48)
    assert shapes["decoder.layers.mlp.shared_experts.gate_weight"] == (2, 1, 32)
    assert shapes["decoder.layers.mlp.router.expert_bias"] == (2, 4)  # aux-loss-free routing's state
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in shapes
    assert "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight" in shapes
    objects = [k for k in meta.state_dict_metadata if k.startswith("decoder.layers.mlp.experts.experts.linear_fc1."
                                                                    "_extra_state/")]
    assert sorted(objects) == [f"decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{i}.{e}_2.4"
                               for i in range(2) for e in range(4)]
