"""pretrain_gpt.py with HEAD's experimental-attention-variant flags: Gated DeltaNet layers mixed with attention
(``--experimental-attention-variant gated_delta_net --linear-attention-freq 2``) and DeepSeek sparse attention inside
multi-latent attention (``--experimental-attention-variant dsa --dsa-indexer-*``) build the layers the flags name and
train (one rank, mock data, 8 iterations: the loss falls by more than 0.05); HEAD's other values are refused in one line."""
import math

import pytest

from helpers.dist_harness import run_distributed

COMMON = ["--mock-data", "--train-iters", "8", "--num-layers", "4", "--log-interval", "1", "--eval-iters", "0",
          "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
          "--no-rope-fusion"]
RUNS = {
    "gdn": ["--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "2",
            "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
            "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "3"],
    "dsa": ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rope-type", "rope",
            "--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "2", "--dsa-indexer-head-dim", "8",
            "--dsa-indexer-topk", "8", "--dsa-indexer-loss-coeff", "0.1"],
}


def body():
    from helpers import train_helpers

    original = train_helpers.load_entry_point
    out = {}

    def spying(name):
        module = original(name)
        provider = module.model_provider

        def model_provider(pre_process=True, post_process=True):
            model = provider(pre_process=pre_process, post_process=post_process)
            out.setdefault("layers", []).append(
                [f"{type(layer.self_attention).__name__}/"
                 f"{type(getattr(layer.self_attention, 'core_attention', None)).__name__}"
                 for layer in model.decoder.layers])
            return model

        module.model_provider = model_provider
        return module

    train_helpers.load_entry_point = spying
    try:
        for name, flags in RUNS.items():
            records = train_helpers.run_pretrain("pretrain_gpt", COMMON + flags, deterministic=False)
            out[name] = [r["loss"]["lm loss"] for r in records]
    finally:
        train_helpers.load_entry_point = original
    return out


def test_gated_delta_net_and_sparse_attention_train_from_the_flags():
    (out,) = run_distributed(body, 1, timeout=300)
    print({name: out[name] for name in RUNS})
    gdn_layers, dsa_layers = out["layers"]
    assert gdn_layers == ["GatedDeltaNet/NoneType", "SelfAttention/DotProductAttention"] * 2, gdn_layers
    assert dsa_layers == ["MLASelfAttention/DSAttention"] * 4, dsa_layers
    for name in RUNS:
        losses = out[name]
        assert len(losses) == 8 and all(math.isfinite(x) for x in losses), (name, losses)
        assert losses[-1] < losses[0] - 0.05, (name, losses)


@pytest.mark.parametrize("value", ["gdn", "gdn2"])
def test_heads_other_variants_are_refused(value):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.errors import ConfigurationError
    from helpers.train_helpers import GPT_ARGS

    args = parse_args(argv=GPT_ARGS + ["--experimental-attention-variant", value])
    with pytest.raises(ConfigurationError, match="--experimental-attention-variant"):
        validate_args(args)
