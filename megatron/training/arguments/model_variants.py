"""validate_args' checks of the flags of today's model families (gpt-oss, Llama 4): gated-unit variants, attention
sinks, sliding windows, NoPE layers, the QK L2 norm, routing weights on the expert input. Each mistake is one ConfigurationError line naming the flags, before any process group."""
from __future__ import annotations

from megatron.training.errors import ConfigurationError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def validate_model_variants(args, log=print) -> None:
    _validate_gated_unit(args)
    _validate_attention_variants(args)
    _validate_llama4(args, log)
    _validate_heterogeneous_layers(args)


def _validate_heterogeneous_layers(args) -> None:
    """Nemotron-NAS per-layer configs: the JSON is read once here into --heterogeneous-layers-config-encoded-json
    (so the checkpoint's args carry it, as megatron-core keeps it in the config) and must list one block per
    layer of --num-layers."""
    import json

    path = getattr(args, "heterogeneous_layers_config_path", None)
    text = getattr(args, "heterogeneous_layers_config_encoded_json", None)
    if path is None and text is None:
        return
    if text is None:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise ConfigurationError(f"--heterogeneous-layers-config-path {path}: cannot read it ({e})") from e
        args.heterogeneous_layers_config_encoded_json = text
    where = f"--heterogeneous-layers-config-path {path}" if path else "--heterogeneous-layers-config-encoded-json"
    try:
        blocks = json.loads(text)["block_configs"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigurationError(f"{where}: not a JSON object with a \"block_configs\" list ({e!r})") from e
    _require(len(blocks) == args.num_layers, f"{where} lists {len(blocks)} blocks; --num-layers is {args.num_layers}: "
                                             "give one block per layer")
    _require(not args.multi_latent_attention and not args.num_experts and not getattr(args, "is_hybrid_model", False),
             f"{where}: heterogeneous layers are GPT layers (no --multi-latent-attention, --num-experts or hybrid "
             "layer pattern)")


def _validate_gated_unit(args) -> None:
    gated = args.swiglu or args.quick_geglu
    if args.glu_linear_offset:
        _require(gated, f"--glu-linear-offset {args.glu_linear_offset} applies to a gated MLP: add --quick-geglu or "
                        "--swiglu")
    clamp = args.activation_func_clamp_value
    if clamp is not None:
        _require(gated, f"--activation-func-clamp-value {clamp} applies to a gated MLP: add --quick-geglu or --swiglu")
        _require(clamp > 0, f"--activation-func-clamp-value must be > 0, got {clamp}")


def _validate_attention_variants(args) -> None:
    window, freq = args.window_size, args.window_attn_skip_freq
    if window is not None:
        _require(len(window) == 2 and all(v >= -1 for v in window),
                 f"--window-size must be 'left,right' with integers >= -1 (-1: unbounded), got {window}")
    if freq is not None:
        _require(window is not None, "--window-attn-skip-freq selects the layers of --window-size: pass --window-size")
        if isinstance(freq, list):
            _require(len(freq) == args.num_layers,
                     f"--window-attn-skip-freq lists {len(freq)} layers; the model has {args.num_layers}")
        else:
            _require(freq >= 1, f"--window-attn-skip-freq must be >= 1, got {freq}")
    variants = [f for f, on in ((f"--window-size {window}", window is not None),
                                (f"--softmax-type {args.softmax_type}", args.softmax_type != "vanilla")) if on]
    if not variants:
        return
    if args.context_parallel_size > 1:
        raise ConfigurationError(f"{' and '.join(variants)} with --context-parallel-size {args.context_parallel_size} "
                                 "is not implemented yet in this library (the context-parallel attention has no "
                                 "window or sink): use --context-parallel-size 1")
    _require(not args.use_flash_attn, f"{' and '.join(variants)}: the flash-attn kernel (--use-flash-attn) is not "
                                      "used for windows or sinks here; drop --use-flash-attn")


def _validate_llama4(args, log) -> None:
    freq = args.no_rope_freq
    if freq is not None:
        _require(args.position_embedding_type in ("rope", "yarn"),
                 f"--no-rope-freq picks layers without rotary embeddings: it needs --position-embedding-type rope, got "
                 f"{args.position_embedding_type}")
        if isinstance(freq, list):
            _require(len(freq) == args.num_layers, f"--no-rope-freq lists {len(freq)} layers; the model has "
                                                   f"{args.num_layers}")
        else:
            _require(freq >= 1 and args.num_layers % freq == 0,
                     f"--no-rope-freq {freq} must be >= 1 and divide --num-layers ({args.num_layers})")
    if args.qk_l2_norm and args.qk_layernorm:
        log("--qk-l2-norm replaces --qk-layernorm: the queries and keys are L2-normalised without a weight")
        args.qk_layernorm = False
    if args.moe_apply_probs_on_input:
        _require(args.num_experts is not None, "--moe-apply-probs-on-input needs a mixture of experts (--num-experts)")
        _require(args.moe_router_topk == 1, f"--moe-apply-probs-on-input needs --moe-router-topk 1 (one routing weight "
                                            f"per token), got {args.moe_router_topk}")
