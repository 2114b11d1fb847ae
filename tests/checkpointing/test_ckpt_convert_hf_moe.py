"""tools/checkpoint/convert.py with Hugging Face Mixtral and Qwen2-MoE: HF -> torch_dist (Megatron's expert keys
[L, E, ...], shared expert keys) -> HF is exact, and the torch_dist checkpoint loads into an MoE GPTModel that
computes HF's logits."""
import os

import pytest
import torch

from helpers.models_helpers import causal_mask, single_rank, tiny_hf_mixtral  # noqa: F401  (fixture)
from helpers.numerics import rel_err

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402


def _convert(*argv):
    from tools.checkpoint import convert
    convert.convert(convert.get_args(["--model-type", "GPT", *argv]))


def test_mixtral_hf_torch_dist_round_trip(tmp_path, single_rank):
    from megatron.core.models.conversion import hf_moe
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint.dist_io import load_dist

    src, dist, back = (str(tmp_path / n) for n in ("hf", "dist", "back"))
    _, model = tiny_hf_mixtral(vocab_size=100)
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
    config = hf_moe.moe_config_to_megatron(model.config, make_vocab_size_divisible_by=128,
                                           use_cpu_initialization=True)
    ours = GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size, 32,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=config.rotary_base).eval()
    ours.load_state_dict({k: v for k, v in full.items() if not k.endswith("_extra_state")})
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = rel_err(ours(ids, torch.arange(10).expand(2, 10), causal_mask(10))[..., :100], model(ids).logits)
    assert err <= 1e-5, err


def _qwen2_moe():
    torch.manual_seed(1)
    cfg = transformers.Qwen2MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=False, max_position_embeddings=32, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.Qwen2MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith(("_proj.bias", "shared_expert_gate.weight")):
                p.normal_(0, 0.3)  # biases and the shared expert's gate are zero-initialised: make them matter
    return model


def _hub_names(sd, num_layers, num_experts):
    """The Hub's per-expert names (Qwen/Qwen1.5-MoE-A2.7B) of transformers 5's fused expert tensors."""
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for i in range(num_layers):
        fused, down = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"], sd[f"model.layers.{i}.mlp.experts.down_proj"]
        for e in range(num_experts):
            gate, up = torch.chunk(fused[e], 2, dim=0)
            out[f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight"] = gate
            out[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"] = up
            out[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"] = down[e]
    return out


def test_qwen2_moe_hf_torch_dist_round_trip(tmp_path, single_rank):
    """Qwen2-MoE (q/k/v biases, softmax-then-top-k without renormalisation, a sigmoid-gated shared expert): HF ->
    torch_dist -> HF is exact and loads in transformers with the same logits; the torch_dist checkpoint in our
    megatron-core MoE GPTModel computes HF's logits; the Hub's per-expert names convert as the fused ones do."""
    from safetensors.torch import save_file

    from megatron.core.models.conversion import hf_moe
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.checkpointing.torch_dist import load_full_checkpoint
    from tools.checkpoint.dist_io import load_dist

    src, hub, dist, back = (str(tmp_path / n) for n in ("hf", "hub", "dist", "back"))
    model = _qwen2_moe()
    model.save_pretrained(src, safe_serialization=True)
    _convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", src, "--save-dir", dist)
    ckpt = load_full_checkpoint(os.path.join(dist, "release"))
    shapes = {k: tuple(v.shape) for k, v in ckpt["model"].items() if torch.is_tensor(v)}
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 4, 48, 32)
    assert shapes["decoder.layers.mlp.shared_experts.linear_fc1.weight"] == (2, 80, 32)
    assert shapes["decoder.layers.mlp.shared_experts.linear_fc2.weight"] == (2, 32, 40)
    assert shapes["decoder.layers.mlp.shared_experts.gate_weight"] == (2, 1, 32)
    assert shapes["decoder.layers.self_attention.linear_qkv.bias"] == (2, 64)  # (4 + 2 * 2) heads of 8
    a = ckpt["args"]
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size,
            a.moe_shared_expert_gate, a.moe_router_pre_softmax, a.add_qkv_bias, a.add_bias_linear) == \
        (4, 2, 24, 40, True, True, True, False)

    _convert("--loader", "torch_dist", "--saver", "hf", "--load-dir", dist, "--save-dir", back)
    written, ref = load_file(os.path.join(back, "model.safetensors")), model.state_dict()
    assert set(written) == set(ref), set(written) ^ set(ref)
    assert all(torch.equal(written[k], ref[k]) for k in ref)
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(3))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
    assert type(reloaded).__name__ == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        ref_logits = model(ids).logits
        assert torch.equal(reloaded(ids).logits, ref_logits)

    # The torch_dist checkpoint, in a megatron-core MoE GPTModel (pre-softmax router, gated shared expert, QKV bias).
    full, _, _ = load_dist(dist)
    config = hf_moe.moe_config_to_megatron(model.config, make_vocab_size_divisible_by=128,
                                           use_cpu_initialization=True)
    assert config.moe_router_pre_softmax and config.moe_shared_expert_gate and config.add_qkv_bias
    ours = GPTModel(config, get_gpt_decoder_block_spec(config), config.padded_vocab_size, 32,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=config.rotary_base).eval()
    ours.load_state_dict({k: v for k, v in full.items() if not k.endswith("_extra_state")})
    with torch.no_grad():
        err = rel_err(ours(ids, torch.arange(10).expand(2, 10), causal_mask(10))[..., :100], ref_logits)
    assert err <= 1e-5, err

    # A checkpoint trained here has no Hugging Face config in its args: the export builds one from the Megatron flags
    # (a gated shared expert, --add-qkv-bias, --moe-router-pre-softmax -> Qwen2-MoE with norm_topk_prob False).
    from tools.checkpoint.hf_io import save_hf

    full, margs, _ = load_dist(dist)
    margs.hf_config, margs.hf_model_type = None, None
    save_hf(full, margs, str(tmp_path / "from_args"), true_vocab_size=100)
    rebuilt = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "from_args")).eval()
    assert type(rebuilt).__name__ == "Qwen2MoeForCausalLM" and rebuilt.config.norm_topk_prob is False
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, ref_logits)

    # A directory with the Hub's per-expert names converts to the same checkpoint.
    os.makedirs(hub)
    model.config.save_pretrained(hub)
    save_file({k: v.contiguous() for k, v in _hub_names(ref, 2, 4).items()}, os.path.join(hub, "model.safetensors"))
    _convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", hub, "--save-dir", str(tmp_path / "dist2"))
    again, _, _ = load_dist(str(tmp_path / "dist2"))
    assert set(again) == set(full) and all(torch.equal(again[k], full[k]) for k in full)


def test_qwen2_moe_with_dense_layers_is_refused(tmp_path, single_rank):
    from tools.checkpoint.legacy_io import ConversionError

    cfg = transformers.Qwen2MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                      decoder_sparse_step=2, max_position_embeddings=32)
    transformers.Qwen2MoeForCausalLM(cfg).save_pretrained(str(tmp_path / "hf"), safe_serialization=True)
    with pytest.raises(ConversionError, match="decoder_sparse_step"):
        _convert("--loader", "hf", "--saver", "torch_dist", "--load-dir", str(tmp_path / "hf"),
                 "--save-dir", str(tmp_path / "out"))
