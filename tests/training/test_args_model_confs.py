"""Megatron-LM HEAD's model configurations of the transformer families (Qwen2.5 / Qwen3 dense and MoE, Llama 3.1 /
3.2, gpt-oss 20b / 120b, Llama 4 Scout / Maverick): their ``MODEL_ARGS``, word for word as bash passes them (tests/helpers/model_confs.py), parse with
``pretrain_gpt.py``'s parser (Megatron's flags plus the ModelOpt ones) and validate unchanged; the values land in
the args and in the TransformerConfig the model is built from. Megatron's vocabulary rules for --padded-vocab-size
/ --make-vocab-size-divisible-by / --no-pad-vocab-size, each bad value one line naming the flag."""
from __future__ import annotations

import pytest
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.models_helpers import single_rank  # noqa: F401  (fixture)
from helpers.model_confs import GPT_OSS, LLAMA3, LLAMA4, QWEN, model_args, shrunk

from megatron.post_training.arguments import add_modelopt_args
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.errors import ConfigurationError

QWEN_COMMON = dict(normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, layernorm_epsilon=1e-5,
                   position_embedding_type="rope", rotary_base=1000000, apply_rope_fusion=False,
                   masked_softmax_fusion=False, bias_activation_fusion=False, bf16=True)
EXPECT = {
    "Qwen__Qwen2.5-0.5B-Instruct": dict(QWEN_COMMON, add_qkv_bias=True, padded_vocab_size=151936, num_layers=24,
                                        hidden_size=896, num_query_groups=2, kv_channels=64,
                                        untie_embeddings_and_output_weights=False, qk_layernorm=False),
    "Qwen__Qwen2.5-7B-Instruct": dict(QWEN_COMMON, add_qkv_bias=True, padded_vocab_size=152064, num_query_groups=4,
                                      kv_channels=128, untie_embeddings_and_output_weights=True),
    "Qwen__Qwen3-0.6B": dict(QWEN_COMMON, qk_layernorm=True, add_qkv_bias=False, padded_vocab_size=None,
                             untie_embeddings_and_output_weights=False, num_query_groups=8, kv_channels=128),
    "Qwen__Qwen3-8B": dict(QWEN_COMMON, qk_layernorm=True, untie_embeddings_and_output_weights=True, num_layers=36),
    "Qwen__Qwen3-30B-A3B": dict(QWEN_COMMON, qk_layernorm=True, num_moe_experts=128, moe_router_topk=8,
                                moe_ffn_hidden_size=768, moe_router_dtype="fp32", moe_aux_loss_coeff=1e-3,
                                moe_token_dispatcher_type="alltoall", moe_router_pre_softmax=False,
                                moe_router_score_function="softmax"),
    "Qwen__Qwen3-235B-A22B": dict(QWEN_COMMON, qk_layernorm=True, num_moe_experts=128, moe_ffn_hidden_size=1536,
                                  num_layers=94, recompute_granularity="selective", hidden_dropout=0.0,
                                  rotary_seq_len_interpolation_factor=1),
    "meta-llama__Llama-3.1-8B-Instruct": dict(normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False,
                                              position_embedding_type="rope", add_position_embedding=False,
                                              use_rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000,
                                              num_query_groups=8, kv_channels=128, make_vocab_size_divisible_by=1,
                                              untie_embeddings_and_output_weights=True),
    "meta-llama__Llama-3.2-1B-Instruct": dict(use_rope_scaling=True, rope_scaling_factor=8.0, num_layers=16,
                                              untie_embeddings_and_output_weights=False, kv_channels=64),
    # --enable-gpt-oss (ModelOpt) is gpt-oss's YaRN; no --disable-bias-linear: attention, router and expert biases
    "openai__gpt-oss-20b": dict(
        softmax_type="learnable", window_size=(127, 0), window_attn_skip_freq=2, gated_linear_unit=True,
        glu_linear_offset=1.0, activation_func_clamp_value=7.0, position_embedding_type="yarn",
        rotary_scaling_factor=32.0, original_max_position_embeddings=131072, beta_fast=32.0, beta_slow=1.0,
        yarn_correction_range_round_to_int=False, add_bias_linear=True, num_moe_experts=32, moe_router_topk=4,
        moe_router_dtype="fp32", padded_vocab_size=201088, rotary_base=150000, num_query_groups=8, kv_channels=64,
        normalization="RMSNorm"),
    "openai__gpt-oss-120b": dict(num_layers=36, num_moe_experts=128, softmax_type="learnable",
                                 position_embedding_type="yarn"),
    # --export-qk-l2-norm (ModelOpt) is --qk-l2-norm, which replaces --qk-layernorm
    "meta-llama__Llama-4-Scout-17B-16E-Instruct": dict(
        qk_l2_norm=True, qk_layernorm=False, moe_apply_probs_on_input=True, num_moe_experts=16, moe_router_topk=1,
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=1.0, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=8192, moe_router_load_balancing_type="seq_aux_loss",
        rotary_interleaved=True, use_rope_scaling=True, rotary_base=500000, no_rope_freq=None,
        padded_vocab_size=202048, kv_channels=128),
    "meta-llama__Llama-4-Maverick-17B-128E-Instruct": dict(
        qk_l2_norm=False, moe_apply_probs_on_input=True, num_moe_experts=128, moe_layer_freq=[0, 1] * 24,
        no_rope_freq=4, use_rope_scaling=False, recompute_granularity="selective",
        recompute_modules=["core_attn", "moe"], ffn_hidden_size=16384, moe_ffn_hidden_size=8192),
}


