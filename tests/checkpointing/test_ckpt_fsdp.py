"""Checkpoints of the fully sharded models on 4 gloo ranks, in one launch: torch_dcp (--use-torch-fsdp2) and
fsdp_dtensor (--use-megatron-fsdp), exact resume, loads across strategies and layouts, and
tools/checkpoint/convert.py between them and torch_dist with the next losses of the resumed runs.

Every run trains 4 iterations of a tiny SwiGLU GPT (fp32, a small random-token corpus) and the checkpointing ones save
at iteration 2, so a run is both the straight reference and the source of a resume for iterations 3 and 4 (the loss
of iteration 3 checks the loaded weights, that of iteration 4 also the loaded optimizer state):

* torch_dcp (FSDP2, --torch-fsdp2-no-reshard-after-forward) and fsdp_dtensor (optim_grads_params, MoE EP=2 with
  grouped experts, --moe-grouped-gemm) resume bit-exactly;
* an fsdp_dtensor checkpoint of the bucketed ZeRO-1 (optim) at DP=4 resumes under ZeRO-2 at TP=2 x DP=2;
* torch_dist written and read directly by FSDP2 (--use-torch-fsdp2 --ckpt-format torch_dist, each rank its rows of
  every tensor): a bf16 run at TP=2 x DP=2 resumes bit-exactly and a bf16 DDP run at DP=4 resumes it (within 1e-4:
  the two engines compute in bf16 at different TP sizes, 5.9e-6 apart at the first step); its checkpoint holds the
  fp32 main weights both as the model tensors and as Megatron's ``optimizer.state.fp32_param`` master copy; FSDP2
  at TP=2 x DP=2 resumes the fp32 DDP run's torch_dist checkpoint (no conversion) within 1e-6;
* torch_dist (plain DDP) -> fsdp_dtensor resumed by Megatron-FSDP, torch_dist -> torch_dcp resumed by FSDP2, and
  fsdp_dtensor (grouped MoE) -> torch_dist resumed by DDP with SequentialMLP experts, each within 1e-6 of the
  source run's own iterations 3 and 4;
* the fsdp_dtensor files use Megatron's layout: ``model.module.`` keys per layer, gated fc1 split into ``_w`` /
  ``_v``, grouped experts stored per expert as ``mlp.experts.linear_fc1.weight{e}`` with global indices ``e``,
  optimizer state under ``optimizer.state.module.module.module.``, RNG keyed ``"(0, 0)"``, and their tensors equal
  the converted torch_dist checkpoint's.
"""
import os

import pytest
import torch

from helpers.ckpt_helpers import losses, run_leg
from helpers.data_support import random_token_corpus
from helpers.dist_harness import run_distributed

REL_TOL = 1e-6
BF16_TOL = {"fsdp2_dist_as_ddp": 1e-4}  # bf16 compute of two engines at two TP sizes
TINY = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--split", "100,0,0", "--num-layers", "2",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "4", "--log-interval", "1",
        "--eval-iters", "0", "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion",
        "--swiglu"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--disable-bias-linear"]
GROUPED = MOE + ["--moe-grouped-gemm"]
DDP = ["--ckpt-format", "torch_dist"]
FSDP2 = ["--use-torch-fsdp2", "--ckpt-format", "torch_dcp", "--torch-fsdp2-no-reshard-after-forward"]
FSDP2_DIST = ["--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--tensor-model-parallel-size", "2",
              "--sequence-parallel"]
BF16 = ["--bf16"]


def _mfsdp(strategy):
    return ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy", strategy]


def _convert(loader, saver, src, dst):
    if torch.distributed.get_rank() == 0:
        from tools.checkpoint.convert import main

        main(["--model-type", "GPT", "--loader", loader, "--saver", saver, "--load-dir", src, "--save-dir", dst])
    torch.distributed.barrier()


