"""Megatron-LM compatible training library.

``import megatron`` is light: the training-framework helpers that Megatron re-exports here
(``get_args``, ``initialize_megatron``, ...) are loaded on first use.
"""
import importlib

_LAZY = {
    "get_args": "megatron.training.global_vars",
    "get_retro_args": "megatron.training.global_vars",
    "get_current_global_batch_size": "megatron.training.global_vars",
    "get_num_microbatches": "megatron.training.global_vars",
    "get_signal_handler": "megatron.training.global_vars",
    "update_num_microbatches": "megatron.training.global_vars",
    "get_tokenizer": "megatron.training.global_vars",
    "get_tensorboard_writer": "megatron.training.global_vars",
    "get_adlr_autoresume": "megatron.training.global_vars",
    "get_timers": "megatron.training.global_vars",
    "initialize_megatron": "megatron.training.initialize",
    "print_rank_0": "megatron.training.utils",
    "is_last_rank": "megatron.training.utils",
    "print_rank_last": "megatron.training.utils",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron' has no attribute {name!r}")