def _validated_conf(argv, world_size=1):
    args = parse_args(add_modelopt_args, argv=list(argv))
    args.world_size = world_size
    return validate_args(args)


@pytest.mark.parametrize("name", QWEN + LLAMA3 + GPT_OSS + LLAMA4)
def test_configuration_validates_unchanged(clean_env, name):
    args = _validated_conf(model_args(name))
    config = core_transformer_config_from_args(args)
    for field, value in EXPECT[name].items():
        got = getattr(args, field) if field in ("padded_vocab_size", "make_vocab_size_divisible_by",
                                                "untie_embeddings_and_output_weights", "use_rope_scaling",
                                                "add_position_embedding") else getattr(config, field)
        assert got == value, f"{name}: {field} = {got!r}, expected {value!r}"


@pytest.mark.parametrize("name", QWEN + LLAMA3 + GPT_OSS + LLAMA4)
def test_shrunk_configuration_validates_at_tp2(clean_env, name):
    """The shrunk form the training tests use validates at TP=2 (MoE at TP > 1 needs --sequence-parallel, which
    Maverick's configuration does not pass; gpt-oss's expert biases need --expert-tensor-parallel-size 1)."""
    argv = shrunk(name)
    sp = "--sequence-parallel" in argv or "--num-experts" in argv
    etp = ["--expert-tensor-parallel-size", "1"] if name in GPT_OSS else []
    args = _validated_conf(argv + ["--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
                                   "--vocab-size", "127", "--padded-vocab-size", "128"]
                           + ["--sequence-parallel"] * sp + etp, world_size=2)
    assert args.tensor_model_parallel_size == 2 and args.hidden_size == 32 and args.padded_vocab_size == 128
    config = core_transformer_config_from_args(args)  # the config accepts it too (Qwen3: q/k norms at TP=2)
    assert config.tensor_model_parallel_size == 2 and config.sequence_parallel == sp


def test_shrunk_keeps_what_sizes_do_not_touch():
    argv = shrunk("meta-llama__Llama-4-Maverick-17B-128E-Instruct")
    assert argv[argv.index("--moe-layer-freq") + 1] == "[0,1,0,1]"
    assert argv[argv.index("--moe-router-topk") + 1] == "1" and "--bf16" not in argv
    assert argv[argv.index("--num-layers") + 1] == "4" and "--no-rope-freq" in argv


