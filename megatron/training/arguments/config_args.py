"""The "transformer configuration" flags, generated from the dataclass configs (``TransformerConfig``, which holds
``ModelParallelConfig``'s fields), as Megatron-LM generates them: one flag per field that carries ``cli(...)``
metadata (megatron/core/config_cli.py), so a field and its flag cannot drift apart.

* the flag is ``--<field-name>`` (``arg_names`` overrides it); its ``dest`` is the field's name;
* its type comes from the annotation: ``int`` / ``float`` / ``str``, ``Optional[X]`` as ``X``, ``List[X]`` as
  ``nargs="+"`` of ``X``, ``Literal[...]`` as ``choices``, an ``Enum`` by member name (choices: its members);
* a boolean whose command-line default is False is a ``store_true`` switch; one whose default is True is
  ``--no-<name>`` / ``--disable-<name>`` (``store_false``);
* the default is the field's, unless ``cli(default=...)`` gives the command line's own (``--num-layers`` has no
  default although the field's is 0).

Fields without ``cli`` metadata have no generated flag: they are derived from other flags
(``core_transformer_config_from_args``), set by the training loop, or callables; some have a flag written by hand in
another group, with the field's name as its ``dest`` (the network-size and training groups, as in Megatron-LM).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import typing
from typing import Any, List, Optional, Tuple

from megatron.core.config_cli import META_KEY
from megatron.core.transformer.transformer_config import TransformerConfig

CONFIG_GROUP = "transformer configuration"


def _enum_type(enum_class):
    def parse(name: str):
        try:
            return enum_class[name]
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"invalid choice {name!r} (choose from {', '.join(m.name for m in enum_class)})") from None

    parse.__name__ = enum_class.__name__
    return parse


def _strip_optional(annotation) -> Tuple[Any, bool]:
    """(the annotation without Optional / a str alternative, whether it is a list)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        if enums:
            return enums[0], False
        annotation = args[0] if len(args) == 1 else args[0]
        origin = typing.get_origin(annotation)
    if origin in (list, List):
        return typing.get_args(annotation)[0], True
    return annotation, False


def config_flag(field: dataclasses.Field, annotation) -> Optional[Tuple[List[str], dict]]:
    """(flags, add_argument keywords) of ``field``, or None when it has no ``cli`` metadata."""
    meta = field.metadata.get(META_KEY)
    if not meta:
        return None
    default = meta.get("default", field.default)
    kind, is_list = _strip_optional(annotation)
    kwargs = {"dest": field.name, "default": default, "help": meta["help"]}
    if kind is bool:
        if default is True:
            flags = meta.get("arg_names") or [f"--no-{field.name.replace('_', '-')}",
                                               f"--disable-{field.name.replace('_', '-')}"]
            kwargs["action"] = "store_false"
        else:
            flags = meta.get("arg_names") or [f"--{field.name.replace('_', '-')}"]
            kwargs["action"] = "store_true"
        return list(flags), kwargs
    flags = meta.get("arg_names") or [f"--{field.name.replace('_', '-')}"]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["type"] = meta.get("type") or _enum_type(kind)
        kwargs["choices"] = list(kind)
        kwargs["metavar"] = "{" + ",".join(m.name for m in kind) + "}"
    elif typing.get_origin(kind) is typing.Literal:
        kwargs["choices"] = list(typing.get_args(kind))
        kwargs["type"] = meta.get("type") or type(kwargs["choices"][0])
    else:
        kwargs["type"] = meta.get("type") or kind
    if "choices" in meta:
        kwargs["choices"] = list(meta["choices"])
    if "nargs" in meta or is_list:
        kwargs["nargs"] = meta.get("nargs", "+")
    return list(flags), kwargs


def config_flags(config_class=TransformerConfig):
    """``[(field, flags, keywords)]`` of every field of ``config_class`` with a generated flag, in field order."""
    hints = typing.get_type_hints(config_class)
    out = []
    for field in dataclasses.fields(config_class):
        spec = config_flag(field, hints[field.name])
        if spec is not None:
            out.append((field, *spec))
    return out


def _add_transformer_config_args(parser):
    group = parser.add_argument_group(title=CONFIG_GROUP)
    for _, flags, kwargs in config_flags():
        group.add_argument(*flags, **kwargs)
    return parser
