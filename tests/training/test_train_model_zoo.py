"""Today's transformer families train on CPU from a Hugging Face checkpoint, with losses independent of the layout.

Per family, Megatron-LM HEAD's configuration file (its ``MODEL_ARGS`` word for word, shrunk: tests/helpers/model_confs.py)
plus a small token corpus and a NullTokenizer runs ``pretrain_gpt.py`` for two iterations from the same torch_dist checkpoint,
converted with tools/checkpoint/convert.py from a tiny random ``transformers`` model of the family whose shape is the
shrunk one. The per-iteration losses (and the router's load-balancing loss) of TP=2 + SP x PP=2 (the MoE families
with their experts over EP=2) equal TP=1's within 1e-5 (fp32: --bf16 is left out). Llama 4 Maverick's interleaved dense / MoE layers
with NoPE layers (no checkpoint: the stacked torch_dist layout holds same-shaped layers only) start from the same
deterministic weights instead. One 4-rank launch runs everything."""
import os

import pytest
import torch

from helpers import hf_zoo
from helpers.dist_harness import run_distributed
from helpers.model_confs import shrunk
from helpers.train_helpers import run_pretrain

# family -> (configuration file, HF family of the checkpoint, its config overrides (the shrunk shape), extra flags)
FAMILIES = {
    "qwen2.5": ("Qwen__Qwen2.5-0.5B-Instruct", "qwen2", dict(num_hidden_layers=4, intermediate_size=64,
                                                               tie_word_embeddings=True), []),
    "qwen3_moe": ("Qwen__Qwen3-30B-A3B", "qwen3_moe", dict(num_hidden_layers=4, head_dim=8, intermediate_size=64,
                                                           moe_intermediate_size=16), []),
    "llama3.2": ("meta-llama__Llama-3.2-1B-Instruct", "llama", dict(num_hidden_layers=4, head_dim=8,
                                                                    intermediate_size=64, tie_word_embeddings=True),
                 []),
    # a window shorter than the sequence, so that it matters
    "gpt_oss": ("openai__gpt-oss-20b", "gpt_oss", dict(head_dim=8), ["--window-size", "3,0"]),
    "llama4_scout": ("meta-llama__Llama-4-Scout-17B-16E-Instruct", "llama4_text", dict(head_dim=8), []),
}
SHAPE = dict(moe_shared_expert_intermediate_size=16)  # Llama 4's shared expert is as wide as an expert
RUN = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(hf_zoo.VOCAB - 1), "--padded-vocab-size",
       str(hf_zoo.PADDED_VOCAB), "--split", "100,0,0", "--micro-batch-size", "1", "--global-batch-size", "4",
       "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--lr", "1e-3", "--min-lr", "1e-4",
       "--lr-warmup-iters", "0", "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--seed", "1234",
       "--ckpt-format", "torch_dist"]
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "llama4_scout", "llama4_maverick")


def layouts(family):
    """TP=1 (DP=4) and TP=2 + SP x PP=2 (DP=1); the MoE families' experts over EP=2 in the second layout too (expert
    tensor parallel size 1, which gpt-oss's expert biases need anyway)."""
    parallel = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]
    if family in MOE_FAMILIES:
        return {"tp1": [], "tp2_sp_pp2_ep2": parallel + ["--expert-model-parallel-size", "2",
                                                         "--expert-tensor-parallel-size", "1"]}
    return {"tp1": [], "tp2_sp_pp2": parallel}


def family_argv(family, checkpoint, data):
    if family == "llama4_maverick":
        conf, extra = "meta-llama__Llama-4-Maverick-17B-128E-Instruct", []
    else:
        conf, _, _, extra = FAMILIES[family]
    load = ["--load", checkpoint] if checkpoint else []
    return shrunk(conf, **SHAPE) + RUN + ["--data-path", data] + extra + load


def zoo_body(runs):
    from helpers import train_helpers

    from megatron.post_training.arguments import add_modelopt_args

    original = train_helpers.deterministic_init

    def wide_routers(model, num_layers):
        # Maverick starts from the deterministic weights (std 0.02): widen its router so that no top-1 choice is a
        # near tie that rounding could flip between layouts (the checkpoints' routers are N(0, 0.5) already).
        original(model, num_layers)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("router.weight"):
                    p.mul_(25.0)

    out = {}
    try:
        for family, layout, argv in runs:
            train_helpers.deterministic_init = wide_routers if family == "llama4_maverick" else original
            records = run_pretrain("pretrain_gpt", argv, extra_args_provider=add_modelopt_args)
            out[(family, layout)] = [(r["iteration"], r["loss"]) for r in records]
    finally:
        train_helpers.deterministic_init = original
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """64 documents of random token ids below the vocabulary (the end-of-document id is NullTokenizer's, 95): a
    corpus small enough that the sample index costs nothing (mock data's is millions of samples)."""
    from helpers.data_support import write_indexed

    prefix = str(tmp_path_factory.mktemp("zoo_data") / "tokens")
    g = torch.Generator().manual_seed(0)
    write_indexed(prefix, [[torch.randint(0, hf_zoo.VOCAB - 1, (int(n),), generator=g).tolist() + [hf_zoo.VOCAB - 1]]
                           for n in torch.randint(20, 60, (64,), generator=g)])
    return prefix


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> torch_dist checkpoint converted from a tiny HF model of the shrunk configuration's shape."""
    out = {}
    for family, (_, hf_family, overrides, _) in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        hf_zoo.tiny_hf(hf_family, **overrides).save_pretrained(str(root / "hf"))
        hf_zoo.convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", str(root / "hf"),
                       "--save-dir", str(root / "dist"))
        out[family] = str(root / "dist")
    return out


@pytest.mark.timeout(600)
def test_families_train_with_layout_independent_losses(checkpoints, data):
    runs = [(family, layout, family_argv(family, checkpoints.get(family), data) + extra)
            for family in list(FAMILIES) + ["llama4_maverick"] for layout, extra in layouts(family).items()]
    results = run_distributed(zoo_body, 4, runs, timeout=580)[-1]  # the last rank is on the last pipeline stage
    worst = {}
    for (family, layout), records in results.items():
        ref = results[(family, "tp1")]
        assert [it for it, _ in records] == [1, 2], (family, layout, records)
        balanced = family in MOE_FAMILIES and family != "gpt_oss"  # gpt-oss: --moe-aux-loss-coeff 0.0
        assert "lm loss" in records[0][1] and (not balanced or any(
            "load_balancing_loss" in k for k in records[0][1])), records[0][1]
        for (it, losses), (_, ref_losses) in zip(records, ref):
            assert set(losses) == set(ref_losses), (family, layout)
            for key, value in ref_losses.items():
                err = abs(losses[key] - value) / abs(value)
                worst[(family, layout, key)] = max(worst.get((family, layout, key), 0.0), err)
                assert err <= 1e-5, f"{family} {layout} iteration {it} {key}: {losses[key]} vs TP=1 {value}"
        assert records[1][1]["lm loss"] != records[0][1]["lm loss"]  # it trained
    print("max relative difference to TP=1:", {f"{f}/{la}/{k}": f"{e:.1e}" for (f, la, k), e in worst.items()})
    print("losses:", {f"{f}/{la}": [round(v["lm loss"], 5) for _, v in r] for (f, la), r in results.items()})