@pytest.mark.parametrize("extra,world,padded", [
    # --padded-vocab-size is used as given: --make-vocab-size-divisible-by is not applied.
    ("--padded-vocab-size 151936 --make-vocab-size-divisible-by 1", 1, 151936),
    ("--padded-vocab-size 1000 --make-vocab-size-divisible-by 128 --tensor-model-parallel-size 2", 2, 1000),
    # Qwen3: 151669 tokens (NullTokenizer: --vocab-size + 1) padded to a multiple of 1187 x TP = 151936 at TP 1 and 2.
    ("--vocab-size 151668 --make-vocab-size-divisible-by 1187", 1, 151936),
    ("--vocab-size 151668 --make-vocab-size-divisible-by 1187 --tensor-model-parallel-size 2", 2, 151936),
    ("--vocab-size 99 --no-pad-vocab-size --tensor-model-parallel-size 2", 2, 100),
    ("--vocab-size 99 --make-vocab-size-divisible-by 1", 1, 100),
])
def test_vocab_padding_rules(clean_env, extra, world, padded):
    args = validated(extra + " --tokenizer-type NullTokenizer" * ("--vocab-size" in extra), world_size=world)
    assert args.padded_vocab_size == padded


@pytest.mark.parametrize("extra,world,message", [
    ("--padded-vocab-size 1001 --tensor-model-parallel-size 2", 2,
     "--padded-vocab-size (1001) must be divisible by --tensor-model-parallel-size (2)"),
    ("--padded-vocab-size 100 --tokenizer-type NullTokenizer --vocab-size 100", 1,
     "--padded-vocab-size (100) is smaller than the tokenizer's vocabulary (101)"),
    ("--padded-vocab-size 0", 1, "--padded-vocab-size must be > 0, got 0"),
    ("--vocab-size 100 --tokenizer-type NullTokenizer --no-pad-vocab-size --tensor-model-parallel-size 2", 2,
     "--no-pad-vocab-size: the vocabulary (101) must be divisible by --tensor-model-parallel-size (2)"),
    ("--make-vocab-size-divisible-by 0", 1, "--make-vocab-size-divisible-by must be > 0, got 0"),
])
def test_vocab_padding_errors_are_one_line(clean_env, extra, world, message):
    with pytest.raises(ConfigurationError) as error:
        validated(extra, world_size=world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_tokenizer_keeps_a_given_padded_vocab_size(clean_env):
    """build_tokenizer uses --padded-vocab-size as given and refuses one the tokenizer's vocabulary does not fit."""
    from megatron.tokenizer import build_tokenizer

    args = validated("--tokenizer-type NullTokenizer --vocab-size 50 --padded-vocab-size 64")
    assert build_tokenizer(args).vocab_size == 51 and args.padded_vocab_size == 64
    args.vocab_size = 70
    with pytest.raises(ValueError, match=r"--padded-vocab-size \(64\) is smaller than the tokenizer's vocabulary"):
        build_tokenizer(args)


def test_norm_epsilon_and_qkv_bias_reach_the_model(clean_env, single_rank):
    """--norm-epsilon (and its 2023 spelling --layernorm-epsilon) sets every norm's epsilon; --add-qkv-bias gives the
    QKV projection a bias while --disable-bias-linear removes the others."""
    from megatron.core.transformer.attention import SelfAttention

    for flag in ("--norm-epsilon", "--layernorm-epsilon"):
        args = validated(f"{flag} 1e-6 --add-qkv-bias --disable-bias-linear --normalization RMSNorm")
        assert args.layernorm_epsilon == 1e-6 and args.add_qkv_bias and not args.add_bias_linear
    config = core_transformer_config_from_args(args)
    assert config.layernorm_epsilon == 1e-6 and config.add_qkv_bias
    attention = SelfAttention(config, layer_number=1)
    assert attention.linear_qkv.bias is not None and attention.linear_proj.bias is None
