"""API details: megatron-core TransformerBlock/TransformerLayer, layer numbering across (virtual) pipeline stages,
checkpoint key compatibility, typed config fields (no global args in the legacy classes), KV cache, RoPE options, Float16Module,
and the example training script."""
import os
import sys
import types

import pytest
import torch

from helpers.numerics import rel_err
from helpers.models_helpers import causal_mask, gpt_inputs, single_rank, tiny_config  # noqa: F401  (fixture)

from megatron.core import InferenceParams, parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerBlock, TransformerConfig, TransformerLayer
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.mlp import swiglu_ffn_hidden_size
from megatron.core.transformer.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.transformer_block import ParallelTransformer
from megatron.model import Float16Module, GPTModel



def test_core_block_equals_legacy_transformer(single_rank):
    config = tiny_config()
    legacy = ParallelTransformer(config).eval()
    block = TransformerBlock(config, get_gpt_layer_local_spec()).eval()
    from megatron.core.models.conversion.keys import legacy_to_mcore

    mapped = legacy_to_mcore({"language_model.encoder." + k: v for k, v in legacy.state_dict().items()})
    block.load_state_dict({k[len("decoder."):]: v for k, v in mapped.items()})
    x = torch.randn(8, 2, 32)
    mask = causal_mask(8)
    assert rel_err(block(x, mask), legacy(x, mask)) <= 1e-6
    layer = TransformerLayer(config, get_gpt_layer_local_spec().submodules, layer_number=1)
    out, context = layer(x, mask)
    assert out.shape == x.shape and context is None
    assert "self_attention.linear_qkv.weight" in layer.state_dict()


@pytest.mark.parametrize("vpp", [None, 2])
def test_layer_numbers_across_pipeline_stages(single_rank, vpp):
    """8 layers, pp 2: stages own [1..4], [5..8]; with vpp 2: stage 0 [1,2] + [5,6], stage 1 [3,4] + [7,8]."""
    expected = {None: {(0, 0): [1, 2, 3, 4], (1, 0): [5, 6, 7, 8]},
                2: {(0, 0): [1, 2], (0, 1): [5, 6], (1, 0): [3, 4], (1, 1): [7, 8]}}[vpp]
    try:
        parallel_state.set_pipeline_model_parallel_world_size(2)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
        for (pp_rank, vp_rank), numbers in expected.items():
            parallel_state.set_pipeline_model_parallel_rank(pp_rank)
            parallel_state.set_virtual_pipeline_model_parallel_rank(vp_rank if vpp else None)
            config = tiny_config(num_layers=8, hidden_size=16, virtual_pipeline_model_parallel_size=vpp)
            block = ParallelTransformer(config, pre_process=False, post_process=False)
            assert [layer.layer_number for layer in block.layers] == numbers
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_rank(None)


def test_checkpoint_keys_and_old_names(single_rank):
    model = GPTModel(tiny_config(style="llama"))
    keys = set(model.state_dict())
    for name in ("language_model.embedding.word_embeddings.weight",
                 "language_model.encoder.layers.1.input_layernorm.weight",
                 "language_model.encoder.layers.1.self_attention.query_key_value.weight",
                 "language_model.encoder.layers.1.self_attention.dense.weight",
                 "language_model.encoder.layers.1.post_attention_layernorm.weight",
                 "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight",
                 "language_model.encoder.layers.1.mlp.dense_4h_to_h.weight",
                 "language_model.encoder.final_layernorm.weight", "language_model.output_layer.weight"):
        assert name in keys, name
    assert not any("position_embeddings" in k or k.endswith(".bias") for k in keys)  # RoPE, no biases
    nested = model.state_dict_for_save_checkpoint()
    assert set(nested["language_model"]) == {"embedding", "encoder", "output_layer"}
    # Later Megatron checkpoints call the norms input_norm / post_attention_norm / final_norm.
    renamed = {k.replace("input_layernorm", "input_norm").replace("final_layernorm", "final_norm"): v
               for k, v in model.state_dict().items()}
    other = GPTModel(tiny_config(style="llama"))
    other.load_state_dict(renamed)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())


def test_legacy_classes_read_typed_config_fields_not_global_args(single_rank, monkeypatch):
    """Legacy classes take Megatron's model settings from typed TransformerConfig fields; global args are ignored."""
    fake = types.ModuleType("megatron.training.global_vars")
    fake.get_args = lambda: types.SimpleNamespace(padded_vocab_size=200, max_position_embeddings=40, openai_gelu=False,
                                                  untie_embeddings_and_output_weights=False)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", fake)
    config = tiny_config(padded_vocab_size=96, max_position_embeddings=12, openai_gelu=True,
                         untie_embeddings_and_output_weights=True)
    model = GPTModel(config)
    assert model.language_model.embedding.word_embeddings.weight.shape[0] == 96
    assert model.language_model.embedding.position_embeddings.weight.shape[0] == 12
    assert model.language_model.output_layer.weight.shape[0] == 96
    assert model.language_model.encoder.layers[0].mlp.activation_func.__name__ == "openai_gelu"


def test_model_settings_are_typed_fields():
    """No setting is hung on the config from outside: unknown names are constructor errors, values are validated."""
    with pytest.raises(TypeError, match="padded_vocab_sizes"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, padded_vocab_sizes=64)
    with pytest.raises(ValueError, match="attention_backend"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, attention_backend="sdpa")
    with pytest.raises(ValueError, match="position_embedding_type"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, position_embedding_type="alibi")
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, attention_backend="flash",
                               padded_vocab_size=64, rotary_base=500000, use_rope_scaling=True)
    assert config.attention_backend is AttnBackend.flash and config.rotary_base == 500000
    with pytest.raises(ValueError, match="padded_vocab_size"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2).required_padded_vocab_size()
    import megatron.core.transformer as transformer_pkg
    assert not hasattr(transformer_pkg, "model_options")
    with pytest.raises(ImportError):
        __import__("megatron.core.transformer.model_options")


