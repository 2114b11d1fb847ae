"""parse_args: flag defaults and destinations against Megatron-LM's (Megatron-LM's
``megatron/training/arguments.py``, typed in by hand), the
argument groups, argv / extra-args handling, and the arguments table."""
import argparse
import importlib
import re

import pytest
from helpers.args_test_helpers import BASE_ARGV, clean_env, validated  # noqa: F401  (fixture)

from megatron.training.arguments import build_parser, format_args_table, parse_args

# dest -> Megatron's default, from Megatron-LM's arguments.py (not read back from our parser). Where today's Megatron-LM
# changed a 2023 default (recompute_num_layers, apply_query_key_layer_scaling, overlap_p2p_comm, local_rank, lazy_mpu_init,
# eval_interval, split, inference_batch_times_seqlen_threshold; --apply-layernorm-1p's dest), today's is expected (the
# README's migration section lists them).
EXPECTED_DEFAULTS = {
    # network size
    "num_layers": None, "encoder_num_layers": None, "decoder_num_layers": None, "hidden_size": None,
    "ffn_hidden_size": None, "num_attention_heads": None, "kv_channels": None, "group_query_attention": False,
    "num_query_groups": 1, "max_position_embeddings": None, "position_embedding_type": "learned_absolute",
    "use_rotary_position_embeddings": False, "rotary_percent": 1.0, "rotary_seq_len_interpolation_factor": None,
    "add_position_embedding": True, "make_vocab_size_divisible_by": 128, "layernorm_epsilon": 1e-5,
    "layernorm_zero_centered_gamma": False, "apply_residual_connection_post_layernorm": False, "openai_gelu": False,
    "squared_relu": False, "swiglu": False, "onnx_safe": None, "bert_binary_head": True, "num_experts": None,
    "untie_embeddings_and_output_weights": False, "embedding_weights_in_fp32": False,
    # regularization
    "attention_dropout": 0.1, "hidden_dropout": 0.1, "weight_decay": 0.01, "start_weight_decay": None,
    "end_weight_decay": None, "weight_decay_incr_style": "constant", "clip_grad": 1.0, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_eps": 1e-08, "sgd_momentum": 0.9,
    # training
    "micro_batch_size": None, "batch_size": None, "global_batch_size": None, "rampup_batch_size": None,
    "recompute_activations": False, "recompute_granularity": None, "distribute_saved_activations": False,
    "recompute_method": None, "recompute_num_layers": None, "profile": False, "profile_step_start": 10,
    "profile_step_end": 12, "profile_ranks": [], "checkpoint_activations": False, "train_iters": None,
    "train_samples": None, "log_interval": 100, "exit_interval": None, "exit_duration_in_mins": None,
    "exit_signal_handler": False, "tensorboard_dir": None, "masked_softmax_fusion": True, "bias_gelu_fusion": True,
    "bias_dropout_fusion": True, "use_flash_attn": False, "add_bias_linear": True, "optimizer": "adam",
    "dataloader_type": None, "async_tensor_model_parallel_allreduce": True, "no_persist_layer_norm": False,
    "sequence_parallel": False, "gradient_accumulation_fusion": True, "use_legacy_models": False,
    "deprecated_use_mcore_models": False,
    # initialization
    "seed": 1234, "data_parallel_random_init": False, "init_method_std": 0.02, "init_method_xavier_uniform": False,
    # learning rate
    "lr": None, "lr_decay_style": "linear", "lr_decay_iters": None, "lr_decay_samples": None,
    "lr_warmup_fraction": None, "lr_warmup_iters": 0, "lr_warmup_samples": 0, "lr_warmup_init": 0.0, "warmup": None,
    "min_lr": 0.0, "override_opt_param_scheduler": False, "use_checkpoint_opt_param_scheduler": False,
    # checkpointing
    "save": None, "save_interval": None, "no_save_optim": None, "no_save_rng": None, "load": None,
    "no_load_optim": None, "no_load_rng": None, "finetune": False, "perform_initialization": True,
    "use_checkpoint_args": False, "exit_on_missing_checkpoint": False, "ckpt_format": "torch_dist",
    # mixed precision
    "fp16": False, "bf16": False, "loss_scale": None, "initial_loss_scale": 2 ** 32, "min_loss_scale": 1.0,
    "loss_scale_window": 1000, "hysteresis": 2, "fp32_residual_connection": False,
    "apply_query_key_layer_scaling": False, "attention_softmax_in_fp32": False,
    "accumulate_allreduce_grads_in_fp32": False, "fp16_lm_cross_entropy": False,
    # distributed
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "pipeline_model_parallel_split_rank": None,
    "model_parallel_size": None, "num_layers_per_virtual_pipeline_stage": None, "overlap_p2p_comm": True,
    "distributed_backend": "nccl", "distributed_timeout_minutes": 10, "DDP_impl": "local",
    "use_contiguous_buffers_in_local_ddp": True, "scatter_gather_tensors_in_pipeline": True,
    "use_ring_exchange_p2p": False, "local_rank": 0, "lazy_mpu_init": False, "use_cpu_initialization": None,
    "empty_unused_memory_level": 0, "standalone_embedding_stage": False, "use_distributed_optimizer": False,
    # validation
    "eval_iters": 100, "eval_interval": None, "skip_train": False,
    # data
    "data_path": None, "split": None, "train_data_path": None, "valid_data_path": None,
    "test_data_path": None, "data_cache_path": None, "mock_data": False, "vocab_size": None, "vocab_file": None,
    "merge_file": None, "vocab_extra_ids": 0, "seq_length": None, "encoder_seq_length": None,
    "decoder_seq_length": None, "retriever_seq_length": 256, "sample_rate": 1.0, "mask_prob": 0.15,
    "short_seq_prob": 0.1, "mmap_warmup": False, "num_workers": 2, "tokenizer_type": None, "tokenizer_model": None,
    "data_impl": "infer", "reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
    # autoresume
    "adlr_autoresume": False, "adlr_autoresume_interval": 1000,
    # biencoder
    "ict_head_size": None, "biencoder_projection_dim": 0, "biencoder_shared_query_context_model": False,
    "query_in_block_prob": 0.1, "retriever_report_topk_accuracies": [], "indexer_batch_size": 128,
    "indexer_log_interval": 1000,
    # vision
    "num_classes": 1000, "img_h": 224, "img_w": 224, "num_channels": 3, "patch_dim": 16, "iter_per_epoch": 1250,
    "dino_local_img_size": 96, "dino_local_crops_number": 10, "dino_head_hidden_size": 2048,
    "dino_bottleneck_size": 256, "dino_freeze_last_layer": 1, "dino_norm_last_layer": False,
    "dino_warmup_teacher_temp": 0.04, "dino_teacher_temp": 0.07, "dino_warmup_teacher_temp_epochs": 30,
    "vision_pretraining_type": "classify", "vision_backbone_type": "vit", "data_sharding": True,
    # logging
    "log_params_norm": False, "log_num_zeros_in_grad": False, "log_throughput": False, "timing_log_level": 0,
    "barrier_with_L1_time": True, "timing_log_option": "minmax", "tensorboard_log_interval": 1,
    "tensorboard_queue_size": 1000, "log_timers_to_tensorboard": False, "log_batch_size_to_tensorboard": False,
    "log_learning_rate_to_tensorboard": True, "log_loss_scale_to_tensorboard": True,
    "log_validation_ppl_to_tensorboard": False, "log_memory_to_tensorboard": False,
    "log_world_size_to_tensorboard": False,
    # inference
    "inference_batch_times_seqlen_threshold": -1, "max_tokens_to_oom": 12000, "output_bert_embeddings": False,
    "bert_embedder_type": "megatron",
    # transformer engine
    "fp8": None, "fp8_margin": 0, "fp8_interval": 1, "fp8_amax_history_len": 1, "fp8_amax_compute_algo": "most_recent",
    "fp8_wgrad": True, "transformer_impl": "transformer_engine", "normalization": "LayerNorm",
    # retro
    "retro_workdir": None, "retro_add_retriever": False, "retro_cyclic_train_iters": None, "retro_encoder_layers": 2,
    "retro_encoder_hidden_dropout": 0.1, "retro_encoder_attention_dropout": 0.1, "retro_num_neighbors": 2,
    "retro_num_retrieved_chunks": 2, "retro_return_doc_ids": False,
}

