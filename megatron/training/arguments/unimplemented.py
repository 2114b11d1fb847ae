"""Values of today's Megatron-LM flags whose features this library does not implement, when the refusal depends on
other flags: MoE in the legacy models, the hierarchical a2a+p2p variant of context parallelism (p2p, all_gather and a2a
are implemented), and the block-scaled FP8 recipes that need Transformer Engine (per-tensor FP8 GEMMs with
--fp8-format run, see megatron/core/fp8_utils.py). Options that are not available whatever their neighbours say are
refused by parse_args from the registry (registry.py).

The flags parse with Megatron's types and defaults, and their values are checked as Megatron checks them; then a
value that would need the missing feature stops with one ConfigurationError line naming the flag. A flag left at
its default (``--context-parallel-size 1``, no ``--num-experts``, no ``--fp8-param-gather``) changes nothing, so a
script that merely spells those defaults out runs.
"""
from __future__ import annotations

from megatron.training.errors import ConfigurationError

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _not_implemented(flag_and_value: str, feature: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"{flag_and_value}: {feature} is not implemented yet in this library; {fix}")


def validate_unimplemented_features(args) -> None:
    """Megatron's checks of the MoE, CP and FP8 flags, then the not-implemented stop (see module doc). Called first
    in validate_args, before the parallel sizes are derived."""
    _validate_moe(args)
    _validate_context_parallel(args)
    _validate_fp8(args)


