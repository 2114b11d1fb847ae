"""Multi-latent attention, YaRN and multi-token prediction flags: Megatron-LM HEAD's spellings and defaults, what they
become in the typed config, and one-line errors for the combinations Megatron refuses or this library lacks."""
import pytest

from helpers.args_test_helpers import clean_env, parse, validated  # noqa: F401  (fixture)

MLA = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 8 --qk-head-dim 8 --qk-pos-emb-head-dim 4 "
       "--v-head-dim 6 --qk-layernorm --normalization RMSNorm --position-embedding-type rope")


def test_defaults_are_megatron_lm_heads(clean_env):
    args = parse()  # the defaults of Megatron-LM HEAD's parser
    expected = dict(multi_latent_attention=False, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128,
                    qk_pos_emb_head_dim=64, v_head_dim=128, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                    rope_type=None, cache_mla_latents=False, mla_down_proj_fusion=False, mtp_num_layers=None,
                    mtp_loss_scaling_factor=0.1, yarn_original_max_position_embeddings=None, yarn_beta_fast=None,
                    yarn_beta_slow=None, yarn_correction_range_round_to_int=None, mtp_use_repeated_layer=False,
                    mtp_detach_heads=False, mtp_hsm=False)
    assert {k: getattr(args, k) for k in expected} == expected


def test_mla_flags_reach_the_mla_config(clean_env):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.training.arguments.transformer_config import core_transformer_config_from_args

    args = validated(MLA + " --rotary-scaling-factor 40 --mscale 0.707 --mscale-all-dim 0.707 "
                     "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 --recompute-granularity selective --recompute-modules "
                     "mla_up_proj layernorm")
    config = core_transformer_config_from_args(args)
    assert isinstance(config, MLATransformerConfig)
    got = {k: getattr(config, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                           "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim",
                                           "rope_type", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                           "mtp_num_layers", "mtp_loss_scaling_factor", "recompute_modules")}
    assert got == dict(q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                       rotary_scaling_factor=40.0, mscale=0.707, mscale_all_dim=0.707, rope_type="yarn",
                       original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mtp_num_layers=1,
                       mtp_loss_scaling_factor=0.3, recompute_modules=["mla_up_proj", "layernorm"])
    assert core_transformer_config_from_args(validated(MLA + " --rope-type rope")).rope_type == "rope"


def test_non_mla_yarn_flags_reach_the_config(clean_env):
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.training.arguments.transformer_config import core_transformer_config_from_args

    config = core_transformer_config_from_args(validated(
        "--position-embedding-type yarn --rotary-scaling-factor 32 --yarn-original-max-position-embeddings 4096 "
        "--yarn-beta-fast 32 --yarn-beta-slow 1 --mscale 1.0 --mscale-all-dim 0.0 "
        "--no-yarn-correction-range-round-to-int"))
    assert not isinstance(config, MLATransformerConfig) and config.position_embedding_type == "yarn"
    assert (config.rotary_scaling_factor, config.original_max_position_embeddings, config.beta_fast, config.beta_slow,
            config.yarn_correction_range_round_to_int) == (32.0, 4096, 32.0, 1.0, False)
    config = core_transformer_config_from_args(validated("--position-embedding-type yarn --yarn-beta-fast 16"))
    assert (config.beta_fast, config.beta_slow, config.yarn_correction_range_round_to_int) == (16.0, 1.0, True)


@pytest.mark.parametrize("extra, message", [
    (MLA + " --group-query-attention --num-query-groups 2", "drop --group-query-attention"),
    ("--rope-type yarn", "--rope-type yarn needs --multi-latent-attention"),
    (MLA + " --cache-mla-latents", "--cache-mla-latents: not available in this library: multi-latent attention's"),
    (MLA + " --mla-down-proj-fusion", "--mla-down-proj-fusion"),
    (MLA + " --qk-pos-emb-head-dim 5", "must be even"),
    (MLA + " --use-legacy-models --ckpt-format torch", "needs the megatron-core models"),
    ("--recompute-granularity selective --recompute-modules mla_up_proj", "needs --multi-latent-attention"),
    ("--mtp-num-layers 1", "--mtp-num-layers needs --position-embedding-type rope or none"),
    ("--mtp-num-layers 1 --position-embedding-type rope --mtp-hsm", "--mtp-hsm: not available in this library"),
    ("--position-embedding-type yarn --rotary-interleaved", "does not support --rotary-interleaved"),
])
def test_refused_combinations_are_one_line_errors(clean_env, extra, message):
    from megatron.training.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message) as info:
        validated(extra)
    assert "\n" not in str(info.value)


def test_moe_layer_freq_forms(clean_env):
    """--moe-layer-freq: an int (every N-th layer), DeepSeek-V3's "[0]*3+[1]*58" and V2-Lite's "([0]+[1]*26)"."""
    from megatron.training.arguments.transformer_config import core_transformer_config_from_args

    assert parse("--moe-layer-freq 1").moe_layer_freq == 1
    assert parse("--moe-layer-freq 2").moe_layer_freq == 2
    assert parse("--moe-layer-freq [0]*3+[1]*58").moe_layer_freq == [0] * 3 + [1] * 58
    assert parse("--moe-layer-freq ([0]+[1]*26)").moe_layer_freq == [0] + [1] * 26
    config = core_transformer_config_from_args(validated("--num-experts 4 --moe-layer-freq [0]+[1]*3"))
    assert [config.is_moe_layer(i) for i in range(1, 5)] == [False, True, True, True]
    config = core_transformer_config_from_args(validated("--num-experts 4 --moe-layer-freq 2"))
    assert [config.is_moe_layer(i) for i in range(1, 5)] == [True, False, True, False]
    with pytest.raises(SystemExit):
        parse("--moe-layer-freq [0]*__import__('os').getpid()")


@pytest.mark.parametrize("extra, message", [
    ("--moe-router-num-groups 2 --moe-router-group-topk 3", "must be <= --moe-router-num-groups"),
    ("--moe-router-group-topk 2", "needs --moe-router-num-groups"),
    ("--moe-shared-expert-overlap --moe-shared-expert-intermediate-size 8", "needs --moe-token-dispatcher-type"),
    ("--moe-layer-freq [0]*3+[1]*2", "lists 5 layers; the model has 4"),
])
def test_deepseek_routing_flags_bad_input(clean_env, extra, message):
    from megatron.training.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message) as info:
        validated("--num-experts 4 " + extra)
    assert "\n" not in str(info.value)