def test_kv_cache_generation_equals_full_forward(single_rank):
    model = GPTModel(tiny_config(style="llama")).eval()
    ids, pos, mask, _ = gpt_inputs(seq=8)
    with torch.no_grad():
        full = model(ids, pos, mask)
        params = InferenceParams(max_batch_size=2, max_sequence_length=8)
        steps = [model(ids[:, :5], pos[:, :5], causal_mask(5), inference_params=params)]
        params.sequence_len_offset += 5
        for t in range(5, 8):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], causal_mask(8)[..., t:t + 1, :t + 1],
                               inference_params=params))
            params.sequence_len_offset += 1
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-5


def test_rotary_options():
    t = torch.randn(6, 1, 2, 8)
    half = RotaryEmbedding(8, rotary_percent=0.5)(6)
    rotated = apply_rotary_pos_emb(t, half)
    assert half.shape == (6, 1, 1, 4) and torch.equal(rotated[..., 4:], t[..., 4:])
    assert not torch.allclose(rotated[1:, ..., :4], t[1:, ..., :4])
    interpolated = RotaryEmbedding(8, seq_len_interpolation_factor=2.0)(6)
    assert torch.allclose(interpolated[2], RotaryEmbedding(8)(6)[1])  # position 2 / 2 = position 1
    assert swiglu_ffn_hidden_size(4096) == 10880


def test_model_variants_run(single_rank):
    """Code paths without an external reference: they must run, give finite values and train."""
    variants = {
        "post-LN residual": dict(apply_residual_connection_post_layernorm=True),
        "fp32 residual": dict(fp32_residual_connection=True),
        "squared relu": dict(squared_relu=True),
        "bias-gelu fusion": dict(bias_gelu_fusion=True),
        "layernorm 1p": dict(layernorm_zero_centered_gamma=True),
        "partial rope + untied": dict(position_embedding_type="rope", rotary_percent=0.5,
                                      untie_embeddings_and_output_weights=True),
        "dropout + drop path free": dict(hidden_dropout=0.1, attention_dropout=0.1),
    }
    ids, pos, mask, labels = gpt_inputs()
    for name, overrides in variants.items():
        model = GPTModel(tiny_config(**overrides))
        loss = model(ids, pos, mask, labels=labels).mean()
        loss.backward()
        assert torch.isfinite(loss), name
        assert all(p.grad is not None for p in model.parameters()), name


def test_float16_module_bf16(single_rank):
    model = Float16Module(GPTModel(tiny_config()), types.SimpleNamespace(fp16=False, bf16=True))
    ids, pos, mask, _ = gpt_inputs()
    out = model(ids, pos, mask)
    assert out.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.config.hidden_size == 32 and "language_model.embedding.word_embeddings.weight" in model.state_dict()


def test_decoder_layer_with_cross_attention(single_rank):
    from megatron.core.transformer.enums import AttnMaskType, LayerType
    from megatron.core.transformer.transformer_layer import ParallelTransformerLayer

    layer = ParallelTransformerLayer(tiny_config(), 1, layer_type=LayerType.decoder,
                                     self_attn_mask_type=AttnMaskType.causal)
    names = set(layer.state_dict())
    for name in ("inter_attention.query.weight", "inter_attention.key_value.weight", "inter_attention.dense.weight",
                 "post_attention_layernorm.weight", "post_inter_attention_layernorm.weight"):
        assert name in names, name
    x, encoder_output = torch.randn(6, 2, 32), torch.randn(9, 2, 32, requires_grad=True)
    out = layer(x, causal_mask(6), encoder_output=encoder_output, enc_dec_attn_mask=None)
    out.sum().backward()
    assert out.shape == x.shape and encoder_output.grad.abs().sum() > 0


def test_one_naming_scheme_legacy_names_only_in_state_dict(single_rank):
    """Modules carry megatron-core names; the legacy classes show Megatron's names only in (and load them from)
    their state dict, from the one table in conversion/keys.py."""
    from megatron.core.models.conversion.keys import LEGACY_SUBMODULE_NAMES
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_layer import ParallelTransformerLayer

    model = GPTModel(tiny_config())
    layer = model.language_model.encoder.layers[0]
    assert hasattr(layer.self_attention, "linear_qkv") and hasattr(layer.mlp, "linear_fc1")
    assert hasattr(layer, "pre_mlp_layernorm") and not hasattr(layer, "post_attention_layernorm")
    params = dict(model.named_parameters())
    assert "language_model.encoder.layers.0.self_attention.linear_qkv.weight" in params
    sd = model.state_dict()
    assert "language_model.encoder.layers.0.self_attention.query_key_value.weight" in sd
    assert "language_model.encoder.layers.0.post_attention_layernorm.weight" in sd
    assert not any("linear_" in k or "pre_mlp" in k for k in sd)
    decoder = ParallelTransformerLayer(tiny_config(), 1, layer_type=LayerType.decoder)
    dsd = decoder.state_dict()
    for mcore, legacy in LEGACY_SUBMODULE_NAMES["decoder_layer"].items():
        assert any(k.startswith(legacy + ".") for k in dsd) and not any(k.startswith(mcore + ".") for k in dsd)
    assert "inter_attention.query.weight" in dsd and "inter_attention.key_value.weight" in dsd
    with torch.no_grad():
        changed = {k: v + 1 for k, v in dsd.items()}
    decoder.load_state_dict(changed)
    assert torch.equal(decoder.cross_attention.linear_kv.weight, changed["inter_attention.key_value.weight"])
