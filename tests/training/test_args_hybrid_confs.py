"""Megatron-LM HEAD's model configurations of the hybrid Mamba family (Nemotron-H 4B / 8B / 47B / 56B,
Nemotron-Nano-9B-v2, Nemotron-3 Nano / Super / Ultra) and Nemotron-Mini-4B: their ``MODEL_ARGS``, word for word as
bash passes them (tests/helpers/model_confs.py), parse with the entry point's parser (Megatron's flags plus the
ModelOpt ones) and validate unchanged, with the values in the args and the TransformerConfig; shrunk (one layer of
each type, tiny sizes, a null tokenizer and a small corpus) each trains for two iterations with its remaining flags as
given (sigmoid routing with expert bias, seq_aux_loss, latent experts, grouped GEMM, alltoall, fused-kernel flags,
RoPE on half the head for Nemotron-H 4B / 8B, LayerNorm 1p for Nemotron-Mini). Bad hybrid settings stop with one
line naming the flag."""
from __future__ import annotations

import pytest
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.dist_harness import run_distributed
from helpers.hybrid_helpers import tiny_corpus
from helpers.model_confs import NEMOTRON_H, NEMOTRON_MINI, model_args, shrunk, shrunk_hybrid
from helpers.train_helpers import run_pretrain

from megatron.post_training.arguments import add_modelopt_args
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.errors import ConfigurationError

H_COMMON = dict(is_hybrid_model=True, normalization="RMSNorm", add_bias_linear=False, squared_relu=True,
                gated_linear_unit=False, bf16=True, untie_embeddings_and_output_weights=True, mamba_num_groups=8)
NEMOTRON3 = dict(H_COMMON, num_moe_experts=128, moe_router_topk=6, moe_router_score_function="sigmoid",
                 moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32",
                 moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_grouped_gemm=True,
                 moe_shared_expert_intermediate_size=3712, moe_token_dispatcher_type="alltoall",
                 use_fused_weighted_squared_relu=True, cross_entropy_loss_fusion=True, moe_permute_fusion=True,
                 position_embedding_type="none", mamba_head_dim=64, mamba_num_heads=64, num_layers=52,
                 hidden_size=2688, num_query_groups=2, kv_channels=128, ffn_hidden_size=1856, moe_latent_size=None)
EXPECT = {
    "nvidia__Nemotron-H-4B-Instruct": dict(H_COMMON, num_layers=52, position_embedding_type="rope", rotary_percent=0.5,
                                           rotary_base=10000, mamba_num_heads=112, mamba_head_dim=64,
                                           mamba_state_dim=128, hidden_size=3072, kv_channels=128),
    "nvidia__Nemotron-H-8B-Base-8K": dict(H_COMMON, num_layers=52, position_embedding_type="rope", rotary_percent=0.5,
                                          rotary_base=500000, mamba_num_heads=128, ffn_hidden_size=21504),
    "nvidia__Nemotron-H-47B-Reasoning-128K": dict(H_COMMON, num_layers=98, position_embedding_type="none",
                                                  mamba_num_heads=256, mamba_state_dim=256, hidden_size=8192),
    # TP 8 is clipped to the world (1 here); the Mamba heads default to 2h / P = 256
    "nvidia__Nemotron-H-56B-Base-8K": dict(H_COMMON, num_layers=118, mamba_num_heads=None, mamba_head_dim=64,
                                           mamba_state_dim=256, init_method_std=0.0099, tensor_model_parallel_size=1),
    "nvidia__NVIDIA-Nemotron-Nano-9B-v2": dict(H_COMMON, num_layers=56, mamba_head_dim=80, mamba_num_heads=128,
                                               hidden_size=4480, position_embedding_type="none"),
    "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": NEMOTRON3,
    "nvidia__NVIDIA-Nemotron-3-Super-120B-A12B-BF16": dict(NEMOTRON3, num_moe_experts=512, moe_router_topk=22,
                                                           moe_router_topk_scaling_factor=5.0, moe_latent_size=1024,
                                                           num_layers=88, hidden_size=4096, mamba_num_heads=128,
                                                           moe_shared_expert_intermediate_size=5376,
                                                           ffn_hidden_size=2688, hidden_dropout=0.0),
    # --num-layers 108 next to a 108-layer --hybrid-override-pattern (the deprecated alias)
    "nvidia__NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16": dict(NEMOTRON3, num_moe_experts=512, moe_router_topk=22,
                                                           moe_router_topk_scaling_factor=5.0, moe_latent_size=2048,
                                                           num_layers=108, hidden_size=8192, mamba_num_heads=256,
                                                           moe_shared_expert_intermediate_size=10240,
                                                           num_attention_heads=64, ffn_hidden_size=5120),
    "nvidia__Nemotron-Mini-4B-Instruct": dict(is_hybrid_model=False, normalization="LayerNorm",
                                              layernorm_zero_centered_gamma=True, squared_relu=True,
                                              position_embedding_type="rope", rotary_percent=0.5, num_layers=32,
                                              num_query_groups=8, add_bias_linear=False, bf16=True),
}
ARGS_ONLY = ("hybrid_layer_pattern", "trust_remote_code", "use_fused_weighted_squared_relu", "padded_vocab_size", "export_model_type",
             "untie_embeddings_and_output_weights", "use_gloo_process_groups", "enable_experimental")


def _validated_conf(argv, world_size=1):
    args = parse_args(add_modelopt_args, argv=list(argv))
    args.world_size = world_size
    return validate_args(args)


