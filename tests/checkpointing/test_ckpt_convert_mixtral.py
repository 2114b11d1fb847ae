"""tools/checkpoint/convert.py with Hugging Face Mixtral: HF -> torch_dist (Megatron's expert keys [L, E, ...])
-> HF is exact, and the torch_dist checkpoint loads into an MoE GPTModel that computes HF's logits."""
import os

import pytest
import torch

from helpers.models_helpers import causal_mask, single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


def _mixtral():
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32, rms_norm_eps=1e-6,
                                     tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate.weight" in name:
                p.normal_(0, 0.5)
    return model


def _convert(*argv):
    from tools.checkpoint import convert
    convert.convert(convert.get_args(["--model-type", "GPT", *argv]))


def test_mixtral_hf_torch_dist_round_trip(tmp_path, single_rank):
    from megatron.core.models.conversion import hf
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint.dist_io import load_dist

    src, dist, back = (str(tmp_path / n) for n in ("hf", "dist", "back"))
    model = _mixtral()
    model.save_pretrained(src, safe_serialization=True)
    _convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", src, "--save-dir", dist)
    ckpt = load_full_checkpoint(os.path.join(dist, "release"))
    assert ckpt["model"]["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 96, 32)
    assert ckpt["model"]["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape == (2, 4, 32, 48)
    assert ckpt["model"]["decoder.layers.mlp.router.weight"].shape == (2, 4, 32)
    assert ckpt["args"].num_experts == 4 and ckpt["args"].moe_router_topk == 2
    # --use-checkpoint-args takes the MoE shape from the checkpoint (Megatron force-copies these).
    import argparse

    from megatron.training.checkpointing import load_args_from_checkpoint
    args, _ = load_args_from_checkpoint(argparse.Namespace(load=dist, ckpt_step=None, num_experts=None,
                                                           moe_router_topk=2, moe_ffn_hidden_size=None))
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.swiglu) == (4, 2, 48, True)

    _convert("--loader", "torch_dist", "--saver", "hf", "--load-dir", dist, "--save-dir", back)
    a, b = load_file(os.path.join(back, "model.safetensors")), model.state_dict()
    assert set(a) == set(b), set(a) ^ set(b)
    assert all(torch.equal(a[k], b[k]) for k in b)

    # The converted checkpoint's tensors, in a megatron-core MoE GPTModel, give HF's logits.
    full, _, _ = load_dist(dist)
    config = hf.mixtral_config_to_megatron(model.config, make_vocab_size_divisible_by=128,
                                           use_cpu_initialization=True)
    ours = GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size, 32,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=config.rotary_base).eval()
    ours.load_state_dict({k: v for k, v in full.items() if not k.endswith("_extra_state")})
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = rel_err(ours(ids, torch.arange(10).expand(2, 10), causal_mask(10))[..., :100], model(ids).logits)
    assert err <= 1e-5, err
