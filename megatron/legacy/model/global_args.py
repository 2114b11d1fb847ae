"""Bridge from Megatron's global ``args`` to the model options that megatron.core reads from the config.

Megatron's legacy model classes read settings such as ``args.padded_vocab_size`` or ``args.openai_gelu``
from the global arguments. The legacy classes here copy those (when the training framework has parsed
arguments) onto a copy of the config before building the megatron.core implementation. Options set
explicitly on the config win; without global args the config (and Megatron's defaults) are used as is.
"""
from __future__ import annotations

from types import SimpleNamespace

from megatron.core.transformer.model_options import MODEL_OPTION_DEFAULTS, config_with_options


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


def legacy_config(config):
    """``config`` with the model options found in the global args (those the config does not set itself)."""
    args = global_args_or_none()
    if args is None or config is None:
        return config
    options = {name: getattr(args, name) for name in MODEL_OPTION_DEFAULTS
               if hasattr(args, name) and getattr(config, name, None) is None}
    return config_with_options(config, **options)


def args_as_parallel_config():
    """The few parallelism flags Megatron's free functions read from args, as a config-like object."""
    args = global_args_or_none()
    return SimpleNamespace(
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        async_tensor_model_parallel_allreduce=bool(getattr(args, "async_tensor_model_parallel_allreduce", False)),
        gradient_accumulation_fusion=bool(getattr(args, "gradient_accumulation_fusion", False)),
        perform_initialization=bool(getattr(args, "perform_initialization", True)),
    )
