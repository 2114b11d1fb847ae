"""The command-line form of a dataclass config field (megatron-core's ``argparse_meta`` field metadata).

``TransformerConfig`` / ``ModelParallelConfig`` are the one typed source of the model and parallelism flags: the
training parser (``megatron/training/arguments/config_args.py``) turns every field into ``--field-name`` with the
field's type and default, as Megatron-LM does:

* ``name: int = 1`` with ``metadata=cli("help")`` -> ``--name N`` (``type=int``, default 1, ``dest="name"``);
  ``Optional[X]`` -> ``type=X``; ``Literal[...]`` -> ``choices``;
* a boolean that defaults to False -> ``--name`` (``store_true``); one that defaults to True -> ``--no-name`` /
  ``--disable-name`` (``store_false``);
* ``cli(...)`` keywords override what the field alone would give: ``arg_names`` (the flags), ``default`` (the
  command line's default when it differs from the field's, e.g. ``None`` for ``num_layers``, whose field default
  is 0), ``type``, ``choices``, ``nargs``;
* a field without ``cli`` metadata has no generated flag: it is derived from other flags (``num_moe_experts`` from
  ``--num-experts``, ``gated_linear_unit`` from ``--swiglu`` ...), set by the training loop, a callable, or its flag
  is written by hand in another argument group with the field's name as ``dest`` (as Megatron-LM does for the
  network-size and training groups).

This module only describes; megatron.core never parses a command line.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence

_UNSET: Any = dataclasses.MISSING
META_KEY = "argparse_meta"


def cli(help: str, *, arg_names: Optional[Sequence[str]] = None, default: Any = _UNSET, type: Any = None,
        choices: Optional[Sequence[Any]] = None, nargs: Optional[str] = None) -> Mapping[str, Any]:
    """Field metadata giving the field's flag a help text and, where the field alone does not say it, its spelling,
    command-line default, type, choices or nargs."""
    meta = {"help": help}
    for key, value in (("arg_names", arg_names), ("type", type), ("choices", choices), ("nargs", nargs)):
        if value is not None:
            meta[key] = tuple(value) if key in ("arg_names", "choices") else value
    if default is not _UNSET:
        meta["default"] = default
    return MappingProxyType({META_KEY: MappingProxyType(meta)})


def flag(field_default: Any, help: str, **overrides) -> Any:
    """A field with a flag: ``dataclasses.field(default=field_default, metadata=cli(help, **overrides))`` (an
    override ``default=`` is the command line's default, not the field's)."""
    return dataclasses.field(default=field_default, metadata=cli(help, **overrides))
