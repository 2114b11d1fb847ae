"""The training framework: arguments, initialisation, global state, timers, the training loop.

``from megatron.training import get_args, print_rank_0, initialize_megatron`` works as in Megatron-LM; the names
are loaded on first use so that importing one submodule does not import them all.
"""
import importlib

_LAZY = {
    "get_args": "megatron.training.global_vars",
    "get_retro_args": "megatron.training.global_vars",
    "get_signal_handler": "megatron.training.global_vars",
    "get_tokenizer": "megatron.training.global_vars",
    "get_tensorboard_writer": "megatron.training.global_vars",
    "get_adlr_autoresume": "megatron.training.global_vars",
    "get_timers": "megatron.training.global_vars",
    "get_num_microbatches": "megatron.training.global_vars",
    "get_current_global_batch_size": "megatron.training.global_vars",
    "update_num_microbatches": "megatron.training.global_vars",
    "initialize_megatron": "megatron.training.initialize",
    "print_rank_0": "megatron.training.utils",
    "is_last_rank": "megatron.training.utils",
    "print_rank_last": "megatron.training.utils",
    "pretrain": "megatron.training.training",
    "get_model": "megatron.training.training",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron.training' has no attribute {name!r}")