# flag -> (dest, value after passing the flag alone): renamed and negative flags.
RENAMED_FLAGS = {
    "--no-masked-softmax-fusion": ("masked_softmax_fusion", False),
    "--no-bias-gelu-fusion": ("bias_gelu_fusion", False),
    "--no-bias-dropout-fusion": ("bias_dropout_fusion", False),
    "--disable-bias-linear": ("add_bias_linear", False),
    "--no-async-tensor-model-parallel-allreduce": ("async_tensor_model_parallel_allreduce", False),
    "--no-gradient-accumulation-fusion": ("gradient_accumulation_fusion", False),
    "--no-position-embedding": ("add_position_embedding", False),
    "--bert-no-binary-head": ("bert_binary_head", False),
    "--no-initialization": ("perform_initialization", False),
    "--no-query-key-layer-scaling": ("apply_query_key_layer_scaling", False),
    "--overlap-p2p-communication": ("overlap_p2p_comm", True),
    "--no-contiguous-buffers-in-local-ddp": ("use_contiguous_buffers_in_local_ddp", False),
    "--no-scatter-gather-tensors-in-pipeline": ("scatter_gather_tensors_in_pipeline", False),
    "--no-barrier-with-level-1-timing": ("barrier_with_L1_time", False),
    "--no-log-learnig-rate-to-tensorboard": ("log_learning_rate_to_tensorboard", False),
    "--no-log-loss-scale-to-tensorboard": ("log_loss_scale_to_tensorboard", False),
    "--no-fp8-wgrad": ("fp8_wgrad", False),
    "--no-data-sharding": ("data_sharding", False),
    "--override-opt_param-scheduler": ("override_opt_param_scheduler", True),
    "--use-checkpoint-opt_param-scheduler": ("use_checkpoint_opt_param_scheduler", True),
}


