"""Megatron-LM's command line: ``parse_args``, ``validate_args``, ``core_transformer_config_from_args``.

One module per family of argument groups (``model_args``, ``training_args``, ``system_args``, ``task_args``; the
"transformer configuration" group generated from the dataclass configs in ``config_args``; every other option of
Megatron-LM HEAD from the registry, ``registry``), the checks and derived values in ``validation``, the table
printout in ``printing``, ``docs/arguments.md`` from ``arguments_doc``.
"""
from megatron.training.arguments.config_args import _add_transformer_config_args  # noqa: F401
from megatron.training.arguments.model_args import (  # noqa: F401
    _add_initialization_args,
    _add_mla_args,
    _add_moe_args,
    _add_network_size_args,
    _add_regularization_args,
    _add_retro_args,
    _add_transformer_engine_args,
)
from megatron.training.arguments.parser import ARGUMENT_GROUPS, build_parser, parse_args  # noqa: F401
from megatron.training.arguments.printing import _print_args, format_args_table  # noqa: F401
from megatron.training.arguments.system_args import (  # noqa: F401
    _add_autoresume_args,
    _add_data_args,
    _add_distributed_args,
    _add_inference_args,
    _add_logging_args,
)
from megatron.training.arguments.task_args import _add_biencoder_args, _add_vision_args  # noqa: F401
from megatron.training.arguments.training_args import (  # noqa: F401
    _add_checkpointing_args,
    _add_learning_rate_args,
    _add_mixed_precision_args,
    _add_training_args,
    _add_validation_args,
)
from megatron.training.arguments.transformer_config import core_transformer_config_from_args  # noqa: F401
from megatron.training.arguments.validation import get_retro_args_path, validate_args  # noqa: F401
