"""Today's Megatron-LM example scripts (gpt3 175B, llama3 8B FP8, bert 340M, t5 220M, mixtral 8x7B): their argument
lists, word for word (tests/helpers/todays_example_argv.py names script and commit), parse with our parser; the
values land with Megatron's types; validation accepts them or stops with the one "not implemented yet" line for
MoE / context parallelism / FP8 (T5 validates). The 2023 example scripts of examples/ still parse too."""
from __future__ import annotations

import os
import shlex

import pytest
from helpers.args_test_helpers import clean_env, validated  # noqa: F401  (fixture)
from helpers.examples_helpers import REPO, install_fake, run_script, script_env
from helpers.mcore_oracle import run_oracle
from helpers.todays_example_argv import TODAYS_SCRIPTS, argv_of

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ConfigurationError


@pytest.fixture
def paths(tmp_path):
    """Temporary files and directories for the scripts' path placeholders (all exist)."""
    data = tmp_path / "corpus_text_document"
    for suffix in (".idx", ".bin"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    for name in ("vocab.txt", "merges.txt", "tokenizer.model"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "hf_tokenizer").mkdir()
    return dict(CKPT=str(tmp_path / "ckpt"), TB=str(tmp_path / "tb"), VOCAB=str(tmp_path / "vocab.txt"),
                MERGE=str(tmp_path / "merges.txt"), DATA=str(data), CACHE=str(tmp_path / "cache"),
                TOKENIZER_MODEL=str(tmp_path / "tokenizer.model"))


@pytest.mark.parametrize("name", sorted(TODAYS_SCRIPTS))
def test_todays_script_parses(clean_env, paths, name):
    entry = TODAYS_SCRIPTS[name]
    if name == "llama3_8b_fp8_data":
        paths["TOKENIZER_MODEL"] = os.path.join(os.path.dirname(paths["VOCAB"]), "hf_tokenizer")
    args = parse_args(argv=argv_of(entry, paths))
    assert args.attention_backend is not None or name == "mixtral_8x7b"
    if name.startswith("llama3"):
        assert (args.fp8, args.fp8_amax_history_len, args.fp8_amax_compute_algo, args.fp8_param_gather) == \
            ("hybrid", 1024, "max", True)
        assert args.fp8_recipe == "delayed" and args.fp8_margin == 0 and args.fp8_wgrad is True
        assert args.context_parallel_size == 1 and args.cp_comm_type == ["p2p"]
        assert args.mmap_bin_files is False and args.create_attention_mask_in_dataloader is False
        assert args.num_workers == 1 and args.data_cache_path == paths["CACHE"] and args.vocab_size == 128256
        assert args.split == "'99,1,0'"  # bash keeps the quotes; the split parser reads the numbers
        assert args.rotary_base == 1000000 and isinstance(args.rotary_base, int)
        assert args.decoupled_lr == 5.0e-4 and args.exit_duration_in_mins == 235
        if name.endswith("mock"):
            assert args.mock_data and args.tokenizer_type == "NullTokenizer" and args.tiktoken_pattern == "v2"
        else:
            assert args.tokenizer_type == "HuggingFaceTokenizer" and not args.mock_data
    if name == "mixtral_8x7b":
        assert (args.num_experts, args.moe_router_topk, args.moe_token_dispatcher_type) == (8, 2, "alltoall")
        assert args.moe_router_load_balancing_type == ["aux_loss"] and args.moe_aux_loss_coeff == [1e-2]
        assert args.moe_grouped_gemm and args.expert_model_parallel_size == 8
        assert args.expert_tensor_parallel_size is None and args.moe_layer_freq == 1
        assert args.tokenizer_type == "Llama2Tokenizer" and args.no_load_optim and args.no_load_rng
    if name == "t5_220m":
        assert (args.encoder_num_layers, args.decoder_num_layers, args.encoder_seq_length,
                args.decoder_seq_length, args.vocab_extra_ids) == (12, 12, 512, 128, 100)
    if name == "gpt3_175b":
        assert args.rampup_batch_size == ["16", "16", "5859375"] and args.fp16


@pytest.mark.parametrize("name,message", [
    ("llama3_8b_fp8_mock", "--fp8-param-gather: not available in this library: FP4 training and these FP8 variants"),
    ("llama3_8b_fp8_data", "--fp8-param-gather: not available in this library: FP4 training and these FP8 variants"),
    ("mixtral_8x7b", "world size (1) must be divisible by --expert-tensor-parallel-size (1) x "
                     "--expert-model-parallel-size (8) x --pipeline-model-parallel-size (1)"),
])
def test_todays_script_stops_with_one_line(clean_env, paths, name, message):
    if name == "llama3_8b_fp8_data":
        paths["TOKENIZER_MODEL"] = os.path.join(os.path.dirname(paths["VOCAB"]), "hf_tokenizer")
    args = parse_args(argv=argv_of(TODAYS_SCRIPTS[name], paths))
    with pytest.raises(ConfigurationError) as error:
        validate_args(args)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_todays_t5_script_validates(clean_env, paths):
    """T5 220M: 12 + 12 layers, 100 sentinels, cased BERT vocabulary; TE falls back to the local implementation."""
    args = validate_args(parse_args(argv=argv_of(TODAYS_SCRIPTS["t5_220m"], paths)), {"tokenizer_type":
                                                                                        "BertWordPieceLowerCase"})
    assert (args.num_layers, args.decoder_num_layers, args.seq_length, args.decoder_seq_length) == (12, 12, 512, 128)
    assert args.tokenizer_type == "BertWordPieceCase" and args.vocab_extra_ids == 100 and args.bf16


def test_todays_bert_script_validates(clean_env, paths):
    """One process: TP 8 x PP 16 are clipped to the world (Megatron's rule); everything else is accepted."""
    args = validate_args(parse_args(argv=argv_of(TODAYS_SCRIPTS["bert_340m"], paths)))
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size) == (1, 1, 1)
    assert args.num_layers == 24 and args.fp16 and args.global_batch_size == 32


