"""Hybrid Mamba training (pretrain_mamba.py) from one checkpoint: a tiny Hugging Face ``NemotronHForCausalLM``
(Mamba, attention, MoE with latent experts and a shared expert, MLP) converted to torch_dist. One 4-rank launch:

* at TP=2 with sequence parallelism, our MambaModel loaded from the torch_dist checkpoint (the per-layer keys
  resharded on load) gives transformers' logits (1e-5);
* training runs of 2 iterations from that checkpoint (fp32, no dropout; sigmoid routing with expert bias,
  seq_aux_loss, alltoall dispatcher) log the same losses (1e-5 relative) at TP=1 x DP=4, TP=2 + SP x DP=2,
  PP=2 split by the pattern's '|' (1 + 7 layers) x DP=2, and PP=4 with two virtual stages per rank from 8 one-layer
  segments (the interleaved schedule); all with the distributed optimizer. The TP=1 run saves its iterations, and a
  TP=2 + SP x PP=2 (3 + 5 layers) run resumed from its iteration 1 (weights and optimizer state resharded, the data
  position) logs iteration 2's loss."""
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.hybrid_helpers import HF_VOCAB, hf_to_torch_dist, ids, tiny_corpus, tiny_hf_nemotron_h
from helpers.train_helpers import run_pretrain

BLOCKS = ["linear_attention", "full_attention", "moe", "mlp", "linear_attention", "full_attention", "mlp",
          "linear_attention"]
PATTERN = "M*E-M*-M"


def _hybrid_args(dist, data, pattern, resume_from=None):
    """The tiny model's flags, fine-tuned from the converted checkpoint ``dist`` (or resumed, optimizer included,
    from iteration 1 of the training checkpoint ``resume_from``)."""
    if resume_from is None:
        load = ["--load", dist, "--finetune", "--no-load-optim", "--no-load-rng"]
    else:
        load = ["--load", resume_from, "--ckpt-step", "1"]
    return ["--hybrid-layer-pattern", pattern, "--hidden-size", "32", "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "8", "--ffn-hidden-size", "48",
            "--squared-relu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--position-embedding-type", "none", "--mamba-num-heads", "8",
            "--mamba-head-dim", "8", "--mamba-num-groups", "2", "--mamba-state-dim", "8", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "24",
            "--moe-latent-size", "16", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
            "--moe-token-dispatcher-type", "alltoall", "--seq-length", "16", "--max-position-embeddings", "64",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(HF_VOCAB), "--data-path", data,
            "--split", "100,0,0",
            "--make-vocab-size-divisible-by", "64",  # 128 rows at TP 1 and 2: the zero rows count in the loss
            "--ckpt-format", "torch_dist", *load, "--train-iters", "2", "--log-interval", "1",
            "--lr-warmup-iters", "0", "--eval-iters", "0", "--use-distributed-optimizer"]


LAYOUTS = {
    "tp1_dp4": (["--save", "{save}", "--save-interval", "1"], PATTERN),  # saves iterations 1 and 2
    "tp2_sp_dp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], PATTERN),
    "pp2_pattern_split": (["--pipeline-model-parallel-size", "2"], "M|*E-M*-M"),
    # iteration 2 only: resumed from tp1_dp4's iteration 1 (weights, distributed-optimizer state, data position)
    "tp2_sp_pp2_resumed": (["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--pipeline-model-parallel-size", "2"], "M*E|-M*-M"),
    # 8 segments over 4 stages: the interleaved schedule with 2 virtual stages per rank (segment vp x 4 + pp)
    "pp4_vpp2_pattern": (["--pipeline-model-parallel-size", "4"], "M|*|E|-|M|*|-|M"),
}


def _tp2_logits_error(dist, hf_config, tokens, reference):
    """Our TP=2 (+SP) MambaModel loaded from the torch_dist checkpoint vs transformers' logits."""
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.models.conversion import hf_nemotron_h
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba.mamba_layer_specs import get_mamba_stack_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_cuda_manual_seed
    from megatron.training.checkpointing.dist_state import apply_loaded_model, model_sharded_state
    from megatron.training.checkpointing.torch_dist import load_sharded_checked

    ps.initialize_model_parallel(2, 1)
    try:
        model_parallel_cuda_manual_seed(1)
        cfg = types.SimpleNamespace(**hf_config)
        config = hf_nemotron_h.nemotron_h_config_to_megatron(cfg, tensor_model_parallel_size=2, sequence_parallel=True,
                                                             use_cpu_initialization=True)
        model = MambaModel(config, get_mamba_stack_spec(), config.padded_vocab_size, 64,
                           hybrid_layer_pattern=hf_nemotron_h.hybrid_pattern(cfg)).eval()
        request = model_sharded_state([model], for_load=True)
        vocab = [k for k in request if "word_embeddings" in k or "output_layer" in k]  # padded to 128 x TP here
        load_sharded_checked(request, dist + "/release", "assume_ok_unexpected", vocab)
        apply_loaded_model([model], request)
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(model(tokens, None, None))[..., :HF_VOCAB]
        return float((logits - reference).abs().max() / reference.abs().max())
    finally:
        ps.destroy_model_parallel()


def hybrid_body(dist, data, save, hf_config, tokens, reference, names):
    out = {"tp2_logits_err": _tp2_logits_error(dist, hf_config, tokens, reference)}
    for name in names:
        extra, pattern = LAYOUTS[name]
        argv = _hybrid_args(dist, data, pattern, resume_from=save if name.endswith("_resumed") else None)
        records = run_pretrain("pretrain_mamba", argv + [a.replace("{save}", save) for a in extra])
        out[name] = [(r["iteration"], r["loss"]) for r in records]
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    cfg, model = tiny_hf_nemotron_h(blocks=BLOCKS)
    tokens = ids(batch=2, seq=12)
    with torch.no_grad():
        reference = model(tokens).logits
    config = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
    root = str(tmp_path_factory.mktemp("hybrid"))
    return hf_to_torch_dist(model, root), tiny_corpus(root), os.path.join(root, "trained"), config, tokens, reference


@pytest.mark.timeout(400)
def test_hybrid_tp2_logits_and_training_layouts(checkpoint):
    dist, data, save, config, tokens, reference = checkpoint
    results = run_distributed(hybrid_body, 4, dist, data, save, config, tokens, reference, list(LAYOUTS),
                              timeout=380)
    errors = [r.pop("tp2_logits_err") for r in results]
    print(f"NemotronH logits at TP=2 + SP vs transformers: max rel err {max(errors):.2e}")
    assert max(errors) <= 1e-5, errors
    runs = results[-1]  # the last rank is on the last pipeline stage in every layout
    base = runs["tp1_dp4"]
    assert [it for it, _ in base] == [1, 2]
    assert [it for it, _ in runs["tp2_sp_pp2_resumed"]] == [2]
    worst = 0.0
    for name, records in runs.items():
        for it, got in records:
            assert it in (1, 2), (name, it)
            want = base[it - 1][1]
            assert set(got) == set(want), (name, got.keys())
            for key in want:
                worst = max(worst, abs(got[key] - want[key]) / abs(want[key]))
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (name, key, got[key], want[key])
        assert [it for it, _ in records] == ([2] if name.endswith("_resumed") else [1, 2]), name
    print({name: [round(r[1]["lm loss"], 6) for r in records] for name, records in runs.items()},
          f"max relative difference to TP=1: {worst:.1e}")
    assert base[-1][1]["lm loss"] != base[0][1]["lm loss"]  # the runs train
