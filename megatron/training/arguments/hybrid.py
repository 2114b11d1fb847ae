"""``validate_args`` step for hybrid Mamba models (``--hybrid-layer-pattern``).

The pattern makes the model hybrid: ``--num-layers`` follows from it (a different value is ignored with a warning,
as in Megatron-LM), ``|`` segments decide the pipeline split and the virtual pipeline size. The Mamba-2 sizes must
fit the tensor-parallel size (heads and groups are split over TP). What this library does not build for hybrid
models stops with one line: multi-token prediction, context parallelism, full activation recompute, the legacy
model classes.
"""
from __future__ import annotations

import types

from megatron.core.ssm.mamba_hybrid_layer_allocation import HybridPatternError, layers_of_stage, \
    parse_hybrid_pattern, virtual_pipeline_size
from megatron.training.errors import ConfigurationError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _log(args, message: str) -> None:
    if args.rank == 0:
        print(message, flush=True)


def validate_hybrid(args) -> None:
    """Resolve the pattern flags, derive --num-layers and the virtual pipeline size, check the Mamba sizes."""
    _log_mamba_state_dtype(args)
    pattern_text = args.hybrid_layer_pattern
    if args.hybrid_override_pattern is not None:
        _require(pattern_text in (None, args.hybrid_override_pattern),
                 "--hybrid-layer-pattern and --hybrid-override-pattern (its deprecated alias) differ: pass one")
        _log(args, "WARNING: --hybrid-override-pattern is deprecated: use --hybrid-layer-pattern")
        pattern_text = args.hybrid_layer_pattern = args.hybrid_override_pattern
    if pattern_text is None:
        _require(not args.is_hybrid_model, "--is-hybrid-model needs --hybrid-layer-pattern (one character per layer: "
                                           "M Mamba, * attention, - MLP, E MoE)")
        _require(args.moe_latent_size is None or args.num_experts,
                 "--moe-latent-size needs --num-experts (it sets the experts' latent width)")
        return
    try:
        pattern = parse_hybrid_pattern(pattern_text)
        vpp = virtual_pipeline_size(pattern, args.pipeline_model_parallel_size)
        layers_of_stage(pattern, args.pipeline_model_parallel_size, 0)  # without '|': an even split
    except HybridPatternError as e:
        raise ConfigurationError(str(e)) from None
    args.is_hybrid_model = True
    if args.num_layers is not None and args.num_layers != pattern.num_layers:
        _log(args, f"WARNING: --num-layers {args.num_layers} is ignored: --hybrid-layer-pattern has "
                   f"{pattern.num_layers} layers")
    args.num_layers = pattern.num_layers
    _require(not args.use_legacy_models, "--hybrid-layer-pattern builds megatron-core's hybrid model: drop "
                                         "--use-legacy-models")
    _require(args.context_parallel_size == 1,
             f"--context-parallel-size {args.context_parallel_size} with a hybrid model: context parallelism of the "
             "Mamba layers is not implemented yet in this library; use --context-parallel-size 1")
    _require(args.recompute_granularity != "full",
             "--recompute-granularity full is not implemented for hybrid models: use --recompute-granularity "
             "selective (attention layers) or no recompute")
    _require(args.num_layers_per_virtual_pipeline_stage is None,
             "--num-layers-per-virtual-pipeline-stage with --hybrid-layer-pattern: the virtual pipeline size follows "
             "from the pattern's '|' segments (segments / --pipeline-model-parallel-size); drop the flag")
    # Megatron's rule for the interleaved schedule (checked there in validate_args)
    _require(vpp is None or args.pipeline_model_parallel_size > 2,
             f"--hybrid-layer-pattern has {len(pattern.segments)} pipeline segments ('|') for "
             f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: {vpp} virtual stages per rank need "
             "the interleaved schedule, which needs --pipeline-model-parallel-size > 2")
    args.virtual_pipeline_model_parallel_size = vpp
    if pattern.count("E"):
        _require(args.num_experts, f"--hybrid-layer-pattern has {pattern.count('E')} MoE layers (E): pass "
                                   "--num-experts")
    else:
        _require(not args.num_experts, "--num-experts is set but --hybrid-layer-pattern has no MoE layer (E)")
    _require(args.moe_latent_size is None or args.num_experts,
             "--moe-latent-size needs --num-experts (it sets the experts' latent width)")
    if pattern.count("M"):
        _validate_mamba_sizes(args)


def _validate_mamba_sizes(args) -> None:
    from megatron.core.ssm.mamba_mixer import mamba_dims

    world = getattr(args, "world_size", None)
    tp = min(args.tensor_model_parallel_size, world) if world else args.tensor_model_parallel_size
    sizes = types.SimpleNamespace(hidden_size=args.hidden_size, mamba_head_dim=args.mamba_head_dim,
                                  mamba_num_groups=args.mamba_num_groups, mamba_num_heads=args.mamba_num_heads,
                                  mamba_state_dim=args.mamba_state_dim, tensor_model_parallel_size=tp)
    try:
        dims = mamba_dims(sizes)
    except ValueError as e:
        raise ConfigurationError(str(e)) from None
    _log(args, f"hybrid model: Mamba-2 mixers with {dims.heads} heads of {dims.head_dim} (d_inner {dims.d_inner}), "
               f"{dims.groups} groups, state {dims.state}")


def _log_mamba_state_dtype(args) -> None:
    if args.mamba_training_ssm_states_dtype == "bf16":
        _log(args, "--mamba-training-ssm-states-dtype bf16: the Mamba scan's inter-chunk states are rounded to "
                   "bfloat16")
