"""``core_transformer_config_from_args``: Megatron-LM's mapping from flags onto ``TransformerConfig``.

The same function as in Megatron-LM's ``megatron/training/arguments.py`` (https://github.com/NVIDIA/Megatron-LM)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


def _mlp_activation(args):
    """(activation_func, gated_linear_unit) chosen by --swiglu / --quick-geglu / --openai-gelu / --squared-relu /
    --onnx-safe."""
    if args.swiglu:
        return F.silu, True
    if getattr(args, "quick_geglu", False):
        from megatron.core.activations import quick_gelu

        return quick_gelu, True
    if args.openai_gelu or args.squared_relu or args.onnx_safe:
        # The activations live with the fused ops of megatron.core.transformer; imported only when asked for.
        from megatron.core import activations as fusions

        if args.openai_gelu:
            return fusions.openai_gelu, False
        if args.squared_relu:
            return fusions.squared_relu, False
        return fusions.erf_gelu, False
    return F.gelu, False


def _yarn_fields(args) -> dict:
    """The YaRN fields: multi-latent attention keeps the dataclass's original context and betas (Megatron-LM has no
    MLA flag for them); --position-embedding-type yarn takes them from the --yarn-* flags (None: the defaults)."""
    if getattr(args, "multi_latent_attention", False):
        return {}
    given = {"original_max_position_embeddings": getattr(args, "yarn_original_max_position_embeddings", None),
             "beta_fast": getattr(args, "yarn_beta_fast", None), "beta_slow": getattr(args, "yarn_beta_slow", None),
             "yarn_correction_range_round_to_int": getattr(args, "yarn_correction_range_round_to_int", None)}
    return {k: v for k, v in given.items() if v is not None}


def core_transformer_config_from_args(args, config_class=None):
    """Build the ``TransformerConfig`` that ``args`` (after ``validate_args``) describe (``MLATransformerConfig`` with
    ``--multi-latent-attention``).

    Every arg whose name is a config field is copied; then the fields whose flag has another name or meaning
    are set as Megatron sets them.
    """
    if config_class is None:
        config_class = MLATransformerConfig if getattr(args, "multi_latent_attention", False) else TransformerConfig
        if getattr(args, "heterogeneous_layers_config_encoded_json", None) or \
                getattr(args, "heterogeneous_layers_config_path", None):
            from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig

            config_class = HeterogeneousTransformerConfig
    kw_args = {}
    for field in dataclasses.fields(config_class):
        if hasattr(args, field.name):
            kw_args[field.name] = getattr(args, field.name)
    if kw_args.get("rope_type", "") is None:
        del kw_args["rope_type"]  # --rope-type not given: the dataclass default (yarn)
    for name in ("original_max_position_embeddings", "beta_fast", "beta_slow", "yarn_correction_range_round_to_int"):
        kw_args.pop(name, None)
    kw_args.update(_yarn_fields(args))
    kw_args["persist_layer_norm"] = not args.no_persist_layer_norm
    kw_args["deallocate_pipeline_outputs"] = True
    kw_args["pipeline_dtype"] = args.params_dtype
    kw_args["batch_p2p_comm"] = not args.overlap_p2p_comm
    # Performance-only on the command line: the plain schedule runs (bit-identical losses); megatron-core's combined
    # 1F1B schedule is for library users who set the config field.
    kw_args["overlap_moe_expert_parallel_comm"] = False

    activation_func, gated = _mlp_activation(args)
    kw_args["activation_func"] = activation_func
    kw_args["gated_linear_unit"] = gated
    if activation_func is not F.gelu:
        # The fused bias-GeLU kernel only computes GeLU.
        kw_args["bias_gelu_fusion"] = False
    # megatron-core's bias_activation_fusion: the SwiGLU flag for --swiglu, the GeLU flag otherwise.
    kw_args["bias_activation_fusion"] = args.bias_swiglu_fusion if args.swiglu else kw_args["bias_gelu_fusion"]

    if args.init_method_xavier_uniform:
        kw_args["init_method"] = torch.nn.init.xavier_uniform_
        kw_args["output_layer_init_method"] = torch.nn.init.xavier_uniform_
    kw_args["num_moe_experts"] = args.num_experts
    kw_args["num_query_groups"] = args.num_query_groups if args.group_query_attention else None
    # --recompute-num-layers defaults to 1 but means nothing with selective recompute, where the config
    # rejects a layer count.
    if args.recompute_granularity == "selective" or getattr(args, "moe_layer_recompute", False):
        kw_args["recompute_num_layers"] = None  # (--moe-layer-recompute turns selective recompute on)
    # One --cp-comm-type value applies to every layer (Megatron passes it as a string).
    if isinstance(getattr(args, "cp_comm_type", None), list) and len(args.cp_comm_type) == 1:
        kw_args["cp_comm_type"] = args.cp_comm_type[0]
    return config_class(**kw_args)


def args_from_transformer_config(config, **overrides):
    """The args of a ``pretrain_gpt.py`` run that builds ``config`` (the inverse of
    :func:`core_transformer_config_from_args`): every flag at its default, the flags that fill a config field of the
    same name set from it, then the flags whose field has another name; ``overrides`` last. The checkpoint
    converters write these args into the checkpoints they make (complete, as a training run's are)."""
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.training.arguments.parser import build_parser

    args = build_parser(add_modelopt_args).parse_args([])
    fields = {f.name for f in dataclasses.fields(config)}
    for dest, default in vars(args).items():
        value = getattr(config, dest, None) if dest in fields else None
        if dest in fields and (value is not None or default is None):
            setattr(args, dest, value)
    # Config fields no flag sets (e.g. a Hugging Face bridge's qk_l2_norm_rope_layers_only) travel in the args too
    # when they differ from their default: core_transformer_config_from_args copies them back.
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if (field.name not in vars(args) and field.default is not dataclasses.MISSING
                and isinstance(value, (bool, int, float, str, tuple, list)) and value != field.default):
            setattr(args, field.name, value)
    gated, act = config.gated_linear_unit, config.activation_func
    from megatron.core.activations import quick_gelu

    args.swiglu = gated and act is F.silu
    args.quick_geglu = gated and act is quick_gelu
    args.num_experts = config.num_moe_experts
    if not getattr(config, "multi_latent_attention", False):  # the --yarn-* flags (see _yarn_fields)
        args.yarn_original_max_position_embeddings = config.original_max_position_embeddings
        args.yarn_beta_fast, args.yarn_beta_slow = config.beta_fast, config.beta_slow
        args.yarn_correction_range_round_to_int = config.yarn_correction_range_round_to_int
    args.group_query_attention = config.num_query_groups != config.num_attention_heads
    args.add_position_embedding = config.add_position_embedding and config.position_embedding_type == "learned_absolute"
    args.seq_length = args.encoder_seq_length = config.max_position_embeddings
    args.encoder_num_layers = config.num_layers
    args.params_dtype = config.params_dtype
    args.rank, args.world_size = 0, 1
    for dest, value in overrides.items():
        setattr(args, dest, value)
    return args


def complete_args(args):
    """``args`` (e.g. a checkpoint's, from an older version) with every flag it lacks at its default, so that
    :func:`core_transformer_config_from_args` can read it."""
    from megatron.post_training.arguments import add_modelopt_args
    from megatron.training.arguments.parser import build_parser

    full = build_parser(add_modelopt_args).parse_args([])
    for dest, value in vars(args).items():
        setattr(full, dest, value)
    if hasattr(args, "apply_layernorm_1p") and not hasattr(args, "layernorm_zero_centered_gamma"):
        full.layernorm_zero_centered_gamma = args.apply_layernorm_1p  # the 2023 destination of --apply-layernorm-1p
    if getattr(full, "params_dtype", None) is None:
        full.params_dtype = torch.bfloat16 if full.bf16 else (torch.half if full.fp16 else torch.float)
    return full