def test_llama_without_fp8_validates(clean_env, paths):
    """The llama argument set minus its FP8 flags (what examples/llama/train_llama3_8b.sh passes) validates, and
    NullTokenizer's --vocab-size 128256 is padded from 128257 (0.16.1's N + 1 rule) to 128384."""
    argv = argv_of(TODAYS_SCRIPTS["llama3_8b_fp8_mock"], paths)
    for flag, nvalues in (("--fp8-format", 1), ("--fp8-amax-history-len", 1), ("--fp8-amax-compute-algo", 1),
                          ("--fp8-param-gather", 0)):
        at = argv.index(flag)
        del argv[at:at + 1 + nvalues]
    args = validate_args(parse_args(argv=argv))
    assert args.padded_vocab_size == 128384 and args.fp8 is None


@pytest.mark.parametrize("extra,message", [
    ("--expert-model-parallel-size 2", "--expert-model-parallel-size 2 needs --num-experts"),
    ("--num-experts 3 --expert-model-parallel-size 2", "--num-experts (3) must be divisible by --expert-model-"),
    ("--num-experts 2 --moe-router-topk 3", "--moe-router-topk (3) must be <= --num-experts (2)"),
    ("--num-experts 4 --moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1",
     "--moe-router-load-balancing-type has 2 values: pass as many --moe-aux-loss-coeff values"),
    ("--moe-layer-freq [1,0,1]", "--moe-layer-freq lists 3 layers; the model has 4"),
    ("--num-experts 4 --moe-grouped-gemm --fp16 --disable-bias-linear",
     "--moe-grouped-gemm with --fp16 is not supported (grouped GEMMs run in bf16 or fp32): use --bf16"),
    ("--num-experts 4 --moe-grouped-gemm", "--moe-grouped-gemm has no expert biases: pass --disable-bias-linear"),
    ("--num-experts 4 --use-legacy-models", "--num-experts with --use-legacy-models: mixture of experts in the "
                                            "legacy model classes is not implemented yet"),
    ("--num-experts 4 --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01",
     "--moe-router-load-balancing-type sinkhorn balances without an aux loss: use it alone, with --moe-aux-loss-coeff 0"),
    ("--num-experts 4 --moe-router-topk 1", "--moe-router-topk 1 with softmax scores takes the softmax over one logit, "
                                            "whose gradient is zero: pass --moe-router-pre-softmax"),
    ("--context-parallel-size 2", "world size (1) must be a multiple of --tensor-model-parallel-size (1) x "
                                  "--pipeline-model-parallel-size (1) x --context-parallel-size (2)"),
    ("--context-parallel-size 8 --cp-comm-type a2a", "--cp-comm-type a2a splits the attention heads over the 8 "
                                                     "context-parallel ranks: the heads (4) and query groups (4) per "
                                                     "tensor-parallel rank must be divisible by --context-parallel-size"),
    ("--context-parallel-size 3", "--seq-length (32) must be divisible by 2 x --context-parallel-size (6)"),
    ("--cp-comm-type allgather", "--cp-comm-type allgather is not one of p2p, all_gather, a2a, a2a+p2p"),
    ("--cp-comm-type p2p a2a", "--cp-comm-type takes one value or one per layer (4), got 2"),
    ("--cp-comm-type a2a+p2p", "--cp-comm-type a2a+p2p: not available in this library: hierarchical context "
                               "parallelism"),
    ("--context-parallel-size 4 --hierarchical-context-parallel-sizes 2 2",
     "--hierarchical-context-parallel-sizes: not available in this library"),
    ("--fp8-format e4m3 --fp8-param-gather", "--fp8-param-gather: not available in this library"),
    ("--fp8-format e4m3 --fp8-amax-history-len 0", "--fp8-amax-history-len must be >= 1, got 0"),
    ("--fp8-format e4m3 --fp8-recipe mxfp8", "--fp8-recipe mxfp8: block-scaled FP8 recipes (Transformer Engine) is "
                                             "not implemented yet"),
])
def test_unimplemented_feature_flags(clean_env, extra, message):
    """Each bad MoE / CP / FP8 value stops in validate_args (before any process group) with one line."""
    with pytest.raises(ConfigurationError, match=None) as error:
        validated(extra)
    assert message in str(error.value) and "\n" not in str(error.value)


