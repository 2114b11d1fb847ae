"""Multi-latent attention and YaRN against Hugging Face ``transformers`` (one rank).

* YaRN: our frequencies and attention concentration equal ``transformers``' ``yarn`` RoPE initialisation
  (``rope_parameters`` with factor, original context, beta fast/slow, mscale / mscale_all_dim).
* ``MLASelfAttention`` equals ``DeepseekV3Attention`` (query compression on and off, YaRN with a concentration of 1 and
  of ``g(s, 1) / g(s, 0.5)``) and ``DeepseekV2Attention`` (complex-number RoPE): the output and the gradient of the
  input within 1e-5 relative, after copying the Hugging Face weights under megatron-core's names (all plain copies).
* The softmax scale is ``g(s, mscale_all_dim)^2 / sqrt(d_n + d_r)``, e.g. 0.13523 for DeepSeek-V3's sizes.
* FP8 (``fp8="hybrid"``): every MLA projection runs the FP8 GEMM (scaling state recorded), output near fp32's.
"""
import math

import pytest
import torch

from helpers.models_helpers import causal_mask, single_rank  # noqa: F401  (fixture)
from helpers.numerics import rel_err

S, B, H = 16, 2, 32
TOL = 1e-5
# name -> (q_lora_rank, rope parameters, transformers model)
CASES = {
    "v3_q_lora": (16, dict(factor=4.0, mscale=1.0, mscale_all_dim=1.0), "v3"),
    "v3_no_q_lora": (None, dict(factor=4.0, mscale=1.0, mscale_all_dim=1.0), "v3"),
    "v3_concentration": (16, dict(factor=8.0, mscale=1.0, mscale_all_dim=0.5), "v3"),
    "v2_lite": (None, dict(factor=4.0, mscale=0.707, mscale_all_dim=0.707), "v2"),
}


def _hf_config(family, q_lora_rank, rope):
    from transformers import DeepseekV2Config, DeepseekV3Config

    cls = DeepseekV3Config if family == "v3" else DeepseekV2Config
    config = cls(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=8,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
                                  "beta_fast": 32, "beta_slow": 1, **rope})
    config._attn_implementation = "eager"
    return config


def _ours(q_lora_rank, rope, **extra):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, q_lora_rank=q_lora_rank,
                                  kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                                  rotary_scaling_factor=rope["factor"], original_max_position_embeddings=16,
                                  mscale=rope["mscale"], mscale_all_dim=rope["mscale_all_dim"], qk_layernorm=True,
                                  layernorm_epsilon=1e-6, add_bias_linear=False, hidden_dropout=0.0,
                                  attention_dropout=0.0, use_cpu_initialization=True, **extra)
    return MLASelfAttention(config, None, 1)


# Hugging Face DeepSeek attention -> megatron-core MLASelfAttention (all plain copies).
_NAMES = {"q_proj.weight": "linear_q_proj.weight", "q_a_proj.weight": "linear_q_down_proj.weight",
          "q_a_layernorm.weight": "q_layernorm.weight", "q_b_proj.weight": "linear_q_up_proj.weight",
          "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight", "kv_a_layernorm.weight": "kv_layernorm.weight",
          "kv_b_proj.weight": "linear_kv_up_proj.weight", "o_proj.weight": "linear_proj.weight"}