def test_defaults_match_megatron(clean_env):
    args = parse_args(argv=[])
    assert len(EXPECTED_DEFAULTS) >= 40
    wrong = {dest: (getattr(args, dest, "<missing>"), want) for dest, want in EXPECTED_DEFAULTS.items()
             if getattr(args, dest, "<missing>") != want or type(getattr(args, dest, None)) is not type(want)}
    assert not wrong, f"(ours, Megatron's): {wrong}"
    assert args.rank == 0 and args.world_size == 1


@pytest.mark.parametrize("flag", sorted(RENAMED_FLAGS))
def test_renamed_flag_destinations(clean_env, flag):
    dest, value = RENAMED_FLAGS[flag]
    assert getattr(parse_args(argv=[flag]), dest) is value


def test_value_flags_and_types(clean_env):
    args = parse_args(argv=["--fp8-format", "hybrid", "--rampup-batch-size", "4", "4", "100", "--data-path", "0.3",
                            "a", "0.7", "b", "--profile-ranks", "0", "3", "--tokenizer-type", "HuggingFaceTokenizer",
                            "--ckpt-format", "torch_dist", "--DDP-impl", "torch", "--local_rank", "3",
                            "--onnx-safe", "1", "--lr", "3e-4"])
    assert args.fp8 == "hybrid"
    assert args.rampup_batch_size == ["4", "4", "100"]  # strings, converted where used (as Megatron)
    assert args.data_path == ["0.3", "a", "0.7", "b"]
    assert args.profile_ranks == [0, 3]
    assert args.tokenizer_type == "HuggingFaceTokenizer" and args.ckpt_format == "torch_dist"
    assert args.DDP_impl == "torch" and args.local_rank == 3 and args.onnx_safe is True and args.lr == 3e-4