T5 = "--decoder-seq-length 16 --tokenizer-type BertWordPieceLowerCase "


@pytest.mark.parametrize("extra,world,message", [
    (T5, 1, "T5 needs sentinel tokens <extra_id_N> in the vocabulary: pass --vocab-extra-ids 100"),
    (T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 2", 2,
     "--pipeline-model-parallel-split-rank (2) is outside the pipeline: the encoder takes stages [0, split) and the "
     "decoder [split, 2), so it must be in [1, 1]"),
    (T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 0", 2,
     "--pipeline-model-parallel-split-rank (0) is outside the pipeline"),
    (T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 2", 2,
     "an encoder-decoder model (T5) with --pipeline-model-parallel-size 2 needs --pipeline-model-parallel-split-rank"),
    (T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 4 --pipeline-model-parallel-split-rank 3", 4,
     "--num-layers (4) must be divisible by the 3 encoder pipeline stages"),
    (T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 4 --pipeline-model-parallel-split-rank 2 "
          "--num-layers-per-virtual-pipeline-stage 1", 4,
     "--pipeline-model-parallel-split-rank: interleaving is not supported with an encoder and decoder model"),
])
def test_t5_bad_input_one_line(clean_env, extra, world, message):
    with pytest.raises(ConfigurationError) as error:
        validated(extra, world_size=world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_t5_flags_validate(clean_env):
    args = validated(T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1",
                     world_size=2)
    assert args.pipeline_model_parallel_split_rank == 1 and args.decoder_seq_length == 16
    # Without a pipeline Megatron ignores the split rank (e.g. a PP=2 script on one process).
    args = validated(T5 + "--vocab-extra-ids 100 --pipeline-model-parallel-size 2 --pipeline-model-parallel-split-rank 1")
    assert args.pipeline_model_parallel_size == 1 and args.pipeline_model_parallel_split_rank is None


def test_moe_and_cp_defaults_change_nothing(clean_env):
    args = validated("--num-experts 0 --moe-layer-freq ([0]+[1]*3) --context-parallel-size 1 --cp-comm-type a2a "
                     "--expert-tensor-parallel-size 1 --moe-expert-capacity-factor -1")
    assert args.num_experts is None and args.moe_layer_freq == [0, 1, 1, 1]
    assert args.moe_expert_capacity_factor is None
    assert args.moe_router_load_balancing_type == "aux_loss" and args.moe_aux_loss_coeff == 0.0
    # --encoder-num-layers / --encoder-seq-length alone are Megatron's aliases, not T5
    args = validated("--encoder-num-layers 2", base=("--hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                                                     "--max-position-embeddings 32 --micro-batch-size 2").split())
    assert args.num_layers == 2


@pytest.mark.parametrize("argv", [["--moe-layer-freq", "[0,2]"], ["--moe-layer-freq", "__import__('os')"],
                                  ["--tiktoken-pattern", "v3"], ["--fp8-recipe", "fast"],
                                  ["--moe-token-dispatcher-type", "nccl"], ["--tokenizer-type", "Tiktoken"]])
def test_bad_values_are_argparse_errors(clean_env, argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv=argv)
    assert argv[0] in capsys.readouterr().err


# The 2023 example scripts of examples/: run each with a stand-in torchrun that records its arguments; the
# recorded list (everything after the training script) parses strictly.
SCRIPTS_2023 = ["pretrain_gpt.sh", "pretrain_gpt_distributed.sh", "pretrain_gpt_distributed_with_mp.sh",
                "pretrain_bert.sh", "pretrain_bert_distributed.sh"]


@pytest.mark.parametrize("script", SCRIPTS_2023)
def test_2023_example_scripts_still_parse(clean_env, tmp_path, script):
    record = tmp_path / "argv.txt"
    install_fake(tmp_path, "torchrun", f'#!/bin/bash\nprintf "%s\\n" "$@" > {shlex.quote(str(record))}\n')
    rc, out = run_script(script, script_env(tmp_path))
    assert rc == 0, out
    argv = record.read_text().splitlines()
    entry = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    assert argv[entry].startswith(REPO)
    args = parse_args(argv=argv[entry + 1:])
    assert args.num_layers == 24 and args.fp16


# Our flag's dest -> the megatron-core 0.16.1 config field it fills (same default), for the flags declared here.
CONFIG_FIELD_OF = {
    "num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_router_load_balancing_type": "moe_router_load_balancing_type", "moe_aux_loss_coeff": "moe_aux_loss_coeff",
    "moe_z_loss_coeff": "moe_z_loss_coeff", "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_router_score_function": "moe_router_score_function",
    "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
    "moe_router_num_groups": "moe_router_num_groups", "moe_router_group_topk": "moe_router_group_topk",
    "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate": "moe_router_bias_update_rate", "moe_router_dtype": "moe_router_dtype",
    "moe_router_fusion": "moe_router_fusion", "moe_grouped_gemm": "moe_grouped_gemm",
    "moe_use_legacy_grouped_gemm": "moe_use_legacy_grouped_gemm",
    "moe_token_dispatcher_type": "moe_token_dispatcher_type", "moe_layer_freq": "moe_layer_freq",
    "moe_input_jitter_eps": "moe_input_jitter_eps", "moe_expert_capacity_factor": "moe_expert_capacity_factor",
    "moe_token_drop_policy": "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate", "moe_shared_expert_overlap": "moe_shared_expert_overlap",
    "moe_permute_fusion": "moe_permute_fusion", "moe_per_layer_logging": "moe_per_layer_logging",
    "moe_layer_recompute": "moe_layer_recompute", "expert_model_parallel_size": "expert_model_parallel_size",
    "expert_tensor_parallel_size": "expert_tensor_parallel_size", "context_parallel_size": "context_parallel_size",
    "hierarchical_context_parallel_sizes": "hierarchical_context_parallel_sizes", "fp8": "fp8",
    "fp8_recipe": "fp8_recipe", "fp8_margin": "fp8_margin", "fp8_amax_history_len": "fp8_amax_history_len",
    "fp8_amax_compute_algo": "fp8_amax_compute_algo", "fp8_interval": "fp8_interval", "fp8_wgrad": "fp8_wgrad",
    "fp8_param_gather": "fp8_param",
}
DUMP = """
import dataclasses, json, sys
from megatron.core.transformer.transformer_config import TransformerConfig
fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
out = {}
for name in sys.argv[1:]:
    f = fields[name]
    out[name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
print(json.dumps(out))
"""


def test_defaults_match_megatron_core_0_16_1(clean_env, tmp_path):
    """The MoE / CP / FP8 flag defaults equal the defaults of the real megatron-core 0.16.1 config fields."""
    import json

    stdout = run_oracle(["-c", DUMP, *CONFIG_FIELD_OF.values()], cwd=tmp_path, timeout=240)
    oracle = json.loads(stdout.strip().splitlines()[-1])
    ours = vars(parse_args(argv=[]))
    assert {dest: ours[dest] for dest in CONFIG_FIELD_OF} == {dest: oracle[f] for dest, f in CONFIG_FIELD_OF.items()}


@pytest.mark.parametrize("extra", ["--fp8-format hybrid", "--fp8-format e4m3 --fp8-recipe tensorwise --fp8-margin 1"])
def test_per_tensor_fp8_validates(clean_env, extra):
    """Per-tensor FP8 (delayed or tensorwise scaling) runs without Transformer Engine (megatron/core/fp8_utils.py)."""
    args = validated(extra)
    assert args.fp8 in ("hybrid", "e4m3") and args.fp8_recipe in ("delayed", "tensorwise")
