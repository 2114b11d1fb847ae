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
                     "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 --recompute-granularity selective "
                     "--recompute-modules mla_up_proj layernorm")
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


DEEPSEEK_CONFS = {  # Megatron-LM HEAD's model configurations (tests/data/head_model_confs) -> config fields
    "deepseek-ai__DeepSeek-R1": dict(
        multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
        v_head_dim=128, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=40.0, mscale=1.0,
        mscale_all_dim=1.0, num_moe_experts=256, moe_layer_freq=[0] * 3 + [1] * 58, moe_router_topk=8,
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_overlap=True, moe_token_drop_policy="probs",
        recompute_granularity="selective", recompute_modules=["core_attn", "moe"], mtp_num_layers=None),
    "deepseek-ai__DeepSeek-V2-Lite": dict(
        multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=512, layernorm_epsilon=1e-6, num_moe_experts=64,
        moe_layer_freq=[0] + [1] * 26, moe_router_topk=6, moe_router_pre_softmax=True,
        moe_router_score_function="softmax", moe_router_topk_scaling_factor=1.0, mscale=0.707, mscale_all_dim=0.707,
        moe_shared_expert_intermediate_size=2816, moe_grouped_gemm=True),
    "moonshotai__Kimi-K2-Instruct": dict(
        multi_latent_attention=True, num_attention_heads=64, num_moe_experts=384, moe_layer_freq=[0] + [1] * 60,
        moe_router_topk_scaling_factor=2.827, rotary_base=50000, rotary_scaling_factor=32.0),
}


@pytest.mark.parametrize("name", sorted(DEEPSEEK_CONFS))
def test_deepseek_and_kimi_configurations_validate_unchanged(clean_env, name):
    """Megatron-LM's DeepSeek-R1 / DeepSeek-V2-Lite / Kimi-K2 MODEL_ARGS, word for word, parse and validate (they
    stopped at argparse before: --multi-latent-attention ...) and their values reach the MLATransformerConfig."""
    from helpers.model_confs import model_args

    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.arguments.transformer_config import core_transformer_config_from_args

    args = parse_args(add_modelopt_args, argv=list(model_args(name)))
    args.world_size = 1
    config = core_transformer_config_from_args(validate_args(args))
    assert isinstance(config, MLATransformerConfig)
    got = {field: getattr(config, field) for field in DEEPSEEK_CONFS[name]}
    assert got == DEEPSEEK_CONFS[name]


# Megatron-LM's DeepSeek-V3 recipe (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh), its model and parallel flags
# as the DDP branch passes them (the Megatron-FSDP branch appends the FSDP flags).
RECIPE = """--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128
--max-position-embeddings 4096 --seq-length 4096 --position-embedding-type rope --rotary-base 10000
--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu
--untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
--init-method-std 0.02 --multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
--qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --num-experts 256 --moe-layer-freq [0]*3+[1]*58
--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
--moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5 --moe-router-pre-softmax
--moe-router-dtype fp32 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 --moe-grouped-gemm
--moe-permute-fusion --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep
--moe-router-force-load-balancing --tensor-model-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --context-parallel-size 1 --sequence-parallel --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --recompute-granularity selective --recompute-modules mlp moe mla_up_proj
layernorm --transformer-impl transformer_engine --bf16 --no-check-for-nan-in-loss-and-grad --tokenizer-type
HuggingFaceTokenizer --tokenizer-model deepseek-ai/DeepSeek-V3 --auto-detect-ckpt-format --dist-ckpt-strictness
log_all --micro-batch-size 1 --global-batch-size 64""".split()


def test_deepseek_v3_recipe_parses_and_validates(clean_env, tmp_path):
    """The recipe's flags parse and validate unchanged at its 8-way expert parallelism (the tokenizer is a local
    directory here: this library never downloads one)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.arguments.transformer_config import core_transformer_config_from_args

    assert parse_args(argv=RECIPE).tokenizer_model == "deepseek-ai/DeepSeek-V3"
    recipe = [str(tmp_path) if a == "deepseek-ai/DeepSeek-V3" else a for a in RECIPE]
    args = parse_args(argv=recipe)
    args.world_size = 8
    config = core_transformer_config_from_args(validate_args(args))
    assert (config.multi_latent_attention, config.mtp_num_layers, config.moe_router_num_groups,
            config.moe_token_dispatcher_type, config.recompute_modules, config.moe_router_force_load_balancing) == (
        True, 1, 8, "alltoall", ["mlp", "moe", "mla_up_proj", "layernorm"], True)