def test_parser_shape(clean_env, capsys):
    parser = build_parser()
    assert parser.description == "Megatron-LM Arguments" and parser.allow_abbrev is False
    titles = [g.title for g in parser._action_groups[2:]]
    assert titles[:20] == ["network size", "regularization", "training", "initialization", "learning rate",
                           "checkpointing", "mixed precision", "distributed", "rerun engine", "validation",
                           "data and dataloader", "autoresume", "biencoder", "vision", "moe", "mla", "logging",
                           "inference", "Transformer-Engine", "retro"]
    assert "rl" in titles[20:] and "In-process restart" in titles[20:]  # HEAD's other groups, from the registry
    with pytest.raises(SystemExit) as exc:  # no abbreviations: --num-lay is unknown
        parse_args(argv=["--num-lay", "2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(argv=["--tokenizer-type", "NoSuchTokenizer"])
    assert "invalid choice" in capsys.readouterr().err
    # --attention-backend (today's Megatron): AttnBackend by name.
    from megatron.core.transformer.enums import AttnBackend

    assert parser._option_string_actions["--attention-backend"].type("flash") is AttnBackend.flash


def test_extra_args_provider_and_unknown_args(clean_env, monkeypatch):
    def provider(parser):
        group = parser.add_argument_group(title="my task")
        group.add_argument("--my-flag", type=int, default=7)
        return parser

    assert parse_args(provider, argv=["--my-flag", "3"]).my_flag == 3
    args = parse_args(ignore_unknown_args=True, argv=["--not-a-flag", "x", "--num-layers", "2"])
    assert args.num_layers == 2
    monkeypatch.setattr("sys.argv", ["prog", "--hidden-size", "48"])
    assert parse_args().hidden_size == 48  # argv defaults to sys.argv[1:]


def test_rank_and_world_size_from_environment(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    args = parse_args(argv=[])
    assert (args.rank, args.world_size) == (3, 8)
    clean_env.delenv("RANK")
    clean_env.delenv("WORLD_SIZE")
    clean_env.setenv("SLURM_PROCID", "5")
    clean_env.setenv("SLURM_NTASKS", "16")
    args = parse_args(argv=[])
    assert (args.rank, args.world_size) == (5, 16)


def test_format_args_table():
    ns = argparse.Namespace(zeta=1, Alpha="x", beta_long_name=None, rank=0)
    assert format_args_table("arguments", ns).split("\n") == [
        "------------------------ arguments ------------------------",
        "  Alpha ........................................... x",
        "  beta_long_name .................................. None",
        "  rank ............................................ 0",
        "  zeta ............................................ 1",
        "-------------------- end of arguments ---------------------",
    ]


def test_validate_prints_table_on_rank_0_only(clean_env, capsys):
    validated()
    out = capsys.readouterr().out.split("\n")
    start = out.index("------------------------ arguments ------------------------")
    end = out.index("-------------------- end of arguments ---------------------")
    rows = out[start + 1:end]
    assert "  num_layers ...................................... 4" in rows
    assert "  DDP_impl ........................................ local" in rows
    assert rows == sorted(rows, key=str.lower)
    # name + dots = 48 chars (Megatron's format; a longer name gets no dots)
    assert all(len(name) + len(dots) == max(48, len(name))
               for name, dots in (re.match(r"  (\S+) (\.*) ", r).groups() for r in rows))
    assert "using world size: 1, data-parallel-size: 1, tensor-model-parallel size: 1, " \
           "pipeline-model-parallel size: 1 " in out

    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    validated(world_size=2)
    assert capsys.readouterr().out == ""


def test_legacy_import_paths_are_the_same_objects():
    import megatron
    import megatron.arguments
    import megatron.global_vars
    import megatron.initialize
    import megatron.microbatches
    import megatron.timers
    import megatron.training
    import megatron.utils
    from megatron.training import arguments, global_vars, initialize, microbatches, timers, utils

    assert megatron.arguments.parse_args is arguments.parse_args
    assert megatron.arguments.validate_args is arguments.validate_args
    assert megatron.arguments.core_transformer_config_from_args is arguments.core_transformer_config_from_args
    assert megatron.initialize.initialize_megatron is initialize.initialize_megatron
    assert megatron.global_vars.get_args is global_vars.get_args
    assert megatron.timers.Timers is timers.Timers
    assert megatron.microbatches.RampupBatchsizeNumMicroBatches is microbatches.RampupBatchsizeNumMicroBatches
    assert megatron.utils.print_rank_0 is utils.print_rank_0
    for package in (megatron, megatron.training):
        for name, module in package._LAZY.items():
            assert getattr(package, name) is getattr(importlib.import_module(module), name)
