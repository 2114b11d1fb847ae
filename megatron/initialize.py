"""Legacy import path ``megatron.initialize`` (re-exports of megatron.training.initialize)."""
from megatron.training.initialize import (  # noqa: F401
    _init_autoresume,
    _initialize_distributed,
    _set_random_seed,
    initialize_megatron,
    set_jit_fusion_options,
)