@pytest.mark.parametrize("name", NEMOTRON_H + NEMOTRON_MINI)
def test_nemotron_configuration_validates_unchanged(clean_env, name):
    args = _validated_conf(model_args(name))
    config = core_transformer_config_from_args(args)
    assert args.trust_remote_code
    for field, value in EXPECT[name].items():
        got = getattr(args, field) if field in ARGS_ONLY else getattr(config, field)
        assert got == value, f"{name}: {field} = {got!r}, expected {value!r}"
    if name in NEMOTRON_H:
        pattern = model_args(name)[model_args(name).index(
            "--hybrid-layer-pattern" if "--hybrid-layer-pattern" in model_args(name) else "--hybrid-override-pattern")
            + 1]
        assert args.hybrid_layer_pattern == pattern and len(pattern) == config.num_layers
        assert args.export_model_type == "HybridModel"
    if name == "nvidia__NVIDIA-Nemotron-Nano-9B-v2":
        assert args.padded_vocab_size == 131072


def train_confs_body(names, data):
    out = {}
    for name in names:
        argv = (shrunk_hybrid(name) if name in NEMOTRON_H else shrunk(name)) + [
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--padded-vocab-size", "128",
            "--data-path", data, "--split", "100,0,0",
            "--train-iters", "2", "--log-interval", "1", "--ckpt-format", "torch_dist", "--lr-warmup-iters", "0",
            "--eval-iters", "0"]
        entry = "pretrain_mamba" if name in NEMOTRON_H else "pretrain_gpt"
        out[name] = [r["loss"] for r in run_pretrain(entry, argv, extra_args_provider=add_modelopt_args)]
    return out


@pytest.mark.timeout(300)
def test_shrunk_configurations_train(tmp_path):
    names = NEMOTRON_H + NEMOTRON_MINI
    runs = run_distributed(train_confs_body, 1, names, tiny_corpus(str(tmp_path)), timeout=280)[0]
    for name in names:
        losses = [loss["lm loss"] for loss in runs[name]]
        assert len(losses) == 2 and all(0 < v < 20 for v in losses), (name, runs[name])
        if "Nemotron-3" in name:  # seq_aux_loss is logged for the MoE configurations
            assert all("seq_load_balancing_loss" in loss for loss in runs[name]), runs[name]
    print({name: [round(loss["lm loss"], 4) for loss in runs[name]] for name in names})


@pytest.mark.parametrize("extra,message", [
    ("--is-hybrid-model", "--is-hybrid-model needs --hybrid-layer-pattern"),
    ("--hybrid-layer-pattern M*X", "--hybrid-layer-pattern 'M*X': unknown layer symbol 'X'"),
    ("--hybrid-layer-pattern M*G", "--hybrid-layer-pattern 'M*G': 'G' (Gated DeltaNet layers) is not implemented"),
    ("--hybrid-layer-pattern M*/M-", "--hybrid-layer-pattern 'M*/M-': multi-token-prediction layers"),
    ("--hybrid-layer-pattern M*E-", "--hybrid-layer-pattern has 1 MoE layers (E): pass --num-experts"),
    ("--hybrid-layer-pattern M*|M-|M- --pipeline-model-parallel-size 2",
     "--hybrid-layer-pattern has 3 pipeline segments ('|'), which is not a multiple of "
     "--pipeline-model-parallel-size (2)"),
    ("--hybrid-layer-pattern M*|M-|M-|M* --pipeline-model-parallel-size 2",
     "--hybrid-layer-pattern has 4 pipeline segments ('|') for --pipeline-model-parallel-size 2: 2 virtual stages per "
     "rank need the interleaved schedule, which needs --pipeline-model-parallel-size > 2"),
    ("--hybrid-layer-pattern M*M --pipeline-model-parallel-size 2",
     "--hybrid-layer-pattern has 3 layers, not divisible by --pipeline-model-parallel-size (2)"),
    ("--hybrid-layer-pattern M*M- --mamba-num-groups 3", "the Mamba heads (2) must be a multiple of "
                                                          "--mamba-num-groups (3)"),  # 2 x hidden 64 / head dim 64
    ("--hybrid-layer-pattern M*M- --mamba-head-dim 16 --mamba-num-groups 2 --tensor-model-parallel-size 4",
     "the Mamba heads (8) and --mamba-num-groups (2) must be divisible by --tensor-model-parallel-size (4)"),
    ("--hybrid-layer-pattern M*M- --context-parallel-size 2 --seq-length 32",
     "--context-parallel-size 2 with a hybrid model: context parallelism of the Mamba layers is not implemented"),
    ("--hybrid-layer-pattern M*M- --hybrid-override-pattern M*--", "--hybrid-layer-pattern and "
                                                                   "--hybrid-override-pattern (its deprecated alias) "
                                                                   "differ"),
    ("--export-model-type HybridModel", "--export-model-type HybridModel builds a hybrid model: pass "
                                        "--hybrid-layer-pattern"),
])
def test_hybrid_misconfiguration_is_one_line(clean_env, extra, message):
    if "--mamba-num-groups" not in extra:
        extra += " --mamba-head-dim 16 --mamba-num-groups 2"  # fits hidden 64 (8 heads)
    world = 4 if "--tensor-model-parallel-size 4" in extra else (2 if "-size 2" in extra else 1)
    with pytest.raises(ConfigurationError) as error:
        validated(extra, world_size=world) if "--export" not in extra else _validated_conf(
            ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "1"] + extra.split())
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


def test_hybrid_pattern_sets_layers_and_virtual_pipeline(clean_env):
    args = validated("--hybrid-layer-pattern M-|M*|M-|ME|M-|M*|M-|ME --num-experts 4 --pipeline-model-parallel-size 4 "
                     "--mamba-head-dim 16 --mamba-num-groups 2", world_size=4)
    assert (args.num_layers, args.is_hybrid_model, args.virtual_pipeline_model_parallel_size) == (16, True, 2)