def body(root, data):
    def run(name, extra, load=None):
        save = ["--save", os.path.join(root, name), "--save-interval", "2"] if load is None else []
        result = losses(run_leg(TINY + ["--data-path", data] + extra + save + (["--load", load] if load else []))[0])
        if load is None and torch.distributed.get_rank() == 0:  # resume (and convert) iteration 2's checkpoint
            with open(os.path.join(root, name, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("2")
        torch.distributed.barrier()
        return result

    d = lambda name: os.path.join(root, name)  # noqa: E731
    out = {
        "ddp": run("ddp", DDP),
        "dcp": run("dcp", FSDP2),
        "zero3_moe": run("zero3_moe", GROUPED + _mfsdp("optim_grads_params")),
        "zero1": run("zero1", _mfsdp("optim")),
        "fsdp2_dist": run("fsdp2_dist", FSDP2_DIST + BF16),
    }
    out["fsdp2_dist_resumed"] = run("", FSDP2_DIST + BF16, load=d("fsdp2_dist"))
    out["fsdp2_dist_as_ddp"] = run("", DDP + BF16, load=d("fsdp2_dist"))
    out["ddp_as_fsdp2_dist"] = run("", FSDP2_DIST, load=d("ddp"))
    out["dcp_resumed"] = run("", FSDP2, load=d("dcp"))
    out["zero3_moe_resumed"] = run("", GROUPED + _mfsdp("optim_grads_params"), load=d("zero3_moe"))
    out["zero1_as_zero2_tp2"] = run("", _mfsdp("optim_grads") + ["--tensor-model-parallel-size", "2"],
                                    load=d("zero1"))
    _convert("torch_dist", "fsdp_dtensor", d("ddp"), d("ddp_as_fsdp_dtensor"))
    out["ddp_as_fsdp_dtensor"] = run("", _mfsdp("optim_grads_params"), load=d("ddp_as_fsdp_dtensor"))
    _convert("torch_dist", "torch_dcp", d("ddp"), d("ddp_as_dcp"))
    out["ddp_as_dcp"] = run("", FSDP2, load=d("ddp_as_dcp"))
    _convert("fsdp_dtensor", "torch_dist", d("zero3_moe"), d("zero3_moe_as_dist"))
    out["zero3_moe_as_dist"] = run("", MOE + DDP, load=d("zero3_moe_as_dist"))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt_fsdp"))
    data = random_token_corpus(os.path.join(root, "tokens"), 128)
    return run_distributed(body, 4, root, data, timeout=600)[-1], root


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.timeout(700)
def test_resume_loads_and_conversions(results):
    out, _ = results
    for name in ("ddp", "dcp", "zero3_moe", "zero1", "fsdp2_dist"):
        assert sorted(out[name]) == [1, 2, 3, 4], (name, out[name])
    exact = {"dcp_resumed": "dcp", "zero3_moe_resumed": "zero3_moe", "fsdp2_dist_resumed": "fsdp2_dist"}
    close = {"zero1_as_zero2_tp2": "zero1", "ddp_as_fsdp_dtensor": "ddp", "ddp_as_dcp": "ddp",
             "zero3_moe_as_dist": "zero3_moe", "fsdp2_dist_as_ddp": "fsdp2_dist", "ddp_as_fsdp2_dist": "ddp"}
    for resumed, source in {**exact, **close}.items():
        assert sorted(out[resumed]) == [3, 4], (resumed, out[resumed])
        for it in (3, 4):
            got, want = out[resumed][it], out[source][it]
            print(f"{resumed} iteration {it}: {got:.9f} vs {source} {want:.9f} (rel {_rel(got, want):.1e})")
            if resumed in exact:
                assert got == want, (resumed, it, got, want)
            else:
                assert _rel(got, want) <= BF16_TOL.get(resumed, REL_TOL), (resumed, it, got, want)


def test_fsdp_dtensor_layout_matches_converted_torch_dist(results):
    from megatron.core.dist_checkpointing.sharded_io import load_full_state_dict

    _, root = results
    ours = load_full_state_dict(os.path.join(root, "zero3_moe", "iter_0000002"))
    dist = load_full_state_dict(os.path.join(root, "zero3_moe_as_dist", "iter_0000002"))
    layer0 = "model.module.decoder.layers.0."
    for e in range(4):  # grouped experts: global indices over EP=2 ranks, gate / up halves of the gated fc1
        for half in ("_w", "_v"):
            assert f"{layer0}mlp.experts.linear_fc1.weight{e}{half}" in ours
        assert f"{layer0}mlp.experts.linear_fc2.weight{e}" in ours
    assert not any("local_experts" in k or k.endswith((".experts.weight1", ".experts.weight2")) for k in ours)
    assert f"{layer0}self_attention.linear_qkv.weight" in ours and not any("_extra_state" in k for k in ours)
    assert "optimizer.state.module.module.module.decoder.layers.1.mlp.router.weight.exp_avg" in ours
    assert set(ours["rng_state"]) == {"(0, 0)"} and ours["iteration"] == 2
    # The torch_dist copy stacks layers [L, ...] and experts [L, E, ...] with fc1 as [gate; up].
    fc1 = dist["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    for layer in range(2):
        for e in range(4):
            name = f"model.module.decoder.layers.{layer}.mlp.experts.linear_fc1.weight{e}"
            assert torch.equal(fc1[layer, e], torch.cat([ours[name + "_w"], ours[name + "_v"]]))
    qkv = dist["decoder.layers.self_attention.linear_qkv.weight"]
    assert torch.equal(qkv[1], ours["model.module.decoder.layers.1.self_attention.linear_qkv.weight"])
    adam = dist["optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    name = "optimizer.state.module.module.module.decoder.layers.0.mlp.experts.linear_fc2.weight3"
    assert torch.equal(adam[0, 3], ours[name + ".exp_avg"])
    fc2 = dist["decoder.layers.mlp.experts.experts.linear_fc2.weight"]
    assert torch.equal(fc2[1, 2], ours["model.module.decoder.layers.1.mlp.experts.linear_fc2.weight2"])


def test_fsdp2_torch_dist_holds_the_fp32_main_weights(results):
    """The bf16 FSDP2 run's torch_dist checkpoint: DDP's keys (stacked layers), the fp32 main weights as the model
    tensors (not bf16-rounded) and again as Megatron's master copy, the whole tensors although each of the 4 ranks
    wrote only its rows."""
    from megatron.core.dist_checkpointing.sharded_io import load_full_state_dict

    _, root = results
    fsdp2 = load_full_state_dict(os.path.join(root, "fsdp2_dist", "iter_0000002"))
    ddp = load_full_state_dict(os.path.join(root, "ddp", "iter_0000002"))
    model_keys = sorted(k for k, v in ddp.items() if torch.is_tensor(v) and not k.startswith(("optimizer.", "rng")))
    assert "decoder.layers.mlp.linear_fc1.weight" in model_keys
    for key in model_keys:
        weight, main = fsdp2[key], fsdp2[f"optimizer.state.fp32_param.{key}"]
        assert weight.dtype == torch.float32 and weight.shape == ddp[key].shape and torch.equal(weight, main), key
        assert fsdp2[f"optimizer.state.exp_avg.{key}"].shape == weight.shape
    fc1 = fsdp2["decoder.layers.mlp.linear_fc1.weight"]
    assert not torch.equal(fc1, fc1.bfloat16().float())  # fp32 values, not the bf16 compute copy


@pytest.mark.parametrize("strict,strictness", [(True, "assume_ok_unexpected"), (False, "log_all"),
                                               (False, "raise_all")])
def test_fsdp_dtensor_strict_loading(strict, strictness, capsys):
    """A model key the checkpoint lacks: an error naming it (strict, the default); with
    --no-strict-fsdp-dtensor-load the key is skipped (reported per --dist-ckpt-strictness; raise_* still raises)."""
    from types import SimpleNamespace

    from megatron.training.checkpointing.fsdp_dtensor import _apply_strictness
    from megatron.training.checkpointing.protocol import CheckpointError

    request = {"model.module.a.weight": 1, "model.module.b.weight": 2, "iteration": None}
    stored = {"model.module.a.weight": object(), "iteration": object()}
    args = SimpleNamespace(strict_fsdp_dtensor_load=strict, dist_ckpt_strictness=strictness)
    if strict or strictness == "raise_all":
        with pytest.raises(CheckpointError, match="model.module.b.weight" if strict else "lacks 1 model key"):
            _apply_strictness(request, stored, "ckpt/iter_0000002", args)
        return
    _apply_strictness(request, stored, "ckpt/iter_0000002", args)
    assert sorted(request) == ["iteration", "model.module.a.weight"]
    assert "lacks 1 model key(s), left as initialised: model.module.b.weight" in capsys.readouterr().out
