"""``parse_args``: Megatron-LM's command line, one argument group per function, in Megatron's order."""
from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

from megatron.training.arguments.config_args import _add_transformer_config_args
from megatron.training.arguments.model_args import (
    _add_initialization_args,
    _add_mla_args,
    _add_moe_args,
    _add_network_size_args,
    _add_regularization_args,
    _add_retro_args,
    _add_transformer_engine_args,
)
from megatron.training.arguments.system_args import (
    _add_autoresume_args,
    _add_data_args,
    _add_distributed_args,
    _add_inference_args,
    _add_logging_args,
    _add_rerun_machine_args,
)
from megatron.training.arguments.task_args import _add_biencoder_args, _add_vision_args
from megatron.training.arguments.training_args import (
    _add_checkpointing_args,
    _add_learning_rate_args,
    _add_mixed_precision_args,
    _add_training_args,
    _add_validation_args,
)
from megatron.training.arguments.registry import add_registry_options
from megatron.training.launch_env import resolve_launch_env

# The order groups appear in ``--help``, as in Megatron-LM.
ARGUMENT_GROUPS = (
    _add_network_size_args,
    _add_regularization_args,
    _add_training_args,
    _add_initialization_args,
    _add_learning_rate_args,
    _add_checkpointing_args,
    _add_mixed_precision_args,
    _add_distributed_args,
    _add_rerun_machine_args,
    _add_validation_args,
    _add_data_args,
    _add_autoresume_args,
    _add_biencoder_args,
    _add_vision_args,
    _add_moe_args,
    _add_mla_args,
    _add_logging_args,
    _add_inference_args,
    _add_transformer_engine_args,
    _add_retro_args,
    _add_transformer_config_args,  # generated from TransformerConfig's fields (config_args.py)
)


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    """Megatron's groups, every other option of Megatron-LM HEAD from the registry (``registry.py``), then the
    script's own flags (``extra_args_provider``)."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    for add_group in ARGUMENT_GROUPS:
        parser = add_group(parser)
    parser = add_registry_options(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False,
               argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse Megatron's flags (plus those ``extra_args_provider(parser)`` adds).

    ``argv`` defaults to ``sys.argv[1:]``; tests and embedding code pass a list. ``args.rank`` and
    ``args.world_size`` come from the launcher's environment (torchrun's RANK/WORLD_SIZE, else SLURM's
    SLURM_PROCID/SLURM_NTASKS, else 0 and 1), so validation can size the data-parallel group before any
    process group exists.
    """
    parser = build_parser(extra_args_provider)
    argv = None if argv is None else list(argv)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)

    launch = resolve_launch_env()
    if args.yaml_cfg is not None:  # Megatron-LM's YAML form replaces the command line (yaml_args.py)
        from megatron.training.arguments.yaml_args import load_yaml_args

        args = load_yaml_args(args.yaml_cfg, parser, args,
                              lambda message: print(message, flush=True) if launch.rank == 0 else None)
    args.rank = launch.rank
    args.world_size = launch.world_size
    return args
