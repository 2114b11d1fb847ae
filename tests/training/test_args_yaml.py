"""--yaml-cfg: Megatron-LM's YAML form of a run's configuration gives the same validated args and TransformerConfig
as the equivalent command line; bad files stop with one line naming the key."""
import dataclasses

import pytest
from helpers.args_test_helpers import clean_env  # noqa: F401  (fixture)

from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.errors import ConfigurationError

YAML = """
language_model:
  num_layers: 4
  hidden_size: 64
  num_attention_heads: 4
  num_query_groups: 2
  ffn_hidden_size: 128
  activation_func: swiglu
  normalization: RMSNorm
  layernorm_epsilon: 1.0e-6
  hidden_dropout: 0.0
  num_moe_experts: 4
  moe_router_topk: 2
  recompute_granularity: selective
model_parallel:
  tensor_model_parallel_size: 2
  sequence_parallel: true
  params_dtype: bfloat16
  bf16: true
micro_batch_size: 2
seq_length: 32
max_position_embeddings: 32
group_query_attention: true
disable_bias_linear: null
add_bias_linear: false
data_path: ${H27_YAML_DATA} ${H27_YAML_DATA}
split: "98,2,0"
lr: 0.0003
"""

FLAGS = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 128 "
         "--swiglu --normalization RMSNorm --norm-epsilon 1e-6 --hidden-dropout 0.0 --num-experts 4 "
         "--moe-router-topk 2 --recompute-granularity selective --tensor-model-parallel-size 2 --sequence-parallel "
         "--bf16 --micro-batch-size 2 --seq-length 32 --max-position-embeddings 32 --group-query-attention "
         "--disable-bias-linear --split 98,2,0 --lr 0.0003")


def _config(args):
    config = core_transformer_config_from_args(args)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in ("init_method", "output_layer_init_method")}  # fresh closures each time


def _validated(argv):
    args = parse_args(argv=argv)
    args.world_size = 2
    return validate_args(args)


def test_yaml_cfg_equals_the_command_line(clean_env, tmp_path, capsys):
    prefix = str(tmp_path / "corpus_text_document")
    for suffix in (".bin", ".idx"):
        open(prefix + suffix, "wb").close()
    clean_env.setenv("H27_YAML_DATA", prefix)
    path = tmp_path / "run.yaml"
    path.write_text(YAML.replace("disable_bias_linear: null\n", ""))
    from_yaml = _validated(["--yaml-cfg", str(path), "--hidden-size", "999"])
    assert "--yaml-cfg" in capsys.readouterr().out  # the ignored --hidden-size is named in the log
    from_flags = _validated(FLAGS.split() + ["--data-path", prefix, prefix])
    assert from_yaml.hidden_size == 64 and from_yaml.data_path == [prefix, prefix]
    assert from_yaml.swiglu and from_yaml.num_experts == 4 and from_yaml.bf16 and not from_yaml.add_bias_linear
    assert _config(from_yaml) == _config(from_flags)
    differ = {k for k in vars(from_flags) if getattr(from_yaml, k, "<none>") != getattr(from_flags, k)}
    assert differ == {"yaml_cfg"}, differ


@pytest.mark.parametrize("text, message", [
    ("language_model:\n  num_layerz: 2\n", "language_model.num_layerz is not a TransformerConfig field"),
    ("model_parallel:\n  num_layers: 2\n", "model_parallel.num_layers is not a ModelParallelConfig field"),
    ("language_model:\n  activation_func: relu6\n", "language_model.activation_func 'relu6': use swiglu"),
    ("language_model:\n  gated_linear_unit: true\n", "language_model.gated_linear_unit is derived from other"),
    ("micro_batch: 2\n", "micro_batch is not a Megatron argument"),
    ("data_path: ${H27_UNSET_VARIABLE}/x\n", "data_path uses ${H27_UNSET_VARIABLE}, which is not set"),
    ("seq_length: ${H27_YAML_WORD}\n", "seq_length 'abc': invalid literal for int()"),
    ("- a\n- b\n", "expected a mapping of settings at the top level"),
])
def test_bad_yaml_cfg_stops_with_one_line(clean_env, tmp_path, text, message):
    clean_env.setenv("H27_YAML_WORD", "abc")
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigurationError) as error:
        parse_args(argv=["--yaml-cfg", str(path)])
    assert str(error.value).startswith(f"--yaml-cfg {path}: ") and message in str(error.value)
    assert "\n" not in str(error.value)
