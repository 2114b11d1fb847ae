"""Legacy import path ``megatron.global_vars`` (re-exports of megatron.training.global_vars)."""
from megatron.training.global_vars import (  # noqa: F401
    destroy_global_vars,
    get_adlr_autoresume,
    get_args,
    get_current_global_batch_size,
    get_num_microbatches,
    get_retro_args,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
    get_tokenizer,
    rebuild_tokenizer,
    set_args,
    set_global_variables,
    set_retro_args,
    update_num_microbatches,
)