def test_yarn_frequencies_and_concentration_match_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron.core.transformer.rotary import YarnRotaryEmbedding

    for dim, factor, orig, mscale, mscale_all_dim, theta in ((64, 40.0, 4096, 1.0, 1.0, 10000.0),
                                                              (4, 4.0, 16, 1.0, 0.5, 10000.0),
                                                              (64, 32.0, 4096, 0.707, 0.707, 50000.0)):
        config = DeepseekV3Config(qk_rope_head_dim=dim, rope_parameters={
            "rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": orig,
            "mscale": mscale, "mscale_all_dim": mscale_all_dim, "beta_fast": 32, "beta_slow": 1})
        ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        ours = YarnRotaryEmbedding(dim, rotary_base=theta, scaling_factor=factor,
                                   original_max_position_embeddings=orig, mscale=mscale, mscale_all_dim=mscale_all_dim)
        assert rel_err(ours.inv_freq, ref_freq) < 1e-6, (dim, factor)
        assert math.isclose(ours.mscale, ref_factor, rel_tol=1e-12), (ours.mscale, ref_factor)
        angles, concentration = ours(5, offset=3)
        assert angles.shape == (5, 1, 1, dim) and concentration == ours.mscale
        assert torch.allclose(angles[1, 0, 0, : dim // 2], 4 * ours.inv_freq)


def test_mla_softmax_scale_is_deepseek_v3s():
    from megatron.core.transformer.multi_latent_attention import mla_softmax_scale
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, mscale=1.0, mscale_all_dim=1.0)
    assert math.isclose(mla_softmax_scale(config), (1 + 0.1 * math.log(40)) ** 2 / math.sqrt(192), rel_tol=1e-12)
    assert abs(mla_softmax_scale(config) - 0.13523) < 1e-5


@pytest.mark.parametrize("name", sorted(CASES))
def test_mla_equals_transformers_deepseek_attention(single_rank, name):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    q_lora_rank, rope, family = CASES[name]
    hf_config = _hf_config(family, q_lora_rank, rope)
    module = v3 if family == "v3" else v2
    torch.manual_seed(0)
    attn = (module.DeepseekV3Attention if family == "v3" else module.DeepseekV2Attention)(hf_config, 0).eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    rotary = (module.DeepseekV3RotaryEmbedding if family == "v3" else module.DeepseekV2RotaryEmbedding)(hf_config)
    ours = _ours(q_lora_rank, rope)
    ours.load_state_dict({_NAMES[k]: v for k, v in attn.state_dict().items()})

    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(B, S, H, generator=torch.Generator().manual_seed(2))
    x_hf = x.clone().requires_grad_(True)
    pos = torch.arange(S).unsqueeze(0).expand(B, S)
    mask = torch.full((S, S), float("-inf")).triu(1).expand(B, 1, S, S)
    if family == "v3":
        ref, _ = attn(x_hf, rotary(x_hf, pos), mask)
    else:
        ref, _ = attn(x_hf, mask, position_embeddings=rotary(x_hf, pos))
    (ref * weight).sum().backward()
    x_ours = x.transpose(0, 1).clone().requires_grad_(True)
    out, bias = ours(x_ours, causal_mask(S))
    assert bias is None
    (out.transpose(0, 1) * weight).sum().backward()
    assert math.isclose(ours.softmax_scale, attn.scaling, rel_tol=1e-12)
    errors = (rel_err(out.transpose(0, 1), ref), rel_err(x_ours.grad.transpose(0, 1), x_hf.grad))
    assert max(errors) < TOL, (name, errors)
    print(name, "output / input-grad relative error", errors)


def test_mla_runs_every_projection_in_fp8(single_rank):
    """--fp8-format hybrid: each of MLA's five projections (the duplicated down projections included) runs the FP8
    GEMM (its scaling state records the input, weight and output-gradient amaxes); the output stays near the fp32
    layer's with the same weights, and differs from it (the operands were rounded to FP8)."""
    from megatron.core import parallel_state

    q_lora_rank, rope, _ = CASES["v3_q_lora"]
    torch.manual_seed(0)
    ref = _ours(q_lora_rank, rope)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, use_fp8=True)
    try:
        fp8 = _ours(q_lora_rank, rope, fp8="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
        result = fp8.load_state_dict(ref.state_dict(), strict=False)
        assert not result.unexpected_keys and all("fp8_meta" in k for k in result.missing_keys), result
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
        outs = []
        for layer in (ref, fp8):
            for _ in range(2):  # the second step uses scales from the recorded amaxes
                out, _ = layer(x, causal_mask(S))
                out.sum().backward()
            outs.append(out.detach())
        names = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
        recorded = {n: getattr(fp8, n).fp8_meta.num_recorded.tolist() for n in names}
        assert all(r == [2, 2, 2] for r in recorded.values()), recorded
        err = rel_err(outs[1], outs[0])
        print("MLA fp8 (hybrid) vs fp32 output: max rel diff", err)
        assert 0 < err < 0.1, err
    finally:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)


def test_yarn_position_embedding_equals_transformers_llama_with_yarn(single_rank):
    """``--position-embedding-type yarn`` (no MLA, e.g. gpt-oss): rotate-half RoPE over the whole head with YaRN
    frequencies and cos/sin times the concentration, softmax scale 1/sqrt(head dim), as transformers' Llama does with
    ``rope_type='yarn'``."""
    import dataclasses

    import transformers

    from megatron.core.models.conversion import hf
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8,
            "beta_fast": 32.0, "beta_slow": 1.0}
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    plain = dict(cfg.to_dict(), rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config = hf.llama_config_to_megatron(transformers.LlamaConfig(**plain), make_vocab_size_divisible_by=64,
                                         use_cpu_initialization=True)
    config = dataclasses.replace(config, position_embedding_type="yarn", rotary_scaling_factor=8.0,
                                 original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=0.0)
    ours = GPTModel(config, get_gpt_layer_local_spec(), 64, 64, position_embedding_type="yarn").eval()
    ours.load_state_dict(hf.llama_hf_to_megatron(model.state_dict(), cfg, 64, key_format="mcore"))
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        err = rel_err(ours(ids, torch.arange(S).expand(B, S), causal_mask(S)), model(ids).logits)
    assert err < TOL, err
    assert ours.decoder.layers[0].self_attention.rope_mscale == pytest.approx(1 + 0.1 * math.log(8))