def _validate_moe(args) -> None:
    if args.num_experts == 0:
        args.num_experts = None  # Megatron: 0 experts means a dense model
    for dest in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, dest)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, dest, value[0])  # Megatron collapses a one-element list
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    if isinstance(types, list):
        _require(isinstance(coeffs, list) and len(coeffs) == len(types),
                 f"--moe-router-load-balancing-type has {len(types)} values: pass as many --moe-aux-loss-coeff values")
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor < 0:
        args.moe_expert_capacity_factor = None
    _require(not args.moe_pad_expert_input_to_capacity or args.moe_expert_capacity_factor is not None,
             "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if isinstance(args.moe_layer_freq, list):
        num_layers = args.num_layers if args.num_layers is not None else args.encoder_num_layers
        _require(len(args.moe_layer_freq) == num_layers,
                 f"--moe-layer-freq lists {len(args.moe_layer_freq)} layers; the model has {num_layers}")
    ep = args.expert_model_parallel_size
    _require(ep >= 1, f"--expert-model-parallel-size must be >= 1, got {ep}")
    if args.expert_tensor_parallel_size is not None:
        _require(args.expert_tensor_parallel_size >= 1,
                 f"--expert-tensor-parallel-size must be >= 1, got {args.expert_tensor_parallel_size}")
    if args.num_experts is not None:
        _require(args.num_experts > 0, f"--num-experts must be >= 0, got {args.num_experts}")
        _require(args.num_experts % ep == 0, f"--num-experts ({args.num_experts}) must be divisible by "
                                             f"--expert-model-parallel-size ({ep})")
        _require(args.moe_router_topk <= args.num_experts, f"--moe-router-topk ({args.moe_router_topk}) must be <= "
                                                           f"--num-experts ({args.num_experts})")
        _validate_moe_implemented(args)
    else:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")


def _validate_moe_implemented(args) -> None:
    """Megatron's remaining MoE checks, and the MoE options this library does not implement."""
    if getattr(args, "use_legacy_models", False):
        raise _not_implemented("--num-experts with --use-legacy-models", "mixture of experts in the legacy model "
                               "classes", "drop --use-legacy-models (megatron-core models are the default)")
    world = args.world_size
    # TP and PP larger than the world are clipped to it later (Megatron's rule); EP is not.
    tp = min(args.tensor_model_parallel_size, world) if world else args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    pp = min(args.pipeline_model_parallel_size, world) if world else args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.world_size is not None:
        _require(args.world_size % (etp * ep * pp) == 0,
                 f"world size ({args.world_size}) must be divisible by --expert-tensor-parallel-size ({etp}) x "
                 f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp})")
    _require(tp == 1 or args.sequence_parallel, f"--num-experts with --tensor-model-parallel-size {tp} needs "
                                                "--sequence-parallel (every TP rank routes its own tokens)")
    if args.moe_grouped_gemm:
        _require(not args.fp16, "--moe-grouped-gemm with --fp16 is not supported (grouped GEMMs run in bf16 or "
                                "fp32): use --bf16, or drop --moe-grouped-gemm")
        _require(not args.add_bias_linear, "--moe-grouped-gemm has no expert biases: pass --disable-bias-linear")
    if etp > 1:
        _require(not args.add_bias_linear, f"--expert-tensor-parallel-size {etp}: expert biases need expert tensor "
                                           "parallel size 1; pass --disable-bias-linear")
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    from megatron.core.transformer.transformer_config import check_moe_routing
    try:
        check_moe_routing(types, args.moe_aux_loss_coeff, args.moe_router_topk, args.moe_router_score_function,
                          args.moe_router_pre_softmax)
    except ValueError as e:
        raise ConfigurationError(str(e)) from None
    if args.moe_expert_capacity_factor is not None:
        _require(all(t in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none") for t in types),
                 "--moe-expert-capacity-factor needs --moe-router-load-balancing-type aux_loss, seq_aux_loss or none")
    if args.moe_router_enable_expert_bias:
        _require(args.moe_router_score_function == "sigmoid",
                 "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if args.moe_router_num_groups is not None:
        _require(args.num_experts % args.moe_router_num_groups == 0 and args.moe_router_group_topk,
                 "--moe-router-num-groups must divide --num-experts and needs --moe-router-group-topk")
        _require(args.moe_router_group_topk <= args.moe_router_num_groups,
                 f"--moe-router-group-topk ({args.moe_router_group_topk}) must be <= --moe-router-num-groups "
                 f"({args.moe_router_num_groups})")
    else:
        _require(args.moe_router_group_topk is None, "--moe-router-group-topk needs --moe-router-num-groups")
    if args.moe_shared_expert_overlap:  # (Megatron's rules; the overlap itself is performance-only here)
        _require(args.moe_token_dispatcher_type in ("alltoall", "flex"),
                 "--moe-shared-expert-overlap needs --moe-token-dispatcher-type alltoall")


def _validate_context_parallel(args) -> None:
    cp = args.context_parallel_size
    _require(cp >= 1, f"--context-parallel-size must be >= 1, got {cp}")
    comm = args.cp_comm_type
    for value in comm:
        _require(value in CP_COMM_TYPES, f"--cp-comm-type {value} is not one of {', '.join(CP_COMM_TYPES)}")
    num_layers = args.num_layers if args.num_layers is not None else args.encoder_num_layers
    _require(len(comm) == 1 or len(comm) == num_layers,
             f"--cp-comm-type takes one value or one per layer ({num_layers}), got {len(comm)}")
    if cp > 1:
        seq = args.seq_length if args.seq_length is not None else args.encoder_seq_length
        world = getattr(args, "world_size", None)
        tp = min(args.tensor_model_parallel_size, world) if world else args.tensor_model_parallel_size
        sp = args.sequence_parallel and tp > 1
        if seq is not None:
            # Each sequence is cut into 2 x CP chunks (rank r keeps chunks r and 2CP-1-r); with sequence
            # parallelism the S/CP local tokens are split again over the TP ranks.
            _require(seq % (2 * cp) == 0 and (not sp or (seq // cp) % tp == 0),
                     f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size ({2 * cp})"
                     + (f" and --seq-length / --context-parallel-size ({seq / cp:g}) by --tensor-model-parallel-size "
                        f"({tp}) with --sequence-parallel" if sp else "")
                     + ": change --seq-length or --context-parallel-size")
        _require(not args.use_legacy_models,
                 f"--context-parallel-size {cp} needs the megatron-core models: drop --use-legacy-models")
        _require(not args.use_flash_attn,
                 f"--context-parallel-size {cp}: the flash-attn kernel (--use-flash-attn) has no context-parallel "
                 "path; drop --use-flash-attn")
        _require(not args.reset_attention_mask,
                 f"--context-parallel-size {cp} supports causal attention only: drop --reset-attention-mask")
        if "a2a" in comm and args.num_attention_heads:
            heads = args.num_attention_heads // tp
            groups = (args.num_query_groups if args.group_query_attention else args.num_attention_heads) // tp
            _require(heads % cp == 0 and groups % cp == 0,
                     f"--cp-comm-type a2a splits the attention heads over the {cp} context-parallel ranks: the heads "
                     f"({heads}) and query groups ({groups}) per tensor-parallel rank must be divisible by "
                     f"--context-parallel-size ({cp})")


def _validate_fp8(args) -> None:
    _require(args.fp8_amax_history_len >= 1, f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")
    _require(args.fp8_margin >= 0, f"--fp8-margin must be >= 0, got {args.fp8_margin}")
    _require(args.fp8_interval >= 1, f"--fp8-interval must be >= 1, got {args.fp8_interval}")
    if args.fp8 is None:
        return
    # FP8 GEMMs run without Transformer Engine (megatron/core/fp8_utils.py) with the two per-tensor recipes.
    if args.fp8_recipe not in ("delayed", "tensorwise"):
        raise _not_implemented(f"--fp8-recipe {args.fp8_recipe}", "block-scaled FP8 recipes (Transformer Engine)",
                               "use --fp8-recipe delayed or tensorwise")
