"""Flags of today's Megatron-LM whose features this library does not implement yet: MoE, context parallelism > 1,
and the FP8 variants that need Transformer Engine (block-scaled recipes, FP8
parameters; per-tensor FP8 GEMMs with --fp8-format run, see megatron/core/fp8_utils.py).

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
        raise _not_implemented(f"--num-experts {args.num_experts}", "mixture of experts (MoE)",
                               "drop --num-experts and the --moe-* flags to train the dense model")
    if ep > 1:
        raise _not_implemented(f"--expert-model-parallel-size {ep}", "mixture of experts (MoE)",
                               "drop --expert-model-parallel-size")


def _validate_context_parallel(args) -> None:
    cp = args.context_parallel_size
    _require(cp >= 1, f"--context-parallel-size must be >= 1, got {cp}")
    comm = args.cp_comm_type
    for value in comm:
        _require(value in CP_COMM_TYPES, f"--cp-comm-type {value} is not one of {', '.join(CP_COMM_TYPES)}")
    num_layers = args.num_layers if args.num_layers is not None else args.encoder_num_layers
    _require(len(comm) == 1 or len(comm) == num_layers,
             f"--cp-comm-type takes one value or one per layer ({num_layers}), got {len(comm)}")
    if args.hierarchical_context_parallel_sizes is not None:
        product = 1
        for size in args.hierarchical_context_parallel_sizes:
            product *= size
        _require(product == cp, f"--hierarchical-context-parallel-sizes {args.hierarchical_context_parallel_sizes}: "
                                f"their product must equal --context-parallel-size ({cp})")
    if "a2a+p2p" in comm:
        _require(args.hierarchical_context_parallel_sizes is not None,
                 "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes")
    if cp > 1:
        seq = args.seq_length if args.seq_length is not None else args.encoder_seq_length
        if seq is not None:
            _require(seq % (2 * cp) == 0, f"--seq-length ({seq}) must be divisible by 2 x --context-parallel-size "
                                          f"({2 * cp})")
        raise _not_implemented(f"--context-parallel-size {cp}", "context parallelism",
                               "use --context-parallel-size 1")


def _validate_fp8(args) -> None:
    _require(args.fp8_amax_history_len >= 1, f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")
    _require(args.fp8_margin >= 0, f"--fp8-margin must be >= 0, got {args.fp8_margin}")
    _require(args.fp8_interval >= 1, f"--fp8-interval must be >= 1, got {args.fp8_interval}")
    if args.fp8_param_gather:
        _require(args.fp8 is not None, "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)")
        _require(args.use_distributed_optimizer,
                 "--fp8-param-gather needs --use-distributed-optimizer (FP8 parameters are gathered by it)")
    if args.fp8 is None:
        return
    # FP8 GEMMs run without Transformer Engine (megatron/core/fp8_utils.py) with the two per-tensor recipes.
    if args.fp8_recipe not in ("delayed", "tensorwise"):
        raise _not_implemented(f"--fp8-recipe {args.fp8_recipe}", "block-scaled FP8 recipes (Transformer Engine)",
                               "use --fp8-recipe delayed or tensorwise")
    if args.fp8_param_gather:
        raise _not_implemented("--fp8-param-gather", "FP8 parameters (Transformer Engine's fp8_model_init)",
                               "drop --fp8-param-gather: the GEMMs still run in FP8")
