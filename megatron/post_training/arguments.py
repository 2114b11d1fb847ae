"""The ModelOpt flags of Megatron-LM's post-training parser (``add_modelopt_args``).

Megatron-LM's model configurations (``examples/post_training/modelopt/conf/<org>/<model>.sh``) carry a few flags that
only its ModelOpt parser defines; ``pretrain_gpt.py`` adds that parser there when ModelOpt is installed. Here the
flags need no ModelOpt: ``pretrain_gpt.py`` always adds them, and ``apply_modelopt_args`` (a step of validate_args)
turns each into the training flag it stands for:

=====================================  ==================================================================
``--export-force-local-attention``     the local (non-Transformer-Engine) attention: the only one this library
                                       builds, so nothing changes (said once in the log)
``--export-qk-l2-norm``                ``--qk-l2-norm`` (which replaces ``--qk-layernorm``)
``--export-moe-apply-probs-on-input``  ``--moe-apply-probs-on-input``
``--enable-gpt-oss``                   gpt-oss's rotary embedding: ``--position-embedding-type yarn
                                       --rotary-scaling-factor 32 --mscale 1 --mscale-all-dim 0`` and, where
                                       not given, ``--yarn-original-max-position-embeddings 131072
                                       --yarn-beta-fast 32 --yarn-beta-slow 1
                                       --no-yarn-correction-range-round-to-int`` (Megatron's values; Hugging
                                       Face's gpt-oss has an original context of 4096: pass
                                       ``--yarn-original-max-position-embeddings 4096`` to match it)
``--export-model-type``                the model class: ``GPTModel`` (the default), or ``HybridModel`` /
                                       ``MambaModel``, which needs ``--hybrid-layer-pattern`` (the hybrid Mamba
                                       model that pattern builds)
=====================================  ==================================================================
"""
from __future__ import annotations


def add_modelopt_args(parser):
    """Add the ModelOpt flags of the model configurations to ``parser`` (an ``extra_args_provider``)."""
    group = parser.add_argument_group(title="modelopt")
    group.add_argument("--export-force-local-attention", action="store_true",
                       help="Build the local (non-Transformer-Engine) attention (this library's only attention).")
    group.add_argument("--export-qk-l2-norm", action="store_true", help="ModelOpt's spelling of --qk-l2-norm.")
    group.add_argument("--export-moe-apply-probs-on-input", action="store_true",
                       help="ModelOpt's spelling of --moe-apply-probs-on-input.")
    group.add_argument("--enable-gpt-oss", action="store_true",
                       help="gpt-oss's YaRN rotary embedding (factor 32; the --yarn-* flags not given take "
                            "Megatron's gpt-oss values).")
    group.add_argument("--export-model-type", type=str, default="GPTModel",
                       choices=["GPTModel", "MambaModel", "HybridModel"],
                       help="The model class: GPTModel, or the hybrid Mamba model (needs --hybrid-layer-pattern).")
    return parser


def apply_modelopt_args(args, log) -> None:
    """Turn the ModelOpt flags present in ``args`` into the training flags they stand for (module docstring)."""
    for modelopt, dest in (("export_qk_l2_norm", "qk_l2_norm"),
                           ("export_moe_apply_probs_on_input", "moe_apply_probs_on_input")):
        if getattr(args, modelopt, False):
            setattr(args, dest, True)
    if getattr(args, "enable_gpt_oss", False):
        args.position_embedding_type, args.rotary_scaling_factor = "yarn", 32.0
        args.mscale, args.mscale_all_dim = 1.0, 0.0
        for dest, value in (("yarn_original_max_position_embeddings", 131072), ("yarn_beta_fast", 32.0),
                            ("yarn_beta_slow", 1.0), ("yarn_correction_range_round_to_int", False)):
            if getattr(args, dest, None) is None:
                setattr(args, dest, value)
        log(f"--enable-gpt-oss: --position-embedding-type yarn, factor 32, original context "
            f"{args.yarn_original_max_position_embeddings}, beta {args.yarn_beta_fast}/{args.yarn_beta_slow}, "
            f"correction range rounded: {args.yarn_correction_range_round_to_int}")
    if getattr(args, "export_force_local_attention", False):
        log("--export-force-local-attention: attention is this library's local implementation (the only one it "
            "builds)")
    if getattr(args, "export_model_type", "GPTModel") in ("MambaModel", "HybridModel"):
        if not (args.hybrid_layer_pattern or args.hybrid_override_pattern):
            from megatron.training.errors import ConfigurationError

            raise ConfigurationError(f"--export-model-type {args.export_model_type} builds a hybrid model: pass "
                                     "--hybrid-layer-pattern (one character per layer: M Mamba, * attention, - MLP, "
                                     "E MoE)")
        log(f"--export-model-type {args.export_model_type}: the hybrid Mamba model of --hybrid-layer-pattern")
