"""examples/qwen, examples/llama/train_llama3.sh, examples/gpt_oss and examples/llama4: each script (every model
variant) hands pretrain_gpt.py an argument list that parses with its parser (Megatron's flags plus the ModelOpt
ones) and validates, with the sizes taken from the environment (a stand-in torchrun records the list; the training
of these configurations is tests/training/test_train_model_zoo.py)."""
import shlex

import pytest
from helpers.args_test_helpers import clean_env  # noqa: F401  (fixture)
from helpers.examples_helpers import install_fake, run_script, script_env

from megatron.post_training.arguments import add_modelopt_args
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

TINY = dict(NUM_LAYERS=4, HIDDEN_SIZE=32, FFN_HIDDEN_SIZE=64, NUM_ATTENTION_HEADS=4, NUM_QUERY_GROUPS=2, KV_CHANNELS=8,
            NUM_EXPERTS=4, MOE_FFN_HIDDEN_SIZE=16, MOE_TOPK=2, SEQ_LENGTH=16, MAX_POSITION_EMBEDDINGS=64,
            PADDED_VOCAB_SIZE=128, VOCAB_SIZE=127, GLOBAL_BATCH_SIZE=2, TRAIN_ITERS=20, GPUS_PER_NODE=4, TP=2, EP=2,
            ROPE_SCALING_FACTOR=16)

CASES = [  # script, environment, (config field, value) the run must have
    ("qwen/train_qwen.sh", dict(QWEN_MODEL="qwen2.5"), dict(add_qkv_bias=True, layernorm_epsilon=1e-6)),
    ("qwen/train_qwen.sh", dict(QWEN_MODEL="qwen3"), dict(qk_layernorm=True, kv_channels=8)),
    ("qwen/train_qwen.sh", dict(QWEN_MODEL="qwen3_moe"), dict(num_moe_experts=4, moe_router_topk=2,
                                                              expert_model_parallel_size=2)),
    ("llama/train_llama3.sh", dict(LLAMA3_MODEL="3.2-1b"), dict(use_rope_scaling=True, rope_scaling_factor=16.0,
                                                                untie_embeddings_and_output_weights=False)),
    ("gpt_oss/train_gpt_oss.sh", dict(WINDOW_SIZE="3,0"), dict(softmax_type="learnable", window_size=(3, 0),
                                                               position_embedding_type="yarn",
                                                               original_max_position_embeddings=4096,
                                                               expert_tensor_parallel_size=1, glu_linear_offset=1.0)),
    ("llama4/train_llama4.sh", dict(LLAMA4_MODEL="scout"), dict(qk_l2_norm=True, moe_apply_probs_on_input=True,
                                                                moe_layer_freq=1, rotary_interleaved=True)),
    ("llama4/train_llama4.sh", dict(LLAMA4_MODEL="maverick", MOE_LAYER_FREQ="([0,1]*2)", NO_ROPE_FREQ=2), dict(moe_layer_freq=[0, 1, 0, 1], no_rope_freq=2,
                                                                   qk_l2_norm=False)),
]


@pytest.mark.parametrize("script,env,expect", CASES, ids=[f"{c[0]}:{list(c[1].values())[0]}" for c in CASES])
def test_model_zoo_script_arguments_validate(clean_env, tmp_path, script, env, expect):
    record = tmp_path / "argv.txt"
    install_fake(tmp_path, "torchrun", f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(record))}\n')
    rc, out = run_script(script, script_env(tmp_path, CHECKPOINT_PATH=tmp_path / "ckpt", **TINY, **env))
    assert rc == 0, out
    argv = record.read_text().splitlines()
    argv = argv[next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py")) + 1:]
    args = parse_args(add_modelopt_args, argv=argv)
    args.world_size = 4
    config = core_transformer_config_from_args(validate_args(args))
    assert (config.num_layers, config.hidden_size, config.tensor_model_parallel_size) == (4, 32, 2)
    for field, value in expect.items():
        assert getattr(config, field) == value, (field, getattr(config, field))


def test_unknown_model_variant_stops(tmp_path):
    rc, out = run_script("gpt_oss/train_gpt_oss.sh", script_env(tmp_path, GPT_OSS_MODEL="7b"))
    assert rc == 2 and "GPT_OSS_MODEL must be 20b or 120b, got 7b" in out
