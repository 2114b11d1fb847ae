"""The ModelOpt flags of Megatron-LM's post-training parser (``add_modelopt_args``).

Megatron-LM's model configurations (``examples/post_training/modelopt/conf/<org>/<model>.sh``) carry a few flags that
only its ModelOpt parser defines; ``pretrain_gpt.py`` adds that parser there when ModelOpt is installed. Here the
flags need no ModelOpt: ``pretrain_gpt.py`` always adds them, and ``apply_modelopt_args`` (a step of validate_args)
turns each into the training flag it stands for:

=====================================  ==================================================================
``--export-force-local-attention``     the local (non-Transformer-Engine) attention: the only one this library
                                       builds, so nothing changes (said once in the log)
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
    group.add_argument("--export-model-type", type=str, default="GPTModel",
                       choices=["GPTModel", "MambaModel", "HybridModel"],
                       help="The model class: GPTModel, or the hybrid Mamba model (needs --hybrid-layer-pattern).")
    return parser


def apply_modelopt_args(args, log) -> None:
    """Turn the ModelOpt flags present in ``args`` into the training flags they stand for (module docstring)."""
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
