"""Megatron's legacy free functions (``parallel_lm_logits``, ``get_linear_layer``, ``Pooler``) read a few
parallelism flags from the global ``args``; this is that one bridge. Model settings are never copied from the
global args: the legacy model classes read typed ``TransformerConfig`` fields (set from the flags by
``core_transformer_config_from_args``).
"""
from __future__ import annotations

from types import SimpleNamespace


def global_args_or_none():
    """The parsed global args, or None when the training framework has not set them."""
    try:
        from megatron.training.global_vars import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except Exception:  # noqa: BLE001 - "args not initialized" is an assertion in Megatron
        return None


def args_as_parallel_config():
    """The few parallelism flags Megatron's free functions read from args, as a config-like object."""
    args = global_args_or_none()
    return SimpleNamespace(
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        async_tensor_model_parallel_allreduce=bool(getattr(args, "async_tensor_model_parallel_allreduce", False)),
        gradient_accumulation_fusion=bool(getattr(args, "gradient_accumulation_fusion", False)),
        perform_initialization=bool(getattr(args, "perform_initialization", True)),
    )
